"""The FLOP/s a model's own FLOP-bound operators reach on the training device (issue 26).

The cost model prices FLOPs at one rate, a large square matmul's (`measure.device`). A model's
own matmuls, convolutions and attention are smaller, thinner or of other kernels: on the H100 of
the first GPU run every unwrapped step modelled from that rate was 33% to 73% short of the
measured one (benchmarks/RESULTS.md), ResNet's convolutions the furthest. So the forward's
FLOP-bound calls the trace recorded (`ActivationProfile.priced_calls`, the most FLOPs first) are
run again on the device at their traced shapes, strides and dtypes, on random tensors, forward
and backward, and timed (`device._fastest_each`): up to `_MOST` of them, until they hold
`_COVERED` of the forward's FLOPs. A call not timed (too large for `_BYTES`, an integer tensor
whose values matter, an operator that cannot be run again) is priced at the large matmul's rate.
The rate returned is in the cost model's terms, three times the forward's FLOPs a step
(`cost.compute_seconds`): those FLOPs over the seconds the timed calls take, each as often as the
whole model runs it, and the rest at the large matmul's rate."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from autoshard._torch_compat import disable_current_modes, tree_leaves, tree_map
from autoshard.decide.hardware import Throughput
from autoshard.decide.profile import ActivationProfile, PricedCall
from autoshard.measure.device import _fastest_each
from autoshard.measure.priced import read
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

_MOST = 8  # calls timed at most
_COVERED = 0.9  # timed until they hold this share of the forward's FLOPs
# The calls' tensors at most, all of them together (inputs and outputs, and their gradients):
# room beside a model already on the device. A larger call runs near a large matmul's rate.
_BYTES = 512 * 2**20
# A timed run holds copies of a small call (its inputs shared, each copy its own leaf), their
# forwards launched one after another, then one backward of them all: about this long, so that
# the host's work per copy is what a step's eager operator costs it, and the device, ahead of
# the host, runs them back to back, as in a step. One forward and one `autograd.grad` per run
# took 34 us on this CPU for a 1x1x1 matmul, about what a 768-wide one takes a GPU.
_RUN_S = 1e-3
_COPIES = 64


class _NotRun(Exception):
    """A call that is not run again: see the module's docstring."""


def with_model_rate(
    throughput: Throughput | None, device: torch.device, profile: ActivationProfile | None
) -> Throughput | None:
    """The device's measured `throughput` with the model's own FLOP/s (`model_rate`) where they
    could be measured; None where the device's were not (the constants stand)."""
    if throughput is None or profile is None or throughput.flops_per_s is None:
        return throughput
    try:
        found = model_rate(device, profile, throughput.flops_per_s)
    except Exception:  # noqa: BLE001 - an OOM or a driver error leaves the large matmul's rate
        logger.debug("timing the model's own operators failed", exc_info=True)
        return throughput
    if found is None:
        return throughput
    rate, where = found
    return replace(throughput, model_flops_per_s=rate, model_where=where)


def model_rate(
    device: torch.device, profile: ActivationProfile, peak_flops_per_s: float
) -> tuple[float, str] | None:
    """The FLOP/s of the model's own step (three times its forward FLOPs over the seconds they
    take: the timed calls' as measured, the rest at `peak_flops_per_s`) and a sentence saying
    how it was measured; None where no call could be timed. What it allocates on a GPU is given
    back to it afterwards (the allocator's cache emptied where it grew)."""
    total = profile.total_forward_flops
    if total <= 0:
        return None
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        timings = _timings(device, profile.priced_calls, total)
    finally:  # the replays' tensors are gone with `_timings`: the cache they grew is given back
        if device.type == "cuda" and torch.cuda.memory_reserved(device) > reserved:
            torch.cuda.empty_cache()
    if not timings:
        return None
    timed = sum(call.total_flops for call, _ in timings)
    # each as often as the model runs it; the rest at the large matmul's rate
    seconds = sum(call.calls * t for call, t in timings)
    seconds += 3 * max(total - timed, 0) / peak_flops_per_s
    operators = sorted({_short(call.operator) for call, _ in timings})
    where = (
        f"{len(timings)} of its FLOP-bound calls ({', '.join(operators)}; "
        f"{min(timed / total, 1.0):.0%} of its FLOPs) run forward and backward at its own shapes"
    )
    return 3 * total / max(seconds, 1e-12), where


