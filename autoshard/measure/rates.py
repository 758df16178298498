"""The FLOP/s a model's own FLOP-bound operators reach on the training device, and the bandwidth
its memory-bound ones reach (issue 26).

The cost model prices FLOPs at one rate, a large square matmul's (`measure.device`). A model's
own matmuls, convolutions and attention are smaller, thinner or of other kernels: on the H100 of
the first GPU run every unwrapped step modelled from that rate was 33% to 73% short of the
measured one (benchmarks/RESULTS.md), ResNet's convolutions the furthest. So the forward's
FLOP-bound calls the trace recorded (`ActivationProfile.priced_calls`) are run again on the
device at their traced shapes, strides and dtypes, on random tensors, forward and backward, and
timed (`device._fastest_each`): those taking the most time first as a roofline has it
(`_Roofline`: the large matmul's FLOP/s or the large copy's bandwidth, whichever is slower for
the call), up to `_MOST` of them, until they take `_COVERED` of the forward's time so reckoned.
A call too large for the bytes left of `_BYTES` runs alone, within `_CUT_BYTES`, at a smaller
batch where it must, its time scaled back to its own (`_cut`): a large batch's convolutions and
normalisations are what a convolution net's step is made of, and they run far from a large
matmul's rate or a large copy's bandwidth. A call not timed (no batch to cut, an integer tensor
whose values matter, an operator that cannot be run again) is priced by that roofline. The rate
returned is in the cost model's terms, three times the forward's FLOPs a step
(`cost.compute_seconds`): those FLOPs over the seconds the timed calls take, each as often as
the whole model runs it, and the rest's by the roofline.

The memory-bound operators (elementwise, normalisations, softmax, casts: the bytes they read and
write, `ActivationProfile.forward_traffic`, priced at a large copy's bandwidth) are timed alike
(`model_bandwidth`): the calls moving the most bytes in all, forward and backward as autograd
dispatched them (`ActivationProfile.moving_calls`), each run again alone without gradients, up
to `_MOST_MOVING` of them until they move `_COVERED` of the step's bytes, the rest at the copy's
bandwidth. Only operators whose kernels take any values run again (`_runs_on_any_values`):
pointwise ones, reductions, and named normalisations, softmaxes and copies; a kernel that checks
its values on a GPU (binary cross-entropy's inputs in [0, 1]) would end the process's CUDA
context on random ones."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from autoshard._torch_compat import disable_current_modes, tree_leaves, tree_map
from autoshard.decide.hardware import Throughput
from autoshard.decide.profile import ActivationProfile, MovingCall, PricedCall
from autoshard.measure.device import _fastest_each
from autoshard.measure.priced import read
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

_META = torch.device("meta")
_MOST = 8  # calls timed at most
_COVERED = 0.9  # timed until they take this share of the forward's time (or move of its bytes)
# The calls' tensors at most, all of them together (inputs and outputs, and their gradients):
# room beside a model already on the device. A call larger than what is left runs alone.
_BYTES = 512 * 2**20
# A call larger than the bytes left for it runs alone at a batch cut to this many bytes at most,
# its time scaled back (`_cut`): large enough that a GPU's kernels fill it, and that a
# memory-bound one's tensors do not sit in its L2 cache (50 MiB on an H100).
_CUT_BYTES = _BYTES // 2
# A timed run holds copies of a small call (its inputs shared, each copy its own leaf), their
# forwards launched one after another, then one backward of them all: about this long, so that
# the host's work per copy is what a step's eager operator costs it, and the device, ahead of
# the host, runs them back to back, as in a step. One forward and one `autograd.grad` per run
# took 34 us on this CPU for a 1x1x1 matmul, about what a 768-wide one takes a GPU.
_RUN_S = 1e-3
_COPIES = 64
# Memory-bound calls timed at most: their bytes spread over more distinct calls than FLOPs do
_MOST_MOVING = 16
# Memory-bound operators not tagged pointwise or reduction whose kernels take any values (a
# normalisation's statistics, a softmax, a copy): those run again on random tensors
_ANY_VALUES = frozenset(
    {
        "aten._to_copy",
        "aten.copy_",
        "aten.cat",
        "aten.stack",
        "aten.native_dropout",
        "aten.native_dropout_backward",
        "aten.native_layer_norm",
        "aten.native_layer_norm_backward",
        "aten.native_group_norm",
        "aten.native_group_norm_backward",
        "aten.native_batch_norm",
        "aten.native_batch_norm_backward",
        "aten._native_batch_norm_legit",
        "aten._native_batch_norm_legit_functional",
        "aten._native_batch_norm_legit_no_training",
        "aten._fused_rms_norm",
        "aten._fused_rms_norm_backward",
        "aten._softmax",
        "aten._safe_softmax",
        "aten._log_softmax",
        "aten._softmax_backward_data",
        "aten._log_softmax_backward_data",
        "aten.slice_backward",
        "aten.select_backward",
        "aten.fill_",
        "aten.zero_",
        "aten.masked_fill_",
    }
)


class _NotRun(Exception):
    """A call that is not run again: see the module's docstring."""


