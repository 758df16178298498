"""The operators a traced step runs and the bytes the memory-bound ones move, per block and whole,
forward and backward: a dispatch mode over the traced step (`trace.profile_step`), for the modelled
step's memory-bound and launch-bound parts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoshard._batch import tensors_in
from autoshard._torch_compat import TorchDispatchMode, op_overload, tree_leaves
from autoshard.measure.priced import MovingCalls, PricedCalls

_UNSAFE_VIEW = op_overload("_unsafe_view")  # the reshape after a batched matmul


class Traffic(TorchDispatchMode):
    """Counts the operators run (kernels: views, which move nothing, left out) and the bytes
    read and written by those without a FLOP formula (`flops.FlopFormulas`: matmuls, convolutions,
    attention, which the FLOP count prices), each tensor at most its storage (a broadcast
    operand is read once, not per element it stands for).

    In all, and per block, so that a depth extension counts what the parent runs between blocks
    as often as there are blocks: in forward, a block's figures run from the previous block's
    end (the model's start, for the first) to its own; in backward, from where autograd reaches
    the block's outputs to where it reaches another block's (the first block's take in what
    follows it: the embedding's backward, which its forward figures hold too). The head and the
    loss, after the last block, are the model's own.

    The forward's FLOP-bound operators are also recorded, one per distinct call, with their
    FLOPs (`flops`: the FLOP counter's total, which counts each before this mode returns) and
    the block they ran in (`priced_calls`), and every memory-bound call, forward and backward,
    with the bytes it moves (`moving_calls`): what `measure.rates` times on the device."""

    # no data moved: metadata, allocations, and views torch does not mark as such (the
    # reshape after a batched matmul, in-place views)
    _FREE = frozenset(
        {
            torch.ops.prim.device,
            torch.ops.aten.lift_fresh,
            *([] if _UNSAFE_VIEW is None else [_UNSAFE_VIEW.overloadpacket]),
            torch.ops.aten.unsqueeze_,
            torch.ops.aten.squeeze_,
            torch.ops.aten.t_,
            torch.ops.aten.transpose_,
            torch.ops.aten.as_strided_,
            torch.ops.aten.empty,
            torch.ops.aten.empty_strided,
            torch.ops.aten.new_empty,
            torch.ops.aten.new_empty_strided,
            torch.ops.aten.empty_like,
        }
    )

    def __init__(
        self, n_blocks: int, priced: frozenset[Any], flops: Callable[[], int] | None = None
    ) -> None:
        super().__init__()
        self.priced = priced  # operators (packets) the FLOP count prices
        self.flops = flops
        self.priced_calls = PricedCalls(n_blocks)
        self.moving_calls = MovingCalls(n_blocks)
        self.in_forward = True
        self.block: int | None = None  # the block whose forward runs now
        self.bytes = 0
        self.kernels = 0
        self.block_bytes = [0] * n_blocks
        self.block_kernels = [0] * n_blocks
        self.backward_bytes = [0] * n_blocks
        self.backward_kernels = [0] * n_blocks
        self.since = (0, 0)  # the figures where the last block ended
        self.backward_in: int | None = None  # the block whose backward runs now
        # the key of this mode's mark on the autograd nodes that start a block's backward (in
        # each node's own `metadata`: a set of the nodes would keep alive a graph the forward
        # drops, a branch cut from the loss, and the saved tensors behind it)
        self.mark_key = f"autoshard.traffic.{id(self)}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        packet = func.overloadpacket
        counted = self.flops if self.in_forward and packet in self.priced else None
        before = 0 if counted is None else counted()
        out = func(*args, **kwargs)
        if counted is not None:
            flops, grad = counted() - before, torch.is_grad_enabled()
            self.priced_calls.record(func, args, kwargs, flops, self.block, grad)
        elif self.backward_in is not None and packet in self.priced:
            # in a block's backward, its forward may run again (`priced.PricedCalls`)
            self.priced_calls.recomputed(func, args, kwargs, self.backward_in)
        if func.is_view or packet in self._FREE:
            return out
        moved = 0
        if packet not in self.priced:
            moved = sum(
                min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                for t in tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor) and t.layout == torch.strided
            )  # a sparse gradient (Embedding(sparse=True)) has no storage: left out
        if moved:
            block = self.block if self.in_forward else self.backward_in
            self.moving_calls.record(func, args, kwargs, moved, block, self.in_forward)
        self.kernels += 1
        self.bytes += moved
        if self.backward_in is not None:
            self.backward_kernels[self.backward_in] += 1
            self.backward_bytes[self.backward_in] += moved
        return out

    def enter(self, index: int) -> None:
        self.block = index
        self.moving_calls.entered(index)
        # from the previous block's end to its own, for each call of a block run more than once
        self.block_bytes[index] -= self.since[0]
        self.block_kernels[index] -= self.since[1]

    def leave(self, index: int, outputs: Any) -> None:
        self.block_bytes[index] += self.bytes
        self.block_kernels[index] += self.kernels
        self.since = (self.bytes, self.kernels)
        self.block = None
        self.mark(index, outputs)

    def mark(self, index: int, outputs: Any) -> None:
        """Autograd reaching `outputs` starts block `index`'s backward."""
        for tensor in tensors_in(outputs):
            node = tensor.grad_fn
            if node is None:
                continue
            marks: Any = node.metadata  # a dict (torch's stub declares a method)
            if self.mark_key not in marks:
                marks[self.mark_key] = True
                node.register_prehook(lambda grads, index=index: self._backward_of(index))

    def _backward_of(self, index: int) -> None:
        self.backward_in = index

    def done(self) -> None:
        self.backward_in = None
