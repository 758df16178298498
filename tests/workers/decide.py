"""strategy="auto" under a memory limit, and bad input on one rank only (no rank may hang).

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 decide.py OUT_DIR
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Cases,
    build,
    error_of,
    is_fsdp,
    local_batches,
    rank,
    reference_losses,
    train,
)
from torch import nn
from torch.distributed.tensor import DTensor

import autoshard

# Wide blocks and a small batch: parameters, gradients and optimizer state dominate the peak, so
# checkpointing activations cannot bring DDP under a limit set between DDP and FSDP.
WIDTH = 64
DEPTH = 4
STEPS = 5

cases = Cases()


def _what_if(**options: Any) -> autoshard.Plan:
    model, optimizer = build(WIDTH, DEPTH)
    return autoshard.plan(
        model,
        optimizer,
        local_batches(1)[0],
        world_size=2,
        device_memory="1TiB",
        mixed_precision="no",
        **options,
    )


def _candidates(plan: autoshard.Plan) -> list[dict[str, Any]]:
    return [
        {
            "strategy": c.strategy.value,
            "activation_checkpointing": c.activation_checkpointing,
            "peak": c.estimated_peak_bytes,
            "fits": c.fits,
        }
        for c in plan.candidates
    ]


def _auto(limit: int) -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    batches = local_batches(STEPS)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], memory_limit=limit, mixed_precision="no"
    )
    return {
        "limit": limit,
        "strategy": plan.strategy.value,
        "activation_checkpointing": plan.activation_checkpointing,
        "device_memory_bytes": plan.device_memory_bytes,
        "estimated_peak_bytes": plan.estimated_peak_bytes,
        "candidates": _candidates(plan),
        "reasons": list(plan.reasons),
        "is_fsdp": is_fsdp(wrapped),
        "is_ddp": isinstance(wrapped, nn.parallel.DistributedDataParallel),
        "losses": train(wrapped, optimizer, batches),
        "reference_losses": reference_losses(STEPS, width=WIDTH, depth=DEPTH),
    }


_estimates: dict[str, Any] = {}


@cases.case
def what_if_estimates() -> dict[str, Any]:
    """The candidates' estimated peaks, read with plan() (decides only, wraps nothing)."""
    plain = _what_if()
    peaks = {
        c.strategy.value: c.estimated_peak_bytes
        for c in plain.candidates
        if c.activation_checkpointing == 0
    }
    # DDP's least peak with any number of checkpointed blocks: the limit must stay below it too,
    # or auto could rightly pick DDP with checkpointing.
    ddp_by_ac = [
        _what_if(strategy="ddp", activation_checkpointing=k).estimated_peak_bytes
        for k in range(DEPTH + 1)
    ]
    fsdp_min = min(peaks["shard_grad_op"], peaks["full_shard"])
    _estimates.update(
        peaks=peaks,
        ddp_by_ac=ddp_by_ac,
        # Midway between DDP's least peak (any checkpointing) and the smallest FSDP peak.
        between=(min(ddp_by_ac) + fsdp_min) // 2,
        generous=4 * peaks["ddp"],
        candidates=_candidates(plain),
    )
    return dict(_estimates)


@cases.case
def auto_limit_between_ddp_and_fsdp() -> dict[str, Any]:
    return _auto(_estimates["between"])


@cases.case
def auto_generous_limit() -> dict[str, Any]:
    return _auto(_estimates["generous"])


@cases.case
def auto_max_batch() -> dict[str, Any]:
    """Each candidate's largest batch, searched on every rank and agreed (the least)."""
    model, optimizer = build(WIDTH, DEPTH)
    batch = local_batches(1)[0]
    _, _, plan = autoshard.prepare(
        model,
        optimizer,
        batch,
        memory_limit=_estimates["between"],
        mixed_precision="no",
        max_batch=True,
        trial_step=False,
    )
    return {
        "max_batch": plan.max_batch,
        "candidates": [
            (c.strategy.value, c.activation_checkpointing, c.max_batch) for c in plan.candidates
        ],
        "reasons": list(plan.reasons),
    }


@cases.case
def does_not_fit_names_the_largest_batch_on_every_rank() -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    limit = min(_estimates["peaks"].values()) // 2
    return error_of(
        lambda: autoshard.prepare(
            model, optimizer, local_batches(1)[0], memory_limit=limit, mixed_precision="no"
        )
    )


# ---------------------------------------------------------------------------------------------
# Bad input on one rank: every rank raises, none waits for the others


