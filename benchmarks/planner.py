"""What-if planner benchmark: a Llama-style 7B model planned for 1024 GPUs on this machine.

    python benchmarks/planner.py            # world size 1024 = 128 nodes x 8, 80 GiB GPUs
    python benchmarks/planner.py --world-size 64 --nodes 8

Runs `autoshard plan benchmarks.planner:llama_7b ...` as a child process (the CLI a user runs),
and reports its wall time and peak resident memory (the child's max RSS) beside the plan it
printed. Targets (issue 4): at most 30 s and 2 GiB on a 2-core CPU machine. The model is built
on the meta device by the CLI, so it costs no memory; the trace and the per-strategy simulations
run on fake tensors. The child plans cold (`AUTOSHARD_CACHE=0`), as a first launch does.

    python benchmarks/planner.py --phases   # also: fake steps, fake operators, time per phase
    python benchmarks/planner.py --warm     # also: the same plan twice with the cache on

`--phases` plans once more in this process, counting the fake steps (the trace's, and each
simulated run's at each depth) and the fake operators (calls into `FakeTensorMode.dispatch`,
decompositions' included: the figure issue 24's targets are in), and timing the trace, the
simulations and the rest. `--warm` runs the CLI twice more with autoshard's cache on, in a
temporary directory of its own: the first writes the cache, the second is a restart that reads
it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.zoo import Llama, lm_loss  # noqa: E402


class LlamaLM(Llama):
    """The zoo's Llama returning its own next-token loss, as Hugging Face models do, so that the
    planner (which takes no loss_fn) traces the real loss's activations."""

    def forward(self, tokens: Any, targets: Any = None) -> Any:
        logits = super().forward(tokens)
        return logits if targets is None else lm_loss(logits, (tokens, targets))


