"""Under `accelerate launch` (2 CPU processes): `autoshard.plan` before any process group plans
for the launched ranks, `prepare` works unchanged, and `Accelerator(**accelerate_kwargs(...))`
trains as the plan says where accelerate supports it on CPU (DDP), with what accelerate does to
a sharded plan on CPU recorded. (Named accel.py: accelerate.py would shadow the package.)

Usage (from tests/_dist.py): accelerate launch --multi_gpu --num_processes 2 accel.py OUT_DIR
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from _common import LR, Cases, build, is_fsdp, local_batches, rank, reference_losses, train
from _hf import build as build_hf
from _hf import global_batches, shard, tied
from torch import nn

import autoshard

STEPS = 4

cases = Cases()


def _with_unused() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tests' Net plus a layer forward never calls: DDP must look for unused parameters."""
    model, _ = build()
    model.unused = nn.Linear(4, 4)  # built after the seeded Net: the other weights are as usual
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _accelerator(kwargs: dict[str, Any]) -> Any:
    """A fresh Accelerator: its state is a per-process singleton, and passing fsdp_plugin sets
    ACCELERATE_USE_FSDP for every later one, so both are reset first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    return Accelerator(**kwargs)


def _kwargs(plan: autoshard.Plan, model: nn.Module) -> tuple[dict[str, Any], list[str]]:
    """accelerate_kwargs and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = autoshard.accelerate_kwargs(plan, model)
    return kwargs, [str(w.message) for w in caught]


def _train_with(accelerator: Any, model: nn.Module, optimizer: Any, steps: int) -> list[float]:
    losses = []
    for batch in local_batches(steps):
        loss = model(**batch)["loss"]
        losses.append(float(loss.detach()))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@cases.case
def reference() -> dict[str, Any]:
    """fp32, one process, the whole global batch; the unused layer changes nothing."""
    return {"losses": reference_losses(STEPS)}


@cases.case
def plan_before_process_group() -> dict[str, Any]:
    """What an Accelerator script does first: plan, before accelerate starts the process group."""
    model, optimizer = build()
    before = dist.is_initialized()
    plan = autoshard.plan(model, optimizer, local_batches(1)[0], mixed_precision="no")
    return {
        "pg_before": before,
        "pg_after": dist.is_initialized(),
        "world_size": plan.world_size,
        "strategy": plan.strategy.value,
        "launched_by_accelerate": "ACCELERATE_MIXED_PRECISION" in os.environ,
    }


@cases.case
def prepare_under_accelerate_launch() -> dict[str, Any]:
    """autoshard.prepare unchanged: it starts the gloo process group itself and shards."""
    model, optimizer = build()
    batches = local_batches(STEPS)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy="full_shard", mixed_precision="no"
    )
    return {
        "strategy": plan.strategy.value,
        "is_fsdp": is_fsdp(wrapped),
        "backend": str(dist.get_backend()),
        "world_size": dist.get_world_size(),
        "reasons": list(plan.reasons),
        "losses": train(wrapped, optimizer, batches),
    }


@cases.case
def accelerator_ddp() -> dict[str, Any]:
    model, optimizer = _with_unused()
    plan = autoshard.plan(
        model, optimizer, local_batches(1)[0], strategy="ddp", mixed_precision="no"
    )
    kwargs, caught = _kwargs(plan, model)
    accelerator = _accelerator(kwargs)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    return {
        "plan_world_size": plan.world_size,
        "unused_parameters": list(plan.unused_parameters),
        "warnings": caught,
        "kwargs": sorted(kwargs),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "is_ddp": isinstance(wrapped, nn.parallel.DistributedDataParallel),
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        "gradient_as_bucket_view": getattr(wrapped, "gradient_as_bucket_view", None),
        # past step 2: DDP without find_unused_parameters fails there on the unused layer
        "losses": _train_with(accelerator, wrapped, optimizer, STEPS),
    }


