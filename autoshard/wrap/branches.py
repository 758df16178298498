"""Backward formulas' plain-tensor branches, taken in the simulation and the CPU trial too.

Some of torch's backward formulas branch on whether a tensor is a subclass (composite
compliance), and fake tensors are one: `index_select`'s backward (`index_select_backward`),
`gather`'s (`gather_backward`), advanced indexing's (`index_backward`) and `masked_select`'s
(`masked_select_backward`) make a tensor of zeros the input's size and add or scatter the
gradient into it, in place for plain tensors (`index_add_`, `scatter_add_`, `_index_put_impl_`,
`masked_scatter_`), out of place for a subclass. So the simulation held a second
tensor of the input's size beside the zeros that the real step does not hold (on CUDA an
overestimate), and never ran the in-place kernel, whose fp32 buffers in bf16 on CPU the workspace
probe counts (`workspace.ACCUMULATIONS`): XLNet's relative shift (`index_select` over the last
dimension) checkpointed under FSDP2 bf16 read 4.1% under the allocator's peak on CPU.

A Python dispatch mode makes real tensors take the subclass branch too (`isTensorSubclassLike`
holds for every tensor while one is active): the CPU trial step's meter (`meter.LiveBytes`) made
the real step hold the copy that training without the meter does not (a model selecting its
logits with a boolean mask measured 1.9% above its steady steps), so the trial runs under
`PlainBranches` as well.

`PlainBranches` runs such an out-of-place call in place where the formula's zeros are its
destination: in backward (a graph task, grad mode off, as the engine runs formulas), made by
torch's C++ formulas (no Python code between the engine and the call), the call right after the
zeros were made, its destination those zeros. A forward's own out-of-place call (grad mode on, a
checkpointed block's recomputation included), and a Python backward's (a custom autograd
Function's, whose out-of-place call the real step makes too) are left as they are.

The engine's own sums take the same branch. Where several gradients reach one input of a node,
autograd sums them as they arrive (`InputBuffer::accumulate`): in place into the first
(`old.add_(new)`) where that is a plain, dense tensor nothing else holds, out of place
(`old + new`) for a subclass, so in the simulation always, and in the CPU trial too. A tensor
read in many places then held one more copy at each sum than training does: Mamba's scan in torch
selects one step at a time from a whole-sequence tensor, each gradient a whole-size tensor of
zeros but one step, and mamba read 4% over the allocator's peak (9% with every block
checkpointed). `PlainBranches` sums in place where it can tell the engine would: in backward, from
C++, an `add` of two plain (or fake) tensors of one shape, dtype and device, the first (the one
held) strided, dense and not a zero tensor, made in backward by another node than the one running
(not a formula's own temporary: `atan2`'s and `var_mean`'s formulas add two of theirs), a node
with one edge, to a node among the running node's next ones (so it sits in that node's buffer,
not in the running node's input), and held by as many references as a gradient nothing else holds
(`_sole_holders`, measured on this torch), storage included. A gradient passed on as it is
(`AddBackward0`) was made by an earlier node whose edge leads elsewhere, a gradient a Python
backward keeps has one more reference, a subclass's or a sparse gradient is not plain: all are
left out of place, as is anything this cannot tell (an overestimate, never an underestimate).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakTensorKeyDictionary

from autoshard._torch_compat import (
    TorchDispatchMode,
    autograd_node,
    disable_current_modes,
    engine_entry,
    engine_sums_seen,
    holders,
    in_backward,
    is_zero_tensor,
    resolve,
)

aten = torch.ops.aten

# out of place -> in place, as the formulas' two branches call them
IN_PLACE = {
    aten.index_add.default: aten.index_add_.default,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.index_put.default: aten.index_put_.default,
    aten.masked_scatter.default: aten.masked_scatter_.default,
}
ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})


class PlainBranches(TorchDispatchMode):
    """Enter it above the memory tracker and the workspace probe: they see the in-place call.
    It must be the innermost mode entered: a mode above it adds a reference to each argument,
    and no sum is then run in place."""

    def __init__(self) -> None:
        super().__init__()
        self._zeros: weakref.ref[torch.Tensor] | None = None  # made by the call just before
        self._sums = engine_sums_seen() and _sole_holders() is not None
        # each tensor made in backward -> (the run of the node that made it, the node its one
        # edge leads to, None where it has several)
        self._made: Any = WeakTensorKeyDictionary()
        # the node whose backward runs, held until another's or the end of backward: its run
        # (a count), its one edge's node, the nodes its edges lead to
        self._node: Any = None
        self._run = 0
        self._edge: Any = None
        self._next: tuple[Any, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        zeros, self._zeros = self._zeros, None
        if any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        in_place = IN_PLACE.get(func)
        if (
            in_place is not None
            and zeros is not None
            and args
            and args[0] is zeros()
            and not torch.is_grad_enabled()
            and in_backward()
            and _from_formula()
        ):
            return in_place(*args, **kwargs)
        made_in_backward = self._sums and not torch.is_grad_enabled() and in_backward()
        if made_in_backward:
            self._running(autograd_node())
        elif self._node is not None:
            self._running(None)
        if made_in_backward and func is aten.add.Tensor and not kwargs and self._engine_sum(args):
            return aten.add_.Tensor(*args)
        result = func(*args, **kwargs)
        if func in ZEROS and isinstance(result, torch.Tensor):
            self._zeros = weakref.ref(result)
        if made_in_backward and isinstance(result, torch.Tensor) and result not in self._made:
            self._made[result] = (self._run, self._edge)
        return result

    def _running(self, node: Any) -> None:
        """`node` runs its backward now (None: no node)."""
        if node is self._node:
            return
        self._node, self._run = node, self._run + 1
        self._next = () if node is None else tuple(edge for edge, _ in node.next_functions)
        edges = [edge for edge in self._next if edge is not None]
        self._edge = edges[0] if len(edges) == 1 else None

    def _engine_sum(self, args: tuple[Any, ...]) -> bool:
        """Whether `args[0] + args[1]` is autograd's engine summing a gradient into a buffer
        where it would sum in place for plain tensors. Nothing here names `args[0]` before its
        references are counted."""
        if len(args) != 2 or not all(type(arg) in _plain_types() for arg in args):
            return False
        if args[0].layout != torch.strided or args[0].is_nested or is_zero_tensor(args[0]):
            return False
        if not _dense(args[0]) or _first_holders(args) != _sole_holders():
            return False
        held, new = args
        if (held.shape, held.dtype, held.device) != (new.shape, new.dtype, new.device):
            return False
        run, goes_to = self._made.get(held, (self._run, None))
        # made by another node, not this one's own temporary (a formula's `a + b`), for a node
        # this one's edges lead to (so sitting in that node's buffer, not this one's input)
        if run == self._run or goes_to is None:
            return False
        return any(edge is goes_to for edge in self._next) and _from_formula()


@functools.cache
def _plain_types() -> tuple[type, ...]:
    """The types of tensor the engine sums in place: plain tensors, and fake ones of them."""
    return (torch.Tensor, resolve("FakeTensor"))


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense, in any order of its dimensions (what the engine asks)."""
    expected = 1
    for size, stride in sorted(
        (
            (size, stride)
            for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
            if size != 1
        ),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _first_holders(args: tuple[Any, ...]) -> tuple[int, int, int]:
    """The references that hold the first argument of a dispatched call: Python's (the
    arguments' tuple and this call's own included), and those `holders` counts."""
    return (sys.getrefcount(args[0]), *holders(args[0]))


@functools.cache
def _sole_holders() -> tuple[int, int, int] | None:
    """`_first_holders` in a mode's dispatch of a sum of gradients where only the engine's
    buffer holds the first: measured once on this torch and Python, summing two fresh
    gradients of real tensors outside every other mode (None where the probe sees no sum)."""
    seen: list[tuple[int, int, int]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is aten.add.Tensor and in_backward():
                seen.append(_first_holders(args))
            return func(*args, **(kwargs or {}))

    with (
        disable_current_modes(),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast("cpu", enabled=False),
    ):
        x = torch.ones(2, device="cpu", requires_grad=True)
        y = x * 2  # the sum: sin's and cos's gradients, each fresh, into y's buffer
        out = (y.sin() + y.cos()).sum()
        with Count():
            out.backward()
    return seen[0] if len(seen) == 1 else None


# Where the frames of torch's dispatch machinery and of the modes above this one live
_DISPATCHING = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, os.path.dirname(__file__))
)


def _from_formula() -> bool:
    """Whether the call being dispatched comes from a C++ backward formula: above the frames of
    torch, of autoshard and of any mode's `__torch_dispatch__`, the engine's Python entry, or no
    Python frame at all (the engine's own thread, as CUDA's); not a Python backward (a custom
    autograd Function's)."""
    frame = inspect.currentframe()
    entry = engine_entry()
    while frame is not None:
        code = frame.f_code
        if code is entry:
            return True
        if code.co_name != "__torch_dispatch__" and not code.co_filename.startswith(_DISPATCHING):
            return False
        frame = frame.f_back
    return True
