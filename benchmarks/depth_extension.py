"""Depth-extension benchmark: the extended estimate against the whole model's, family by family.

    python benchmarks/depth_extension.py                      # every family, strategy, AC
    python benchmarks/depth_extension.py --families llama,t5 --strategies ddp
    python benchmarks/depth_extension.py --json depth.json    # also the rows as JSON

A model whose blocks repeat is simulated with a few periods of every list of blocks and extended
to its full depth (`measure.layout`, `measure.simulate`); the extension must never fall short:
an estimate below the whole model's is an out-of-memory error after `prepare`. For every family
of `benchmarks/deep_families.py` (deep, narrow, built on meta), every strategy and activation
checkpointing off and on, this plans twice in this process, for 8 ranks of 80 GiB GPUs in bf16
as tests/test_depth_extension.py does:

- as autoshard plans it, recording the periods of every simulated run (`simulate._run`'s last
  argument; none for the whole model) and counting the fake operators (calls into
  `FakeTensorMode.dispatch`, the trace's included, as benchmarks/planner.py's `--phases` does);
- with the extension turned off (`layout.MIN_DEPTH_TO_EXTEND` out of reach): every block
  simulated, the reference.

It prints one row per plan pair: the family, strategy, AC, the depths simulated (`whole` where a
run had every block, `ext` where none did, `ext>whole` where the shallow runs were followed by a
whole one: the terms were not linear), both peaks, the signed error of the extended one against
the whole one (negative: an underestimate), the same error over the simulated terms alone
(`terms %`: the peak less the overheads and cuBLAS workspaces, constants of several hundred MiB
that dwarf a narrow model's own bytes and would hide its error), both operator counts and both
wall times. The cache is off (`AUTOSHARD_CACHE=0`): each plan simulates. Exit code 1 where any
|error| of the peak exceeds 0.5%, 2 where a plan failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# before autoshard is imported: a cached simulation would stand in for the whole one
os.environ["AUTOSHARD_CACHE"] = "0"
# every run made in this process, where `_run` and the fake operators are counted (measure/pool.py)
os.environ["AUTOSHARD_SIMULATION_WORKERS"] = "0"

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deep_families  # noqa: E402

TOLERANCE = 0.005  # of the whole model's peak
STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
OUT_OF_REACH = 10**9  # no model has this many blocks: every model simulated whole


def _run_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The periods a call of `simulate._run` simulates: [k] for a shallow copy of k periods of
    every list (`measure.layout`), [] for the whole model."""
    periods = args[5] if len(args) > 5 else kwargs.get("periods")
    return [] if periods is None else [periods]


@contextlib.contextmanager
def _counting(whole: bool) -> Iterator[dict[str, Any]]:
    """While it lasts: each simulated run's depth arguments and block count recorded, fake
    operators counted, and with `whole` the extension turned off."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import autoshard.measure.layout as layout_module
    import autoshard.measure.simulate as simulate_module

    seen: dict[str, Any] = {"runs": [], "operators": 0}
    run = simulate_module._run
    dispatch = FakeTensorMode.dispatch

    def counted_run(*args: Any, **kwargs: Any) -> Any:
        setup = args[1] if len(args) > 1 else kwargs.get("setup")
        names = getattr(setup, "block_names", None)
        seen["runs"].append((_run_arguments(args, kwargs), None if names is None else len(names)))
        return run(*args, **kwargs)

    def counted_dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["operators"] += 1
        return dispatch(self, *args, **kwargs)

    saved = [(simulate_module, "_run", run), (FakeTensorMode, "dispatch", dispatch)]
    replacements: list[tuple[Any, str, Any]] = [
        (simulate_module, "_run", counted_run),
        (FakeTensorMode, "dispatch", counted_dispatch),
    ]
    if whole:  # no layout worth a shallow copy: every model simulated whole
        saved.append((layout_module, "MIN_DEPTH_TO_EXTEND", layout_module.MIN_DEPTH_TO_EXTEND))
        replacements.append((layout_module, "MIN_DEPTH_TO_EXTEND", OUT_OF_REACH))
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield seen
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _shown(arguments: list[Any]) -> str:
    """A run's depth as the table shows it: its int arguments (a depth, or a number of periods),
    else its arguments' type names; `whole` for none."""
    if not arguments:
        return "whole"
    ints = [str(a) for a in arguments if isinstance(a, int)]
    return ":".join(ints or [type(a).__name__ for a in arguments])


def depths_simulated(runs: list[tuple[list[Any], int | None]]) -> tuple[str, str]:
    """(kind, depths): `whole` where every run had every block, `ext` where none did,
    `ext>whole` where shallow runs were followed by a whole one (the terms were not linear),
    `none` where nothing was simulated; and each distinct run's depth (`_shown`), in order. A run
    had every block where `_run` was given no depth, or the block count itself."""
    if not runs:
        return "none", "-"
    distinct: list[str] = []
    for arguments, _ in runs:
        if (text := _shown(arguments)) not in distinct:
            distinct.append(text)
    whole = [
        not arguments or (len(arguments) == 1 and arguments[0] == full) for arguments, full in runs
    ]
    kind = "whole" if all(whole) else "ext>whole" if any(whole) else "ext"
    return kind, ",".join(distinct)


