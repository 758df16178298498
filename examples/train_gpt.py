"""Train a compact GPT with autoshard choosing DDP, ZeRO-2 or ZeRO-3 for it.

This is what a user's own training script looks like: an ordinary model, optimizer and loop, plus
one call to `autoshard.prepare`. Launch it as you would any script:

    python examples/train_gpt.py                                    # one process
    torchrun --nproc-per-node 2 examples/train_gpt.py --strategy full_shard
    accelerate launch --multi_gpu --num_processes 2 examples/train_gpt.py

(On a machine without GPUs, accelerate's `--multi_gpu` still starts 2 processes through torchrun and
autoshard runs them on CPU with gloo; `accelerate launch --cpu --num_processes 2` starts only one
process unless it is given an MPI hostfile.)

The task: each sequence counts upward from a random token by a random stride of 1 to 4, modulo the
vocabulary. After the first two tokens everything is predictable, so the loss falls fast.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard


class CompactGPT(nn.Module):
    """A decoder-only transformer built from stock `nn.TransformerEncoderLayer`s with a causal
    mask. The layers sit in an `nn.ModuleList`, which is how autoshard finds the repeated blocks
    it shards and checkpoints."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim,
                heads,
                4 * dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1)
        x = self.embed(tokens) + self.pos[:length]
        # A boolean mask (True = may not attend): attention converts it to the query's dtype, so
        # it also works when mixed precision runs the layers in bf16 or fp16.
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """Predict token t+1 from tokens <= t. Also given to prepare(), so its trial step measures
    the same computation as training."""
    (tokens,) = batch
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def counting_batch(step: int, args: argparse.Namespace, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous chunk of the global batch for `step` (the same on every rank)."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(args.vocab, (args.batch_size, 1), generator=g)
    stride = torch.randint(1, 5, (args.batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq_len)) % args.vocab
    share = args.batch_size // world
    return tokens[rank * share : (rank + 1) * share]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a compact GPT with autoshard.prepare.")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "local", "ddp", "shard_grad_op", "full_shard"],
    )
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "no"])
    p.add_argument("--memory-limit", default=None, help="usable memory per rank, e.g. '6GiB'")
    return p.parse_args()


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value)  # SUM: ReduceOp.AVG is not supported by gloo
        value /= dist.get_world_size()
    return value.item()


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model: nn.Module = CompactGPT(args.vocab, dim=96, layers=3, heads=4, max_len=args.seq_len)
    model.to(device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    prepared = autoshard.prepare(
        model,
        optimizer,
        example_batch=(counting_batch(0, args, rank, world).to(device),),
        loss_fn=next_token_loss,
        strategy=args.strategy,
        mixed_precision=args.mixed_precision,
        memory_limit=args.memory_limit,
    )
    model, optimizer, plan = prepared
    scaler = prepared.scaler  # a GradScaler when the plan uses fp16, else None
    if rank == 0:
        print(plan, flush=True)

    for step in range(args.steps):
        batch = (counting_batch(step, args, rank, world).to(device),)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(model(*batch), batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # CUDA runs asynchronously: wait, to time the step itself
        elapsed_ms = (time.perf_counter() - start) * 1e3
        average = mean_over_ranks(loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1:3d}  loss {average:.4f}  {elapsed_ms:.0f} ms", flush=True)


def main() -> None:
    args = parse_args()
    # torchrun and accelerate launch set these. They are needed before prepare() starts the
    # process group, because the example batch must be this rank's share.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} ranks")
    train(args, rank, world)
    # The wrapped model died with train()'s frame; collect() breaks its reference cycles. Only
    # then destroy the process group: destroying it while DistributedDataParallel still holds it
    # can make the process abort or hang at exit (seen with torch 2.13 and gloo).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
