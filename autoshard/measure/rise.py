"""How far a training step's held bytes rise in backward above where they stood as it began: a
dispatch mode over the traced step (`trace.profile_step`), for the formulas' backward temporaries
(`ActivationProfile.backward_rise_bytes`)."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import TorchDispatchMode, in_backward, storage_key, tree_leaves

_ADD = torch.ops.aten.add.Tensor


def stored(tensor: Any) -> bool:
    """Whether `tensor` is a plain strided tensor with a storage of its own to follow (not a
    sparse gradient, whose storage torch refuses, nor a DTensor)."""
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, DTensor)
        and tensor.layout is torch.strided
    )


class BackwardRise(TorchDispatchMode):
    """How far the bytes the step holds rise in backward above where they stood as it began
    (`rise`): the storages operators make in backward (not their inputs' views or in-place
    results), each from its making to its freeing, less the saved activations freed meanwhile
    (`saved`), the parameters' gradients left out (`gradient`). Forward's operators pass
    straight through.

    Also as it rises where each gradient is summed into a buffer that holds it already (DDP's
    buckets, an accumulated micro-batch: `rise_into_buffers`): the traced step's gradients
    become the parameters' (the engine hands a parameter without one its new gradient), there
    each is made, then freed once summed into its buffer."""

    def __init__(self) -> None:
        super().__init__()
        # (allocation, bytes: + made, - freed, whether a gradient's summing into its buffer)
        self.events: list[tuple[int, int, bool]] = []
        self.alive: dict[int, int] = {}  # storage made in backward -> its allocation
        self.grads: set[int] = set()  # allocations that were a parameter's gradient
        self._sums: dict[int, tuple[int, ...]] = {}  # a sum's allocation -> its terms'
        self._saved: set[int] = set()  # the saved activations' storages
        self._made = itertools.count()
        self._backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not in_backward():
            return out
        self._backward = True
        inputs: set[int] | None = None  # their storages, found where an output needs them
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not stored(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key in self.alive:
                continue
            if inputs is None:
                inputs = {
                    storage_key(t.untyped_storage())
                    for t in tree_leaves((args, kwargs))
                    if stored(t)
                }
            if key in inputs:
                continue
            made, size = next(self._made), storage.nbytes()
            self.alive[key] = made
            self.events.append((made, size, False))
            weakref.finalize(storage, self._freed, key, made, size)
            if func is _ADD:  # the engine summing a tensor's gradients, or a formula
                self._sums[made] = tuple(
                    self.alive[k]
                    for t in args
                    if stored(t) and (k := storage_key(t.untyped_storage())) in self.alive
                )
        return out

    def saved(self, tensor: torch.Tensor) -> None:
        """A tensor saved for backward (a `saved_tensors_hooks` pack hook): its storage's
        freeing in backward counts off."""
        if not stored(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key not in self._saved:
            self._saved.add(key)
            weakref.finalize(storage, self._freed, key, next(self._made), storage.nbytes())

    def gradient(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (`register_post_accumulate_grad_hook`): its
        storage is the gradients', and so are the terms it was summed from (a parameter used
        twice: its first gradient waits for the second)."""
        grad = param.grad
        if grad is None or not stored(grad):
            return
        made = self.alive.get(storage_key(grad.untyped_storage()))
        if made is not None:  # summed into a buffer, the new gradient would be freed now
            self.events.append((made, -grad.untyped_storage().nbytes(), True))
        terms = [] if made is None else [made]
        while terms:
            term = terms.pop()
            if term not in self.grads:
                self.grads.add(term)
                terms.extend(self._sums.get(term, ()))

    def _freed(self, key: int, made: int, size: int) -> None:
        if self.alive.get(key) == made:
            del self.alive[key]
        self._saved.discard(key)
        if self._backward:
            self.events.append((made, -size, False))

    def rise(self) -> int:
        """How far the bytes held rose in backward, from where they stood as it began."""
        held = peak = 0
        for made, size, summed in self.events:
            if made not in self.grads and not summed:
                held += size
                peak = max(peak, held)
        return peak

    def rise_into_buffers(self) -> int:
        """The same where each parameter's gradient is summed into a buffer holding it already:
        every storage counted, each gradient from its making to its summing."""
        held = peak = 0
        for _, size, _ in self.events:
            held += size
            peak = max(peak, held)
        return peak
