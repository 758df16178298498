"""Largest batch (issue 25): the per-rank batch `max_batch=True` reports against the true largest,
found by bisection with real training steps under the same memory_limit.

    torchrun --standalone --nproc-per-node 2 benchmarks/max_batch.py --out DIR      # CPU, gloo
    torchrun --standalone --nproc-per-node 1 benchmarks/max_batch.py --out DIR      # one GPU

For each family of the project's zoo (`benchmarks/zoo.py`) and the external one
(`benchmarks/zoo_external.py`), on every rank of the job:

1. limit: two plans of the family with no limit (`autoshard.plan`, the job's world size), at its
   example batch of b0 rows and at 2 * b0; through the chosen candidate's two needs (estimated
   peak plus the reserve kept beside it) a line, and memory_limit where it reaches `--scale` * b0
   rows, rounded up to 64 KiB: the batch size is what decides whether a step fits, and the
   answer lands well above one row and below a few hundred. Where the need grows linearly with
   the rows, the limit sits at most 64 KiB above the estimate at `--scale` * b0 rows: a tight
   place, where an underestimate larger than what the rounding left shows as R > T. Rank 0's
   figure is used on every rank.
2. reported: `autoshard.prepare(..., memory_limit=limit, max_batch=True)` on the example batch,
   as a user calls it (its trial step included): the chosen strategy, checkpointed blocks and
   mixed precision, and R = `plan.max_batch`, the largest per-rank batch with which the chosen
   candidate's estimate fits. `--strategy` (default auto) is given to these plans and prepare.
3. true: T, the largest batch whose real steps stay within the limit, for that same strategy,
   checkpointing and precision (forced). A batch b is measured with the model built again at b
   rows, `prepare(..., trial_step=False)` with no limit (a limit would refuse a batch whose
   estimate does not fit, and the estimate is what is being checked), and `--steps` steps
   (forward, backward, optimizer step, gradients set to None; 2: the second runs beside the
   optimizer state the first creates). It is within the limit when every rank's peak is (all
   ranks agree: an all_reduce MAX of the peaks). Peak: on CPU the allocator's live bytes from
   torch's profiler (`_live_bytes.py`, as `estimate_accuracy.py` measures: a profile started
   before the model is built, so that it counts everything the training holds, gloo's and
   DDP's C++-side buffers included, the peak taken over the steps); on CUDA
   `max_memory_allocated` over the steps less what was allocated before the model was built
   (an out-of-memory error counts as over the limit). The search starts at R: R + R/8 next
   (the answer is expected near R), then doubling until a batch exceeds the limit (or halving
   until one fits), then bisection. It assumes the peak grows with the batch.

Per family: limit, strategy, checkpointing, R, T, R/T, whether R trained within the limit (the
issue's first acceptance) and the target (R <= T and R >= 0.9 T). DIR/report.md and
DIR/report.json are rewritten after every family; rank 0 prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # a plain checkout: autoshard need not be installed
import _bench as common  # noqa: E402
import zoo  # noqa: E402
import zoo_external  # noqa: E402
from _live_bytes import AllocatorProfile  # noqa: E402
from estimate_accuracy import PHASES, train_step  # noqa: E402

import autoshard  # noqa: E402
from autoshard._torch_compat import clear_cublas_workspaces  # noqa: E402

ZOOS = {"own": zoo, "external": zoo_external}
OWN = ("gpt", "mlp", "vit", "llama", "resnet")
# The external families run by default: a GQA decoder, an MoE, tied embeddings, an encoder, an
# encoder-decoder, speech, two vision models with convolutions and BatchNorm, a plain-torch one.
EXTERNAL = ("llama", "mixtral", "gpt2", "bert", "t5", "whisper", "vit", "convnext", "resnext")
RATIO_TARGET = 0.9  # R must be at least this share of T
MEASURED = "max_batch.measured"
MAX_ROWS = 4096  # the search for a batch that exceeds the limit stops here


# ---------------------------------------------------------------------------------------------
# The families, built as rank `rank` feeds them


def default_rows(zoo_name: str, family: str) -> int:
    if zoo_name == "own":
        return zoo.DEFAULT_BATCH[family]
    return zoo_external.ENTRIES[family][1]


def build(zoo_name: str, family: str, rows: int, device: torch.device) -> zoo.ZooModel:
    return ZOOS[zoo_name].build(family, rows, rank=dist.get_rank(), seed=0, device=device)


def need(candidate: Any) -> int:
    """What a candidate needs of the usable memory: its estimated peak and the reserve beside."""
    return int(candidate.estimated_peak_bytes + candidate.reserve_bytes)


def choose_limit(zoo_name: str, family: str, args: argparse.Namespace) -> dict[str, Any]:
    """memory_limit where the unlimited plan's choice reaches `--scale` * b0 rows (see above)."""
    scale = args.scale
    rows = default_rows(zoo_name, family)
    needs, chosen = [], []
    for n in (rows, 2 * rows):
        built = build(zoo_name, family, n, args.device)
        plan = autoshard.plan(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            strategy=args.strategy,
        )
        needs.append(need(plan.chosen))
        chosen.append(f"{plan.strategy.value} {plan.activation_checkpointing}/{plan.num_blocks}")
        del built, plan
        gc.collect()
    per_row = max((needs[1] - needs[0]) / rows, 1.0)
    limit = int(needs[0] + per_row * (scale - 1) * rows)
    return common.broadcast(
        {
            "example_rows": rows,
            "unlimited_choices": chosen,
            "unlimited_needs": needs,
            "target_rows": scale * rows,
            "limit_bytes": -(-limit // 2**16) * 2**16,  # rounded up to 64 KiB
        }
    )


def reported(
    zoo_name: str, family: str, rows: int, limit: int, args: argparse.Namespace
) -> dict[str, Any]:
    """prepare(..., memory_limit=limit, max_batch=True) on the example batch: its choice and R."""
    built = build(zoo_name, family, rows, args.device)
    started = time.perf_counter()
    prepared = autoshard.prepare(
        built.model,
        built.optimizer,
        built.batch,
        loss_fn=built.loss_fn,
        strategy=args.strategy,
        memory_limit=limit,
        max_batch=True,
    )
    plan = prepared.plan
    out = {
        "strategy": plan.strategy.value,
        "checkpointed": plan.activation_checkpointing,
        "num_blocks": plan.num_blocks,
        "mixed_precision": str(plan.mixed_precision.value),
        "R": plan.max_batch,
        "usable_bytes": plan.device_memory_bytes,
        "need_at_example_bytes": need(plan.chosen),
        "trial_peak_bytes": plan.measured_peak_bytes,
        "params": zoo.parameter_count(built.model),
        "batch_reason": next((r for r in plan.reasons if "largest" in r and "batch" in r), ""),
        "prepare_s": time.perf_counter() - started,
    }
    del prepared, plan, built
    gc.collect()
    return out


def need_at(
    zoo_name: str, family: str, rows: int, choice: dict[str, Any], device: torch.device
) -> int:
    """The forced choice's need at `rows` (a plan with no limit): what R's answer rested on."""
    built = build(zoo_name, family, rows, device)
    settings = {k: v for k, v in forced(choice).items() if k != "trial_step"}
    plan = autoshard.plan(
        built.model, built.optimizer, built.batch, loss_fn=built.loss_fn, **settings
    )
    figure = need(plan.chosen)
    del built, plan
    gc.collect()
    return int(common.broadcast(figure))


# ---------------------------------------------------------------------------------------------
# A real step's peak


class NoWindows:
    """Stands in for the profile on CUDA: `train_step`'s phase windows label nothing there."""

    def window(self, name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def run_steps(prepared: autoshard.Prepared, built: zoo.ZooModel, steps: int, prof: Any) -> None:
    """`steps` steps as estimate_accuracy.py runs them, each phase a window of `prof`."""
    held: list[Any] = [None]
    for _ in range(steps):
        train_step(prepared, built, prof, held)


def forced(choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "strategy": choice["strategy"],
        "activation_checkpointing": choice["checkpointed"],
        "mixed_precision": choice["mixed_precision"],
        "trial_step": False,
    }


def cpu_peak(
    zoo_name: str, family: str, rows: int, choice: dict[str, Any], steps: int
) -> dict[str, Any]:
    """This rank's peak over `steps` real steps, in a profile started before the model is built."""
    device = torch.device("cpu")
    gc.collect()
    with AllocatorProfile() as prof:
        built = build(zoo_name, family, rows, device)
        prepared = autoshard.prepare(
            built.model, built.optimizer, built.batch, loss_fn=built.loss_fn, **forced(choice)
        )
        with prof.window(MEASURED):
            run_steps(prepared, built, steps, prof)
        del prepared, built
        gc.collect()
    live = prof.live_bytes(MEASURED)
    return {
        "peak": live.peak,
        "upper_peak": live.upper_peak,
        "leaked": live.leaked[1],
        "phase": prof.span_at(live.peak_ns, set(PHASES)),
    }


def cuda_peak(
    zoo_name: str, family: str, rows: int, choice: dict[str, Any], steps: int, device: Any
) -> dict[str, Any]:
    """This rank's `max_memory_allocated` over the steps, less what was allocated before the
    model was built; None where the allocator ran out of memory."""
    gc.collect()
    torch.cuda.empty_cache()
    clear_cublas_workspaces()  # from none, as a new process starts: the estimate counts them
    before = torch.cuda.memory_allocated(device)
    peak: int | None = None
    try:
        built = build(zoo_name, family, rows, device)
        prepared = autoshard.prepare(
            built.model, built.optimizer, built.batch, loss_fn=built.loss_fn, **forced(choice)
        )
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_steps(prepared, built, steps, NoWindows())
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    except torch.OutOfMemoryError:
        pass  # over the limit: freed below, outside the except block
    prepared = built = None  # type: ignore[assignment]
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak": peak, "upper_peak": peak, "leaked": 0, "phase": None}


def real_step(
    zoo_name: str, family: str, rows: int, choice: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Every rank's peak at `rows`, and whether all are within the limit (agreed)."""
    device = args.device
    started = time.perf_counter()
    if device.type == "cuda":
        mine = cuda_peak(zoo_name, family, rows, choice, args.steps, device)
    else:
        mine = cpu_peak(zoo_name, family, rows, choice, args.steps)
    # an OOM (None) counts as over the limit on every rank
    worst = torch.tensor([float("inf") if mine["peak"] is None else float(mine["peak"])])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ranks = common.gather(mine)
    return {
        "rows": rows,
        "within": bool(worst.item() <= choice["limit_bytes"]),
        "peaks": [r["peak"] for r in ranks],
        "upper_peaks": [r["upper_peak"] for r in ranks],
        "leaked": [r["leaked"] for r in ranks],
        "peak_phase": [r["phase"] for r in ranks],
        "seconds": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------
# The search


def true_largest(within: Callable[[int], bool], start: int) -> tuple[int, int | None]:
    """(the largest batch within the limit, 0 where not even one row is; the smallest found
    over it, None where none was up to MAX_ROWS), searched from `start` (the reported batch)."""
    low, high = 0, None
    if within(start):
        low, n = start, start + max(1, start // 8)
        while n <= MAX_ROWS and within(n):
            low, n = n, 2 * n
        high = n if n <= MAX_ROWS else None
    else:
        high, n = start, start // 2
        while n >= 1 and not within(n):
            high, n = n, n // 2
        low = max(n, 0)
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        if within(mid):
            low = mid
        else:
            high = mid
    return low, high


def measure_family(zoo_name: str, family: str, args: argparse.Namespace) -> dict[str, Any]:
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    started = time.perf_counter()
    row: dict[str, Any] = {"zoo": zoo_name, "family": family}
    row.update(choose_limit(zoo_name, family, args))
    limit = row["limit_bytes"]
    row.update(reported(zoo_name, family, row["example_rows"], limit, args))
    say(
        f"{zoo_name}/{family}: limit {common.mib(limit)} MiB, {row['strategy']} "
        f"{row['checkpointed']}/{row['num_blocks']}, R = {row['R']}",
        flush=True,
    )
    probes: dict[int, dict[str, Any]] = {}

    def within(rows: int) -> bool:
        if rows not in probes:
            probes[rows] = real_step(zoo_name, family, rows, row, args)
            p = probes[rows]
            say(
                f"  {rows} rows: peak {common.mib(max(p['peaks'], key=_finite))} MiB, "
                f"{'within' if p['within'] else 'over'} ({p['seconds']:.1f} s)",
                flush=True,
            )
        return bool(probes[rows]["within"])

    if row["R"] is None:
        row.update(T=None, T_bound=None, R_within=None, need_at_R_bytes=None)
    else:
        row["need_at_R_bytes"] = need_at(zoo_name, family, row["R"], row, args.device)
        row["T"], row["T_bound"] = true_largest(within, row["R"])
        row["R_within"] = probes[row["R"]]["within"]
    row["probes"] = [probes[n] for n in sorted(probes)]
    row.update(verdict(row))
    row["seconds"] = time.perf_counter() - started
    return row


def _finite(value: int | None) -> float:
    return float("inf") if value is None else float(value)


def verdict(row: dict[str, Any]) -> dict[str, Any]:
    r, t = row["R"], row["T"]
    if r is None or t is None:
        return {"ratio": None, "target_met": False, "underestimate": False}
    return {
        "ratio": r / t if t else None,
        "target_met": bool(row["R_within"]) and r <= t and r >= RATIO_TARGET * t,
        "underestimate": r > t,  # the estimate let through a batch that exceeds the limit
    }


# ---------------------------------------------------------------------------------------------
# Report


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| family | params | example rows | limit MiB | strategy | AC | mp | R | T | R/T | "
        "need at R MiB | peak at R MiB | R within limit | R <= T, R >= 0.9 T | batches measured "
        "| s |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        lead = f"| {r['zoo']}/{r['family']} |"
        if "error" in r:
            lines.append(f"{lead} failed: {r['error'][:100]} |" + " |" * 14)
            continue
        at_r = next((p for p in r["probes"] if p["rows"] == r["R"]), None)
        peak_at_r = "-" if at_r is None else common.mib(max(at_r["peaks"], key=_finite))
        t = "-" if r["T"] is None else f"{r['T']}" + ("" if r["T_bound"] else "+")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"{lead} {r['params'] / 1e6:.2f}M | {r['example_rows']} | "
            f"{common.mib(r['limit_bytes'])} | {r['strategy']} | "
            f"{r['checkpointed']}/{r['num_blocks']} | {r['mixed_precision']} | {r['R']} | {t} | "
            f"{ratio} | {common.mib(r['need_at_R_bytes'])} | {peak_at_r} | "
            f"{_yes(r['R_within'])} | {_yes(r['target_met'])} | "
            f"{len(r['probes'])} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "**NO**"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r]
    return {
        "families": len(rows),
        "failed": [f"{r['zoo']}/{r['family']}" for r in rows if "error" in r],
        "R_within_limit": all(r["R_within"] for r in done) and len(done) == len(rows),
        "target_met": all(r["target_met"] for r in done) and len(done) == len(rows),
        "underestimates": [_case(r) for r in done if r["underestimate"]],
        "below_target": [
            _case(r) for r in done if r["ratio"] is not None and r["ratio"] < RATIO_TARGET
        ],
        "least_ratio": min((r["ratio"] for r in done if r["ratio"] is not None), default=None),
    }


def _case(r: dict[str, Any]) -> str:
    return (
        f"{r['zoo']}/{r['family']} {r['strategy']} {r['checkpointed']}/{r['num_blocks']} "
        f"at {common.mib(r['limit_bytes'])} MiB: R {r['R']}, T {r['T']}"
    )


def summary_lines(s: dict[str, Any]) -> str:
    least = "-" if s["least_ratio"] is None else f"{s['least_ratio']:.3f}"
    lines = [
        f"{s['families']} families, {len(s['failed'])} failed {s['failed'] or ''}".rstrip(),
        f"every reported batch trained within the limit: {_yes(s['R_within_limit'])}",
        f"every R within [0.9 T, T]: {_yes(s['target_met'])} (least R/T {least})",
    ]
    lines += [
        f"R > T (the estimate let an over-limit batch through): {c}" for c in s["underestimates"]
    ]
    lines += [f"R < 0.9 T: {c}" for c in s["below_target"]]
    return "\n".join(lines)


def write(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> str:
    s = summary(rows)
    machine = common.machine()
    settings = {k: str(v) for k, v in vars(args).items()}
    where = machine["cuda"] or f"CPU ({machine['cpu_count']} cores)"
    text = "\n".join(
        [
            "# Largest batch: reported against real steps (issue 25)",
            "",
            f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
            f"- torch {machine['torch']}, {machine['world_size']} rank(s), {machine['backend']}, "
            f"{where}",
            f"- settings: {settings}",
            "",
            table(rows),
            "",
            summary_lines(s),
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    result = {"machine": machine, "settings": settings, "summary": s, "rows": rows}
    (out / "report.json").write_text(json.dumps(result, indent=1))
    return text


# ---------------------------------------------------------------------------------------------
# Main


def families(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(zoo, family) pairs: `--families` names each plainly (in every zoo `--zoo` selects that
    has it) or as zoo/family."""
    zoos = ("own", "external") if args.zoo == "both" else (args.zoo,)
    if args.families is None:
        defaults = {"own": OWN, "external": EXTERNAL}
        return [(z, f) for z in zoos for f in defaults[z]]
    out = []
    for name in args.families.split(","):
        where, _, family = name.rpartition("/")
        known = [z for z in ((where,) if where else zoos) if family in _known(z)]
        if not known:
            raise SystemExit(f"no family {name!r} in the {' or '.join(zoos)} zoo")
        out += [(z, family) for z in known]
    return out


def _known(zoo_name: str) -> Any:
    return zoo.BUILDERS if zoo_name == "own" else zoo_external.ENTRIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="report.md and report.json go here")
    p.add_argument("--zoo", choices=("own", "external", "both"), default="both")
    p.add_argument(
        "--families",
        default=None,
        help=f"comma-separated, plain or zoo/family (default: own {','.join(OWN)}; external "
        f"{','.join(EXTERNAL)})",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=4,
        help="the limit is set where the unlimited plan's choice reaches this many times the "
        "example batch's rows",
    )
    p.add_argument(
        "--strategy",
        default="auto",
        choices=("auto", "ddp", "shard_grad_op", "full_shard", "local"),
        help="what the limit's plans and the reported prepare are given (default: auto)",
    )
    p.add_argument("--steps", type=int, default=2, help="real steps per measured batch")
    args = p.parse_args(argv)
    if args.scale < 2 or args.steps < 1:
        p.error("--scale must be >= 2 and --steps >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pairs = families(args)
    rank, _, args.device = common.init_distributed()
    rows = []
    for zoo_name, family in pairs:
        try:
            rows.append(measure_family(zoo_name, family, args))
        except Exception as error:  # recorded: one family does not end the run
            traceback.print_exc()
            rows.append({"zoo": zoo_name, "family": family, "error": repr(error)})
        gc.collect()
        if rank == 0:
            write(rows, args, args.out)
    if rank == 0:
        print()
        print(write(rows, args, args.out), flush=True)
    common.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