@cases.case
def accelerator_fsdp_plan_on_cpu() -> dict[str, Any]:
    """A sharded plan's plugin, given to accelerate on CPU: what accelerate does with it."""
    model, optimizer = build()
    plan = autoshard.plan(
        model,
        optimizer,
        local_batches(1)[0],
        strategy="full_shard",
        mixed_precision="no",
        activation_checkpointing=1,
    )
    kwargs, caught = _kwargs(plan, model)
    accelerator = _accelerator(kwargs)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    return {
        "warnings": caught,
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "is_fsdp": is_fsdp(wrapped),
        "wrapped_type": type(wrapped).__name__,
        "losses": _train_with(accelerator, wrapped, optimizer, STEPS),
    }


# accelerate 1.15 never runs FSDP on CPU: its FSDP branch (AcceleratorState) lists only
# accelerator types, so on CPU the state stays MULTI_CPU and the plugin is ignored (the case
# above). To run its FSDP2 preparation (fsdp2_prepare_model, fsdp2_apply_ac) with autoshard's
# plugin anyway, the cases below set the distributed type accelerate would have set on a GPU.
# That path itself runs on CPU with gloo.


def _forced_fsdp2(model: nn.Module, optimizer: Any, batch: Any, strategy: str) -> dict[str, Any]:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    plan = autoshard.plan(
        model,
        optimizer,
        batch,
        strategy=strategy,
        mixed_precision="no",
        activation_checkpointing=1,  # accelerate checkpoints all blocks or none: here all
    )
    kwargs, _ = _kwargs(plan, model)  # warns that accelerate runs no FSDP on CPU: seen above
    accelerator = _accelerator(kwargs)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = kwargs["fsdp_plugin"]
    is_fsdp2 = accelerator.is_fsdp2
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    # The units that hold parameters. accelerate's policy looks through a CheckpointWrapper, so
    # both the wrapper (no parameters of its own) and the block inside it are fully_shard-ed;
    # a unit is named here by its block. A unit that reshards after forward keeps a mesh to
    # gather from again in backward.
    units = {}
    for name, unit in wrapped.named_modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is not None:
            block = name.replace("._checkpoint_wrapped_module", "") or "<root>"
            units[block] = group.post_forward_mesh_info is not None
    return {
        "is_fsdp2": is_fsdp2,
        "wrapped_type": type(wrapped).__name__,
        "reshard_after_forward": units,
        "checkpointed": sorted(
            name
            for name, m in wrapped.named_modules()
            if type(m).__name__.endswith("CheckpointWrapper")
        ),
        "wrapped": wrapped,
        "accelerator": accelerator,
        "optimizer": optimizer,
    }


def _forced_net(strategy: str) -> dict[str, Any]:
    model, optimizer = build()
    info = _forced_fsdp2(model, optimizer, local_batches(1)[0], strategy)
    info["losses"] = _train_with(
        info.pop("accelerator"), info.pop("wrapped"), info.pop("optimizer"), STEPS
    )
    return info


@cases.case
def forced_fsdp2_full_shard() -> dict[str, Any]:
    return _forced_net("full_shard")


@cases.case
def forced_fsdp2_shard_grad_op() -> dict[str, Any]:
    return _forced_net("shard_grad_op")


@cases.case
def forced_fsdp2_gpt2_tied() -> dict[str, Any]:
    """A Hugging Face model with tied embeddings through accelerate's FSDP2 path."""
    try:
        import transformers  # noqa: F401
    except ImportError as error:  # the test skips on this
        return {"skipped": str(error)}
    model = build_hf("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = shard(global_batches(1)[0], rank())
    info = _forced_fsdp2(model, optimizer, batch, "full_shard")
    wrapped, accelerator, optimizer = (
        info.pop("wrapped"),
        info.pop("accelerator"),
        info.pop("optimizer"),
    )
    info["tied"] = tied(wrapped)
    loss = wrapped(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    info["tied_after_step"] = tied(wrapped)
    info["loss"] = float(loss.detach())
    return info


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main(init_process_group=False)
