"""Checks of the caller's arguments, run before anything is touched. Every failure names the
problem and the fix."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard._units import parse_bytes
from autoshard.decide.optimizer import unowned_parameters
from autoshard.decide.precision import Precision, parse_precision
from autoshard.strategies.strategy import Strategy


@dataclass(frozen=True)
class Request:
    """The caller's choices, normalised: None means "auto"."""

    strategy: Strategy | None
    mixed_precision: Precision | None
    activation_checkpointing: int | None
    memory_limit: int | None
    accumulation_steps: int = 1  # micro-batches whose gradients are summed before each step
    max_batch: bool = False  # search every candidate's largest per-rank batch
    batch_size: int | None = None  # the example batch's size, named where it is ambiguous


def check_model(model: Any, *, allow_meta: bool = False) -> None:
    """`allow_meta`: a what-if plan needs only shapes, so a model built on meta will do."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_not_data_parallel(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "model is already wrapped in DistributedDataParallel; pass the unwrapped model "
            "(model.module) and let autoshard choose the wrapping"
        )
    _check_not_sharded(model)
    _check_initialised(model)
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"model {type(model).__name__} has no trainable parameters (none with "
            f"requires_grad=True); there is nothing to train"
        )
    if not allow_meta and any(p.is_meta for p in params):
        raise ValueError(
            "model has parameters on the meta device; materialise them first "
            "(model.to_empty(device=...) and initialise), then call prepare"
        )


def _check_not_data_parallel(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if not isinstance(module, nn.DataParallel):
            continue
        where, unwrap = (
            (f"submodule '{name}'", f"replace submodule '{name}' by its .module")
            if name
            else ("model", "pass model.module")
        )
        raise ValueError(
            f"{where} is wrapped in torch.nn.DataParallel, which is obsolete (PyTorch recommends "
            f"DistributedDataParallel instead): one Python process drives every GPU, its threads "
            f"contend for the GIL, it replicates the model onto every GPU again at every forward "
            f"and gathers the outputs on the first GPU, so it is slower than DDP even on a single "
            f"machine. Unwrap it ({unwrap}) and launch one process per GPU with torchrun "
            f"(torchrun --nproc-per-node=N train.py) or accelerate launch; autoshard then "
            f"chooses DDP or FSDP for it"
        )


def _check_not_sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            where = f"submodule '{name}'" if name else "model"
            raise ValueError(
                f"{where} is already sharded with FSDP ({type(module).__name__}); pass the model "
                f"before any fully_shard/FullyShardedDataParallel call and let autoshard wrap it"
            )
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter '{name}' is already a DTensor (sharded or distributed); pass the model "
                f"with plain tensors and let autoshard distribute it"
            )


def _check_initialised(model: nn.Module) -> None:
    """A lazy module (nn.LazyLinear, LazyConv2d, LazyBatchNorm) has no shapes until its first
    forward: nothing can be estimated, sharded or broadcast before then."""
    from torch.nn.parameter import is_lazy

    lazy = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if is_lazy(tensor)
    ]
    if lazy:
        raise ValueError(
            f"model has {len(lazy)} parameter(s) or buffer(s) not initialised yet ('{lazy[0]}', "
            f"of a lazy module such as nn.LazyLinear, whose shapes come from its first forward); "
            f"run the model once on a batch (model(example_batch), under torch.no_grad()) before "
            f"building the optimizer and calling prepare"
        )


def check_batch_device(batch: Any, *, request_trial: bool) -> None:
    """A trial step trains on the batch: a tensor on the meta device has no data to train on."""
    from autoshard._batch import tensors_in

    meta = [t for t in tensors_in(batch) if t.is_meta]
    if request_trial and meta:
        raise ValueError(
            f"example_batch holds {len(meta)} tensor(s) on the meta device (e.g. shape "
            f"{tuple(meta[0].shape)}), which have no data for prepare()'s trial step to train on; "
            f"pass a real batch, or trial_step=False (plan() also takes a meta batch)"
        )


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer built on model.parameters(), got "
            f"{type(optimizer).__name__}"
        )
    foreign = unowned_parameters(model, optimizer)
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that model does not own (shapes "
            f"{shapes}{', ...' if len(foreign) > 3 else ''}); build the optimizer on "
            f"model.parameters() of the model passed to prepare"
        )


def check_request(
    strategy: Any,
    mixed_precision: Any,
    activation_checkpointing: Any,
    memory_limit: Any,
    loss_fn: Any,
    trial_step: Any,
    accumulation_steps: Any = 1,
    max_batch: Any = False,
    batch_size: Any = None,
) -> Request:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, batch), got {loss_fn!r}")
    if not isinstance(trial_step, bool):
        raise TypeError(f"trial_step must be True or False, got {trial_step!r}")
    precision = parse_precision(mixed_precision)
    return Request(
        strategy=parse_strategy(strategy),
        mixed_precision=precision,
        activation_checkpointing=_parse_checkpointing(activation_checkpointing),
        memory_limit=None if memory_limit is None else parse_bytes(memory_limit),
        accumulation_steps=_parse_accumulation(accumulation_steps),
        max_batch=_parse_max_batch(max_batch),
        batch_size=_parse_batch_size(batch_size),
    )


def _parse_max_batch(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"max_batch must be True or False (search each candidate's largest per-rank batch), "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _parse_batch_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"batch_size must be a positive int, the example batch's size along its batch "
            f"dimension (or None: the leading size its tensors share), got {value!r}"
        )
    return value


def _parse_accumulation(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"accumulation_steps must be an int (micro-batches per optimizer step), got "
            f"{type(value).__name__} {value!r}; write e.g. accumulation_steps=4"
        )
    if value < 1:
        raise ValueError(
            f"accumulation_steps={value} must be at least 1 (1: no gradient accumulation); "
            f"write the number of micro-batches whose gradients are summed before each "
            f"optimizer step"
        )
    return value


def parse_strategy(value: Any) -> Strategy | None:
    if isinstance(value, Strategy):
        return value
    if value == "auto":
        return None
    choices = ["auto", *(s.value for s in Strategy)]
    if isinstance(value, str) and value.lower() in choices[1:]:
        return Strategy(value.lower())
    guess = suggest_strategy(value)
    hint = f"; did you mean {guess!r}?" if guess else ""
    raise ValueError(f"strategy={value!r} is not one of {', '.join(map(repr, choices))}{hint}")


# What users call the strategies elsewhere (FSDP1, DeepSpeed, accelerate), by what autoshard names.
_STRATEGY_ALIASES = {
    "fsdp": "full_shard",
    "fsdp2": "full_shard",
    "zero3": "full_shard",
    "zero-3": "full_shard",
    "zero_3": "full_shard",
    "zero2": "shard_grad_op",
    "zero-2": "shard_grad_op",
    "zero_2": "shard_grad_op",
    "hsdp": "hybrid_shard",
    "offload": "cpu_offload",
    "none": "local",
    "no_shard": "ddp",
}


def suggest_strategy(value: Any) -> str | None:
    """The strategy a mistyped or foreign name most likely means, or None."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    if text in _STRATEGY_ALIASES:
        return _STRATEGY_ALIASES[text]
    close = difflib.get_close_matches(text.replace("-", "_"), [s.value for s in Strategy], n=1)
    return close[0] if close else None


def _parse_checkpointing(value: Any) -> int | None:
    """ "auto" -> None; True -> every block (-1 until the blocks are known); False -> 0; an int."""
    if value == "auto":
        return None
    if isinstance(value, bool):
        return -1 if value else 0
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        f"activation_checkpointing={value!r} must be 'auto', True (every block), False (none) "
        f"or a number of blocks >= 0"
    )