def llama_7b(batch_size: int = 1, seq_len: int = 1024) -> tuple[nn.Module, object, object]:
    """Llama-2-7B's shape: 32 blocks of width 4096, 32 heads, vocabulary 32000 (the zoo's SwiGLU
    width is 8/3 x 4096 rounded to 32, 10944, against Llama's 11008, and its embeddings are
    tied), with AdamW and one batch of token ids."""
    import torch

    model = LlamaLM(vocab_size=32000, width=4096, depth=32, heads=32, kv_heads=32, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.zeros(batch_size, seq_len + 1, dtype=torch.long)
    return model, optimizer, (tokens[:, :-1], tokens[:, 1:])


def llama_1b(batch_size: int = 4, seq_len: int = 2048) -> tuple[nn.Module, object, object]:
    """TinyLlama-1.1B's shape (issue 24's first row): 22 blocks of width 2048, 32 heads over 4
    key/value heads, vocabulary 32000 (the zoo's SwiGLU width is 5472 against 5632)."""
    import torch

    model = LlamaLM(vocab_size=32000, width=2048, depth=22, heads=32, kv_heads=4, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.zeros(batch_size, seq_len + 1, dtype=torch.long)
    return model, optimizer, (tokens[:, :-1], tokens[:, 1:])


def llama_405b(batch_size: int = 1, seq_len: int = 8192) -> tuple[nn.Module, object, object]:
    """Llama-3.1-405B's shape (issue 24's 405B row): 126 blocks of width 16384, 128 heads over
    8 key/value heads, SwiGLU width 53248, vocabulary 128256 (the zoo's embeddings are tied,
    Llama's are not: 2.1B parameters fewer), with AdamW and one sequence of 8192 tokens."""
    import torch

    model = LlamaLM(
        vocab_size=128256,
        width=16384,
        depth=126,
        heads=128,
        kv_heads=8,
        seq_len=seq_len,
        hidden=53248,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.zeros(batch_size, seq_len + 1, dtype=torch.long)
    return model, optimizer, (tokens[:, :-1], tokens[:, 1:])


def tiny_llama(batch_size: int = 2, seq_len: int = 32) -> tuple[nn.Module, object, object]:
    """A Llama-style model of 16 blocks at width 64: the benchmark's code paths in seconds
    (its smoke test), the blocks enough to be simulated shallow and extended."""
    import torch

    model = LlamaLM(vocab_size=256, width=64, depth=16, heads=4, kv_heads=2, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.zeros(batch_size, seq_len + 1, dtype=torch.long)
    return model, optimizer, (tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factory", default="benchmarks.planner:llama_7b", help="MODULE:FACTORY")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--device-memory", default="80GiB")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--phases", action="store_true", help="fake steps, operators, phases")
    parser.add_argument("--warm", action="store_true", help="a restart with the cache on")
    args = parser.parse_args(argv)
    code, wall, rss_gib = _run_cli(args, {"AUTOSHARD_CACHE": "0"})
    print(
        f"\nplanner: {args.factory}, world size {args.world_size} ({args.nodes} nodes), batch "
        f"{args.batch_size} x {args.seq_len}: {wall:.1f} s wall (target <= 30 s), "
        f"peak RSS {rss_gib:.2f} GiB (target <= 2 GiB), {os.cpu_count()} CPU(s)"
    )
    if code == 0 and args.warm:
        with tempfile.TemporaryDirectory() as kept:
            cache = {"AUTOSHARD_CACHE": "1", "AUTOSHARD_CACHE_DIR": kept}
            code, writing, _ = _run_cli(args, cache)
            if code == 0:
                code, restart, _ = _run_cli(args, cache)
                print(
                    f"planner, cache on: {writing:.1f} s wall writing it, {restart:.1f} s "
                    f"wall for a restart reading it (process start and imports included)"
                )
    if code == 0 and args.phases:
        print(_phases(args))
    return code


def _run_cli(args: argparse.Namespace, environment: dict[str, str]) -> tuple[int, float, float]:
    """The CLI's plan in a child process: its exit code, wall seconds and max RSS (GiB)."""
    cmd = [
        sys.executable,
        "-m",
        "autoshard",
        "plan",
        args.factory,
        "--world-size",
        str(args.world_size),
        "--nodes",
        str(args.nodes),
        "--device-memory",
        args.device_memory,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
    ]
    print("running:", " ".join(cmd[1:]), flush=True)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(environment)
    code = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
    wall = time.perf_counter() - started
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    return code, wall, rss_gib


def _phases(args: argparse.Namespace) -> str:
    """The same plan in this process (cache off, no simulation worker), its fake steps and
    operators counted and its phases timed, by wrapping autoshard's and torch's functions for
    the duration."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import autoshard
    from autoshard.measure import facts, pool, simulate, simulated

    os.environ["AUTOSHARD_CACHE"] = "0"
    counts = {"steps": 0, "operators": 0}
    seconds = {"trace": 0.0, "simulation": 0.0}

    def timed(owner: Any, name: str, phase: str | None, step: bool) -> Any:
        original = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            counts["steps"] += step
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if phase is not None:
                    seconds[phase] += time.perf_counter() - started

        return wrapper

    dispatch = FakeTensorMode.dispatch

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        counts["operators"] += 1
        return dispatch(self, *a, **k)

    patches = [
        (facts, "_measure", timed(facts, "_measure", "trace", True)),
        (simulated, "simulate_all", timed(simulated, "simulate_all", "simulation", False)),
        (simulate, "_run", timed(simulate, "_run", None, True)),
        (FakeTensorMode, "dispatch", counted),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    # every fake step made in this process, where it is counted (no worker: measure/pool.py)
    workers = os.environ.get(pool.WORKERS)
    os.environ[pool.WORKERS] = "0"
    try:
        module, _, name = args.factory.partition(":")
        factory = getattr(importlib.import_module(module), name)
        with torch.device("meta"):
            model, optimizer, batch = factory(batch_size=args.batch_size, seq_len=args.seq_len)
        started = time.perf_counter()
        autoshard.plan(
            model,
            optimizer,
            batch,
            world_size=args.world_size,
            num_nodes=args.nodes,
            device="cuda",
            device_memory=args.device_memory,
        )
        total = time.perf_counter() - started
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        if workers is None:
            del os.environ[pool.WORKERS]
        else:
            os.environ[pool.WORKERS] = workers
    rest = total - seconds["trace"] - seconds["simulation"]
    return (
        f"planner, in-process: {counts['steps']} fake steps, {counts['operators']:,} fake "
        f"operators; {total:.1f} s: trace {seconds['trace']:.1f} s, simulations "
        f"{seconds['simulation']:.1f} s, the rest {rest:.1f} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
