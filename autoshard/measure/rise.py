"""How far a training step's held bytes rise in backward above where they stood as it began, how
far its forward rose above where it ends, and what each block holds in its forward and its
backward: a dispatch mode over the traced step (`trace.profile_step`), for the formulas' backward
temporaries (`ActivationProfile.backward_rise_bytes`), the forward's peak
(`ActivationProfile.forward_rise_bytes`) and checkpointed blocks
(`ActivationProfile.block_checkpointed_bytes`, `block_forward_peak_bytes`), and which block made a
storage the output holds (`made_in`)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import TorchDispatchMode, in_backward, storage_key, tree_leaves

_ADD = torch.ops.aten.add.Tensor


class _Event(NamedTuple):
    made: int  # the allocation: a storage made in backward, or a saved activation
    size: int  # bytes: + made, - freed
    summed: bool  # a gradient's summing into its buffer
    saved_by: int | None  # a saved activation's freeing: the block that saved it, or -1
    block: int | None  # the block whose backward ran then


def stored(tensor: Any) -> bool:
    """Whether `tensor` is a plain strided tensor with a storage of its own to follow (not a
    sparse gradient, whose storage torch refuses, nor a DTensor)."""
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, DTensor)
        and tensor.layout is torch.strided
    )


def _new_storages(
    args: Any, kwargs: Any, out: Any, known: dict[int, Any]
) -> list[tuple[torch.UntypedStorage, int]]:
    """The storages of an operator's outputs that it made: not its inputs' (views, in-place
    results), nor ones in `known`; with their keys."""
    inputs: set[int] | None = None  # their storages, found where an output needs them
    made = []
    for tensor in out if isinstance(out, (tuple, list)) else (out,):
        if not stored(tensor):
            continue
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key in known:
            continue
        if inputs is None:
            inputs = {
                storage_key(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if stored(t)
            }
        if key not in inputs:
            made.append((storage, key))
    return made


class BackwardRise(TorchDispatchMode):
    """How far the bytes the step holds rise in backward above where they stood as it began
    (`rise`): the storages operators make in backward (not their inputs' views or in-place
    results), each from its making to its freeing, less the saved activations freed meanwhile
    (`saved`), the parameters' gradients left out (`gradient`). Forward's operators pass
    straight through.

    Also as it rises where each gradient is summed into a buffer that holds it already (DDP's
    buckets, an accumulated micro-batch: `rise_into_buffers`): the traced step's gradients
    become the parameters' (the engine hands a parameter without one its new gradient), there
    each is made, then freed once summed into its buffer.

    And, with `block` telling which block runs (its forward in forward, its backward in
    backward), what each block's backward holds beside the activations saved outside it
    (`held_in_blocks`): what a checkpointed block's backward holds once its saved activations
    are recomputed."""

    def __init__(self, block: Callable[[], int | None] = lambda: None) -> None:
        super().__init__()
        self.block = block
        self.events: list[_Event] = []
        self.alive: dict[int, int] = {}  # storage made in backward -> its allocation
        self.grads: set[int] = set()  # allocations that were a parameter's gradient
        self._sums: dict[int, tuple[int, ...]] = {}  # a sum's allocation -> its terms'
        self._saved: set[int] = set()  # the saved activations' storages
        self._made = itertools.count()
        self._backward = False
        # storages forward made -> (allocation, the block making it, None outside the blocks);
        # bytes alive of each block's, and their most; of all, and their most
        self._forward: dict[int, tuple[int, int | None]] = {}
        self._forward_held: dict[int, int] = {}
        self.forward_peak: dict[int, int] = {}
        self._forward_total = 0
        self._forward_most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not in_backward():
            self._made_in_forward(self.block(), args, kwargs, out)
            return out
        self._backward = True
        for storage, key in _new_storages(args, kwargs, out, self.alive):
            made, size = next(self._made), storage.nbytes()
            self.alive[key] = made
            self.events.append(_Event(made, size, False, None, self.block()))
            weakref.finalize(storage, self._freed, key, made, size, None)
            if func is _ADD:  # the engine summing a tensor's gradients, or a formula
                self._sums[made] = tuple(
                    self.alive[k]
                    for t in args
                    if stored(t) and (k := storage_key(t.untyped_storage())) in self.alive
                )
        return out

    def _made_in_forward(self, block: int | None, args: Any, kwargs: Any, out: Any) -> None:
        for storage, key in _new_storages(args, kwargs, out, self._forward):
            made, size = next(self._made), storage.nbytes()
            self._forward[key] = (made, block)
            self._forward_total += size
            self._forward_most = max(self._forward_most, self._forward_total)
            if block is not None:
                held = self._forward_held.get(block, 0) + size
                self._forward_held[block] = held
                self.forward_peak[block] = max(self.forward_peak.get(block, 0), held)
            weakref.finalize(storage, self._forward_freed, key, made, size)

    def forward_rise(self) -> int:
        """How far above what it holds now the forward's storages stood at their most (called as
        forward ends: its transients, a block's temporaries beside every activation saved
        before it)."""
        return self._forward_most - self._forward_total

    def made_in(self, key: int) -> int | None:
        """The block whose forward made the storage `key`, alive still; None where none did."""
        entry = self._forward.get(key)
        return entry[1] if entry is not None else None

    def _forward_freed(self, key: int, made: int, size: int) -> None:
        entry = self._forward.get(key)
        if entry is not None and entry[0] == made:
            del self._forward[key]
            self._forward_total -= size
            if entry[1] is not None:
                self._forward_held[entry[1]] -= size

    def saved(self, tensor: torch.Tensor) -> None:
        """A tensor saved for backward (a `saved_tensors_hooks` pack hook): its storage's
        freeing in backward counts off (one made in backward, a checkpoint's recomputation,
        counts off as made already)."""
        if not stored(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key not in self._saved and key not in self.alive:
            self._saved.add(key)
            by = self.block()
            by = -1 if by is None else by
            weakref.finalize(storage, self._freed, key, next(self._made), storage.nbytes(), by)

    def gradient(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (`register_post_accumulate_grad_hook`): its
        storage is the gradients', and so are the terms it was summed from (a parameter used
        twice: its first gradient waits for the second)."""
        grad = param.grad
        if grad is None or not stored(grad):
            return
        made = self.alive.get(storage_key(grad.untyped_storage()))
        if made is not None:  # summed into a buffer, the new gradient would be freed now
            size = grad.untyped_storage().nbytes()
            self.events.append(_Event(made, -size, True, None, self.block()))
        terms = [] if made is None else [made]
        while terms:
            term = terms.pop()
            if term not in self.grads:
                self.grads.add(term)
                terms.extend(self._sums.get(term, ()))

    def _freed(self, key: int, made: int, size: int, saved_by: int | None) -> None:
        if self.alive.get(key) == made:
            del self.alive[key]
        self._saved.discard(key)
        if self._backward:
            self.events.append(_Event(made, -size, False, saved_by, self.block()))

    def _counted(self, event: _Event, into_buffers: bool) -> bool:
        """Whether `event` changes the bytes held: every storage where gradients are summed
        into buffers, else all but the parameters' gradients."""
        return into_buffers or (event.made not in self.grads and not event.summed)

    def rise(self) -> int:
        """How far the bytes held rose in backward, from where they stood as it began."""
        held = peak = 0
        for event in self.events:
            if self._counted(event, into_buffers=False):
                held += event.size
                peak = max(peak, held)
        return peak

    def rise_into_buffers(self) -> int:
        """The same where each parameter's gradient is summed into a buffer holding it already:
        every storage counted, each gradient from its making to its summing."""
        held = peak = 0
        for event in self.events:
            held += event.size
            peak = max(peak, held)
        return peak

    def held_in_blocks(
        self, n_blocks: int, into_buffers: bool = False
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For each block, what its backward held beyond the activations saved outside it, as
        it began and at its most: the storages made in backward and alive then (the gradient
        reaching the block, its activations' gradients and the formulas' temporaries; with
        `into_buffers` the parameters' gradients too, until summed), less the block's own saved
        activations freed meanwhile. With the block's saved activations and what is saved
        before it, the most is its backward's peak, checkpointed or not: a checkpointed block's
        backward recomputes its saved activations first, then frees them as the unchecked one
        does. A block whose backward did not run (its outputs left out of the loss) holds 0."""
        held = 0
        own_freed = [0] * n_blocks  # each block's saved activations freed so far
        start: list[int | None] = [None] * n_blocks
        peak = [0] * n_blocks
        for event in self.events:
            block = event.block if event.block is not None and event.block < n_blocks else None
            if block is not None:  # before the event: as it began
                if start[block] is None:
                    start[block] = held
                peak[block] = max(peak[block], held - own_freed[block])
            if event.saved_by is not None:
                if 0 <= event.saved_by < n_blocks:
                    own_freed[event.saved_by] -= event.size
            elif self._counted(event, into_buffers):
                held += event.size
            if block is not None:
                peak[block] = max(peak[block], held - own_freed[block])
        return tuple(s or 0 for s in start), tuple(peak)

    def forward_held(self, n_blocks: int) -> tuple[int, ...]:
        """For each block, the most its forward held at once of what it made (what it saves,
        its temporaries, its output): what a checkpointed block's recomputation holds."""
        return tuple(self.forward_peak.get(i, 0) for i in range(n_blocks))