def plan_peak(name: str, strategy: str, checkpointed: bool, whole: bool) -> dict[str, Any]:
    """One plan of family `name`: its peak, the runs simulated, fake operators and seconds."""
    import autoshard

    built = deep_families.build(name)
    with _counting(whole) as seen:
        started = time.perf_counter()
        plan = autoshard.plan(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            world_size=8,
            device="cuda",  # planned for GPUs (the what-if needs none): no gloo buffers
            device_memory="80GiB",
            strategy=strategy,
            mixed_precision="bf16",
            activation_checkpointing=checkpointed,
        )
        seconds = time.perf_counter() - started
    kind, depths = depths_simulated(seen["runs"])
    footprint = plan.chosen.footprint
    return {
        "peak": plan.chosen.estimated_peak_bytes,
        # what the simulation gives: the peak less the constants beside it (the CUDA context,
        # the allocator's overheads, cuBLAS's workspaces), which no depth changes
        "simulated": footprint.peak - footprint.overheads - footprint.workspace,
        "kind": kind,
        "depths": depths,
        "blocks": max((full for _, full in seen["runs"] if full is not None), default=None),
        "runs": [[repr(a) for a in arguments] for arguments, _ in seen["runs"]],
        "operators": seen["operators"],
        "seconds": seconds,
    }


def measure(name: str, strategy: str, checkpointed: bool) -> dict[str, Any]:
    """One row: the plan as autoshard makes it against the plan of the whole model."""
    row: dict[str, Any] = {"family": name, "strategy": strategy, "ac": checkpointed}
    try:
        extended = plan_peak(name, strategy, checkpointed, whole=False)
        whole = plan_peak(name, strategy, checkpointed, whole=True)
    except Exception as error:  # a family that fails to plan is reported, not fatal
        row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        row["traceback"] = traceback.format_exc()
        return row
    row.update(
        kind=extended["kind"],
        depths=extended["depths"],
        blocks=whole["blocks"],
        extended_peak=extended["peak"],
        whole_peak=whole["peak"],
        error_pct=100.0 * (extended["peak"] - whole["peak"]) / whole["peak"],
        extended_simulated=extended["simulated"],
        whole_simulated=whole["simulated"],
        simulated_error_pct=100.0
        * (extended["simulated"] - whole["simulated"])
        / max(1, whole["simulated"]),
        ops_extended=extended["operators"],
        ops_whole=whole["operators"],
        seconds_extended=extended["seconds"],
        seconds_whole=whole["seconds"],
        whole_depths=whole["depths"],
    )
    return row


HEADER = (
    f"{'family':18} {'strategy':13} {'AC':3} {'simulated':18} {'extended MiB':>12} "
    f"{'whole MiB':>10} {'error %':>8} {'terms %':>8} {'ops ext':>8} {'ops whole':>9} "
    f"{'s ext':>6} {'s whole':>7}"
)


def render(row: dict[str, Any]) -> str:
    head = f"{row['family']:18} {row['strategy']:13} {'on' if row['ac'] else 'off':3}"
    if "error" in row:
        return f"{head} FAILED: {row['error']}"
    mib = 2**20
    flag = "  <-- off by more than 0.5%" if abs(row["error_pct"]) > 100 * TOLERANCE else ""
    simulated = f"{row['kind']} {row['depths']}"
    return (
        f"{head} {simulated:18} {row['extended_peak'] / mib:12.2f} {row['whole_peak'] / mib:10.2f}"
        f" {row['error_pct']:+8.3f} {row['simulated_error_pct']:+8.3f}"
        f" {row['ops_extended']:8d} {row['ops_whole']:9d}"
        f" {row['seconds_extended']:6.1f} {row['seconds_whole']:7.1f}{flag}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families",
        default=",".join(deep_families.FAMILIES),
        help="comma-separated families of benchmarks/deep_families.py (default: all)",
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated (default: %(default)s)"
    )
    parser.add_argument(
        "--ac",
        default="off,on",
        help="activation checkpointing settings, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in deep_families.FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(deep_families.FAMILIES)}")
    strategies = [s for s in args.strategies.split(",") if s]
    settings = [{"off": False, "on": True}[a] for a in args.ac.split(",") if a]

    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    # torch's module tracker, on a block freed before its backward hook ran (T5, Whisper)
    warnings.filterwarnings("ignore", message="Module is None")
    rows = []
    started = time.perf_counter()
    print(HEADER, flush=True)
    for name in families:
        for strategy in strategies:
            for checkpointed in settings:
                row = measure(name, strategy, checkpointed)
                rows.append(row)
                print(render(row), flush=True)
    total = time.perf_counter() - started
    failed = [r for r in rows if "error" in r]
    off = [r for r in rows if "error" not in r and abs(r["error_pct"]) > 100 * TOLERANCE]
    extended = sorted({r["family"] for r in rows if r.get("kind") in ("ext", "ext>whole")})
    print(f"\n{len(rows)} plan pairs in {total:.0f} s; extended: {', '.join(extended) or 'none'}")
    if off:
        print(f"off by more than {100 * TOLERANCE}%: {len(off)} rows")
    for row in failed:
        print(f"\n{row['family']} {row['strategy']} AC={row['ac']} failed:\n{row['traceback']}")
    if args.json:
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "traceback"} for r in rows], indent=1)
        )
    return 2 if failed else 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
