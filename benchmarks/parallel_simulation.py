"""Simulations shared out to worker processes (`measure/pool.py`, issue 24): the same plan, in how
much less time.

    python benchmarks/parallel_simulation.py                 # every case, workers = cores - 1
    python benchmarks/parallel_simulation.py --workers 3 --cases llama_1b,bart_large

Each case is planned twice in this process with autoshard's cache off, once with no worker
(`AUTOSHARD_SIMULATION_WORKERS=0`) and once with `--workers` (by default one per core but this
process's), as a what-if `plan` on fake CPU tensors (8 ranks of 80 GiB GPUs, bf16): the only
simulations the pool takes (on CUDA it is not used, see the module). Reports both walls and the
count of runs at a depth the workers made; exits 1 if any plan differs from its sequential twin
(candidates, figures and reasons but the note's seconds and count of the workers' steps), which
must not happen whatever the timing. Wall times depend on the machine being idle: run it alone.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
import autoshard.measure.pool as pool_module  # noqa: E402
from benchmarks import planner  # noqa: E402


def bart_large() -> tuple[torch.nn.Module, Any, Any]:
    """BART-large's shape (12 + 12 blocks of width 1024), 4 x 512 source and 128 target tokens:
    simulated whole (no saving in extending 12 blocks)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=16, decoder_attention_heads=16,
        encoder_ffn_dim=4096, decoder_ffn_dim=4096, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = BartForConditionalGeneration(config)
    batch = {
        "input_ids": torch.zeros(4, 512, dtype=torch.long),
        "labels": torch.zeros(4, 128, dtype=torch.long),
    }
    return model, torch.optim.AdamW(model.parameters()), batch


def llama_7b() -> tuple[torch.nn.Module, Any, Any]:
    return _on_meta(lambda: planner.llama_7b(batch_size=1, seq_len=1024))


def llama_1b() -> tuple[torch.nn.Module, Any, Any]:
    return _on_meta(lambda: planner.llama_1b(batch_size=4, seq_len=2048))


def tiny_llama() -> tuple[torch.nn.Module, Any, Any]:
    """16 blocks at width 64: the benchmark's code paths in seconds (its smoke test)."""
    return planner.tiny_llama()


def _on_meta(factory: Callable[[], Any]) -> Any:
    with torch.device("meta"):
        return factory()


CASES: dict[str, Callable[[], tuple[torch.nn.Module, Any, Any]]] = {
    "llama_1b": llama_1b,
    "llama_7b": llama_7b,
    "bart_large": bart_large,
    "tiny_llama": tiny_llama,
}
MEASURED = ("llama_1b", "llama_7b", "bart_large")  # the default cases


def _planned(factory: Callable[[], Any], workers: int) -> tuple[autoshard.Plan, float, int]:
    """The plan with `workers` workers, its wall seconds, and the fake steps its workers made
    (the plan's reasons say)."""
    os.environ[pool_module.WORKERS] = str(workers)
    try:
        model, optimizer, batch = factory()
        started = time.perf_counter()
        plan = autoshard.plan(
            model, optimizer, batch, world_size=8, device_memory="80GiB", device="cuda",
            mixed_precision="bf16",
        )  # fmt: skip
        seconds = time.perf_counter() - started
    finally:
        del os.environ[pool_module.WORKERS]
    made = sum(
        int(n) for r in plan.reasons for n in re.findall(r"(\d+) of the fake steps made by", r)
    )
    return plan, seconds, made


def _comparable(plan: autoshard.Plan) -> tuple[Any, ...]:
    """The plan as data, with the seconds a round took and what the workers made taken out of
    its reasons."""
    workers = r", \d+ of the fake steps made by \d+ worker process\(es\)"
    reasons = tuple(
        re.sub(workers, "", re.sub(r"\d+\.\ds(,|\))", "Ts\\1", r)) for r in plan.reasons
    )
    return plan.candidates, plan.chosen, reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--workers", type=int, default=max(1, (cores or 2) - 1))
    parser.add_argument("--cases", default=",".join(MEASURED), help=f"of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    os.environ["AUTOSHARD_CACHE"] = "0"
    print(f"{cores} CPU(s), torch {torch.__version__}, {args.workers} worker(s)")
    print("| case | sequential s | with workers s | runs by workers | same plan |")
    print("|---|---|---|---|---|")
    differ = 0
    for name in args.cases.split(","):
        sequential, alone, _ = _planned(CASES[name], 0)
        shared, together, made = _planned(CASES[name], args.workers)
        same = _comparable(sequential) == _comparable(shared)
        differ += not same
        print(f"| {name} | {alone:.1f} | {together:.1f} | {made} | {'yes' if same else 'NO'} |")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
