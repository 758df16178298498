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
"""

from __future__ import annotations

import inspect
import os
import weakref

import torch
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import TorchDispatchMode, in_backward

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
    """Enter it above the memory tracker and the workspace probe: they see the in-place call."""

    def __init__(self) -> None:
        super().__init__()
        self._zeros: weakref.ref[torch.Tensor] | None = None  # made by the call just before

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
        result = func(*args, **kwargs)
        if func in ZEROS and isinstance(result, torch.Tensor):
            self._zeros = weakref.ref(result)
        return result


# Where the frames of torch's dispatch machinery and of the modes above this one live
_DISPATCHING = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, os.path.dirname(__file__))
)
# torch's Python entry into the autograd engine (torch/autograd/graph.py, torch 2.11 to 2.15)
_ENGINE_ENTRY = "_engine_run_backward"


def _from_formula() -> bool:
    """Whether the call being dispatched comes from a C++ backward formula: above the frames of
    torch, of autoshard and of any mode's `__torch_dispatch__`, the engine's Python entry, or no
    Python frame at all (the engine's own thread, as CUDA's); not a Python backward (a custom
    autograd Function's)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == _ENGINE_ENTRY:
            return True
        code = frame.f_code
        if code.co_name != "__torch_dispatch__" and not code.co_filename.startswith(_DISPATCHING):
            return False
        frame = frame.f_back
    return True