def _untouched(model: nn.Module, optimizer: torch.optim.Optimizer, ids: list[int]) -> bool:
    """prepare() raised before changing anything: no sharding, optimizer still on the originals."""
    return (
        not is_fsdp(model)
        and not any(isinstance(p, DTensor) for p in model.parameters())
        and [id(p) for p in optimizer.param_groups[0]["params"]] == ids
    )


def _one_rank_differs(
    mine: dict[str, Any], theirs: dict[str, Any], **build_args: Any
) -> dict[str, Any]:
    """Rank 1 passes `theirs` (or builds with `build_args`), rank 0 passes `mine`."""
    odd = rank() == 1
    model, optimizer = build(**(build_args if odd else {}))
    ids = [id(p) for p in model.parameters()]
    batch = local_batches(1)[0]
    options = theirs if odd else mine
    result = error_of(lambda: autoshard.prepare(model, optimizer, batch, **options))
    result["untouched"] = _untouched(model, optimizer, ids)
    return result


@cases.case
def bad_strategy_on_rank1() -> dict[str, Any]:
    return _one_rank_differs({"strategy": "ddp"}, {"strategy": "zero4"})


@cases.case
def bad_type_on_rank1() -> dict[str, Any]:
    return _one_rank_differs({"trial_step": True}, {"trial_step": "yes"})


@cases.case
def different_model_on_rank1() -> dict[str, Any]:
    return _one_rank_differs({"strategy": "ddp"}, {"strategy": "ddp"}, width=48)


@cases.case
def different_strategy_on_rank1() -> dict[str, Any]:
    return _one_rank_differs({"strategy": "ddp"}, {"strategy": "full_shard"})


@cases.case
def local_strategy_on_two_ranks() -> dict[str, Any]:
    """strategy="local" (no wrapper) cannot train 2 ranks: a ValueError on both, as for "zero4"."""
    return _one_rank_differs({"strategy": "local"}, {"strategy": "local"})


@cases.case
def simulations_shared_out_to_workers() -> dict[str, Any]:
    """Inside a job each rank shares its simulated runs out with a worker process of its own
    (`measure.pool`), which simulates as that rank of a fake group: the same results as the
    rank alone, gathered alike on both ranks."""
    import os

    from autoshard.decide.estimate import model_stats
    from autoshard.measure.pool import WORKERS
    from autoshard.measure.sharing import workers
    from autoshard.measure.simulate import Setup, simulate_all
    from autoshard.strategies.strategy import Strategy

    depth = 16  # simulated at 3, 4 and 5 blocks: 3 steps per run
    model, optimizer = build(WIDTH, depth)
    names = [f"blocks.{i}" for i in range(depth)]
    stats = model_stats(model, [model.get_submodule(n) for n in names], 0, "", 0)
    setup = Setup(names, local_batches(1)[0], None, optimizer, None, torch.device("cpu"))
    strategies = (Strategy.DDP, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
    alone, _ = simulate_all(
        model, setup, strategies, stats, 2, checkpointed=strategies, shared=True
    )
    os.environ[WORKERS] = "1"
    try:
        # 6 runs shared out between the 2 ranks: 3 on each, of 3 kinds (sharded or not,
        # checkpointed or not), 9 steps; the first of each kind made by the rank (its worker
        # checks itself against it), the other 6 by its worker
        with workers(model, setup, 2, 3, run_here=False) as helpers:
            assert helpers is not None
            shared, note = simulate_all(
                model,
                setup,
                strategies,
                stats,
                2,
                checkpointed=strategies,
                shared=True,
                workers=helpers,
            )
    finally:
        del os.environ[WORKERS]
    return {"equal": shared == alone, "runs": len(shared), "note": note}


@cases.case
def still_in_step_after_errors() -> dict[str, Any]:
    """After the errors above, both ranks still meet in the same collectives and train."""
    model, optimizer = build()
    batches = local_batches(STEPS)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy="full_shard", mixed_precision="no"
    )
    losses = train(wrapped, optimizer, batches)
    marker = torch.tensor([float(rank() + 1)])
    dist.all_reduce(marker)
    return {
        "strategy": plan.strategy.value,
        "losses": losses,
        "reference_losses": reference_losses(STEPS),
        "all_reduce": float(marker),
    }


@cases.case
def optimizer_state_on_rank0_only() -> dict[str, Any]:
    """Rank 0 resumed its optimizer, rank 1 did not: the trial would run a different number of
    steps on each and state re-keying would scatter on one only; both must refuse instead."""
    model, optimizer = build(WIDTH, DEPTH)
    batch = local_batches(1)[0]
    if rank() == 0:
        train(model, optimizer, [batch])  # one plain step: AdamW now holds state
    return error_of(lambda: autoshard.prepare(model, optimizer, batch, strategy="full_shard"))