class _TooLarge(_NotRun):
    """A call whose tensors take more than the bytes left for it (`_cut` may make it fit)."""


def with_model_rate(
    throughput: Throughput | None, device: torch.device, profile: ActivationProfile | None
) -> Throughput | None:
    """The device's measured `throughput` with the model's own FLOP/s (`model_rate`) and memory
    bandwidth (`model_bandwidth`), each where it could be measured; None where the device's
    figures were not (the constants stand)."""
    if throughput is None or profile is None or throughput.flops_per_s is None:
        return throughput
    peak, copy = throughput.flops_per_s, throughput.memory_bytes_per_s
    flops = _measured(lambda: model_rate(device, profile, peak, copy))
    bandwidth = None
    if copy is not None:
        bandwidth = _measured(lambda: model_bandwidth(device, profile, copy))
    if flops is None and bandwidth is None:
        return throughput
    return replace(
        throughput,
        model_flops_per_s=None if flops is None else flops[0],
        model_where="" if flops is None else flops[1],
        model_memory_bytes_per_s=None if bandwidth is None else bandwidth[0],
        model_memory_where="" if bandwidth is None else bandwidth[1],
    )


def _measured(measure: Callable[[], tuple[float, str] | None]) -> tuple[float, str] | None:
    try:
        return measure()
    except Exception:  # noqa: BLE001 - an OOM or a driver error leaves the device's figure
        logger.debug("timing the model's own operators failed", exc_info=True)
        return None


def model_rate(
    device: torch.device,
    profile: ActivationProfile,
    peak_flops_per_s: float,
    copy_bytes_per_s: float | None = None,
) -> tuple[float, str] | None:
    """The FLOP/s of the model's own step (three times its forward FLOPs over the seconds they
    take: the timed calls' as measured, the rest by `_Roofline`) and a sentence saying how it
    was measured; None where no call could be timed. What it allocates on a GPU is given back
    to it afterwards (the allocator's cache emptied where it grew)."""
    total = profile.total_forward_flops
    if total <= 0:
        return None
    roofline = _Roofline(peak_flops_per_s, copy_bytes_per_s)
    # the calls taking the most time first, as the roofline has it (stable: ties as recorded)
    calls = sorted(profile.priced_calls, key=roofline.seconds, reverse=True)
    recorded = sum(call.total_flops for call in calls)
    unrecorded = 3 * max(total - recorded, 0) / peak_flops_per_s
    whole = sum(map(roofline.seconds, calls)) + unrecorded
    kind = _Kind(_MOST, roofline.seconds, _no_flops)
    with _cache_given_back(device):
        timings, cut = _timed(device, calls, kind, whole)
    if not timings:
        return None
    timed = [call for call, _ in timings]
    seconds = sum(call.calls * t for call, t in timings) + unrecorded
    seconds += sum(roofline.seconds(call) for call in calls if call not in timed)
    share = sum(call.total_flops for call in timed) / total
    where = (
        f"{len(timings)} of its FLOP-bound calls ({_names(timings)}; "
        f"{min(share, 1.0):.0%} of its FLOPs) run forward and backward at its own shapes"
        f"{_scaled(cut)}"
    )
    return 3 * total / max(seconds, 1e-12), where


