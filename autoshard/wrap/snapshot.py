"""What one training step mutates, copied aside and put back bitwise: parameters and buffers (only
this rank's shards, copied to host memory so the snapshot itself cannot exhaust the device), the
optimizer's state and hyper-parameters, and the CPU and CUDA RNG states; and what the user's own
forward leaves in its modules' attributes (`attributes_kept`), around every step autoshard runs
of it, fake or real."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Snapshot:
    """Host copies of what one training step mutates."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live local tensor, host copy)
    optimizer_state: dict[Any, dict[str, Any]]
    group_options: list[dict[str, Any]]
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_copy(value: Any) -> Any:
    return _local(value).detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def take_snapshot(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> Snapshot:
    """Every rank copies its own tensors (DDP's replicas too): a rank whose peer died mid-step
    must put itself back without anyone's help."""
    live = [_local(t) for t in [*module.parameters(), *module.buffers()]]
    return Snapshot(
        tensors=[(t, t.detach().to("cpu", copy=True)) for t in live],
        optimizer_state={
            p: {k: _host_copy(v) for k, v in s.items()}
            for p, s in (optimizer.state.items() if optimizer is not None else ())
        },
        group_options=[
            {k: v for k, v in g.items() if k != "params"}
            for g in (optimizer.param_groups if optimizer is not None else ())
        ],
        cpu_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )


def restore(
    snapshot: Snapshot,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    *,
    clear_grads: bool = True,
) -> None:
    """Copy the snapshot back in place; state the step created (a fresh optimizer's) is dropped.
    The optimizer updates its state tensors in place, so those that existed are still the ones
    it holds, on their own device (fused/capturable Adam keeps `step` on the GPU)."""
    with torch.no_grad():
        for live, copy in snapshot.tensors:
            live.copy_(copy)
        for param in list(optimizer.state if optimizer is not None else ()):
            saved = snapshot.optimizer_state.get(param)
            if saved is None:
                del optimizer.state[param]  # type: ignore[union-attr]
                continue
            state = optimizer.state[param]  # type: ignore[union-attr]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    _local(state[key]).copy_(value)
                else:
                    state[key] = value
    if clear_grads:
        for param in module.parameters():
            param.grad = None
    groups = optimizer.param_groups if optimizer is not None else []
    for group, options in zip(groups, snapshot.group_options, strict=True):
        group.update(options)
    torch.set_rng_state(snapshot.cpu_rng)
    if snapshot.cuda_rng is not None:
        torch.cuda.set_rng_state(snapshot.cuda_rng, device)


def kept_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Host copies of the gradients the caller's parameters hold, by name; the gradients are
    cleared (the trial step must not accumulate into them)."""
    kept = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            kept[name] = _host_copy(param.grad)
            param.grad = None
    return kept


def put_back_grads(module: nn.Module, kept: dict[str, torch.Tensor]) -> None:
    """Give each parameter its gradient back, bitwise, laid out as the parameter now is (a
    sharded parameter gets this rank's shard of it, with no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in module.named_parameters():
        grad = kept.get(name)
        if grad is None:
            continue
        if isinstance(param, DTensor):
            local = param.to_local()
            whole = grad.to(device=local.device, dtype=param.dtype)
            param.grad = distribute_tensor(
                whole, param.device_mesh, param.placements, src_data_rank=None
            )
        else:
            param.grad = grad.to(device=param.device, dtype=param.dtype)


# What `attributes_kept` puts back: the builtin kinds, whose `clear`, `update` and slice
# assignment do what they say (a module's registries are dicts and OrderedDicts)
_CONTAINERS = frozenset({dict, collections.OrderedDict, collections.defaultdict, list, set})
# nn.Module's own bookkeeping in a module's __dict__ (its registries of parameters, submodules and
# hooks), besides the buffers' registry, which a forward may reassign like any attribute
_MODULE_OWN = frozenset(vars(nn.Module())) - {"_buffers"}
# Of those, the registries of forward and backward hooks (and the flag a backward hook sets),
# which no engine fills in a forward (FSDP2's and DDP's are registered as they wrap)
_STEP_HOOKS = frozenset(name for name in _MODULE_OWN if "hook" in name and "state_dict" not in name)


@contextlib.contextmanager
def attributes_kept(model: nn.Module, *, engines_run: bool = False) -> Iterator[None]:
    """Runs the user's own model (the trace, the operator check, the trial step) and puts back
    every module's attributes as they were: a forward on fake tensors that caches what it
    computed on its module (a rotary table built on first call, a stored auxiliary loss) would
    otherwise leave a fake tensor there, and the next real forward would compute on it without an
    error; a real one leaves a counter it keeps 2 higher (the trial's two steps). The dicts,
    lists and sets the modules hold (a cache keyed by length), those within them and within
    tuples, and the registries of parameters, buffers and submodules (a buffer registered in
    forward) are put back in place. Only containers of the builtin kinds are: a subclass may
    forbid `update` (transformers' `ModelOutput`, which the restore then left empty) or mean
    something else by it. An object of another kind keeps what the forward left in it.

    `engines_run`: the model is wrapped and the engines' own state must stay as the step left
    it. nn.Module's registries of parameters, submodules and state-dict hooks, and the state
    torch's composable APIs keep under "__" names, are left alone: FSDP2 swaps its gathered
    parameters in and out of `_parameters` and registers state-dict hooks on its first forward.
    The buffers' registry is still put back, and so are the forward and backward hooks'
    (`_STEP_HOOKS`): the engines register theirs as they wrap, and what a forward adds there is
    the model's own, which an attribute it sets often stands for (transformers 5 installs its
    output-capturing hooks on its first forward and marks the model: with the mark put back and
    the hooks left, the next forward installed them again, every hidden state was captured
    twice, and Segformer's head, which reads them all, failed)."""
    # No recursive closure: a function that calls itself is a reference cycle, and the copies
    # (the user's parameters among them) would outlive this call until the next collection,
    # after FSDP has replaced the parameters with their shards (seen: 3.3 MiB of a 26.6 MiB
    # step still held).
    kept: list[tuple[Any, Any]] = []  # (a container, a shallow copy of what it held)
    entries: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (a __dict__, the user's entries)
    seen: set[int] = set()
    pending: list[Any] = []
    for module in model.modules():
        attributes = vars(module)
        if engines_run:
            users = {k: v for k, v in attributes.items() if _users(k) or k in _STEP_HOOKS}
            entries.append((attributes, users))
            pending.extend(users.values())
        else:
            pending.append(attributes)
    while pending:
        container = pending.pop()
        if id(container) in seen or not (
            type(container) in _CONTAINERS or isinstance(container, tuple)  # a named tuple too
        ):
            continue
        seen.add(id(container))
        if isinstance(container, dict):
            kept.append((container, dict(container)))
            inner: Any = container.values()
        elif isinstance(container, tuple):  # unchangeable, but what it holds may change
            inner = container
        else:
            kept.append((container, container.copy()))
            inner = container
        pending.extend(inner)
    try:
        yield
    finally:
        for attributes, users in entries:
            for name in [k for k in attributes if _users(k) and k not in users]:
                del attributes[name]
            attributes.update(users)
        for container, content in kept:
            if isinstance(container, list):
                container[:] = content
            else:
                container.clear()
                container.update(content)
        kept.clear()
        entries.clear()


def _users(name: str) -> bool:
    """Whether an entry of a module's __dict__ is the user's rather than torch's own."""
    return name not in _MODULE_OWN and not name.startswith("__")
