"""The program behind `autoshard demo`: a small GPT-2-style decoder trained on a learnable task.

Launched once per rank (by torchrun, which `autoshard demo` starts for you). Each rank builds the
same model from the same seed, hands it to `autoshard.prepare`, and trains on its own slice of a
synthetic global batch. Unlike the library, this module is a program, so it prints (rank 0 only).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.cli.options import build_parser


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the demo decoder; the defaults make about 0.9M parameters."""

    vocab_size: int = 256
    block_size: int = 64  # longest sequence the position table covers
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    mlp_ratio: int = 4


class GPTOutput(NamedTuple):
    """A NamedTuple rather than a dataclass: torch's pytree, which DDP and FSDP2 use to find the
    output tensors they hook for backward, flattens NamedTuples but not unregistered dataclasses."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout scaled_dot_product_attention expects
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: the unit autoshard shards and checkpoints."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Not tied to tok_emb (GPT-2 ties them): the demo shows sharding, not weight sharing, and
        # untied weights keep every parameter in exactly one module.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # fp32 loss: under bf16/fp16 mixed precision the logits arrive in low precision
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return GPTOutput(logits, loss)


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation (std 0.02); torch's default Linear init trains slower here
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class MarkovChainData:
    """Token sequences from a fixed first-order Markov chain with a peaked transition table.

    Every token has `len(probs)` possible successors, drawn with the same probabilities, so the
    best achievable loss is the entropy of `probs` (about 1.1 nats) against ln(vocab) = 5.5 for a
    model that knows nothing: a small model closes most of that gap within a few dozen steps.
    Batches depend only on (seed, step), so every rank builds the same global batch and keeps its
    own rows of it.
    """

    def __init__(
        self, vocab_size: int, seed: int, probs: Sequence[float] = (0.55, 0.25, 0.15, 0.05)
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.seed = seed
        self.successors = torch.stack(
            [torch.randperm(vocab_size, generator=g)[: len(probs)] for _ in range(vocab_size)]
        )
        p = torch.tensor(probs, dtype=torch.float64)
        self.cum_probs = (p / p.sum()).cumsum(0).float()
        self.entropy = float(-(p / p.sum() * (p / p.sum()).log()).sum())

    def batch(
        self, step: int, global_batch: int, seq_len: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, (global_batch / world_size, seq_len) each, for `rank`."""
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * (step + 1))
        seq = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (global_batch,), generator=g)
        u = torch.rand(global_batch, seq_len, generator=g)
        choice = torch.searchsorted(self.cum_probs, u).clamp_(max=self.successors.size(1) - 1)
        for t in range(seq_len):
            seq[:, t + 1] = self.successors[seq[:, t], choice[:, t]]
        mine = seq[rank::world_size]  # strided rows: each rank a different, equal share
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def plan_example() -> tuple[GPT, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    """The demo's model, optimizer and one per-rank batch (8 x 64), for what-if planning:

    autoshard plan autoshard.cli.demo:plan_example --world-size 8 --device-memory 80GiB
    """
    model = GPT(GPTConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # The data is drawn on the CPU even when `autoshard plan` builds the model on the meta
    # device (the Markov chain's sampling reads values, which meta tensors have not), then moved
    # to the model's device: a meta model is traced with a meta batch.
    with torch.device("cpu"):
        x, y = MarkovChainData(model.config.vocab_size, seed=0).batch(0, 8, 64, 0, 1)
    device = model.lm_head.weight.device
    return model, optimizer, (x.to(device), y.to(device))


def _env_rank_world() -> tuple[int, int]:
    # torchrun and accelerate launch set these; the example batch must be this rank's share, so
    # they are needed before prepare() creates the process group.
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _pick_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        # SUM then divide: ReduceOp.AVG is not available on every backend (gloo)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def _warmup(steps: int) -> Callable[[int], float]:
    warmup_steps = max(1, min(10, steps // 5))
    return lambda step: min(1.0, (step + 1) / warmup_steps)


def _train(
    prepared: autoshard.Prepared,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: MarkovChainData,
    args: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """Run the loop; returns the rank-averaged loss and the step time (s) of every step."""
    model, optimizer, _ = prepared
    scaler = prepared.scaler  # a GradScaler only when the plan chose fp16, else None
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, rank, world))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y).loss
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # CUDA is asynchronous: time the work, not the launch
        times.append(time.perf_counter() - start)
        losses.append(_mean_over_ranks(loss.detach()))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(
                f"step {step + 1:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                f"{times[-1] * 1e3:7.1f} ms",
                flush=True,
            )
    return losses, times


# Set by `autoshard demo` to a file where rank 0 writes the demo's exit status. The ranks then
# exit 0, so that torchrun, which prints a multi-screen ChildFailedError for any rank that exits
# non-zero, stays quiet about an answer the demo has already printed (nothing fits, say).
STATUS_FILE_ENV = "AUTOSHARD_DEMO_STATUS_FILE"


def main(argv: Sequence[str] | None = None) -> int:
    """Train the demo model under `autoshard.prepare`; 0 if the loss went down, 1 if not, 2 if
    nothing fits the memory."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rank, world = _env_rank_world()
    # prepare says what it is doing, and then the plan, through the "autoshard" logger (rank 0)
    logging.basicConfig(level=logging.INFO, format="autoshard: %(message)s", stream=sys.stdout)
    if args.batch_size % world:
        parser.error(f"--batch-size {args.batch_size} must be divisible by the {world} ranks")
    try:
        losses, times, optimum = _run(args, rank, world)
        status = None
    except autoshard.DoesNotFit as exc:  # an answer, not a crash: said once, from rank 0
        if rank == 0:
            print(f"autoshard demo: {exc}", file=sys.stderr, flush=True)
        status = 2
    # Destroy the process group only once the wrapped model is gone (it died with _run's frame;
    # collect() breaks its reference cycles). With torch 2.13 + gloo, destroying the group while a
    # DistributedDataParallel still held it made about 1 exit in 10 abort or hang.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if status is None:
        status = _summarise(losses, times, optimum, rank)
    status_file = os.environ.get(STATUS_FILE_ENV)
    if status_file is None:
        return status
    if rank == 0:
        with open(status_file, "w") as f:
            f.write(str(status))
    return 0


def _run(args: argparse.Namespace, rank: int, world: int) -> tuple[list[float], list[float], float]:
    device = _pick_device()
    torch.manual_seed(args.seed)  # same seed on every rank: identical initial weights
    cfg = GPTConfig(block_size=args.seq_len)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    # Built before prepare on purpose: prepare re-binds this same optimizer in place, so the
    # scheduler keeps driving it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(args.steps))
    data = MarkovChainData(cfg.vocab_size, seed=args.seed)
    example = tuple(t.to(device) for t in data.batch(0, args.batch_size, args.seq_len, rank, world))

    if rank == 0:
        print(
            f"autoshard demo: GPT {n_params / 1e6:.2f}M params, {cfg.n_layer} blocks, "
            f"{world} rank(s) on {device.type}, global batch {args.batch_size} x {args.seq_len}",
            flush=True,
        )
    prepared = autoshard.prepare(
        model,
        optimizer,
        example_batch=example,
        strategy=args.strategy,
        mixed_precision=args.mixed_precision,
        activation_checkpointing=args.activation_checkpointing,
        memory_limit=args.memory_limit,
    )
    losses, times = _train(prepared, scheduler, data, args, rank, world, device)
    return losses, times, data.entropy


def _summarise(losses: list[float], times: list[float], optimum: float, rank: int) -> int:
    # step 1 pays one-off costs (allocator warm-up, lazy init), so the mean leaves it out
    mean_ms = 1e3 * sum(times[1:]) / len(times[1:])
    went_down = math.isfinite(losses[-1]) and losses[-1] < losses[0]
    if rank == 0:
        verdict = "loss went down" if went_down else "FAILED: loss did not go down"
        print(
            f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} (best possible {optimum:.2f}), "
            f"mean step {mean_ms:.1f} ms over steps 2-{len(times)}: {verdict}",
            flush=True,
        )
    return 0 if went_down else 1


if __name__ == "__main__":
    sys.exit(main())