class _Roofline:
    """A FLOP-bound call's time before it is timed: forward and backward (about twice its
    FLOPs and twice its bytes), each at the large matmul's FLOP/s or the large copy's bandwidth,
    whichever takes longer (Williams, Waterman and Patterson 2009), as often as the model runs
    it. A depthwise convolution does few FLOPs per byte: it takes a GPU many times what its
    FLOPs take at a matmul's rate, so it is timed before matmuls of more FLOPs, and priced by
    its bytes where it is not."""

    def __init__(self, peak_flops_per_s: float, copy_bytes_per_s: float | None) -> None:
        self.peak = peak_flops_per_s
        self.bandwidth = copy_bytes_per_s
        self.moved: dict[tuple[str, str], int] = {}

    def seconds(self, call: PricedCall) -> float:
        flops = call.flops / self.peak
        if self.bandwidth is None:
            return 3 * call.calls * flops
        key = (call.operator, call.arguments)
        if key not in self.moved:
            self.moved[key] = _moved(call.operator, call.arguments)
        return 3 * call.calls * max(flops, self.moved[key] / self.bandwidth)


def _moved(name: str, arguments: str) -> int:
    """Bytes one forward call reads and writes, its tensors' and its outputs' (on meta), each
    at most its elements' (as the trace counts them: q, k and v cut from one projection read
    their own columns, not its whole storage); 0 where its arguments were not written or it
    cannot run on meta."""
    try:
        with disable_current_modes():  # whatever modes the caller runs under
            args, kwargs = _made(arguments, _META)
            out = _operator(name)(*args, **kwargs)
        return sum(
            min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
            for t in tree_leaves((args, kwargs, out))
            if _is_tensor(t)
        )
    except Exception:  # noqa: BLE001 - priced by its FLOPs alone
        logger.debug("the bytes of %s were not found", name, exc_info=True)
        return 0


def model_bandwidth(
    device: torch.device, profile: ActivationProfile, copy_bytes_per_s: float
) -> tuple[float, str] | None:
    """The bandwidth of the model's own memory-bound operators (the bytes its forward and
    backward move over the seconds they take: the timed calls' as measured, the rest at
    `copy_bytes_per_s`) and a sentence saying how it was measured; None where no call could be
    timed. What it allocates on a GPU is given back as `model_rate`'s is."""
    total = profile.forward_traffic + profile.backward_traffic
    if total <= 0:
        return None
    with _cache_given_back(device):
        kind = _Kind(_MOST_MOVING, lambda call: call.total_bytes, _checks_values, by_bytes=True)
        timings, cut = _timed(device, profile.moving_calls, kind, total)
    if not timings:
        return None
    timed = sum(call.total_bytes for call, _ in timings)
    seconds = sum(call.calls * t for call, t in timings)
    seconds += max(total - timed, 0) / copy_bytes_per_s  # the rest at the copy's bandwidth
    where = (
        f"{len(timings)} of its memory-bound calls ({_names(timings)}; "
        f"{min(timed / total, 1.0):.0%} of its bytes) run again at its own shapes{_scaled(cut)}"
    )
    return total / max(seconds, 1e-12), where


@contextlib.contextmanager
def _cache_given_back(device: torch.device) -> Iterator[None]:
    """The CUDA cache grown inside emptied after (the replays' tensors are gone by then)."""
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        yield
    finally:
        if device.type == "cuda" and torch.cuda.memory_reserved(device) > reserved:
            torch.cuda.empty_cache()


Call = TypeVar("Call", PricedCall, MovingCall)


@dataclass(frozen=True)
class _Kind:
    """How calls of one kind are timed: at most `most` of them, each weighing `weight` (its
    share of the step's time or bytes), those `runs` refuses (raising `_NotRun`) left."""

    most: int
    weight: Callable[[Any], float]
    runs: Callable[[Any], None]
    # a call timed at a cut batch scaled by its bytes (memory-bound), else by its rows
    by_bytes: bool = False


def _no_flops(call: PricedCall) -> None:
    if call.flops <= 0:
        raise _NotRun("no FLOPs")


def _checks_values(call: MovingCall) -> None:
    if not _runs_on_any_values(call.operator):
        raise _NotRun("its kernel may check its values")


