"""Backward formulas' plain-tensor branches, taken in the simulation too.

Some of torch's backward formulas branch on whether a tensor is a subclass (composite
compliance), and fake tensors are one: `index_select`'s backward (`index_select_backward`),
`gather`'s (`gather_backward`) and advanced indexing's (`index_backward`) make a tensor of zeros
the input's size and add the gradient into it, in place for plain tensors (`index_add_`,
`scatter_add_`, `_index_put_impl_`), out of place for a subclass. So the simulation held a second
tensor of the input's size beside the zeros that the real step does not hold (on CUDA an
overestimate), and never ran the in-place kernel, whose fp32 buffers in bf16 on CPU the workspace
probe counts (`workspace.ACCUMULATIONS`): XLNet's relative shift (`index_select` over the last
dimension) checkpointed under FSDP2 bf16 read 4.1% under the allocator's peak on CPU.

`PlainBranches` runs such an out-of-place call in place where the formula's zeros are its
destination: in backward (a graph task, grad mode off, as the engine runs formulas), the call
right after the zeros were made, its destination those zeros. A forward's own out-of-place call
(grad mode on, a checkpointed block's recomputation included) is left as it is.
"""

from __future__ import annotations

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
        ):
            return in_place(*args, **kwargs)
        result = func(*args, **kwargs)
        if func in ZEROS and isinstance(result, torch.Tensor):
            self._zeros = weakref.ref(result)
        return result
