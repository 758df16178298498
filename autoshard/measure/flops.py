"""FLOPs of the traced step's operators: torch's formulas, guarded so that none can abort the
trace, and autoshard's own for the operators torch counts wrongly or not at all (fused attention
on grouped-query shapes before torch 2.12 and on the CPU before 2.15, `_grouped_mm`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from autoshard._torch_compat import flop_formulas, grouped_mm, raw_flop_formula, sdpa_flop_ops


class FlopFormulas:
    """torch's FLOP formulas, made unable to abort the trace (issue 22). Where torch's formula
    for an operator raises (torch 2.11 on grouped-query attention: "sdpa_flop_count:
    query/key/value shapes are incompatible", fixed in 2.12), autoshard's own formula for that
    operator counts it; where autoshard has none, it counts 0 and is named in `uncounted`."""

    def __init__(self) -> None:
        self.sdpa = sdpa_flop_ops()  # operator -> is a backward
        self.by_own: set[str] = set()
        self.uncounted: set[str] = set()

    def mapping(self) -> dict[Any, Callable[..., int]]:
        """`FlopCounterMode`'s custom_mapping: every operator torch counts, guarded, and those
        torch has no formula for and autoshard has: fused attention's CPU kernel (before torch
        2.15) and `_grouped_mm` (a mixture of experts' expert matmuls). Without them their
        FLOPs counted 0, silently, and their bytes as memory traffic."""
        mapping = {op: self._guarded(op, formula) for op, formula in flop_formulas().items()}
        own: dict[Any, Callable[[tuple[Any, ...]], int | None]] = {
            op: functools.partial(_own_sdpa_flops, backward=backward)
            for op, backward in self.sdpa.items()
        }
        grouped = grouped_mm()
        if grouped is not None:
            own[grouped.overloadpacket] = grouped_mm_flops
        for op, formula in own.items():
            if op not in mapping:
                mapping[op] = self._own(op, formula)
        return mapping

    def _own(self, op: Any, formula: Callable[[tuple[Any, ...]], int | None]) -> Callable[..., int]:
        def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            flops = formula(args)
            if flops is None:
                self.uncounted.add(str(op))
                return 0
            return flops

        return raw_flop_formula(count)

    def _guarded(self, op: Any, formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
            try:
                return formula(*args, out_val=out_val, **kwargs)
            except Exception:  # noqa: BLE001 - a formula's failure costs its count, not the trace
                return self._fallback(op, args)

        return raw_flop_formula(count)

    def _fallback(self, op: Any, args: tuple[Any, ...]) -> int:
        backward = self.sdpa.get(op)
        flops = None if backward is None else _own_sdpa_flops(args, backward)
        if flops is None:
            self.uncounted.add(str(op))
            return 0
        self.by_own.add(str(op))
        return flops


def grouped_mm_flops(args: tuple[Any, ...]) -> int | None:
    """`_grouped_mm(a, b, offs)`: 2 FLOPs per multiply-add over the groups, every row of `a`
    counted (a group's rows are where `offs` puts them). a (M, K) with b (G, K, N): the experts'
    forward; a (G, M, K) with b (G, K, N): batched; a (G, M, K) with b (K, N) and a (M, K) with
    b (K, N), the groups along N or K: their gradients. None where the shapes are not these."""
    try:
        a, b = args[0].shape, args[1].shape
    except (AttributeError, IndexError):
        return None
    if len(a) == 2 and len(b) in (2, 3):
        return 2 * a[0] * a[1] * b[-1]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[-1]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[-1]
    return None


def _own_sdpa_flops(args: tuple[Any, ...], backward: bool) -> int | None:
    """autoshard's count for a fused attention operator's arguments ((grad_out,) query, key,
    value first), None where they are not the dense 4-d tensors it knows (nested ones)."""
    try:
        shapes = [tuple(t.shape) for t in args[: 4 if backward else 3]]
        return sdpa_backward_flops(*shapes) if backward else sdpa_flops(*shapes)
    except (AttributeError, TypeError, ValueError):
        return None


def sdpa_flops(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]) -> int:
    """Forward FLOPs of fused attention on (batch, heads, length, dim) shapes, as torch >= 2.12
    counts them (`torch.utils.flop_counter.sdpa_flop_count`): scores = q @ k^T, then
    out = scores @ v, 2 FLOPs per multiply-add, key/value heads broadcast to the query's
    (grouped-query attention); a causal mask is not discounted."""
    batch, heads, q_len, dim = _attention_shape(query, key, value)
    k_len, v_dim = key[2], value[3]
    return 2 * batch * heads * q_len * k_len * (dim + v_dim)


def sdpa_backward_flops(
    grad_out: tuple[int, ...],
    query: tuple[int, ...],
    key: tuple[int, ...],
    value: tuple[int, ...],
) -> int:
    """Backward FLOPs of fused attention, as torch >= 2.12 counts them
    (`sdpa_backward_flop_count`): scores recomputed (q @ k^T), grad_scores = grad_out @ v^T,
    grad_v = scores^T @ grad_out, grad_q = grad_scores @ k, grad_k = q^T @ grad_scores; with
    key/value heads broadcast to the query's."""
    batch, heads, q_len, dim = _attention_shape(query, key, value)
    k_len, v_dim = key[2], value[3]
    if tuple(grad_out) != (batch, heads, q_len, v_dim):
        raise ValueError(f"attention grad_out {grad_out} is not the output's shape")
    return 2 * batch * heads * q_len * k_len * (3 * dim + 2 * v_dim)


def _attention_shape(
    query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]
) -> tuple[int, int, int, int]:
    """The query's (batch, heads, length, dim), once key and value fit it: same batch, key/value
    heads dividing the query's, key and value of one length, query and key of one dim."""
    batch, heads, q_len, dim = query
    fits = (
        key[0] == value[0] == batch
        and key[1] == value[1]
        and heads % key[1] == 0
        and key[2] == value[2]
        and key[3] == dim
    )
    if not fits:
        raise ValueError(f"attention shapes q={query}, k={key}, v={value} do not fit")
    return batch, heads, q_len, dim
