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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from autoshard._torch_compat import disable_current_modes, tree_leaves
from autoshard.decide.hardware import Throughput
from autoshard.decide.profile import ActivationProfile, PricedCall
from autoshard.measure.device import _fastest_each
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

_MOST = 8  # calls timed at most
_COVERED = 0.9  # timed until they hold this share of the forward's FLOPs
# A call's tensors at most (its inputs and output, and their gradients): room beside a model
# already on the device. A larger call runs near a large matmul's rate anyway.
_BYTES = 256 * 2**20


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
    how it was measured; None where no call could be timed."""
    total = profile.total_forward_flops
    if total <= 0:
        return None
    with (
        disable_current_modes(),
        caller_peak_kept(device),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(device.type, enabled=False),  # the traced dtypes are autocast's already
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        chosen: list[tuple[PricedCall, Callable[[], None]]] = []
        for call in profile.priced_calls:
            if len(chosen) >= _MOST or sum(c.total_flops for c, _ in chosen) >= _COVERED * total:
                break
            try:
                chosen.append((call, _run_again(call, device)))
            except Exception:  # noqa: BLE001 - see the module's docstring
                logger.debug("not timed: %s", call.operator, exc_info=True)
        if not chosen:
            return None
        times = _fastest_each(device, [run for _, run in chosen])
    timed = sum(call.total_flops for call, _ in chosen)
    # each as often as the model runs it
    seconds = sum(call.calls * t for (call, _), t in zip(chosen, times, strict=True))
    seconds += 3 * (total - timed) / peak_flops_per_s
    operators = sorted({_short(call.operator) for call, _ in chosen})
    where = (
        f"{len(chosen)} of its FLOP-bound calls ({', '.join(operators)}; "
        f"{timed / total:.0%} of its FLOPs) run forward and backward at its own shapes"
    )
    return 3 * total / max(seconds, 1e-12), where


def _run_again(call: PricedCall, device: torch.device) -> Callable[[], None]:
    """A forward and backward of `call` on random tensors on `device`, run once already (raises
    `_NotRun`, or what running it raised)."""
    if not call.arguments or call.flops <= 0:
        raise _NotRun("arguments not written, or no FLOPs")
    operator = _operator(call.operator)
    spec = json.loads(call.arguments)

    def made(on: torch.device) -> tuple[list[Any], dict[str, Any]]:
        return [_tensor(a, on) for a in spec["args"]], {
            k: _tensor(v, on) for k, v in spec["kwargs"].items()
        }

    meta_args, meta_kwargs = made(torch.device("meta"))  # the sizes, before any memory is taken
    meta_out = operator(*meta_args, **meta_kwargs)
    tensors = [t for t in tree_leaves((meta_args, meta_kwargs, meta_out)) if _is_tensor(t)]
    needed = 2 * sum(t.untyped_storage().nbytes() for t in tensors)  # and their gradients
    if needed > _BYTES:
        raise _NotRun(f"{needed} bytes")
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 2 * needed:
        raise _NotRun("too little memory free")
    args, kwargs = made(device)
    inputs = [t for t in tree_leaves((args, kwargs)) if _is_tensor(t) and t.requires_grad]
    outputs = [t for t in tree_leaves(operator(*args, **kwargs)) if _is_tensor(t)]
    differentiable = [t for t in outputs if t.requires_grad]
    gradients = [torch.randn_like(t) for t in differentiable]

    def run() -> None:
        out = operator(*args, **kwargs)
        if inputs and gradients:
            ends = [t for t in tree_leaves(out) if _is_tensor(t) and t.requires_grad]
            torch.autograd.grad(ends, inputs, gradients, allow_unused=True)

    run()
    return run


def _tensor(value: Any, device: torch.device) -> Any:
    """The argument `value` as written (`measure.priced`), a tensor made on `device` with random
    values where it stands for one."""
    if isinstance(value, list):
        return [_tensor(v, device) for v in value]
    if not (isinstance(value, dict) and set(value) == {"tensor"}):
        return value
    shape, stride, dtype_name, requires_grad = value["tensor"]
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _NotRun(f"a {dtype_name} tensor, whose values matter")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    base = torch.empty(extent, dtype=dtype, device=device)
    if device.type != "meta":
        base.normal_()
    made = base.as_strided(shape, stride).detach()
    return made.requires_grad_(bool(requires_grad))


def _operator(name: str) -> Any:
    """The operator overload "namespace.name.overload" names."""
    namespace, rest = name.split(".", 1)
    packet, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _short(name: str) -> str:
    return name.split(".")[1]


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
