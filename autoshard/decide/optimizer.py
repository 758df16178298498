"""The optimizer as the estimate sees it: how much state it will hold and what its step needs,
and which of its parameters the model does not own (`wrap.optim` re-binds it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def _adam_like(group: Mapping[str, Any]) -> int:
    return 3 if group.get("amsgrad", False) else 2


def _sgd(group: Mapping[str, Any]) -> int:
    return 1 if group.get("momentum", 0) else 0


def _rmsprop(group: Mapping[str, Any]) -> int:
    return 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered", False) else 0)


# Full-size state tensors per parameter, read off each optimizer's `_init_group` in torch/optim.
# Scalar states (`step`, NAdam's `mu_product`) are counted separately as 4 bytes each.
_STATES_PER_PARAM = {
    "Adam": _adam_like,
    "AdamW": _adam_like,
    "Adamax": lambda g: 2,  # exp_avg, exp_inf
    "NAdam": lambda g: 2,  # exp_avg, exp_avg_sq
    "RAdam": lambda g: 2,  # exp_avg, exp_avg_sq
    "Adadelta": lambda g: 2,  # square_avg, acc_delta
    "Adagrad": lambda g: 1,  # sum
    "Rprop": lambda g: 2,  # prev, step_size
    "ASGD": lambda g: 1,  # ax (eta and mu are scalars)
    "SGD": _sgd,
    "RMSprop": _rmsprop,
    # a factored second moment (`_factored_bytes`): about one state's traffic, far less memory
    "Adafactor": lambda g: 1,
}
_ASSUMED_STATES = 2
# Scalar state per parameter, in bytes: `step` (fp32) for most; NAdam adds `mu_product`, ASGD keeps
# `eta` and `mu`; SGD keeps none.
_SCALAR_BYTES = {"SGD": 0, "NAdam": 8, "ASGD": 12}
# SGD updates in place; the others compute intermediates (Adam's sqrt(exp_avg_sq), Adagrad's and
# RMSprop's sqrt of their running sums).
_IN_PLACE = {"SGD"}
# Parameter-sized intermediates of one parameter's single-tensor step: Adam's
# `(exp_avg_sq.sqrt() / bias_correction2_sqrt)` allocates two; Adagrad's and RMSprop's `sqrt()`
# one, added to in place.
_LOOP_INTERMEDIATES = {"Adam": 2, "AdamW": 2}
# Devices where torch's optimizers default to foreach kernels (torch.utils._foreach_utils
# `_get_foreach_kernels_supported_devices`, used by `_default_to_fused_or_foreach`).
_FOREACH_DEVICES = {"cuda", "xpu", "mtia"}


def _known(optimizer: torch.optim.Optimizer) -> str | None:
    """The nearest optimizer class in the MRO whose state is known (a subclass of Adam is Adam)."""
    return next(
        (c.__name__ for c in type(optimizer).__mro__ if c.__name__ in _STATES_PER_PARAM), None
    )


def step_temporary_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """The most intermediate bytes the optimizer step holds at once, for unsharded parameters.

    A foreach step (torch's default on CUDA) materialises one intermediate per parameter of a
    group at once; the single-tensor step (the default elsewhere, e.g. CPU) one parameter's
    intermediates at a time, while the loop's variable still holds the previous parameter's
    last one; a fused kernel and an in-place optimizer (SGD) none.
    """
    known = _known(optimizer)
    if known in _IN_PLACE:
        return 0
    per_param = _LOOP_INTERMEDIATES.get(known or "", 1)
    worst = 0
    for group in optimizer.param_groups:
        sizes = [p.numel() * p.element_size() for p in group["params"] if p.requires_grad]
        if not sizes or group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach is None:
            foreach = device_type in _FOREACH_DEVICES
        loop = max(per_param * size + last for last, size in zip([0, *sizes], sizes, strict=False))
        worst = max(worst, sum(sizes) if foreach else loop)
    return worst


# Passes over a parameter-sized tensor (each a read or a write) of one unfused step, per parameter,
# read off torch/optim's single-tensor steps (the foreach ones make the same passes, list by list).
# Adam: lerp_ of exp_avg (3), mul_ and addcmul_ of exp_avg_sq (2 + 3), sqrt, div and add_ of the
# denominator (2 + 2 + 2), addcdiv_ of the parameter (4); AdamW's decoupled decay: a mul_ (2),
# Adam's: the gradient added to (3). Its operators: 7, and 1 for the decay.
_ADAM_PASSES, _ADAM_OPERATORS = 18, 7
# torch's multi-tensor kernels take tensors in lists of a few dozen: one launch per list
_TENSORS_PER_LAUNCH = 64


def step_traffic(optimizer: torch.optim.Optimizer, device_type: str) -> tuple[int, int]:
    """Bytes the optimizer step reads and writes over the unsharded trainable parameters, and
    the operators it runs: the memory-bound and the launch-bound time of the step in the cost
    model. A fused step (`fused=True`) reads the parameter, its gradient and each state once and
    writes the parameter and the states; an unfused one (the loop, or foreach: torch's default on
    CUDA) makes Adam's passes (SGD: a read-modify-write per buffer; optimizers not known here:
    Adam's for two states, scaled by theirs), its foreach kernels taking tensors list by list."""
    known = _known(optimizer)
    rule = _STATES_PER_PARAM[known] if known is not None else None
    traffic = operators = 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            continue
        size = sum(p.numel() * p.element_size() for p in params)
        states = rule(group) if rule is not None else _ASSUMED_STATES
        decay = 1 if group.get("weight_decay", 0) else 0
        lists = -(-len(params) // _TENSORS_PER_LAUNCH)
        if group.get("fused"):
            traffic += (3 + 2 * states) * size
            operators += lists
            continue
        if known == "SGD":
            passes, ops = 3 + 5 * states + 3 * decay, 1 + 2 * states + decay
        elif known in ("Adam", "AdamW"):
            passes = _ADAM_PASSES + (2 if known == "AdamW" else 3) * decay
            ops = _ADAM_OPERATORS + decay
        else:
            passes = max(3, _ADAM_PASSES * states // _ASSUMED_STATES)
            ops = max(1, _ADAM_OPERATORS * states // _ASSUMED_STATES)
        foreach = group.get("foreach")
        if foreach is None:
            foreach = device_type in _FOREACH_DEVICES
        traffic += passes * size
        operators += ops * (lists if foreach else len(params))
    return traffic, operators


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """Bytes of optimizer state once every trainable parameter has taken a step, and why.

    States are kept in the parameter's dtype (fp32 master weights under mixed precision), so this
    is per-parameter-size x states; sharding divides it by the world size.
    """
    name = type(optimizer).__name__
    known = _known(optimizer)
    rule = _STATES_PER_PARAM[known] if known is not None else None
    scalars = _SCALAR_BYTES.get(known or "", 4)
    total = 0
    for group in optimizer.param_groups:
        states = rule(group) if rule is not None else _ASSUMED_STATES
        for param in group["params"]:
            if not param.requires_grad:
                continue
            if known == "Adafactor":
                total += _factored_bytes(param) + scalars
            else:
                total += states * param.numel() * param.element_size() + scalars
    if rule is None:
        return total, f"{name}: unknown optimizer, assumed {_ASSUMED_STATES} states per parameter"
    if known == "Adafactor":
        kind = name if known == name else f"{name} (an {known})"
        return total, f"{kind}: a row and a column per matrix, a full state per vector"
    counts = sorted({rule(g) for g in optimizer.param_groups})
    kind = name if known == name else f"{name} (a {known})"
    return total, f"{kind}: {'/'.join(map(str, counts))} state(s) per parameter"


def _factored_bytes(param: torch.Tensor) -> int:
    """Adafactor's second moment of `param` (torch.optim.Adafactor's `_init_group`): of a matrix
    (or more dimensions), its mean over the last dimension and over the second-last (`row_var`,
    `col_var`); of a vector, one of its size (`variance`)."""
    if param.dim() < 2:
        return param.numel() * param.element_size()
    rows = param.numel() // param.shape[-1]
    columns = param.numel() // param.shape[-2]
    return (rows + columns) * param.element_size()


def unowned_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    owned = {id(p) for p in model.parameters()}
    return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
