"""A Plan as Hugging Face accelerate's own configuration, for scripts built around `Accelerator`.

    plan = autoshard.plan(model, optimizer, example_batch)
    accelerator = Accelerator(**autoshard.accelerate_kwargs(plan, model))

What maps one to one: FULL_SHARD / SHARD_GRAD_OP are accelerate's FSDP2 plugin with
`reshard_after_forward` True / False, wrapping each of the blocks autoshard found (by class name,
accelerate's `transformer_based_wrap`); DDP is `DistributedDataParallelKwargs`; mixed precision is
accelerate's `mixed_precision` string and, under FSDP, FSDP2's `MixedPrecisionPolicy` with fp32
gradient reduction as `prepare` uses it. What does not: accelerate checkpoints all blocks or none,
and only under FSDP; those differences are documented on `accelerate_kwargs` and warned about.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from autoshard._world import _cuda
from autoshard.decide.blocks import find_blocks, without_shared
from autoshard.decide.plan import Plan
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy


def accelerate_kwargs(plan: Plan, model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for `accelerate.Accelerator` that train as `plan` says.

    Args:
        plan: from `autoshard.plan` (or `prepare`), made for the job's world size: under
            `accelerate launch`, `autoshard.plan` plans for the launched number of processes.
        model: the unwrapped model the plan was made for; its repeated blocks (found as
            `prepare` finds them: `_no_split_modules`, else the repeated classes of lists of
            children) become accelerate's FSDP units, by class name.

    Returns:
        A dict with `mixed_precision` ("bf16", "fp16" or "no"), and:
        - FULL_SHARD / SHARD_GRAD_OP / CPU_OFFLOAD: `fsdp_plugin`, a
          `FullyShardedDataParallelPlugin` with `fsdp_version=2`, `reshard_after_forward` True
          (ZeRO-3, and CPU offload) / False (ZeRO-2), `cpu_offload` (True for CPU_OFFLOAD),
          `mixed_precision_policy` (compute dtype, fp32 gradient reduction), `auto_wrap_policy`
          "transformer_based_wrap" on the block classes, and `activation_checkpointing` True when
          the plan checkpoints any block. accelerate checkpoints every block or none, so a plan
          that checkpoints k of n blocks gets all n (and a warning): n - k more block forwards
          recomputed per step, and activation memory that of n checkpointed blocks, usually
          below the plan's (not always: the recompute peak can grow with the count).
        - DDP: `kwargs_handlers` with `DistributedDataParallelKwargs(gradient_as_bucket_view=True,
          find_unused_parameters=...)`, the latter True when the traced step left trainable
          parameters without a gradient (`plan.unused_parameters`) or the model drops layers at
          random (`plan.layer_drop`): `plan.find_unused_parameters`. accelerate has no activation
          checkpointing outside FSDP: a DDP plan that checkpoints blocks warns instead.
        - LOCAL (one process): nothing else.
        - `AutocastKwargs(enabled=False)` in `kwargs_handlers` where the model's forward raises
          under autocast (`plan.autocast_raises`, a sharded plan): accelerate autocasts every
          forward under mixed precision, FSDP's too; FSDP2's cast parameters compute it instead.
        - `cpu=True` where there is no CUDA device: without it accelerate 1.x treats each process
          of `accelerate launch --multi_gpu` on a machine without GPUs as a job of its own
          (`DistributedType.NO`), so the ranks would train apart. On CPU accelerate runs DDP only
          (`MULTI_CPU`): it ignores `fsdp_plugin` there, and a sharded plan warns.

    Raises:
        ValueError: `model` does not have the number of blocks the plan was made with, or the
            plan's strategy has no accelerate equivalent here (HYBRID_SHARD; a sharded plan of a
            model with parameters of no dimension, which `prepare` keeps whole).
    """
    blocks = find_blocks(model)
    if len(blocks) != plan.num_blocks:
        raise ValueError(
            f"the plan was made for a model with {plan.num_blocks} repeated block(s), but this "
            f"model has {len(blocks)}; pass the model the plan was made for, unwrapped"
        )
    kwargs: dict[str, Any] = {"mixed_precision": plan.mixed_precision.value}
    if not _cuda():
        kwargs["cpu"] = True
    if recipe(plan.strategy).sharded:
        if recipe(plan.strategy).accelerate_reshard_after_forward is None:
            raise ValueError(
                f"the plan chose {plan.strategy}, which accelerate_kwargs does not express in "
                f"accelerate's configuration yet (accelerate shards over nodes with "
                f"ParallelismConfig(dp_replicate_size=<nodes>, dp_shard_size=<ranks per node>)); "
                f"train with autoshard.prepare instead"
            )
        whole = [name for name, param in model.named_parameters() if param.dim() == 0]
        if whole:
            raise ValueError(
                f"the plan chose {plan.strategy}, but the model has {len(whole)} parameter(s) "
                f"of no dimension (e.g. '{whole[0]}'), which FSDP2 cannot shard: "
                f"autoshard.prepare keeps them whole and averages their gradients itself, "
                f"accelerate's FSDP2 plugin does not (fully_shard refuses them, and as ignored "
                f"modules their gradients would not be averaged); train with autoshard.prepare, "
                f"or plan for accelerate with strategy='ddp'"
            )
        kwargs["fsdp_plugin"] = fsdp_plugin(plan, model, blocks)
        if 0 < plan.activation_checkpointing < plan.num_blocks:
            warnings.warn(
                f"the plan checkpoints {plan.activation_checkpointing} of {plan.num_blocks} "
                f"blocks, but accelerate checkpoints all of them or none: all "
                f"{plan.num_blocks} will be, which recomputes more than planned",
                stacklevel=2,
            )
        if not _cuda():
            warnings.warn(
                f"the plan chose {plan.strategy}, but accelerate runs FSDP only on accelerators: "
                f"on CPU it ignores fsdp_plugin and wraps the model in DDP, which holds the whole "
                f"model, gradients and optimizer state on every rank; autoshard.prepare runs "
                f"FSDP2 on CPU with gloo",
                stacklevel=2,
            )
    elif plan.strategy == Strategy.DDP:
        kwargs["kwargs_handlers"] = [ddp_kwargs(plan)]
    if plan.autocast_raises is not None and plan.mixed_precision.dtype is not None:
        from accelerate.utils import AutocastKwargs

        # accelerate runs the forward under autocast whenever mixed precision is on, FSDP too
        handlers = [*kwargs.get("kwargs_handlers", []), AutocastKwargs(enabled=False)]
        kwargs["kwargs_handlers"] = handlers
    if plan.activation_checkpointing and not recipe(plan.strategy).sharded:
        warnings.warn(
            f"the plan checkpoints {plan.activation_checkpointing} of {plan.num_blocks} blocks "
            f"under {plan.strategy}, but accelerate checkpoints activations only with "
            f"fsdp_plugin; checkpoint those blocks yourself (Hugging Face models: "
            f"model.gradient_checkpointing_enable()), or let autoshard.prepare wrap the model",
            stacklevel=2,
        )
    return kwargs


