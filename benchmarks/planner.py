"""What-if planner benchmark: a Llama-style 7B model planned for 1024 GPUs on this machine.

    python benchmarks/planner.py            # world size 1024 = 128 nodes x 8, 80 GiB GPUs
    python benchmarks/planner.py --world-size 64 --nodes 8

Runs `autoshard plan benchmarks.planner:llama_7b ...` as a child process (the CLI a user runs),
and reports its wall time and peak resident memory (the child's max RSS) beside the plan it
printed. Targets (issue 4): at most 30 s and 2 GiB on a 2-core CPU machine. The model is built
on the meta device by the CLI, so it costs no memory; the trace and the per-strategy simulations
run on fake tensors.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--device-memory", default="80GiB")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args(argv)
    cmd = [
        sys.executable,
        "-m",
        "autoshard",
        "plan",
        "benchmarks.planner:llama_7b",
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
    code = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
    wall = time.perf_counter() - started
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    print(
        f"\nplanner: world size {args.world_size} ({args.nodes} nodes), batch "
        f"{args.batch_size} x {args.seq_len}: {wall:.1f} s wall (target <= 30 s), "
        f"peak RSS {rss_gib:.2f} GiB (target <= 2 GiB), {os.cpu_count()} CPU(s)"
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
