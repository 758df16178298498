"""Estimate accuracy: autoshard's predicted per-rank peak against the peak the allocator measured.

For each zoo model (`--zoo own`: benchmarks/zoo.py; `--zoo external`: benchmarks/zoo_external.py,
models nobody here wrote; `--zoo FILE.py`: a zoo of your own, laid out as zoo_external.py is) x
strategy ("ddp", "shard_grad_op", "full_shard"; at world size 1 they still wrap, torchrun having
made a process group) x mixed precision x activation checkpointing
(off, or on every block): the prediction is `estimated_peak_bytes` of an `autoshard.plan(...)`
made first, outside any profiler (a running profiler changes what the estimator can measure:
DESIGN.md section 3), with the chosen candidate's terms. Then, inside the profile, the model is
built again and `autoshard.prepare(...)` wraps it (with its trial step unless `--no-trial`; the
trial's measured peak is reported beside the figures), `--warmup` unmeasured steps run (default
0) and `--steps` K measured steps (default 3: the first step after prepare counts), each
`loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)` with the model's output held
through it and into the next step's forward, as a user's loop holds it (`--accumulation M`: M
micro-batches per step, gradient sync off for all but the last; plan and prepare told). On each
rank:

- allocator peak (the figure compared): on CPU, torch's profiler with `profile_memory=True`,
  started before the model is built, so that its running total of allocator bytes counts
  everything the training holds, C++-side buffers included (DDP's gradient buckets); its maximum
  over the measured steps with the frees gloo makes on its own thread inferred (`_live_bytes.py`,
  DESIGN.md section 3) at the earliest moment they can have happened (the end of the block's last
  use), and beside it the upper bound (the same frees at the latest moment: the reuse of the
  address) and the raw one (those frees not inferred at all).
  On CUDA, `torch.cuda.max_memory_allocated` over the measured steps less what was allocated
  before the model was built.
- tracker peak, beside it: torch's MemTracker (FSDPMemTracker under FSDP2) over the same steps.
  It sees tensors at the dispatcher, so it misses C++-side buffers and kernels' scratch memory.

error = (predicted - allocator peak) / allocator peak, per rank; a row reports it for the rank
with the highest peak (the estimate is the job's: the most any rank needs), with the upper and
raw errors beside it. Every configuration builds its own model and optimizer and frees
them before the next; frees of blocks allocated before its profile are not counted. A
configuration whose profile ends with an unexplained block still live (a free the profiler missed
and could not infer, see `_live_bytes.py`) is measured again, up to `--retries` times; if it
stays, its row is marked an upper bound.

    torchrun --standalone --nproc-per-node 2 benchmarks/estimate_accuracy.py --json out.json
    python benchmarks/estimate_accuracy.py --world-sizes 1,2 --json out.json  # both, merged
    torchrun --standalone --nproc-per-node 2 benchmarks/estimate_accuracy.py --zoo external
    torchrun --standalone --nproc-per-node 1 benchmarks/estimate_accuracy.py --zoo my_zoo.py

Output (rank 0): a markdown table, the summary against the targets (median |error| <= 3%, worst
<= 8%, no underestimate worse than -3%) with each model's worst signed error, and with
`--json PATH` every figure per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import autoshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench as common  # noqa: E402
import zoo  # noqa: E402
import zoo_external  # noqa: E402
from _live_bytes import AllocatorProfile  # noqa: E402

from autoshard._batch import call_model, tensors_in  # noqa: E402
from autoshard.wrap.apply import gradient_sync  # noqa: E402

STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
MEDIAN_TARGET = 0.03
WORST_TARGET = 0.08
UNDER_TARGET = -0.03  # no underestimate worse than this
MEASURED = "estimate_accuracy.measured"
# Leftover bytes tolerated before a configuration is measured again (a few small blocks remain
# in most profiles: gloo's and the profiler's own bookkeeping).
LEAK_TOLERANCE = 64 * 1024
PHASES = ("forward", "backward", "optimizer")


# ---------------------------------------------------------------------------------------------
# Measuring one configuration on this rank


def train_step(
    prepared: autoshard.Prepared,
    built: zoo.ZooModel,
    prof: AllocatorProfile,
    held: list[Any],
    micro_batches: int = 1,
) -> None:
    """One steady-state step, each phase a labelled window (to say where the peak falls), the
    output held through backward and the optimizer step as a user's loop holds it, and in
    `held` (a list of one item) until the next forward returns its own. With `micro_batches`
    above 1 the step accumulates the gradients of that many forwards and backwards of the batch,
    gradient sync off for all but the last, as a user's loop does it (DDP's `no_sync()`,
    FSDP2's `set_requires_gradient_sync(False)`)."""
    model, optimizer, _ = prepared
    for micro in range(micro_batches):
        # DDP decides in its forward whether the backward syncs: both inside
        with gradient_sync(model, micro == micro_batches - 1):
            with prof.window("forward"):
                held[0] = call_model(model, built.batch)
                loss = built.loss_fn(held[0], built.batch)
                loss = loss / micro_batches if micro_batches > 1 else loss
            with prof.window("backward"):
                (loss if prepared.scaler is None else prepared.scaler.scale(loss)).backward()
    with prof.window("optimizer"):
        if prepared.scaler is None:
            optimizer.step()
        else:
            prepared.scaler.step(optimizer)
            prepared.scaler.update()
        optimizer.zero_grad(set_to_none=True)