def _timed(
    device: torch.device, calls: Sequence[Call], kind: _Kind, total: float
) -> tuple[list[tuple[Call, float]], int]:
    """The calls of `kind` timed, the heaviest first, until they weigh `_COVERED` of `total`,
    each with its seconds a call, and how many of them were timed at a cut batch (`_alone`: a
    call too large for the bytes left, timed alone). Their tensors are gone on return."""
    with _replaying(device):
        chosen: list[tuple[Call, Callable[[], None], int]] = []
        alone: list[tuple[Call, float, bool]] = []
        budget = _BYTES
        for call in calls:
            if len(chosen) + len(alone) >= kind.most:
                break
            weighed = [c for c, _, _ in chosen] + [c for c, _, _ in alone]
            if sum(kind.weight(c) for c in weighed) >= _COVERED * total:
                break
            try:
                kind.runs(call)
                share = budget // (kind.most - len(weighed))
                run, copies, used = _run_again(call.operator, call.arguments, device, budget, share)
            except _TooLarge:
                try:
                    seconds, cut = _alone(call, device, kind.by_bytes)
                    alone.append((call, seconds, cut))
                except Exception:  # noqa: BLE001 - see the module's docstring
                    logger.debug("not timed at a cut batch: %s", call.operator, exc_info=True)
                continue
            except Exception:  # noqa: BLE001 - see the module's docstring
                logger.debug("not timed: %s", call.operator, exc_info=True)
                continue
            chosen.append((call, run, copies))
            budget -= used
        times = _fastest_each(device, [run for _, run, _ in chosen]) if chosen else []
    timings = [(call, t / copies) for (call, _, copies), t in zip(chosen, times, strict=True)]
    timings += [(call, seconds) for call, seconds, _ in alone]
    return timings, sum(cut for _, _, cut in alone)


