"""What a plan costs as the model gets deeper (issue 24: "any depth from 16 to 128 layers within
1.2x of each other"): fake steps and fake operators of a what-if plan of the TinyLlama-shaped
model (`planner.llama_1b`, width 2048, 4 x 2048 tokens) at several depths, 8 ranks, bf16.

    python benchmarks/depth_cost.py                          # 80 GiB, then 1000 GiB
    python benchmarks/depth_cost.py --depths 16,128 --device-memory 80GiB

At 80 GiB the deepest models fit only with checkpointing, which adds the checkpointed runs the
plan then needs; with memory to spare every depth simulates the same runs, and the cost is the
extension's alone. Counted in this process with no simulation worker and the cache off; counts
do not depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["AUTOSHARD_CACHE"] = "0"
os.environ["AUTOSHARD_SIMULATION_WORKERS"] = "0"  # every fake step made here, where it is counted

import autoshard  # noqa: E402
from autoshard.measure import simulate  # noqa: E402
from benchmarks.planner import LlamaLM  # noqa: E402


def _counted(depth: int, memory: str) -> tuple[int, int, str]:
    """Fake steps, fake operators and the choice of a plan at `depth` blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counts = {"steps": 0, "operators": 0}
    dispatch, run = FakeTensorMode.dispatch, simulate._run

    def counted_dispatch(self: Any, *a: Any, **k: Any) -> Any:
        counts["operators"] += 1
        return dispatch(self, *a, **k)

    def counted_run(*a: Any, **k: Any) -> Any:
        counts["steps"] += 1
        return run(*a, **k)

    FakeTensorMode.dispatch = counted_dispatch  # type: ignore[method-assign]
    simulate._run = counted_run  # type: ignore[assignment]
    try:
        with torch.device("meta"):
            model = LlamaLM(
                vocab_size=32000, width=2048, depth=depth, heads=32, kv_heads=4, seq_len=2048
            )
            tokens = torch.zeros(4, 2049, dtype=torch.long)
        plan = autoshard.plan(
            model,
            torch.optim.AdamW(model.parameters()),
            (tokens[:, :-1], tokens[:, 1:]),
            world_size=8,
            device_memory=memory,
            device="cuda",
            mixed_precision="bf16",
        )
    finally:
        FakeTensorMode.dispatch = dispatch  # type: ignore[method-assign]
        simulate._run = run  # type: ignore[assignment]
    chosen = f"{plan.strategy.value}, AC {plan.activation_checkpointing}"
    return counts["steps"], counts["operators"], chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="16,22,64,128")
    parser.add_argument("--device-memory", default="80GiB,1000GiB")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}")
    print("| memory | blocks | simulated runs | fake operators | x the first | chosen |")
    print("|---|---|---|---|---|---|")
    for memory in args.device_memory.split(","):
        first = None
        for depth in (int(d) for d in args.depths.split(",")):
            steps, operators, chosen = _counted(depth, memory)
            first = first or operators
            print(
                f"| {memory} | {depth} | {steps} | {operators:,} | {operators / first:.2f} "
                f"| {chosen} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