def make_tracker(prepared: autoshard.Prepared, batch: Any) -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from autoshard.measure.step import frozen_safe

    model = prepared.model
    if isinstance(model, FSDPModule):
        fsdp_tracker = frozen_safe(FSDPMemTracker(model, prepared.optimizer))
        fsdp_tracker.track_inputs(tuple(tensors_in(batch)))
        return fsdp_tracker
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    tracker = frozen_safe(MemTracker())
    tracker.track_external(module, prepared.optimizer, *tensors_in(batch))
    return tracker


def tracker_peak(tracker: Any) -> tuple[int, dict[str, int]]:
    """The tracker's peak total, and its categories at that moment (all devices summed)."""
    categories: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot("peak").values():
        for key, value in snap.items():
            name = str(getattr(key, "value", key))
            categories[name] = categories.get(name, 0) + int(value)
    return categories.pop("Total", 0), categories


class NoTracker(contextlib.nullcontext):  # type: ignore[type-arg]
    """Stands in for the tracker with --no-tracker (to check the tracker changes nothing)."""

    def reset_mod_stats(self) -> None:
        pass

    def get_tracker_snapshot(self, kind: str) -> dict[str, dict[str, int]]:
        return {}


class CudaMeter:
    """The CUDA allocator's peak over the measured steps, less what was allocated before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = torch.cuda.memory_allocated(device)
        self.peak = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.before


def chosen_candidate(plan: autoshard.Plan) -> Any:
    return next(
        c
        for c in plan.candidates
        if c.strategy == plan.strategy
        and c.activation_checkpointing == plan.activation_checkpointing
    )


def state_pointers(prepared: autoshard.Prepared, batch: Any) -> frozenset[int]:
    """Addresses of the storages the training holds (parameters, FSDP2's local shards, gradients,
    buffers, optimizer state, the batch): the blocks a tracker may keep alive after teardown."""
    tensors: list[torch.Tensor] = [*prepared.model.buffers(), *tensors_in(batch)]
    for param in prepared.model.parameters():
        tensors += [param, param.grad] if param.grad is not None else [param]
    tensors += [v for state in prepared.optimizer.state.values() for v in state.values()]
    pointers = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
            if local.untyped_storage().size():
                pointers.add(local.untyped_storage().data_ptr())
    return frozenset(pointers)


def build(
    name: str, args: argparse.Namespace, device: torch.device, implementation: str = "default"
) -> zoo.ZooModel:
    """Zoo model `name` from the zoo `--zoo` names, as this rank feeds it, its optimizer running
    `implementation` (`OPTIMIZER_IMPLEMENTATIONS`)."""
    built = registry(args.zoo).build(
        name, args.batch_size, rank=dist.get_rank(), seed=args.seed, device=device
    )
    return built._replace(optimizer=with_implementation(built.optimizer, implementation))


# How an optimizer's step runs: torch's default for the device (CPU: the for-loop, CUDA:
# foreach), the for-loop over parameters, one foreach kernel per list, one fused kernel.
OPTIMIZER_IMPLEMENTATIONS = {
    "default": {},
    "loop": {"foreach": False, "fused": None},
    "foreach": {"foreach": True, "fused": None},
    "fused": {"foreach": None, "fused": True},
}


_ZOO_FILE = "estimate_accuracy.zoo_file:"  # sys.modules' key of a zoo file, by its path


def registry(name: str) -> Any:
    """The zoo `--zoo` names: the project's own, the external one, or a file of the user's
    that defines, as zoo_external.py does, `ENTRIES` (the models by name) and
    `build(name, per_rank_batch, *, rank, seed, device)` returning a `zoo.ZooModel`."""
    if name == "own":
        return zoo
    if name == "external":
        return zoo_external
    path = Path(name).resolve()
    module = sys.modules.get(_ZOO_FILE + str(path))
    if module is None:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--zoo {name}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for needed in ("ENTRIES", "build"):
            if not hasattr(module, needed):
                raise ValueError(f"--zoo {name}: defines no {needed} (see zoo_external.py)")
        sys.modules[_ZOO_FILE + str(path)] = module  # loaded once per process
    return module


def with_implementation(optimizer: torch.optim.Optimizer, implementation: str) -> Any:
    """The same optimizer class over the same parameter groups, its step run as
    `implementation` (no state yet: the zoo's optimizers have not stepped)."""
    flags = OPTIMIZER_IMPLEMENTATIONS[implementation]
    if not flags:
        return optimizer
    groups = [{**group, **flags} for group in optimizer.param_groups]
    return type(optimizer)(groups)  # type: ignore[call-arg]


def plan_figures(plan: autoshard.Plan) -> dict[str, Any]:
    chosen = chosen_candidate(plan)
    return {
        "reasons": list(plan.reasons),
        "plan": {
            "strategy": plan.strategy.value,
            "mixed_precision": plan.mixed_precision,
            "activation_checkpointing": plan.activation_checkpointing,
            "num_blocks": plan.num_blocks,
        },
        "predicted_bytes": plan.estimated_peak_bytes,
        "breakdown": dataclasses.asdict(chosen.footprint),
    }


class Config(NamedTuple):
    """One row of the grid."""

    model: str
    strategy: str
    mp: str  # mixed precision requested
    ac: bool | int  # every block checkpointed (True), none (False), or the first k
    optimizer: str = "default"  # the step's implementation (`OPTIMIZER_IMPLEMENTATIONS`)


def measure(config: Config, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """This rank's figures for one configuration: built, wrapped, stepped and freed inside one
    allocator profile, so that its running total counts everything the training holds."""
    name, strategy, mp, ac, implementation = config
    out: dict[str, Any] = {}
    gc.collect()
    dist.barrier()
    cuda = CudaMeter(device) if device.type == "cuda" else None
    # autoshard measures kernel workspaces (convolutions) with the profiler, which cannot start
    # while this one runs: the same plan made first, outside it, measures them (kept per process).
    choice: dict[str, Any] = {
        "strategy": strategy,
        "mixed_precision": mp,
        "activation_checkpointing": ac,
    }
    built = build(name, args, device, implementation)
    # The estimate compared: a plan() made before and outside the profile, as a user makes it.
    outside = autoshard.plan(
        built.model,
        built.optimizer,
        built.batch,
        loss_fn=built.loss_fn,
        accumulation_steps=args.accumulation,
        **choice,
    )
    out.update(plan_figures(outside))
    del built
    gc.collect()
    with AllocatorProfile(record_uses=args.last_use) as prof:
        built = build(name, args, device, implementation)
        out["params"] = zoo.parameter_count(built.model)
        out["optimizer_class"] = type(built.optimizer).__name__
        out["per_rank_batch"] = tensors_in(built.batch)[0].shape[0]
        started = time.perf_counter()
        prepared = autoshard.prepare(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            trial_step=args.trial,
            accumulation_steps=args.accumulation,
            **choice,
        )
        out["prepare_s"] = time.perf_counter() - started
        # prepare's own plan (made inside the profile) and its trial step's measured peak
        out["prepare_predicted_bytes"] = prepared.plan.estimated_peak_bytes
        out["trial_peak_bytes"] = prepared.plan.measured_peak_bytes
        out["trial_reasons"] = [r for r in prepared.plan.reasons if "trial" in r.lower()]
        held: list[Any] = [None]
        for _ in range(args.warmup):
            train_step(prepared, built, prof, held, args.accumulation)
        tracker = make_tracker(prepared, built.batch) if args.tracker else NoTracker()
        times = []
        with prof.window(MEASURED), tracker:
            if cuda:
                cuda.start()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step(prepared, built, prof, held, args.accumulation)
                times.append(time.perf_counter() - t0)
                tracker.reset_mod_stats()  # its per-module stats refuse a second iteration
            if cuda:
                cuda.stop()
        out["tracker_peak_bytes"], out["tracker_categories"] = tracker_peak(tracker)
        out["step_s"] = statistics.median(times)
        known = state_pointers(prepared, built.batch)
        # Free everything inside the profile: what stays is retained (by the tracker) or leaked.
        del prepared, built, tracker, held
        gc.collect()
    live = prof.live_bytes(MEASURED, known)
    out["allocator_peak_bytes"] = cuda.peak if cuda else live.peak
    out["allocator_upper_peak_bytes"] = cuda.peak if cuda else live.upper_peak
    out["allocator_raw_peak_bytes"] = live.raw_peak
    out["window"] = {
        "at_start": live.at_start,
        "final": live.final,
        "missed_frees": live.missed_frees,
        "retained": live.retained,
        "leaked": live.leaked,
        "foreign_frees": live.foreign_frees,
        "memory_events": live.events,
        "memory_threads": prof.thread_count(),
    }
    out["peak_phase"] = None if cuda else prof.span_at(live.peak_ns, set(PHASES))
    if args.explain and not cuda:
        blocks = sorted(prof.live_at_peak(MEASURED, known), key=lambda a: -a.nbytes)
        out["at_peak"] = [[a.nbytes, a.where] for a in blocks[: args.explain]]
    return out


def clean(figures: dict[str, Any]) -> bool:
    """No unexplained block outlived the profile (else the peak is an upper bound)."""
    return "error" in figures or figures["window"]["leaked"][1] <= LEAK_TOLERANCE


def measure_agreed(
    config: Config, args: argparse.Namespace, device: torch.device
) -> tuple[list[dict[str, Any]], int]:
    """Every rank's figures, measured again (up to --retries times) while some rank's profile
    has an unexplained leftover block; the attempt with the fewest leaked bytes is kept."""
    best: list[dict[str, Any]] | None = None
    for attempt in range(1, args.retries + 2):
        try:
            mine: dict[str, Any] = measure(config, args, device)
        except Exception as error:  # recorded, so that one configuration does not end the grid
            mine = {"error": f"{type(error).__name__}: {error}"}
        ranks = common.gather(mine)
        if any("error" in r for r in ranks):
            return ranks, attempt
        if best is None or leaked(ranks) < leaked(best):
            best = ranks
        if all(clean(r) for r in ranks):
            break
    assert best is not None
    return best, attempt


def leaked(ranks: list[dict[str, Any]]) -> int:
    return max(r["window"]["leaked"][1] for r in ranks)


def run_config(config: Config, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One row: every rank's figures and the worst rank's error."""
    ranks, attempts = measure_agreed(config, args, device)
    row: dict[str, Any] = {
        "model": config.model,
        "optimizer": config.optimizer,
        "world_size": dist.get_world_size(),
        "strategy": config.strategy,
        "mixed_precision_requested": config.mp,
        "activation_checkpointing_requested": config.ac,
        "accumulation_steps": args.accumulation,
        "attempts": attempts,
        "error_message": next((r["error"] for r in ranks if "error" in r), None),
    }
    if row["error_message"] is not None:
        return row
    first = ranks[0]
    predicted = [r["predicted_bytes"] for r in ranks]
    allocator = [r["allocator_peak_bytes"] for r in ranks]
    upper = [r["allocator_upper_peak_bytes"] for r in ranks]
    raw = [r["allocator_raw_peak_bytes"] for r in ranks]
    errors = [(p - a) / a for p, a in zip(predicted, allocator, strict=True)]
    upper_errors = [(p - a) / a for p, a in zip(predicted, upper, strict=True)]
    raw_errors = [(p - a) / a for p, a in zip(predicted, raw, strict=True)]
    # The estimate is the job's: what every rank must have free, the most any rank needs (rank
    # 0's shard is the largest). So it is compared with the rank whose measured peak is highest;
    # every rank's error is kept beside it (`errors`).
    worst = max(range(len(ranks)), key=lambda i: (allocator[i], -i))
    row.update(
        {
            "params": first["params"],
            "optimizer_class": first["optimizer_class"],
            "per_rank_batch": first["per_rank_batch"],
            "plan": first["plan"],
            "mixed_precision": first["plan"]["mixed_precision"],
            "checkpointed": first["plan"]["activation_checkpointing"],
            "num_blocks": first["plan"]["num_blocks"],
            "breakdown": first["breakdown"],
            "predicted_bytes": predicted,
            "allocator_peak_bytes": allocator,
            "allocator_upper_peak_bytes": upper,
            "allocator_raw_peak_bytes": raw,
            "upper_errors": upper_errors,
            "raw_errors": raw_errors,
            "prepare_predicted_bytes": [r["prepare_predicted_bytes"] for r in ranks],
            "trial_peak_bytes": [r["trial_peak_bytes"] for r in ranks],
            "trial_reasons": first["trial_reasons"],
            "reasons": first["reasons"],
            "tracker_peak_bytes": [r["tracker_peak_bytes"] for r in ranks],
            "tracker_categories": [r["tracker_categories"] for r in ranks],
            "errors": errors,
            "worst_rank": worst,
            "error": errors[worst],
            "peak_phase": [r["peak_phase"] for r in ranks],
            "at_peak": [r.get("at_peak") for r in ranks],
            "window": [r["window"] for r in ranks],
            # no unexplained block outlived the profile: the peak is not just an upper bound
            "clean": all(clean(r) for r in ranks),
            "step_s": max(r["step_s"] for r in ranks),
            "prepare_s": max(r["prepare_s"] for r in ranks),
        }
    )
    return row


# ---------------------------------------------------------------------------------------------
# Output


def _mib(values: list[int], worst: int) -> str:
    return common.mib(values[worst])


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | world | strategy | optimizer | mp | AC | predicted MiB | allocator peak MiB | "
        "upper bound MiB | raw peak MiB | trial MiB | tracker MiB | error % | upper error % | "
        "raw error % | measured peak in |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        mp = r.get("mixed_precision", r["mixed_precision_requested"])
        ac = (
            f"{r['checkpointed']}/{r['num_blocks']}"
            if "checkpointed" in r
            else str(r["activation_checkpointing_requested"])
        )
        optimizer = r.get("optimizer", "default")
        lead = f"| {r['model']} | {r['world_size']} | {r['strategy']} | {optimizer} | {mp} | {ac} |"
        if r["error_message"] is not None:
            lines.append(f"{lead} failed: {r['error_message'][:80]} | | | | | | | | | |")
            continue
        w = r["worst_rank"]
        flag = "" if r["clean"] else " (upper bound)"
        trial = r["trial_peak_bytes"][w]
        lines.append(
            f"{lead} {_mib(r['predicted_bytes'], w)} | {_mib(r['allocator_peak_bytes'], w)} | "
            f"{_mib(r['allocator_upper_peak_bytes'], w)} | "
            f"{_mib(r['allocator_raw_peak_bytes'], w)} | "
            f"{'-' if trial is None else common.mib(trial)} | "
            f"{_mib(r['tracker_peak_bytes'], w)} | {100 * r['error']:+.1f}{flag} | "
            f"{100 * r['upper_errors'][w]:+.1f} | "
            f"{100 * r['raw_errors'][w]:+.1f} | {r['peak_phase'][w]} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r["error_message"] is None]
    errors = [abs(r["error"]) for r in done]
    worst = max(done, key=lambda r: abs(r["error"]), default=None)
    median = statistics.median(errors) if errors else None
    return {
        "rows": len(rows),
        "failed": len(rows) - len(done),
        "median_abs_error": median,
        "worst_abs_error": abs(worst["error"]) if worst else None,
        "worst": (
            f"{worst['model']} world {worst['world_size']} {worst['strategy']} "
            f"{worst.get('optimizer_class', 'AdamW')} {worst.get('optimizer', 'default')} "
            f"mp {worst['mixed_precision']} "
            f"AC {worst['checkpointed']}/{worst['num_blocks']}"
            if worst
            else None
        ),
        "most_under": min((r["error"] for r in done), default=None),
        "median_ok": median is not None and median <= MEDIAN_TARGET,
        "worst_ok": worst is not None and abs(worst["error"]) <= WORST_TARGET,
        "under_ok": all(r["error"] >= UNDER_TARGET for r in done),
        "worst_by_model": worst_by_model(done),
    }


def worst_by_model(done: list[dict[str, Any]]) -> dict[str, float]:
    """Each model's worst signed error (the one of largest magnitude)."""
    out: dict[str, float] = {}
    for r in done:
        if abs(r["error"]) > abs(out.get(r["model"], 0.0)):
            out[r["model"]] = r["error"]
        out.setdefault(r["model"], r["error"])
    return out


def summary_lines(s: dict[str, Any]) -> str:
    if s["median_abs_error"] is None:
        return "no configuration finished"
    verdict = {True: "met", False: "NOT met"}
    return "\n".join(
        [
            f"median |error| {100 * s['median_abs_error']:.1f}% (target <= "
            f"{100 * MEDIAN_TARGET:g}%: {verdict[s['median_ok']]})",
            f"worst |error| {100 * s['worst_abs_error']:.1f}% (target <= {100 * WORST_TARGET:g}%: "
            f"{verdict[s['worst_ok']]}), at {s['worst']}",
            f"most under {100 * s['most_under']:+.1f}% (target >= {100 * UNDER_TARGET:g}%: "
            f"{verdict[s['under_ok']]})",
            f"{s['rows']} configurations, {s['failed']} failed",
            "worst signed error by model: "
            + ", ".join(f"{m} {100 * e:+.1f}%" for m, e in s["worst_by_model"].items()),
        ]
    )


def report(rows: list[dict[str, Any]], settings: dict[str, Any], path: Path | None) -> None:
    s = summary(rows)
    print()
    print(table(rows))
    print()
    print(summary_lines(s), flush=True)
    if path is not None:
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": common.machine(),
            "settings": settings,
            "targets": {"median_abs_error": MEDIAN_TARGET, "worst_abs_error": WORST_TARGET},
            "summary": s,
            "rows": rows,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"json written to {path}")


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--zoo",
        default="own",
        help="own (benchmarks/zoo.py), external (zoo_external.py), or a Python file defining "
        "ENTRIES and build() as zoo_external.py does",
    )
    p.add_argument("--models", default=None, help="comma-separated (default: the zoo's set)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--mixed-precision", default="no,bf16", help="comma-separated: no, bf16, auto")
    p.add_argument(
        "--optimizer",
        default="default",
        help="comma-separated step implementations: default (the device's), loop, foreach, fused",
    )
    p.add_argument(
        "--ac",
        default="off,on",
        help="activation checkpointing, comma-separated: off, on (all blocks), or a number of "
        "blocks (the first k; more than the model has is refused by prepare)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: per model)")
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="steps after prepare before the measured ones (0: the first step is measured)",
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps (K)")
    p.add_argument(
        "--accumulation",
        type=int,
        default=1,
        metavar="M",
        help="micro-batches per optimizer step (gradient accumulation; the plan and prepare are "
        "told: accumulation_steps=M)",
    )
    p.add_argument(
        "--no-trial",
        dest="trial",
        action="store_false",
        help="prepare(trial_step=False): no trial step, no trial peak beside the figures",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="measure a configuration again while a rank's profile has an unexplained leftover",
    )
    p.add_argument(
        "--no-tracker",
        dest="tracker",
        action="store_false",
        help="measure the allocator only (to check that the tracker changes nothing)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument(
        "--no-last-use",
        dest="last_use",
        action="store_false",
        help="bound unreported frees at the latest only (address reuse): no operator inputs "
        "recorded, a cheaper profile; the compared peak is then the upper bound",
    )
    p.add_argument(
        "--explain",
        type=int,
        default=0,
        metavar="N",
        help="print each rank's N largest blocks live at its peak, with the operators that "
        "allocated them (CPU)",
    )
    p.add_argument(
        "--world-sizes",
        default=None,
        help="without torchrun: launch torchrun once per world size (e.g. 1,2) and merge",
    )
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.accumulation < 1:
        p.error("--warmup must be >= 0, --steps and --accumulation >= 1")
    if args.zoo not in ("own", "external") and not (
        args.zoo.endswith(".py") and Path(args.zoo).is_file()
    ):
        p.error(f"--zoo takes own, external or an existing .py file, not {args.zoo!r}")
    try:
        zoo_module = registry(args.zoo)
    except ValueError as error:
        p.error(str(error))
    known = zoo.BUILDERS if args.zoo == "own" else zoo_module.ENTRIES
    if args.models is None:
        args.models = "gpt,mlp,vit,llama,resnet" if args.zoo == "own" else ",".join(known)
    for model in args.models.split(","):
        if model not in known:
            p.error(f"unknown {args.zoo} zoo model {model!r}; choose from {', '.join(known)}")
    for strategy in args.strategies.split(","):
        if strategy not in (*STRATEGIES, "local"):
            p.error(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}, local")
    for implementation in args.optimizer.split(","):
        if implementation not in OPTIMIZER_IMPLEMENTATIONS:
            p.error(
                f"unknown optimizer implementation {implementation!r}; choose from "
                f"{', '.join(OPTIMIZER_IMPLEMENTATIONS)}"
            )
    for ac in args.ac.split(","):
        if ac not in ("off", "on") and not (ac.isdigit() and int(ac) > 0):
            p.error(
                f"--ac takes off, on or a positive number of blocks (comma-separated), not {ac!r}"
            )
    return args


def _checkpointing(ac: str) -> bool | int:
    """`--ac`'s value as `prepare` takes it."""
    return {"off": False, "on": True}[ac] if ac in ("off", "on") else int(ac)


def launch_each(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under torchrun once per world size, then merge the rows."""
    rows: list[dict[str, Any]] = []
    machines: dict[int, Any] = {}
    child = _drop_values(argv, ("--world-sizes", "--json"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.world_sizes.split(",")):
            path = Path(tmp) / f"world{world}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command += ["--nproc-per-node", str(world), __file__, *child, "--json", str(path)]
            print(f"$ {' '.join(command)}", flush=True)
            if subprocess.run(command, env=env).returncode != 0 or not path.exists():
                print(f"world size {world} failed", file=sys.stderr)
                return 1
            child_result = json.loads(path.read_text())
            rows += child_result["rows"]
            machines[world] = child_result["machine"]  # as the ranks saw it: group, threads
    print(f"\n## All world sizes ({args.world_sizes})")
    report(rows, {**vars(args), "json": str(args.json), "machines": machines}, args.json)
    return 0


def _drop_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without `options` (as `--opt value` or `--opt=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        if args.world_sizes is None:
            raise SystemExit("launch with torchrun, or give --world-sizes 1,2 to launch it")
        return launch_each(args, argv)
    rank, world, device = common.init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    grid = itertools.starmap(
        Config,
        itertools.product(
            args.models.split(","),
            args.strategies.split(","),
            args.mixed_precision.split(","),
            [_checkpointing(a) for a in args.ac.split(",")],
            args.optimizer.split(","),
        ),
    )
    rows = []
    for config in grid:
        name, strategy, _, _, implementation = config
        row = run_config(config, args, device)
        rows.append(row)
        if row["error_message"] is None:
            say(
                f"  {name:6s} world {world} {strategy:13s} {implementation:7s} "
                f"mp {row['mixed_precision']:4s} "
                f"AC {row['checkpointed']}/{row['num_blocks']}: predicted "
                f"{_mib(row['predicted_bytes'], row['worst_rank'])} MiB, allocator "
                f"{_mib(row['allocator_peak_bytes'], row['worst_rank'])} MiB, error "
                f"{100 * row['error']:+.1f}%",
                flush=True,
            )
            for r, blocks in enumerate(row["at_peak"] if args.explain else []):
                say(f"    rank {r}: {row['allocator_peak_bytes'][r]:,d} B at its peak")
                for nbytes, where in blocks:
                    say(f"      {nbytes:>10,d} B  {where}")
        else:
            say(f"  {name:6s} world {world} {strategy:13s} failed: {row['error_message']}")
    if rank == 0:
        settings = {**vars(args), "json": str(args.json), "device": str(device)}
        report(rows, settings, args.json)
    common.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
