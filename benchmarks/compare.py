"""The automatic choice against every manual choice, side by side, on the same machine and run.

For each zoo model x memory budget, `autoshard.prepare` runs once per manual strategy ("ddp",
"shard_grad_op", "full_shard", with activation_checkpointing="auto" as a user would leave it) and
once with strategy="auto"; each run then trains `--warmup` + `--steps` timed steps and one more
step whose per-rank peak memory is measured. Launch with torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/compare.py --models gpt,mlp \
        --steps 5 --warmup 2 --out benchmarks/out

Budgets (`memory_limit`, per rank) are by default derived from `autoshard.plan`'s estimates (each
with the reserve kept free beside it under FSDP2: what a candidate needs to fit), so that each
strategy in turn stops fitting:

    generous  1.5x DDP's estimate without checkpointing: everything fits
    no_ddp    halfway between SHARD_GRAD_OP's and DDP's estimate (no checkpointing)
    no_zero2  halfway between FULL_SHARD's and SHARD_GRAD_OP's estimate
    ac_only   halfway between FULL_SHARD's smallest estimate (blocks checkpointed) and its estimate
              without checkpointing: only checkpointing fits

`--budgets` takes those names and/or sizes ("300MiB", bytes), comma-separated. Rank 0 computes
the budgets and broadcasts them, so every rank runs the same grid.

Every strategy of a grid point runs `--rounds` times (default 3), the rounds interleaved (each
starts one strategy later), and its timed steps are pooled: the machine's drift then falls on every
strategy alike. Where auto chose the same plan as the best manual run (strategy and checkpointed
blocks), its regret is 1 by construction and the table says "same plan", with the timed ratio
beside it: a difference there is noise (one round once timed such a pair at 0.62).

A run "fits" unless `prepare` raised `DoesNotFit`, a timed step ran out of memory, or the measured
peak of the tracked step exceeded the budget (on CPU nothing really runs out of memory: as in
`prepare`'s own trial step, a measured peak above `memory_limit` counts as out of memory).

Output (rank 0): a markdown table on stdout, `<out>/compare.json` (one row per run plus a `derived`
section per grid point) and `<out>/compare.png` (needs matplotlib: `pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autoshard
from autoshard._units import parse_bytes
from autoshard.decide.precision import REQUESTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench as common  # noqa: E402
import zoo  # noqa: E402

MANUAL = ("ddp", "shard_grad_op", "full_shard")
STRATEGIES = (*MANUAL, "auto")
BUDGET_NAMES = ("generous", "no_ddp", "no_zero2", "ac_only")
REGRET_TARGET = 0.97
OVERHEAD_TARGET_S = 3.0


# ---------------------------------------------------------------------------------------------
# Budgets


def estimates(name: str, args: argparse.Namespace, world: int) -> dict[str, dict[str, int]]:
    """Per strategy, the per-rank memory a candidate needs to fit (its estimated peak and the
    reserve kept free beside it) without checkpointing ("plain") and the smallest over any number
    of checkpointed blocks ("frugal"), from `autoshard.plan` (no wrapping).

    A device memory of 1 byte makes nothing fit, so a forced strategy's plan shows both its plain
    candidate and its most frugal one."""
    out: dict[str, dict[str, int]] = {}
    for strategy in MANUAL:
        built = zoo.build(name, args.batch_size, rank=0, seed=args.seed)
        plan = autoshard.plan(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            world_size=world,
            device_memory=1,
            strategy=strategy,
            mixed_precision=args.mixed_precision,
        )
        # what a candidate needs to fit: its estimate and what is kept free beside it
        needs = [c.estimated_peak_bytes + c.reserve_bytes for c in plan.candidates]
        plain = next(c for c in plan.candidates if c.activation_checkpointing == 0)
        out[strategy] = {
            "plain": plain.estimated_peak_bytes + plain.reserve_bytes,
            "frugal": min(needs),
        }
    return out


def derive_budget(kind: str, est: dict[str, dict[str, int]]) -> int:
    ddp, zero2, zero3 = (est[s]["plain"] for s in MANUAL)
    if kind == "generous":
        return int(1.5 * max(ddp, zero2, zero3))
    if kind == "no_ddp":
        return (zero2 + ddp) // 2
    if kind == "no_zero2":
        return (zero3 + zero2) // 2
    if kind == "ac_only":
        return (est["full_shard"]["frugal"] + zero3) // 2
    raise ValueError(f"unknown budget {kind!r}; use {', '.join(BUDGET_NAMES)} or a size")


def budgets_for(
    name: str, specs: list[str], args: argparse.Namespace, world: int
) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """[(label, bytes)] for model `name`, and the estimates they came from (computed on rank 0
    only and broadcast: every rank runs exactly the same grid)."""
    result: tuple[list[tuple[str, int]], dict[str, Any]] | None = None
    if dist.get_rank() == 0:
        est = estimates(name, args, world) if any(s in BUDGET_NAMES for s in specs) else {}
        budgets = [
            (s, derive_budget(s, est)) if s in BUDGET_NAMES else (s, parse_bytes(s, what="budget"))
            for s in specs
        ]
        result = (budgets, est)
    budgets, est = common.broadcast(result)
    return budgets, est


# ---------------------------------------------------------------------------------------------
# One run


def trial_seconds(plan: autoshard.Plan) -> float | None:
    """Seconds of the trial step that fitted, from the plan's attempts (the library times only
    the attempt that fitted; attempts that ran out of memory count as prepare overhead)."""
    found = [a.seconds for a in plan.attempts if a.seconds is not None]
    return sum(found) if found else None


_PLAN_FIELDS = (
    "strategy",
    "activation_checkpointing",
    "num_blocks",
    "mixed_precision",
    "estimated_peak_bytes",
    "measured_peak_bytes",
    "attempts",
)


def plan_fields(plan: autoshard.Plan) -> dict[str, Any]:
    decision = plan.to_dict()
    return {key: decision[key] for key in _PLAN_FIELDS}


def run_one(
    name: str,
    budget: tuple[str, int],
    strategy: str,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    built = zoo.build(name, args.batch_size, rank=rank, seed=args.seed, device=device)
    row: dict[str, Any] = {
        "model": name,
        "params": zoo.parameter_count(built.model),
        "per_rank_batch": built.batch[0].shape[0],
        "global_batch": built.batch[0].shape[0] * world,
        "budget": budget[0],
        "budget_bytes": budget[1],
        "strategy": strategy,
        "fits": False,
        "oom_stage": None,
        "error": None,
        "samples_per_s": None,
        "step_s": None,
        "step_times_s": [],
        "prepare_s": None,
        "trial_s": None,
        "prepare_overhead_s": None,
        "plan": None,
        "measured_peak_bytes": None,
        "peak_bytes_per_rank": None,
        "peak_bytes_max": None,
    }
    dist.barrier()
    started = time.perf_counter()
    prepared: autoshard.Prepared | None = None
    try:
        prepared = autoshard.prepare(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            strategy=strategy,
            mixed_precision=args.mixed_precision,
            activation_checkpointing="auto",
            memory_limit=budget[1],
        )
    except autoshard.DoesNotFit as error:  # raised on every rank alike
        row["error"] = str(error)
    row["prepare_s"] = max(common.gather(time.perf_counter() - started))
    if prepared is None:
        row["oom_stage"] = "prepare"
        del built
        gc.collect()
        return row

    plan = prepared.plan
    row["plan"] = plan_fields(plan)
    row["measured_peak_bytes"] = plan.measured_peak_bytes
    row["trial_s"] = trial_seconds(plan)
    if row["trial_s"] is not None:
        row["prepare_overhead_s"] = row["prepare_s"] - row["trial_s"]
    times, oom = common.timed_steps(
        prepared, built.batch, built.loss_fn, args.warmup, args.steps, device
    )
    row["step_times_s"] = times
    if oom:
        row["oom_stage"] = "steps"
    else:
        peaks = common.gather(common.step_peak_bytes(prepared, built.batch, built.loss_fn, device))
        row["peak_bytes_per_rank"] = peaks
        row["peak_bytes_max"] = max(peaks)
        step = common.median(times)
        row["step_s"] = step
        row["samples_per_s"] = row["global_batch"] / step if step else None
        if max(peaks) > budget[1]:
            row["oom_stage"] = "over_budget"
        else:
            row["fits"] = True
    # Free the wrapper now: the next run builds its own, and a DDP wrapper must not outlive the
    # process group.
    del prepared, built
    gc.collect()
    return row


def merge_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, budget, strategy) from its rounds: it fits if every round fitted;
    samples/s from the median of every round's timed steps pooled; prepare and trial seconds
    the median over rounds; peaks the largest; the plan the first round's (`plans_differ` says
    whether a later round chose another)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["budget"], row["strategy"]), []).append(row)
    merged = []
    for runs in groups.values():
        row = dict(runs[0])
        row["rounds"] = len(runs)
        failed = [r for r in runs if not r["fits"]]
        row["fits"] = not failed
        row["oom_stage"] = failed[0]["oom_stage"] if failed else None
        times = [t for r in runs for t in r["step_times_s"]]
        row["step_times_s"] = times
        row["step_s"] = common.median(times) if row["fits"] and times else None
        row["samples_per_s"] = row["global_batch"] / row["step_s"] if row["step_s"] else None
        for key in ("prepare_s", "trial_s", "prepare_overhead_s"):
            values = [r[key] for r in runs if r[key] is not None]
            row[key] = common.median(values) if values else None
        per_rank = [r["peak_bytes_per_rank"] for r in runs if r["peak_bytes_per_rank"]]
        row["peak_bytes_per_rank"] = [max(p) for p in zip(*per_rank, strict=True)] or None
        row["peak_bytes_max"] = max(row["peak_bytes_per_rank"] or [], default=None)
        row["plans_differ"] = len({json.dumps(_chosen(r["plan"])) for r in runs}) > 1
        merged.append(row)
    return merged


def _chosen(plan: dict[str, Any] | None) -> Any:
    return None if plan is None else (plan["strategy"], plan["activation_checkpointing"])


# ---------------------------------------------------------------------------------------------
# Derived figures


def derive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, budget): regret, whether auto ran out of memory, prepare overhead."""
    points: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        points.setdefault((row["model"], row["budget"]), {})[row["strategy"]] = row
    derived = []
    for (model, budget), runs in points.items():
        manual = [runs[s] for s in MANUAL if s in runs and runs[s]["fits"]]
        best = max(manual, key=lambda r: r["samples_per_s"], default=None)
        auto = runs.get("auto")
        ratio = regret = None
        if best is not None and auto is not None and auto["fits"]:
            ratio = regret = auto["samples_per_s"] / best["samples_per_s"]
        # The same wrapping as the best manual run (strategy and checkpointed blocks; the mixed
        # precision is the grid's): any difference in speed is timing noise, not a result.
        same_plan = bool(
            best is not None
            and auto is not None
            and auto["fits"]
            and not auto["plans_differ"]
            and not best["plans_differ"]
            and _chosen(auto["plan"]) == _chosen(best["plan"])
        )
        if same_plan:
            regret = 1.0
        auto_plan = auto["plan"] if auto else None
        overhead = auto["prepare_overhead_s"] if auto else None
        derived.append(
            {
                "model": model,
                "budget": budget,
                "budget_bytes": next(iter(runs.values()))["budget_bytes"],
                "manual_fitting": [r["strategy"] for r in manual],
                "best_manual": best["strategy"] if best else None,
                "best_manual_samples_per_s": best["samples_per_s"] if best else None,
                "auto_samples_per_s": auto["samples_per_s"] if auto else None,
                "auto_plan": (
                    f"{auto_plan['strategy']} AC {auto_plan['activation_checkpointing']}/"
                    f"{auto_plan['num_blocks']}"
                    if auto_plan
                    else None
                ),
                "regret": regret,
                "same_plan": same_plan,
                "samples_per_s_ratio": ratio,  # as timed, also where the plans are the same
                "regret_ok": None if regret is None else regret >= REGRET_TARGET,
                # the strategy auto finally kept ran out of memory (prepare or training)
                "auto_oom": bool(auto and not auto["fits"] and auto["oom_stage"] != "prepare"),
                "auto_does_not_fit": bool(auto and auto["oom_stage"] == "prepare"),
                # auto's first pick ran out of memory in the trial step and it fell back
                "auto_fell_back_in_trial": bool(auto_plan and len(auto_plan["attempts"]) > 1),
                "auto_prepare_s": auto["prepare_s"] if auto else None,
                "auto_trial_s": auto["trial_s"] if auto else None,
                "auto_prepare_overhead_s": overhead,
                "overhead_ok": None if overhead is None else overhead <= OVERHEAD_TARGET_S,
                "auto_step_s": auto["step_s"] if auto else None,
            }
        )
    return derived