def fsdp_plugin(plan: Plan, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> Any:
    """accelerate's FSDP2 plugin for a sharded plan."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = plan.mixed_precision.dtype
    classes = sorted({type(module).__name__ for _, module in blocks})
    _warn_on_extra_units(model, blocks, classes)
    # As `prepare` does (autoshard/wrap/apply.py): parameters gathered in the compute dtype,
    # gradients reduced in fp32. No output_dtype: accelerate's autocast returns fp32 outputs.
    policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype is not None
        else None
    )
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=recipe(plan.strategy).accelerate_reshard_after_forward,
        mixed_precision_policy=policy,
        auto_wrap_policy="transformer_based_wrap" if classes else "no_wrap",
        transformer_cls_names_to_wrap=classes or None,
        activation_checkpointing=plan.activation_checkpointing > 0,
        cpu_offload=plan.cpu_offload,
    )


def ddp_kwargs(plan: Plan) -> Any:
    """accelerate's DDP settings for a DDP plan, as `prepare` builds its DDP
    (autoshard/wrap/apply.py): gradients as views into the all-reduce buckets (one copy of the
    gradients fewer), and the per-step search for unused parameters only when the trace found
    some or the model drops layers at random."""
    from accelerate.utils import DistributedDataParallelKwargs

    return DistributedDataParallelKwargs(
        find_unused_parameters=plan.find_unused_parameters, gradient_as_bucket_view=True
    )


def _warn_on_extra_units(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], classes: list[str]
) -> None:
    """accelerate wraps by class: modules of a block's class that are not blocks become FSDP units
    of their own too (e.g. blocks that are plain nn.Sequential). One left out of the blocks
    because it shares a parameter with another unit (tied weights) would make FSDP2 fail: that is
    an error here, before accelerate is built."""
    names = {name for name, _ in blocks}
    extra = [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ in classes and name not in names
    ]
    kept, _ = without_shared(model, extra)
    tied = [name for name, _ in extra if name not in {n for n, _ in kept}]
    if tied:
        cls = type(model.get_submodule(tied[0])).__name__
        raise ValueError(
            f"accelerate wraps modules by class name, and '{tied[0]}' ({cls}, the class of the "
            f"blocks) shares a parameter with another part of the model (tied "
            f"weights), so accelerate would make it an FSDP unit of its own, which FSDP2 refuses "
            f'("shared with a parameter already managed by another FSDP group"); train this '
            f"model with autoshard.prepare, which keeps it in the root unit"
        )
    if extra:
        warnings.warn(
            f"accelerate wraps modules by class name, and {len(extra)} module(s) of the block "
            f"class(es) {', '.join(classes)} are not blocks (e.g. '{extra[0][0] or 'the model'}'): "
            f"each becomes an FSDP unit of its own as well",
            stacklevel=4,
        )
