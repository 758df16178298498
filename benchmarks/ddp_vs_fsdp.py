"""DDP vs FSDP: memory per rank, throughput, memory savings, for a ViT-Large-style model.

Trains the zoo's ViT under `autoshard.prepare` with each strategy forced (DDP, FSDP2 ZeRO-2
`shard_grad_op`, FSDP2 ZeRO-3 `full_shard`), no activation checkpointing and one mixed-precision
setting for all, and prints: measured peak memory per rank, samples/s, and the memory saved
against DDP. Launch with torchrun on whatever the machine has (GPUs with NCCL, else CPU with gloo):

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_vs_fsdp.py

The model keeps ViT-Large's block shape (width 1024, 16 heads, MLP 4096, patch 16). On GPUs it
defaults to ViT-L/16 in full (24 blocks, 224 px); on CPU, where one ViT-L step takes minutes, to
4 blocks at 64 px. `--depth`, `--width`, `--heads`, `--image-size`, `--batch-size` override that;
the output says which size ran.
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
from autoshard.decide.precision import REQUESTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench as common  # noqa: E402
import zoo  # noqa: E402

STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
CPU_DEFAULTS = dict(depth=4, image_size=64, batch_size=4)
GPU_DEFAULTS = dict(
    depth=zoo.VIT_LARGE["depth"], image_size=zoo.VIT_LARGE["image_size"], batch_size=8
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=zoo.VIT_LARGE["width"])
    p.add_argument("--heads", type=int, default=zoo.VIT_LARGE["heads"])
    p.add_argument("--depth", type=int, default=None, help="blocks (default: 24 on GPU, 4 on CPU)")
    p.add_argument("--image-size", type=int, default=None, help="default: 224 on GPU, 64 on CPU")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (8 on GPU, 4 on CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--mixed-precision",
        default=None,
        choices=REQUESTS,
        help="the same for every strategy (default: 'no' on CPU, 'bf16' on GPU)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    return p.parse_args(argv)


def run(strategy: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    built = zoo.build_vit_large(
        args.batch_size,
        rank=rank,
        device=device,
        width=args.width,
        heads=args.heads,
        depth=args.depth,
        image_size=args.image_size,
    )
    dist.barrier()
    started = time.perf_counter()
    prepared = autoshard.prepare(
        built.model,
        built.optimizer,
        built.batch,
        loss_fn=built.loss_fn,
        strategy=strategy,
        mixed_precision=args.mixed_precision,
        activation_checkpointing=False,
    )
    prepare_s = max(common.gather(time.perf_counter() - started))
    times, oom = common.timed_steps(
        prepared, built.batch, built.loss_fn, args.warmup, args.steps, device
    )
    peaks = (
        None
        if oom
        else common.gather(common.step_peak_bytes(prepared, built.batch, built.loss_fn, device))
    )
    step = common.median(times)
    row = {
        "strategy": strategy,
        "fits": not oom,
        "peak_bytes_per_rank": peaks,
        "peak_bytes_max": max(peaks) if peaks else None,
        "trial_peak_bytes": prepared.plan.measured_peak_bytes,
        "estimated_peak_bytes": prepared.plan.estimated_peak_bytes,
        "step_s": step,
        "step_times_s": times,
        "samples_per_s": args.batch_size * dist.get_world_size() / step if step else None,
        "prepare_s": prepare_s,
        "mixed_precision": prepared.plan.mixed_precision,
    }
    del prepared, built
    gc.collect()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    ddp = next((r for r in rows if r["strategy"] == "ddp" and r["fits"]), None)
    lines = [
        "| strategy | memory per rank MiB (rank 0 / rank 1 ...) | max MiB | estimated MiB | "
        "samples/s | memory savings vs DDP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['strategy']} | OOM | - | - | - | - |")
            continue
        saving = "-" if ddp is None else f"{1 - r['peak_bytes_max'] / ddp['peak_bytes_max']:.1%}"
        per_rank = " / ".join(common.mib(p) for p in r["peak_bytes_per_rank"])
        lines.append(
            f"| {r['strategy']} | {per_rank} | {common.mib(r['peak_bytes_max'])} | "
            f"{common.mib(r['estimated_peak_bytes'])} | {r['samples_per_s']:.2f} | {saving} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = common.init_distributed()
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.mixed_precision is None:
        args.mixed_precision = "bf16" if device.type == "cuda" else "no"
    started = datetime.now(timezone.utc)
    rows = [run(strategy, args, device) for strategy in STRATEGIES]
    if rank == 0:
        params = zoo.parameter_count(
            zoo.ViT(args.image_size, 16, args.width, args.depth, args.heads, 1000)
        )
        full = (args.depth, args.width, args.image_size) == (24, 1024, 224)
        size = (
            f"ViT {'L/16 (full size)' if full else 'L-shaped, shrunk'}: width {args.width}, "
            f"{args.depth} blocks, {args.heads} heads, patch 16, {args.image_size} px "
            f"({(args.image_size // 16) ** 2 + 1} tokens), {params / 1e6:.1f}M parameters; "
            f"per-rank batch {args.batch_size}, {world} ranks on {device.type} "
            f"({dist.get_backend()}), mixed precision {args.mixed_precision}, AdamW, "
            f"no activation checkpointing; {args.steps} timed steps after {args.warmup} warm-up"
        )
        print(size)
        print()
        print(table(rows))
        memory_note = (
            "memory: CUDA allocator peak of one training step"
            if device.type == "cuda"
            else "memory: tensor bytes torch's MemTracker sees during one training step (C++-side "
            "buffers such as DDP's gradient buckets are not counted)"
        )
        print()
        print(memory_note)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "ddp_vs_fsdp.json"
        path.write_text(
            json.dumps(
                {
                    "date": started.isoformat(timespec="seconds"),
                    "machine": common.machine(),
                    "size": size,
                    "settings": {k: str(v) for k, v in vars(args).items()},
                    "runs": rows,
                },
                indent=1,
            )
        )
        print(f"json written to {path}", flush=True)
    common.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