# ---------------------------------------------------------------------------------------------
# Output


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def runs_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | budget | strategy | fits | samples/s | step ms | peak/rank MiB (max) | "
        "trial peak MiB | prepare s | trial s | plan |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        plan = r["plan"]
        plan_text = (
            f"{plan['strategy']} AC {plan['activation_checkpointing']}/{plan['num_blocks']}"
            + (f" ({len(plan['attempts'])} attempts)" if len(plan["attempts"]) > 1 else "")
            if plan
            else "-"
        )
        fits = "yes" if r["fits"] else f"OOM ({r['oom_stage']})"
        lines.append(
            f"| {r['model']} | {r['budget']} ({common.mib(r['budget_bytes'])} MiB) | "
            f"{r['strategy']} | {fits} | {_num(r['samples_per_s'], '.1f')} | "
            f"{_num(r['step_s'] and r['step_s'] * 1e3, '.1f')} | "
            f"{common.mib(r['peak_bytes_max'])} | {common.mib(r['measured_peak_bytes'])} | "
            f"{_num(r['prepare_s'], '.2f')} | {_num(r['trial_s'], '.2f')} | {plan_text} |"
        )
    return "\n".join(lines)


def _regret(d: dict[str, Any]) -> str:
    if d["same_plan"]:  # 1 by construction; the timed ratio shows the noise
        return f"1 (same plan; timed {_num(d['samples_per_s_ratio'], '.3f')})"
    return _num(d["regret"], ".3f")