def _alone(
    call: PricedCall | MovingCall, device: torch.device, by_bytes: bool
) -> tuple[float, bool]:
    """The seconds of `call`, too large for the bytes left, run alone where it has a batch
    (`_cut`: one whose first output has no batch to cut is not run): whole within `_CUT_BYTES`,
    else at a batch cut to them and scaled back to its own; and whether it was cut."""
    free = _free(device)
    allowance = _CUT_BYTES if free is None else min(_CUT_BYTES, free // 2)
    arguments, scale = _cut(call.operator, call.arguments, allowance, by_bytes)
    run, copies, _ = _run_again(call.operator, arguments, device, allowance, allowance)
    return _fastest_each(device, [run])[0] / copies * scale, arguments != call.arguments


def _cut(name: str, arguments: str, allowance: int, by_bytes: bool) -> tuple[str, float]:
    """`arguments` with their batch cut so that the call's tensors take `allowance` bytes at most
    (as `_run_again` counts them; as they are where they do already), and what the cut call's
    time is multiplied by to give the traced call's: its rows' ratio (a FLOP-bound call's FLOPs
    are its output rows' times theirs), or where `by_bytes` its bytes' (`_moved`: a memory-bound
    call's time is its bytes').

    The batch is the first output's first dimension, of B rows. It is cut in every tensor
    argument whose first dimension is B, or where that fails (another's may be B by chance: a
    square weight) in the first of them alone; a cut that runs on meta with each output the
    traced one, or the traced one with its first dimension cut alike (the first output so cut),
    is taken. A dense tensor keeps its dimensions' order (channels last, a transpose); a view's
    strides are kept. Raises `_NotRun` where no such cut fits."""
    operator = _operator(name)
    traced = _meta_outputs(operator, arguments)
    rows = traced[0].shape[0] if traced and traced[0].dim() else 0
    if rows < 2:
        raise _NotRun("no batch to cut")
    tensors = _tensor_specs(json.loads(arguments))
    batch = [i for i, (shape, *_) in enumerate(tensors) if shape and shape[0] == rows]
    for which in (batch, batch[:1]):
        if not which:
            continue
        try:
            fewest = _cut_bytes(operator, arguments, which, 1, traced)
            most = _cut_bytes(operator, arguments, which, rows, traced)
        except Exception:  # noqa: BLE001 - another cut, or none
            continue
        if most <= allowance:  # whole, alone
            return arguments, 1.0
        if fewest > allowance:
            raise _TooLarge(f"{fewest} bytes at one row, {allowance} free for it")
        # the bytes are affine in the rows (each cut tensor's extent is)
        cut = min(rows - 1, 1 + (allowance - fewest) * (rows - 1) // max(most - fewest, 1))
        written = _with_rows(arguments, which, cut)
        if _cut_bytes(operator, arguments, which, cut, traced) > allowance:
            raise _TooLarge("its bytes are not affine in its rows")
        if not by_bytes:
            return written, rows / cut
        before, after = _moved(name, arguments), _moved(name, written)
        if before <= 0 or after <= 0:
            raise _NotRun("its bytes were not found")
        return written, before / after
    raise _NotRun("its batch could not be cut")


def _cut_bytes(
    operator: Any, arguments: str, which: list[int], rows: int, traced: list[torch.Tensor]
) -> int:
    """The bytes the call takes (inputs, outputs and gradients, as `_run_again` counts them)
    with the tensors `which` cut to `rows`; raises where it fails to run on meta or its outputs
    are not the traced ones cut alike."""
    args, kwargs = _made(_with_rows(arguments, which, rows), _META)
    out = operator(*args, **kwargs)
    outputs = [t for t in tree_leaves(out) if _is_tensor(t)]
    full = traced[0].shape[0]
    if len(outputs) != len(traced) or not _cut_alike(outputs[0], traced[0], rows, full):
        raise _NotRun("its first output is not cut with its batch")
    for got, was in zip(outputs, traced, strict=True):
        if got.shape != was.shape and not _cut_alike(got, was, rows, full):
            raise _NotRun("an output is not the traced one, cut or not")
    return _held(operator, args, kwargs, out)


def _cut_alike(got: torch.Tensor, was: torch.Tensor, rows: int, full: int) -> bool:
    """Whether `got` is `was` with its first dimension cut as `rows` of `full`."""
    return (
        got.dim() == was.dim() >= 1
        and got.shape[1:] == was.shape[1:]
        and got.shape[0] * full == was.shape[0] * rows
    )


def _with_rows(arguments: str, which: list[int], rows: int) -> str:
    """`arguments` with the tensors `which` (in `_tensor_specs`' order) cut to `rows` in their
    first dimension."""
    spec = json.loads(arguments)
    for i, written in enumerate(_tensor_specs(spec)):
        if i in which:
            shape, stride = written[0], written[1]
            written[1] = _dense_strides([rows, *shape[1:]], shape, stride)
            shape[0] = rows
    return json.dumps(spec, sort_keys=True)


def _dense_strides(shape: list[int], traced: list[int], stride: list[int]) -> list[int]:
    """The strides of a tensor of `shape` laid out as one of `traced` shape with `stride` is:
    dense in the same order of dimensions where that one is dense, else `stride` itself."""
    order = sorted(range(len(traced)), key=lambda d: stride[d])  # innermost first
    expected, dense = 1, True
    for d in order:
        dense = dense and (traced[d] == 1 or stride[d] == expected)
        expected *= traced[d]
    if not dense:
        return stride
    new, step = [0] * len(shape), 1
    for d in order:
        new[d] = step
        step *= shape[d]
    return new


def _tensor_specs(value: Any) -> list[list[Any]]:
    """The tensors written in `value` (`priced.arguments_json`), each its [shape, stride, dtype,
    requires_grad] list, the arguments' first, then the keywords' in their order."""
    if isinstance(value, dict) and set(value) == {"tensor"}:
        return [value["tensor"]]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensor_specs(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensor_specs(v)]
    return []


def _scaled(cut: int) -> str:
    return f" ({cut} at a smaller batch, scaled to their own)" if cut else ""


def _names(timings: Sequence[tuple[PricedCall | MovingCall, float]]) -> str:
    return ", ".join(sorted({_short(call.operator) for call, _ in timings}))


def _runs_on_any_values(name: str) -> bool:
    """Whether `name`'s kernel takes any values (see the module's docstring)."""
    tags = _operator(name).tags
    return (
        torch.Tag.pointwise in tags
        or torch.Tag.reduction in tags
        or name.rsplit(".", 1)[0] in _ANY_VALUES
    )


@contextlib.contextmanager
def _replaying(device: torch.device) -> Iterator[None]:
    """Calls run again as they ran in the step, whatever the caller's modes, its random streams
    and peak left as they were."""
    with (
        disable_current_modes(),
        caller_peak_kept(device),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(device.type, enabled=False),  # the traced dtypes are autocast's
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        yield


def _run_again(
    name: str, arguments: str, device: torch.device, budget: int = _BYTES, share: int = _BYTES
) -> tuple[Callable[[], None], int, int]:
    """A run of the operator `name` on random tensors on `device` as `arguments` describe them,
    forward, and backward where a tensor needs a gradient, in as many copies as `_RUN_S` asks
    (`_COPIES` at most, within `budget` bytes, and more than one only within `share`, what is
    left for each call of those to come): the run, its copies, and the bytes it holds. Run
    already (raises `_NotRun`, or what running it raised)."""
    operator = _operator(name)
    # the sizes first, on meta, before any memory is taken
    meta_args, meta_kwargs = _made(arguments, _META)
    meta_out = operator(*meta_args, **meta_kwargs)
    held = _bytes((meta_args, meta_kwargs))  # shared by every copy
    each = _held(operator, meta_args, meta_kwargs, meta_out) - held  # a copy's
    free = _free(device)
    if free is not None:  # half the device's free memory at most
        budget = min(budget, free // 2)
    if held + each > budget:
        raise _TooLarge(f"{held + each} bytes, {budget} free for it")
    args, kwargs = _made(arguments, device)
    single = _copies(operator, args, kwargs, 1)
    single()  # the first run warms up (kernels chosen, workspaces made)
    _synchronize(device)
    started = time.perf_counter()
    single()
    _synchronize(device)
    took = time.perf_counter() - started
    room = (min(budget, share) - held) // max(each, 1)
    copies = max(1, min(_COPIES, math.ceil(_RUN_S / max(took, 1e-9)), room))
    run = single if copies == 1 else _copies(operator, args, kwargs, copies)
    run()
    return run, copies, held + copies * each


def _held(operator: Any, args: list[Any], kwargs: dict[str, Any], out: Any) -> int:
    """The bytes one copy of a call holds (on meta, their sizes): its inputs, its outputs, and
    where a tensor needs a gradient the outputs' and the inputs' gradients."""
    inputs, outputs = _bytes((args, kwargs)), _bytes(out)
    if any(t.requires_grad for t in tree_leaves((args, kwargs)) if _is_tensor(t)):
        return inputs + outputs * 2 + inputs
    return inputs + outputs


def _meta_outputs(operator: Any, arguments: str) -> list[torch.Tensor]:
    """The call's output tensors on meta."""
    args, kwargs = _made(arguments, _META)
    return [t for t in tree_leaves(operator(*args, **kwargs)) if _is_tensor(t)]


def _made(arguments: str, device: torch.device) -> tuple[list[Any], dict[str, Any]]:
    """The positional and keyword arguments `arguments` writes, their tensors on `device`."""
    if not arguments:
        raise _NotRun("arguments not written")
    spec = json.loads(arguments)

    def tensor(shape: list[int], stride: list[int], dtype: torch.dtype, grad: bool) -> Any:
        return _tensor(shape, stride, dtype, grad, device)

    def on(kind: str) -> torch.device:
        if device.type != "meta" and kind != device.type:  # a copy between devices
            raise _NotRun(f"a call naming {kind}, run again on {device.type}")
        return device

    args = read(spec["args"], tensor, on)
    return args, {k: read(v, tensor, on) for k, v in spec["kwargs"].items()}


def _copies(operator: Any, args: list[Any], kwargs: dict[str, Any], n: int) -> Callable[[], None]:
    """`n` forwards of `operator`, each on its own leaves sharing the inputs' memory, their
    outputs kept to the end as a step keeps them, then one backward of them all (none where
    nothing needs a gradient)."""

    def leaf(t: Any) -> Any:
        return t.detach().requires_grad_(t.requires_grad) if _is_tensor(t) else t

    copies = [tree_map(leaf, (args, kwargs)) for _ in range(n)]
    inputs = [t for c in copies for t in tree_leaves(c) if _is_tensor(t) and t.requires_grad]
    first = [t for t in tree_leaves(operator(*args, **kwargs)) if _is_tensor(t)]
    gradients = [torch.randn_like(t) for t in first if t.requires_grad] * n

    def run() -> None:
        outputs = [operator(*a, **k) for a, k in copies]
        ends = [t for t in tree_leaves(outputs) if _is_tensor(t) and t.requires_grad]
        if inputs and ends:
            torch.autograd.grad(ends, inputs, gradients, allow_unused=True)

    return run


def _tensor(
    shape: list[int], stride: list[int], dtype: torch.dtype, grad: bool, device: torch.device
) -> torch.Tensor:
    """A tensor of the traced shape, strides and dtype on `device`, of random values (a
    floating-point or boolean one: an integer tensor's values matter, offsets or indices; on
    meta, which holds none, any)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    if device.type == "meta":
        base = torch.empty(extent, dtype=dtype, device=device)
    elif not dtype.is_floating_point and dtype is not torch.bool:
        raise _NotRun(f"a {dtype} tensor, whose values matter")
    elif dtype is torch.bool:  # a mask
        base = torch.rand(extent, device=device) < 0.5
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