def _timings(
    device: torch.device, calls: tuple[PricedCall, ...], total: int
) -> list[tuple[PricedCall, float]]:
    """The calls timed, the most FLOPs first, each with its seconds a call."""
    with (
        disable_current_modes(),
        caller_peak_kept(device),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(device.type, enabled=False),  # the traced dtypes are autocast's
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        chosen = _chosen(device, calls, total)
        times = _fastest_each(device, [run for _, run, _ in chosen]) if chosen else []
    return [(call, t / copies) for (call, _, copies), t in zip(chosen, times, strict=True)]


def _chosen(
    device: torch.device, calls: tuple[PricedCall, ...], total: int
) -> list[tuple[PricedCall, Callable[[], None], int]]:
    """The calls to time, the most FLOPs first, each with its run and the copies it runs."""
    chosen: list[tuple[PricedCall, Callable[[], None], int]] = []
    budget = _BYTES
    for call in calls:
        if len(chosen) >= _MOST or sum(c.total_flops for c, _, _ in chosen) >= _COVERED * total:
            break
        try:
            run, copies, used = _run_again(call, device, budget)
        except Exception:  # noqa: BLE001 - see the module's docstring
            logger.debug("not timed: %s", call.operator, exc_info=True)
            continue
        chosen.append((call, run, copies))
        budget -= used
    return chosen


def _run_again(
    call: PricedCall, device: torch.device, budget: int = _BYTES
) -> tuple[Callable[[], None], int, int]:
    """A run of `call` on random tensors on `device`, forward and backward, in as many copies as
    `_RUN_S` asks (`_COPIES` at most, and within `budget` bytes): the run, its copies, and the
    bytes it holds. Run already (raises `_NotRun`, or what running it raised)."""
    if not call.arguments or call.flops <= 0:
        raise _NotRun("arguments not written, or no FLOPs")
    operator = _operator(call.operator)
    spec = json.loads(call.arguments)

    def made(on: torch.device) -> tuple[list[Any], dict[str, Any]]:
        def tensor(shape: list[int], stride: list[int], dtype: torch.dtype, grad: bool) -> Any:
            return _tensor(shape, stride, dtype, grad, on)

        return read(spec["args"], tensor), {k: read(v, tensor) for k, v in spec["kwargs"].items()}

    # the sizes first, on meta, before any memory is taken
    meta_args, meta_kwargs = made(torch.device("meta"))
    meta_out = operator(*meta_args, **meta_kwargs)
    held = _bytes((meta_args, meta_kwargs))  # shared by every copy
    each = _bytes(meta_out) * 2 + held  # a copy's outputs, their gradients and the inputs'
    free = _free(device)
    if free is not None:  # half the device's free memory at most
        budget = min(budget, free // 2)
    if held + each > budget:
        raise _NotRun(f"{held + each} bytes, {budget} free for it")
    args, kwargs = made(device)
    single = _copies(operator, args, kwargs, 1)
    single()  # the first run warms up (kernels chosen, workspaces made)
    _synchronize(device)
    started = time.perf_counter()
    single()
    _synchronize(device)
    took = time.perf_counter() - started
    copies = max(1, min(_COPIES, math.ceil(_RUN_S / max(took, 1e-9)), (budget - held) // each))
    run = single if copies == 1 else _copies(operator, args, kwargs, copies)
    run()
    return run, copies, held + copies * each


def _copies(operator: Any, args: list[Any], kwargs: dict[str, Any], n: int) -> Callable[[], None]:
    """`n` forwards of `operator`, each on its own leaves sharing the inputs' memory, then one
    backward of them all (none where nothing needs a gradient)."""

    def leaf(t: Any) -> Any:
        return t.detach().requires_grad_(t.requires_grad) if _is_tensor(t) else t

    copies = [tree_map(leaf, (args, kwargs)) for _ in range(n)]
    inputs = [t for c in copies for t in tree_leaves(c) if _is_tensor(t) and t.requires_grad]
    first = [t for t in tree_leaves(operator(*args, **kwargs)) if _is_tensor(t)]
    gradients = [torch.randn_like(t) for t in first if t.requires_grad] * n

    def run() -> None:
        ends = [
            t
            for a, k in copies
            for t in tree_leaves(operator(*a, **k))
            if _is_tensor(t) and t.requires_grad
        ]
        if inputs and ends:
            torch.autograd.grad(ends, inputs, gradients, allow_unused=True)

    return run


def _tensor(
    shape: list[int], stride: list[int], dtype: torch.dtype, grad: bool, device: torch.device
) -> torch.Tensor:
    """A tensor of the traced shape, strides and dtype on `device`, of random values (a
    floating-point one: an integer tensor's values matter, offsets or indices)."""
    if not dtype.is_floating_point:
        raise _NotRun(f"a {dtype} tensor, whose values matter")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    if device.type == "meta":
        base = torch.empty(extent, dtype=dtype, device=device)
    elif dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        base = torch.randn(extent, dtype=dtype, device=device)
    else:  # float8 and the like: no random kernel of their own
        base = torch.randn(extent, device=device).to(dtype)
    return base.as_strided(shape, stride).detach().requires_grad_(grad)


def _free(device: torch.device) -> int | None:
    """The device's free memory in bytes; None off CUDA (the budget alone bounds the calls)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(tree: Any) -> int:
    """The bytes of the meta tensors in `tree` (the sizes a call's real ones will have)."""
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(tree) if _is_tensor(t))


def _operator(name: str) -> Any:
    """The operator overload "namespace.name.overload" names."""
    namespace, rest = name.split(".", 1)
    packet, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _short(name: str) -> str:
    return name.split(".")[1]


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