def derived_table(derived: list[dict[str, Any]]) -> str:
    head = (
        f"| model | budget | manual that fit | best manual | auto chose | regret (>= "
        f"{REGRET_TARGET}) | auto OOM (never) | prepare s | trial s | overhead s (<= "
        f"{OVERHEAD_TARGET_S:g}) |"
    )
    lines = [head, "|" + "---|" * 10]
    for d in derived:
        auto_oom = "yes" if d["auto_oom"] else "no"
        if d["auto_does_not_fit"]:
            auto_oom += " (DoesNotFit)"
        if d["auto_fell_back_in_trial"]:
            auto_oom += " (fell back in trial)"
        lines.append(
            f"| {d['model']} | {d['budget']} | {', '.join(d['manual_fitting']) or 'none'} | "
            f"{d['best_manual'] or '-'} | {d['auto_plan'] or '-'} | {_regret(d)} | "
            f"{auto_oom} | {_num(d['auto_prepare_s'], '.2f')} | {_num(d['auto_trial_s'], '.2f')} "
            f"| {_num(d['auto_prepare_overhead_s'], '.2f')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Throughput and peak memory per strategy per budget, auto marked; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.6 * len(models)), squeeze=False)
    colors = {"ddp": "#4c72b0", "shard_grad_op": "#55a868", "full_shard": "#c44e52", "auto": "#333"}
    width = 0.2
    for (ax_tp, ax_mem), model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        budgets = list(dict.fromkeys(r["budget"] for r in mine))
        for i, strategy in enumerate(STRATEGIES):
            for j, budget in enumerate(budgets):
                r = next(x for x in mine if x["budget"] == budget and x["strategy"] == strategy)
                x = j + (i - 1.5) * width
                style = dict(
                    color=colors[strategy],
                    hatch="//" if strategy == "auto" else None,
                    edgecolor="white" if strategy == "auto" else None,
                    label=strategy if j == 0 else None,
                )
                if r["fits"]:
                    ax_tp.bar(x, r["samples_per_s"], width, **style)
                    ax_mem.bar(x, r["peak_bytes_max"] / common.MiB, width, **style)
                    if strategy == "auto" and r["plan"]:
                        p = r["plan"]
                        short = {"ddp": "DDP", "shard_grad_op": "Z2", "full_shard": "Z3"}
                        text = f"{short[p['strategy']]}\nAC{p['activation_checkpointing']}"
                        ax_tp.annotate(
                            text, (x, r["samples_per_s"]), ha="center", va="bottom", fontsize=7
                        )
                else:
                    for ax in (ax_tp, ax_mem):
                        ax.plot(x, 0, marker="x", color=colors[strategy], markersize=8)
                        ax.annotate("OOM", (x, 0), ha="center", va="bottom", fontsize=7)
        for j, budget in enumerate(budgets):
            limit = next(r["budget_bytes"] for r in mine if r["budget"] == budget) / common.MiB
            ax_mem.hlines(limit, j - 0.45, j + 0.45, colors="k", linestyles="--", linewidth=1)
        labels = [
            f"{b}\n{common.mib(next(r['budget_bytes'] for r in mine if r['budget'] == b))} MiB"
            for b in budgets
        ]
        for ax in (ax_tp, ax_mem):
            ax.set_xticks(range(len(budgets)), labels, fontsize=8)
        ax_tp.margins(y=0.2)
        ax_tp.set_ylabel("samples/s (global)")
        ax_tp.set_title(f"{model}: throughput (x = out of memory; auto hatched)", fontsize=9)
        ax_mem.set_ylabel("peak MiB per rank (max over ranks)")
        ax_mem.set_title(f"{model}: measured peak memory (dashed = budget)", fontsize=9)
        ax_tp.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models", default="gpt,mlp", help=f"comma-separated: {', '.join(zoo.BUILDERS)}"
    )
    p.add_argument("--budgets", default=",".join(BUDGET_NAMES), help="names and/or sizes")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: per model)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run every strategy of a grid point this many times, interleaved, and pool the "
        "timed steps (the machine's drift then falls on every strategy alike; default 3: with "
        "1, auto's plan, identical to the best manual one, was once timed at 0.62 of it on 2 "
        "busy CPU cores)",
    )
    p.add_argument(
        "--mixed-precision",
        default=None,
        choices=REQUESTS,
        help="fixed for the whole grid (default: 'no' on CPU, 'bf16' on GPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    for name in args.models.split(","):
        if name not in zoo.BUILDERS:
            p.error(f"unknown model {name!r}; choose from {', '.join(zoo.BUILDERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = common.init_distributed()
    if args.mixed_precision is None:
        args.mixed_precision = "bf16" if device.type == "cuda" else "no"
    say = print if rank == 0 else (lambda *a, **k: None)
    started = datetime.now(timezone.utc)
    round_rows: list[dict[str, Any]] = []
    estimates_by_model: dict[str, Any] = {}
    for name in args.models.split(","):
        budgets, est = budgets_for(name, args.budgets.split(","), args, world)
        estimates_by_model[name] = {"estimates": est, "budgets": dict(budgets)}
        say(f"{name}: budgets " + ", ".join(f"{b} {common.mib(n)} MiB" for b, n in budgets))
        for budget in budgets:
            for round_index in range(args.rounds):
                # each round starts one strategy later: no strategy always runs first or last
                shift = round_index % len(STRATEGIES)
                for strategy in STRATEGIES[shift:] + STRATEGIES[:shift]:
                    row = run_one(name, budget, strategy, args, device)
                    row["round"] = round_index
                    round_rows.append(row)
                    say(
                        f"  {name:4s} {budget[0]:10s} {strategy:13s} round {round_index} "
                        + (
                            f"{row['samples_per_s']:8.1f} samples/s  peak "
                            f"{common.mib(row['peak_bytes_max'])} MiB  "
                            f"prepare {row['prepare_s']:.2f} s"
                            if row["fits"]
                            else f"OOM ({row['oom_stage']})"
                        ),
                        flush=True,
                    )
    rows = merge_rounds(round_rows)
    derived = derive(rows)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "date": started.isoformat(timespec="seconds"),
            "machine": common.machine(),
            "settings": {
                "models": args.models.split(","),
                "budgets": args.budgets.split(","),
                "batch_size": args.batch_size,
                "steps": args.steps,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "mixed_precision": args.mixed_precision,
                "activation_checkpointing": "auto",
                "device": str(device),
            },
            "targets": {"regret_min": REGRET_TARGET, "overhead_max_s": OVERHEAD_TARGET_S},
            "budgets": estimates_by_model,
            "runs": rows,
            "runs_by_round": round_rows,
            "derived": derived,
        }
        (args.out / "compare.json").write_text(json.dumps(result, indent=1))
        print()
        print(f"## Runs ({world} ranks, {device.type}, mixed precision {args.mixed_precision})")
        print()
        print(runs_table(rows))
        print()
        print("## Per grid point")
        print()
        print(derived_table(derived))
        print()
        print(f"json written to {args.out / 'compare.json'}")
        print(plot(rows, args.out / "compare.png"), flush=True)
    common.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