@cases.case
def example_batch_on_rank0_only() -> dict[str, Any]:
    """Rank 1 passes no example_batch: it would skip the trial the others run."""
    model, optimizer = build(WIDTH, DEPTH)
    batch = local_batches(1)[0] if rank() == 0 else None
    return error_of(lambda: autoshard.prepare(model, optimizer, batch, strategy="ddp"))


class _WithUnusedHead(nn.Module):
    """A model whose `unused` layer never takes part in forward (like a pooler left idle)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _prepared_ddp(
    model_class: type[nn.Module],
) -> tuple[nn.Module, torch.optim.Optimizer, autoshard.Plan, torch.Tensor]:
    """A model of `model_class` prepared under DDP, fp32: the wrapped model, its optimizer, the
    plan and the batch."""
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(8, WIDTH)
    wrapped, optimizer, plan = autoshard.prepare(
        model, optimizer, batch, strategy="ddp", mixed_precision="no"
    )
    return wrapped, optimizer, plan, batch


def _own_steps(
    wrapped: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> list[float]:
    """Three of the user's own steps after `prepare`: their losses."""
    losses = []
    for _ in range(3):
        loss = wrapped(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@cases.case
def ddp_with_parameters_that_get_no_gradient() -> dict[str, Any]:
    """Plain DDP fails on the second step when a parameter gets no gradient; the trace finds
    such parameters and DDP is built with find_unused_parameters."""
    wrapped, optimizer, plan, batch = _prepared_ddp(_WithUnusedHead)
    losses = _own_steps(wrapped, optimizer, batch)  # the trial already ran two
    return {
        "find_unused_parameters": bool(wrapped.find_unused_parameters),
        "reasons": [r for r in plan.reasons if "no gradient" in r],
        "losses": losses,
    }


class _LayerDrop(nn.Module):
    """LayerDrop as transformers' M2M100 and SpeechT5 keep it (`self.layerdrop`, a probability):
    which layers a step skips is drawn anew every step, on each rank apart. Here the draw is
    replaced by a choice the case makes after `prepare` (`skips_on`: the rank whose steps skip
    block 1), so that the traced and trial steps use every block and the user's steps do not."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.layerdrop = 0.1
        self.skips_on: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 1 and self.skips_on == rank():
                continue  # dropped this step
            x = torch.tanh(block(x))
        return x


@cases.case
def ddp_with_layer_drop() -> dict[str, Any]:
    """Every parameter got a gradient in the traced step; the user's steps then skip a layer on
    one rank: DDP without find_unused_parameters fails there (the other rank's all-reduce of
    that layer's gradients waits for one that never comes)."""
    wrapped, optimizer, plan, batch = _prepared_ddp(_LayerDrop)
    wrapped.module.skips_on = 1
    losses = _own_steps(wrapped, optimizer, batch)
    return {
        "find_unused_parameters": bool(wrapped.find_unused_parameters),
        "unused_parameters": list(plan.unused_parameters),
        "layer_drop": plan.layer_drop,
        "reasons": [r for r in plan.reasons if "LayerDrop" in r],
        "losses": losses,
    }


class _ConvNet(nn.Module):
    """Convolutions with batch norm in repeated blocks: under FSDP2 mixed precision the norms
    must stay fp32 (their running statistics are)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(2)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: Any = None) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


def _batchnorm_bf16(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _ConvNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank())
    images, labels = torch.randn(4, 3, 8, 8, generator=g), torch.randint(3, (4,), generator=g)

    def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output.float(), batch[1])

    wrapped, _, plan = autoshard.prepare(
        model,
        optimizer,
        (images, labels),
        loss_fn=loss_fn,
        strategy=strategy,
        mixed_precision="bf16",
    )
    losses = []
    for _ in range(3):
        loss = loss_fn(wrapped(images), (images, labels))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    return {
        "strategy": plan.strategy.value,
        "losses": losses,
        "norm_stats_dtype": str(norm.running_mean.dtype),
    }


@cases.case
def batchnorm_bf16_full_shard() -> dict[str, Any]:
    return _batchnorm_bf16("full_shard")


@cases.case
def batchnorm_bf16_shard_grad_op() -> dict[str, Any]:
    return _batchnorm_bf16("shard_grad_op")


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main()
