"""Loss parity with a single-process reference on the same global batch, per forced strategy,
with activation checkpointing, bf16 and fp16. Leaves initialising the process group to prepare().

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 parity.py OUT_DIR
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    LR,
    Cases,
    ScalarNet,
    all_finite,
    build,
    global_batches,
    is_fsdp,
    local_batches,
    reference_losses,
    train,
)
from torch import nn

import autoshard

STEPS = 5
LONG_STEPS = 10  # bf16 / fp16, on one fixed batch: enough to see the loss go down
# ... at a learning rate that takes it down gradually (1.57 -> 0.34 in fp32) rather than to ~1e-5,
# where bf16 cannot represent the loss to any useful relative precision.
LONG_LR = 1e-3

cases = Cases()


@cases.case
def reference() -> dict[str, Any]:
    """fp32, one process, full global batch; computed identically on both ranks."""
    return {
        "losses": reference_losses(STEPS),
        "fixed_batch_losses": reference_losses(LONG_STEPS, fixed=True, lr=LONG_LR),
        **_scalar_reference(),
    }


def _scalar_reference() -> dict[str, Any]:
    """ScalarNet trained in one process on the global batches: its losses and its scalars."""
    model, optimizer = build(cls=ScalarNet)
    losses = train(model, optimizer, global_batches(STEPS))
    return {"scalar_losses": losses, "scalars": _scalars(model)}


def _scalars(model: nn.Module) -> dict[str, float]:
    """The parameters of no dimension, by name: FSDP2 keeps them whole on every rank."""
    return {name: float(p.detach()) for name, p in model.named_parameters() if p.dim() == 0}


def _with_scalars(strategy: str, **options: Any) -> dict[str, Any]:
    """ScalarNet (a gate per block, a temperature: parameters of no dimension, which FSDP2
    refuses to shard) under a forced strategy: the losses and the scalars after training."""
    model, optimizer = build(cls=ScalarNet)
    batches = local_batches(STEPS)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy=strategy, mixed_precision="no", **options
    )
    info: dict[str, Any] = {
        "strategy": plan.strategy.value,
        "is_fsdp": is_fsdp(wrapped),
        "scalar_types": sorted({type(p).__name__ for p in model.parameters() if p.dim() == 0}),
        "reasons": plan.reasons,
    }
    if options.get("accumulation_steps") == 2:  # each batch as two micro-batches, sync on the last
        from autoshard.wrap.apply import gradient_sync

        losses = []
        for batch in batches:
            halves = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
            with gradient_sync(wrapped, False):
                first = wrapped(**halves[0])["loss"]
                (first / 2).backward()
            second = wrapped(**halves[1])["loss"]
            (second / 2).backward()
            losses.append((float(first) + float(second)) / 2)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        info["losses"] = losses
    else:
        info["losses"] = train(wrapped, optimizer, batches)
    info["scalars"] = _scalars(model)
    return info


def _forced(
    strategy: str, steps: int = STEPS, *, fixed: bool = False, lr: float = LR, **options: Any
) -> dict[str, Any]:
    model, optimizer = build(lr=lr)
    batches = local_batches(steps, fixed=fixed)
    prepared = autoshard.prepare(model, optimizer, batches[0], strategy=strategy, **options)
    wrapped, returned, plan = prepared
    info: dict[str, Any] = {
        "wrapped_type": type(wrapped).__name__,
        "is_ddp": isinstance(wrapped, nn.parallel.DistributedDataParallel),
        "is_fsdp": is_fsdp(wrapped),
        "wraps_the_module": wrapped is model or getattr(wrapped, "module", None) is model,
        "optimizer_is_same": returned is optimizer,
        "strategy": plan.strategy.value,
        "mixed_precision": plan.mixed_precision,
        "activation_checkpointing": plan.activation_checkpointing,
        "scaler": type(prepared.scaler).__name__ if prepared.scaler is not None else None,
    }
    calls = _count_block_forwards(model)
    info["losses"] = train(wrapped, optimizer, batches, prepared.scaler)
    info["block_forwards_per_step"] = [c / steps for c in calls]
    return info


def _count_block_forwards(model: nn.Module) -> list[int]:
    """Count the forwards of each block's first Linear: a checkpointed block runs it twice a step
    (forward, then recomputed in backward). Behavioural, so it holds whether checkpointing is a
    wrapper module or composable hooks."""
    fc1 = [m for name, m in model.named_modules() if name.endswith(".fc1")]
    calls = [0] * len(fc1)
    for i, module in enumerate(fc1):

        def hook(*_: Any, i: int = i) -> None:
            calls[i] += 1

        module.register_forward_hook(hook)
    return calls


@cases.case
def parity_ddp() -> dict[str, Any]:
    # The first prepare() of this launch: no process group exists yet, prepare makes one.
    before = dist.is_initialized()
    info = _forced("ddp", mixed_precision="no")
    info["pg_initialised_before"] = before
    info["pg_backend"] = str(dist.get_backend()) if dist.is_initialized() else None
    info["world_size"] = dist.get_world_size() if dist.is_initialized() else None
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    return info


@cases.case
def parity_shard_grad_op() -> dict[str, Any]:
    return _forced("shard_grad_op", mixed_precision="no")


@cases.case
def parity_full_shard() -> dict[str, Any]:
    return _forced("full_shard", mixed_precision="no")


for _strategy in ("shard_grad_op", "full_shard"):
    cases.case(lambda s=_strategy: _with_scalars(s), name=f"scalars_{_strategy}")
cases.case(
    lambda: _with_scalars("full_shard", accumulation_steps=2),
    name="scalars_full_shard_accumulating",
)


@cases.case
def ac_ddp() -> dict[str, Any]:
    return _forced("ddp", mixed_precision="no", activation_checkpointing=2)


@cases.case
def ac_shard_grad_op() -> dict[str, Any]:
    return _forced("shard_grad_op", mixed_precision="no", activation_checkpointing=2)


@cases.case
def ac_full_shard() -> dict[str, Any]:
    return _forced("full_shard", mixed_precision="no", activation_checkpointing=2)


@cases.case
def bf16_ddp() -> dict[str, Any]:
    return _forced(
        "ddp",
        LONG_STEPS,
        fixed=True,
        lr=LONG_LR,
        mixed_precision="bf16",
        activation_checkpointing=False,
    )


@cases.case
def bf16_full_shard() -> dict[str, Any]:
    return _forced(
        "full_shard",
        LONG_STEPS,
        fixed=True,
        lr=LONG_LR,
        mixed_precision="bf16",
        activation_checkpointing=False,
    )


def _fp16(strategy: str) -> dict[str, Any]:
    model, optimizer = build(lr=LONG_LR)
    batches = local_batches(LONG_STEPS, fixed=True)
    prepared = autoshard.prepare(
        model, optimizer, batches[0], strategy=strategy, mixed_precision="fp16"
    )
    wrapped, returned, plan = prepared  # the 3-tuple unpacking still works
    scaler = prepared.scaler
    info: dict[str, Any] = {
        "is_prepared": isinstance(prepared, autoshard.Prepared),
        "is_tuple_of_3": isinstance(prepared, tuple) and len(prepared) == 3,
        "unpacked_match": wrapped is prepared.model
        and returned is prepared.optimizer
        and plan is prepared.plan,
        "optimizer_is_same": returned is optimizer,
        "mixed_precision": plan.mixed_precision,
        "strategy": plan.strategy.value,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale_before": float(scaler.get_scale()) if scaler is not None else None,
    }
    info["losses"] = train(wrapped, optimizer, batches, scaler)
    info["scale_after"] = float(scaler.get_scale()) if scaler is not None else None
    info["finite"] = all_finite(info["losses"])
    return info


@cases.case
def fp16_ddp() -> dict[str, Any]:
    return _fp16("ddp")


@cases.case
def fp16_full_shard() -> dict[str, Any]:
    return _fp16("full_shard")


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main(init_process_group=False)
