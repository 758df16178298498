"""Shared by the worker scripts that tests/_dist.py launches under torchrun (2 gloo ranks, CPU).

A worker registers many sub-cases with `Cases.case` and runs them all in one launch (process
start-up and `import torch` cost seconds). Each case returns JSON-able data; the runner records
per rank `{"ok": True, "data": ...}` or `{"ok": False, "error": ..., "traceback": ...}` and
rewrites `rank<r>.json` after every case, so the cases that finished before a hang or a crash
still report. Assertions live in tests/test_distributed.py, not here.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SEED = 0
DATA_SEED = 1234
IN_FEATURES = 16
CLASSES = 4
PER_RANK = 8  # rows of the global batch each rank feeds
WORLD = 2
LR = 1e-2


# ---------------------------------------------------------------------------------------------
# Running the cases


class Cases:
    """An ordered registry of sub-cases, run once per launch on every rank."""

    def __init__(self) -> None:
        self._cases: list[tuple[str, Callable[[], Any]]] = []

    def case(self, fn: Callable[[], Any], name: str | None = None) -> Callable[[], Any]:
        """Register `fn` (usable as a decorator) under `name`, by default its own name."""
        self._cases.append((name or str(getattr(fn, "__name__", fn)), fn))
        return fn

    def main(self, *, init_process_group: bool = True) -> None:
        """Run every case; `init_process_group=False` leaves initialising it to prepare()."""
        out = Path(sys.argv[1])
        rank = int(os.environ["RANK"])
        _redirect_output(out / f"rank{rank}.log")
        if init_process_group:
            # A collective timeout turns a desynchronised case into an error instead of a hang
            # (the harness's own timeout is the backstop).
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        results: dict[str, Any] = {}
        path = out / f"rank{rank}.json"
        for name, fn in self._cases:
            started = time.perf_counter()
            print(f"[rank {rank}] case {name} ...", flush=True)
            try:
                results[name] = {"ok": True, "data": fn()}
            except Exception as error:
                text = traceback.format_exc()
                print(text, file=sys.stderr, flush=True)
                results[name] = {
                    "ok": False,
                    "error": f"{type(error).__name__}: {error}",
                    "traceback": text,
                }
            results[name]["seconds"] = round(time.perf_counter() - started, 3)
            _write_json(path, results)
        results["__finished__"] = {"ok": True, "data": True}
        _write_json(path, results)
        # Free every DDP wrapper (reference cycles included) while the process group is alive: one
        # freed after destroy_process_group can hang or abort the exit (seen with plain DDP too).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _redirect_output(log: Path) -> None:
    """Send this rank's stdout and stderr (C++ output included) to its own file, so a failing
    test can show each rank's tail instead of torchrun's interleaving of both."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _write_json(path: Path, results: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, default=_jsonable, allow_nan=True))
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def error_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """Call `fn` and describe what it raised (for cases where an exception is the result)."""
    try:
        fn()
    except Exception as error:
        return {"raised": True, "type": type(error).__name__, "message": str(error)}
    return {"raised": False, "type": None, "message": None}


# ---------------------------------------------------------------------------------------------
# Models: a ModuleList of identical blocks, so autoshard shards and checkpoints per block


class Block(nn.Module):
    """Pre-norm residual MLP block, transformer-like; optional BatchNorm and dropout."""

    def __init__(self, width: int, *, batchnorm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm: nn.Module = nn.BatchNorm1d(width) if batchnorm else nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.norm(h)))))


class Net(nn.Module):
    """Input projection, `depth` blocks, classifier head; returns {"loss": cross-entropy}."""

    def __init__(
        self, width: int = 32, depth: int = 4, *, batchnorm: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, width)
        self.blocks = nn.ModuleList(
            Block(width, batchnorm=batchnorm, dropout=dropout) for _ in range(depth)
        )
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return {"loss": F.cross_entropy(self.head(h), y)}


class GatedBlock(Block):
    """A block whose residual branch is scaled by a learned number, a parameter of no dimension
    (ReZero's gate, Bachlechner et al. 2020)."""

    def __init__(self, width: int, **kwargs: Any) -> None:
        super().__init__(width, **kwargs)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * self.fc2(F.gelu(self.fc1(self.norm(h))))


class ScalarNet(Net):
    """`Net` with parameters of no dimension: a gate in every block and a learned temperature
    on the logits, as CLIP's `logit_scale` (FSDP2 shards neither)."""

    def __init__(self, width: int = 32, depth: int = 4, **kwargs: Any) -> None:
        super().__init__(width, depth, **kwargs)
        self.blocks = nn.ModuleList(GatedBlock(width, **kwargs) for _ in range(depth))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return {"loss": F.cross_entropy(self.head(h) * self.temperature, y)}


def build(
    width: int = 32, depth: int = 4, *, lr: float = LR, cls: type[Net] = Net, **kwargs: Any
) -> tuple[Net, torch.optim.AdamW]:
    """The same model and optimizer on every rank and in every reference: seeded."""
    torch.manual_seed(SEED)
    model = cls(width, depth, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


# ---------------------------------------------------------------------------------------------
# Data: one global batch per step, from a generator independent of torch's global RNG


def global_batches(steps: int, *, fixed: bool = False) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches of WORLD * PER_RANK rows of a learnable task (a linear teacher):
    a new batch each step, or with `fixed` one batch repeated, whose loss falls step after step
    (a clean "it trains" signal; fresh batches make the loss noisy over 10 steps)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=gen)
    batches = []
    for _ in range(1 if fixed else steps):
        x = torch.randn(WORLD * PER_RANK, IN_FEATURES, generator=gen)
        batches.append({"x": x, "y": (x @ teacher).argmax(dim=1)})
    return batches * steps if fixed else batches


def shard(batch: dict[str, torch.Tensor], r: int | None = None) -> dict[str, torch.Tensor]:
    """Rank r's half of a global batch (rows r*PER_RANK .. (r+1)*PER_RANK-1)."""
    r = rank() if r is None else r
    return {k: v[r * PER_RANK : (r + 1) * PER_RANK] for k, v in batch.items()}


def local_batches(steps: int, *, fixed: bool = False) -> list[dict[str, torch.Tensor]]:
    return [shard(b) for b in global_batches(steps, fixed=fixed)]


# ---------------------------------------------------------------------------------------------
# Training


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, torch.Tensor]] | list[dict[str, torch.Tensor]],
    scaler: Any = None,
) -> list[float]:
    """Plain training steps; the losses this rank saw."""
    losses = []
    for batch in batches:
        loss = model(**batch)["loss"]
        losses.append(float(loss.detach()))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def reference_losses(steps: int, *, fixed: bool = False, **build_kwargs: Any) -> list[float]:
    """One process, no autoshard, the full global batch each step: what 2 ranks must match."""
    model, optimizer = build(**build_kwargs)
    return train(model, optimizer, global_batches(steps, fixed=fixed))


def all_finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered if it is a DTensor (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0
