"""What a decision is made from: the mixed precision, the traced activations, the usable memory,
gathered into the `PlanInputs` that `candidates.decide` takes."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard._batch import LossFn, batch_bytes, forward_error, tensors_in
from autoshard._torch_compat import cpu_has_native_bf16, needs_real_values
from autoshard._units import human
from autoshard._world import Memory, RankReport
from autoshard.decide.candidates import strategies_for
from autoshard.decide.estimate import Setting, model_stats
from autoshard.decide.hardware import hardware_for
from autoshard.decide.job import Ranks, Work
from autoshard.decide.optimizer import optimizer_state_bytes, step_temporary_bytes, step_traffic
from autoshard.decide.plan import PlanInputs
from autoshard.decide.precision import Precision
from autoshard.decide.profile import ActivationProfile
from autoshard.decide.validate import Request
from autoshard.measure import cache
from autoshard.measure.fake import MixedDtypes, shallow_copy
from autoshard.measure.layout import SHALLOW, Layout, repeats
from autoshard.measure.operators import first_unlike
from autoshard.measure.priced import most_moving
from autoshard.measure.quiet import own_runs_quiet
from autoshard.measure.rng import state_bytes
from autoshard.measure.step import autograd_on
from autoshard.measure.trace import extended, profile_scaled, profile_step
from autoshard.strategies.engines import is_transformers_layer
from autoshard.wrap.meter import held_bytes
from autoshard.wrap.snapshot import attributes_kept

logger = logging.getLogger("autoshard")


@dataclass(frozen=True)
class Measured:
    """One rank's measurements, exchanged in the agreement collective."""

    profile: ActivationProfile | None
    trace_note: str
    user_error: str | None = None  # the batch or loss_fn does not fit the model
    by_values: bool = False  # measured on real tensors: it depends on the batch's values
    # where user_error is that the forward raises under autocast alone: what it raised there
    under_autocast: str | None = None


# Parameters in these dtypes keep mixed precision off under "auto"
_DOUBLE_PRECISION = (torch.float64, torch.complex128)


def resolve_mixed_precision(
    requested: Precision | None, device: torch.device, model: nn.Module
) -> tuple[Precision, str]:
    """The mixed precision to use and why (every automatic choice carries its reason).
    `requested`: the caller's, None for "auto"."""
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floating and floating <= {torch.bfloat16, torch.float16}:
        off = f"mixed precision off: parameters are already {', '.join(map(str, floating))}"
        return Precision.NO, off
    if requested is not None:
        return requested, f"mixed precision {requested} requested by the caller"
    wide = sorted({str(p.dtype) for p in model.parameters() if p.dtype in _DOUBLE_PRECISION})
    if wide:
        return Precision.NO, (
            f"mixed precision off (auto): parameters are {', '.join(wide)}, a precision the "
            f"caller chose (FSDP2's bf16 parameters would compute them in bf16; autocast leaves "
            f"them as they are)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():  # a what-if plan for GPUs
        planned = "mixed precision bf16 (auto): planned for GPUs of capability 8.0 or newer"
        return Precision.BF16, planned
    if device.type != "cuda":
        if _cpu_has_native_bf16():
            native = "mixed precision bf16 (auto): this CPU computes bf16 natively (oneDNN)"
            return Precision.BF16, native
        return Precision.NO, (
            "mixed precision off (auto): this CPU has no native bf16 (oneDNN reports none: no "
            "AVX512-BF16/AMX), where bf16 autocast runs many times slower than fp32"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        supported = f"mixed precision bf16 (auto): CUDA capability {major}.{minor} supports bf16"
        return Precision.BF16, supported
    return Precision.FP16, (
        f"mixed precision fp16 (auto): CUDA capability {major}.{minor} has no bf16, so fp16 with a "
        f"gradient scaler (prepared.scaler)"
    )


def precision_off(chosen: Precision, measured: Measured) -> tuple[Precision, str] | None:
    """Mixed precision off, and why, where the automatic choice `chosen` is one the model's
    forward raises under (autocast; `measured` traced under it) and runs without: the model
    trains as it is written rather than not at all. None where that is not so."""
    if measured.under_autocast is None or chosen.dtype is None:
        return None
    name = str(chosen.dtype).removeprefix("torch.")
    return Precision.NO, (
        f"mixed precision off (auto chose {chosen}): the model's forward raises under autocast "
        f"to {name} ({measured.under_autocast}) and runs without it (an operator of the model "
        f"mixes dtypes autocast leaves apart); cast where it mixes them to train in {chosen}"
    )


def _cpu_has_native_bf16() -> bool:
    return cpu_has_native_bf16()


def with_resident(
    memory: Memory,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    batch: Any = None,
) -> Memory:
    """Free memory plus what the model, optimizer and example batch already hold on the training
    device: the estimate counts those bytes, so they must not also be missing from what is
    free."""
    held = held_bytes(model, optimizer, device, batch)
    if held == 0:
        return memory
    source = f"{memory.source} + {human(held)} the model, optimizer and batch already hold there"
    return Memory(memory.free_bytes + held, memory.total_bytes, source)


def measure(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    dtype: torch.dtype | None,
    names: list[str] | None = None,
    device: torch.device | None = None,
    cast: bool = False,
) -> Measured:
    """Trace one step of `batch`. A model whose blocks repeat (more than SHALLOW[-1] periods:
    `layout.repeats`) is traced with SHALLOW[0] periods of them (a module tree sharing the
    model's tensors) and extended. `device`: where the simulations run (`fake.simulated_on`),
    and so where a model on meta is traced (`trace.fake_state`). With `cast`, `dtype` is computed
    as FSDP2's mixed precision computes it (`trace.cast_as_fsdp2`), on fake tensors only: where
    they cannot run the step so, no profile, and the note says what it raised."""
    device = device if device is not None and _on_meta(model, batch) else None
    if batch is None:
        return Measured(
            None, "no example_batch: activations are not estimated and no trial step can run"
        )
    name = cache.digest(
        lambda: [
            "trace",
            cache.describe_model(model),
            cache.describe_batch(batch),
            cache.describe_callable(loss_fn),
            str(dtype),
            names,
            None if device is None else cache.describe_device(device),
            *(["cast"] if cast else []),
        ]
    )
    kept = cache.load("trace", name, _measured_from_json)
    if kept is not None:
        return kept
    measured = _measure(model, blocks, batch, loss_fn, dtype, names, device, cast)
    # a step measured on real tensors depends on the batch's values (what it read back): not kept
    if measured.profile is not None and measured.user_error is None and not measured.by_values:
        value = {"profile": cache.profile_to_json(measured.profile), "note": measured.trace_note}
        cache.store("trace", name, value)
    return measured


def _measured_from_json(value: dict[str, Any]) -> Measured:
    note = f"{value['note']} (read from autoshard's cache: {cache.directory()})"
    return Measured(cache.profile_from_json(value["profile"]), note)


def _measure(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    dtype: torch.dtype | None,
    names: list[str] | None,
    device: torch.device | None,
    cast: bool = False,
) -> Measured:
    if cast:  # on fake tensors only, with no fallback: where they cannot run it so, no profile
        try:
            with own_runs_quiet(), autograd_on():
                profile = _profile(model, blocks, batch, loss_fn, dtype, names, device, cast)
        except Exception as error:  # noqa: BLE001 - said, not raised
            logger.debug("the step with cast parameters could not be traced", exc_info=True)
            return Measured(None, _first_line(error))
        name = str(dtype).removeprefix("torch.")
        return Measured(profile, _traced(profile, f" with the parameters cast to {name}"))
    where = ""
    try:
        with own_runs_quiet(), autograd_on():
            try:
                profile = _profile(model, blocks, batch, loss_fn, dtype, names, device)
            except Exception as error:
                if device is None:
                    raise
                # a tensor the model keeps outside its parameters and buffers, left on meta,
                # cannot meet the others made on `device`: traced on meta, as built
                logger.debug("the trace on %s failed; traced on meta", device, exc_info=True)
                profile = _profile(model, blocks, batch, loss_fn, dtype, names, None)
                if dtype is not None and isinstance(error, MixedDtypes):
                    # on meta, where autocast does not apply, it ran: autocast mixed them
                    message = _fails_under_autocast(error, dtype)
                    return Measured(None, "", message, under_autocast=_first_line(error))
                where = (
                    f"; traced on the meta device, as the model was built, since the step could "
                    f"not be traced on {device.type} tensors: attention on meta runs its math "
                    f"path and saves score matrices that the fused kernels of a real step do "
                    f"not, so the activations, and what checkpointing frees, can read high"
                )
    except (TypeError, ValueError) as error:  # the call itself is wrong: a user error
        return Measured(None, "", _not_callable(error))
    except Exception as error:  # data-dependent control flow and the like cannot be traced
        with attributes_kept(model):  # what its forward caches on the model is put back
            real = forward_error(model, batch, dtype)
            plain = real if real is None or dtype is None else forward_error(model, batch, None)
        values = needs_real_values(error) or (real is not None and _asks_meta_for_values(real))
        if real is not None and _on_meta(model, batch) and values:
            # on meta the "real" forward cannot give values either: it says nothing of the batch
            return Measured(None, "", _needs_real_values(model, error, real, batch))
        if real is not None and plain is None:  # it runs, but not under autocast
            message = _fails_under_autocast(real, dtype)
            return Measured(None, "", message, under_autocast=_first_line(real))
        if real is not None:  # the real forward fails too: the batch does not fit the model
            return Measured(None, "", _does_not_fit(real, batch))
        with autograd_on():
            return _measured_for_real(model, blocks, batch, loss_fn, dtype, error)
    return Measured(profile, _traced(profile, "", where))


def _traced(profile: ActivationProfile, how: str, where: str = "") -> str:
    """The trace's note: what it saved, and what it could not count as a step does."""
    return (
        f"activations traced from the example batch{how}: {human(profile.activation_bytes(0))} "
        f"saved for backward over the whole forward (the table's activ is what is still alive "
        f"at each candidate's peak moment, less what checkpointing frees){_flops_note(profile)}"
        f"{_unlike_note(profile)}{_values_note(profile)}{where}"
    )


def _values_note(profile: ActivationProfile) -> str:
    """Where the step branched on the example batch's own values, to append to the trace's note."""
    if not profile.batch_values_read:
        return ""
    whats = sorted({what for _, what in profile.batch_values_read})
    return (
        f"; planned for the example batch's own values, as the real step branches on them: "
        f"{'; '.join(whats[:3])}{f' (and {len(whats) - 3} more)' if len(whats) > 3 else ''}; "
        f"a batch whose values differ (an attention mask with padding) takes the other branch, "
        f"which can hold more memory (a mask built, keys and values repeated for every head): "
        f"if training batches differ so, give one of them as the example"
    )


def _unlike_note(profile: ActivationProfile) -> str:
    if profile.unlike_blocks is None:
        return ""
    return (
        f"; {profile.unlike_blocks}: the model is traced and simulated whole, not extended "
        f"from a few of its blocks"
    )


def _flops_note(profile: ActivationProfile) -> str:
    """What the traced FLOPs could not count as torch does, to append to the trace's note."""
    note = ""
    if profile.flops_by_own_formula:
        note += (
            f"; FLOPs of {', '.join(profile.flops_by_own_formula)} counted by autoshard's own "
            f"formula: this torch {torch.__version__}'s raised on them (grouped-query attention "
            f"before torch 2.12)"
        )
    if profile.flops_uncounted:
        note += (
            f"; warning: no FLOP count for {', '.join(profile.flops_uncounted)} (this torch's "
            f"formula raised and autoshard has none): counted as 0, so the modelled step time "
            f"leaves them out"
        )
    return note


def _profile(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    dtype: torch.dtype | None,
    names: list[str] | None,
    device: torch.device | None = None,
    cast: bool = False,
) -> ActivationProfile:
    """The trace's profile, its memory-bound calls cut to those moving the most bytes in the
    whole model (`priced.most_moving`): a shallow trace's once extended. `cast`: as `measure`'s."""

    def whole() -> ActivationProfile:
        return _kept(profile_step(model, blocks, batch, loss_fn, dtype, device=device, cast=cast))

    # One copy is traced, not three as simulated (`layout.layout`): worth it wherever it holds
    # fewer blocks (BART-large's 12 + 12 blocks: 6, a quarter of the whole trace's operators)
    found = repeats(model, names) if names is not None else None
    if names is None or found is None or len(found.kept(SHALLOW[0])) >= len(names):
        return whole()
    # blocks alike run alike operators in any dtype: compared without autocast where it raises
    unlike = _unlike(model, blocks, names, found, batch, None if cast else dtype, device)
    if unlike is not None:  # a copy would not run what the model runs: nothing is extended
        return replace(whole(), unlike_blocks=unlike)
    try:  # a copy with fewer blocks may fail where the model runs (as may copying at all)
        shallow, kept = shallow_copy(model, names, found.kept(SHALLOW[0]))
        traced = [shallow.get_submodule(n) for n in kept]
        profile = profile_step(shallow, traced, batch, loss_fn, dtype, device=device, cast=cast)
    except Exception:  # noqa: BLE001 - see above
        return whole()
    # A block of the copy whose parameters got no gradient (a head reading the second-last
    # block's output) stands for blocks that may get one in the model
    prefixes = tuple(f"{name}." for name in kept)
    if any(name.startswith(prefixes) for name in profile.unused_parameters):
        return whole()
    sources = found.source(SHALLOW[0]), found.source(SHALLOW[0], backward=True)
    return _kept(extended(profile, names, *sources))


def _kept(profile: ActivationProfile) -> ActivationProfile:
    return replace(profile, moving_calls=most_moving(profile.moving_calls))


def _unlike(
    model: nn.Module,
    blocks: list[nn.Module],
    names: list[str],
    found: Layout,
    batch: Any,
    dtype: torch.dtype | None,
    device: torch.device | None,
) -> str | None:
    """Where blocks `found` alike run different operators (`operators.first_unlike`), which;
    None where none do, or where the model's forward cannot run on fake tensors (the trace then
    fails alike and measures on real tensors; the blocks' attributes decide)."""
    try:
        return first_unlike(model, blocks, names, found, batch, dtype, device)
    except Exception:  # noqa: BLE001 - see above
        logger.debug("the blocks' operators could not be compared", exc_info=True)
        return None


def _not_callable(error: Exception) -> str:
    return (
        f"the example batch could not be run through the model and loss "
        f"({type(error).__name__}: {error}); check that example_batch is what the model "
        f"takes (a Mapping as keyword arguments, a tuple/list as positional ones, a tensor "
        f"as the only one) and that loss_fn(output, batch) returns a scalar"
    )


def _on_meta(model: nn.Module, batch: Any) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *tensors_in(batch)])


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _shapes(batch: Any) -> str:
    return ", ".join(
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors_in(batch)
    )


# What torch raises where a forward on meta tensors asks them for values: `.item()` and Python
# conditions ("Tensor.item() cannot be called on meta tensors"), `.tolist()` ("Cannot copy out of
# meta tensor"), `repeat_interleave` ("a meta tensor"), `nonzero` ("The register_meta
# function"), `masked_select` ("with Meta tensors"), numpy ("meta device type tensor")
_META_VALUES = re.compile(r"meta (device type )?tensor|register_meta", re.IGNORECASE)


def _asks_meta_for_values(error: Exception) -> bool:
    return _META_VALUES.search(str(error)) is not None


def _needs_real_values(
    model: nn.Module, fake_error: Exception, meta_error: Exception, batch: Any
) -> str:
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    where = "the model is on the meta device" if on_meta else "example_batch is on the meta device"
    return (
        f"{where}, where its forward cannot be checked: on fake tensors it raised "
        f"{_first_line(fake_error)[:200].rstrip('.')}, which needs real values (a value read back: "
        f".item(), a Python condition on a tensor, numpy; an output shaped by values: nonzero; "
        f"an operator with no fake kernel), and run on meta it raised "
        f"{_first_line(meta_error)[:200].rstrip('.')}. If that is about shapes, example_batch "
        f"does not fit the model (it holds tensors of shapes {_shapes(batch)}); otherwise give "
        f"real tensors: build the model and its batch on the CPU, and autoshard measures the "
        f"activations on a few real rows of the batch, whatever device is planned for"
    )


def _does_not_fit(error: Exception, batch: Any) -> str:
    return (
        f"example_batch does not fit the model: the model's forward raises on it "
        f"({_first_line(error)}); the batch holds tensors of shapes {_shapes(batch)}: check "
        f"them against what the model expects (a tuple/list is passed as positional arguments, "
        f"a Mapping as keyword ones)"
    )


def _fails_under_autocast(error: Exception, dtype: torch.dtype | None) -> str:
    name = _name(dtype)
    return (
        f"the model's forward raises under autocast to {name} ({_first_line(error)}), and runs "
        f"without it: an operator of the model mixes dtypes autocast leaves apart (an in-place "
        f"one between an fp32 tensor and a {name} one, say). Pass mixed_precision='no', or cast "
        f"where the model mixes them"
    )


def autocast_raises(dtype: torch.dtype, raised: str) -> str:
    """What a forward raised under autocast to `dtype` (`Measured.under_autocast`), as
    `Job.autocast_raises` says it."""
    return f"the model's forward raises under autocast to {_name(dtype)} ({raised})"


def fails_cast_too(dtype: torch.dtype, raised: str, cast_note: str) -> str:
    """The error for mixed precision asked for where the forward raises under autocast (`raised`)
    and the step with cast parameters could not run either (`cast_note`, the cast trace's)."""
    name = _name(dtype)
    return (
        f"{autocast_raises(dtype, raised)}, and runs without it, but the step with its "
        f"parameters cast to {name}, as FSDP2 computes it without autocast, could not be run on "
        f"fake tensors either ({cast_note}): an operator of the model mixes dtypes (an in-place "
        f"one between an fp32 tensor and a {name} one, say). Pass mixed_precision='no', or cast "
        f"where the model mixes them"
    )


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _measured_for_real(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    dtype: torch.dtype | None,
    error: Exception,
) -> Measured:
    """The activations of a batch fake tensors cannot run, measured on real tensors at a few
    rows and scaled (`profile_scaled`); where that cannot run either (a model on meta), none,
    and a warning: the estimate then leaves activations out."""
    failed = f"the example batch could not be traced on fake tensors ({type(error).__name__}: "
    failed += f"{error})"[:200]
    if not _on_meta(model, batch):
        try:
            profile, how = profile_scaled(model, blocks, batch, loss_fn, dtype)
        except Exception as real_error:  # noqa: BLE001 - reported below, as for the fake trace
            failed += f"; nor on real tensors ({type(real_error).__name__}: {real_error})"[:200]
        else:
            answered = (
                f"; the simulation answers the {len(profile.answers)} yes/no value(s) that step "
                f"read back from its tensors as it did"
                if profile.answers
                else ""
            )
            if profile.nonzero_found:
                answered += (
                    f"; what its nonzero, torch.where or boolean mask found at "
                    f"{len(profile.nonzero_found)} place(s) is found there in the same share"
                )
            return Measured(
                profile,
                f"{failed}; its activations were {how} "
                f"({human(profile.activation_bytes(0))} saved for backward){answered}"
                f"{_flops_note(profile)}",
                by_values=True,
            )
    note = f"warning: {failed}; activations not estimated: the estimate leaves them out"
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(note)
    return Measured(None, note)


def usable_host_memory(reports: list[RankReport]) -> int | None:
    """Host RAM per rank for CPU offload: the least any rank has (None where not measured)."""
    known = [r.memory.host_free_bytes for r in reports if r.memory.host_free_bytes is not None]
    return min(known) if len(known) == len(reports) else None


def usable_memory(reports: list[RankReport], limit: int | None) -> tuple[int, str]:
    """The usable memory per rank: the least any rank has free, capped by memory_limit."""
    low = min(reports, key=lambda r: r.memory.free_bytes)
    where = f"minimum over {len(reports)} ranks, rank {low.rank}: " if len(reports) > 1 else ""
    text = f"free memory per rank {human(low.memory.free_bytes)} ({where}{low.memory.source})"
    if limit is not None and limit < low.memory.free_bytes:
        return limit, f"{text}, capped by memory_limit at {human(limit)}"
    return low.memory.free_bytes, text


def plan_inputs(
    work: Work,
    blocks: list[nn.Module],
    profile: ActivationProfile | None,
    ranks: Ranks,
    mixed_precision: Precision,
    reasons: list[str],
) -> PlanInputs:
    """The facts a decision is made from, for `ranks` training `work`."""
    model, optimizer, batch = work.model, work.optimizer, work.batch
    device, accumulation_steps = ranks.device, work.request.accumulation_steps
    opt_bytes, opt_reason = optimizer_state_bytes(optimizer)
    # the cost model's step is one micro-batch's: the optimizer step's share of it
    moved, operators = step_traffic(optimizer, device.type)
    stats = model_stats(
        model,
        blocks,
        opt_bytes,
        opt_reason,
        batch_bytes(batch) if batch is not None else 0,
        step_temporary_bytes(optimizer, device.type),
        step_temporary_bytes(optimizer, "cpu"),  # CPU offload's step, on the host
        (-(-moved // accumulation_steps), -(-operators // accumulation_steps)),
    )
    element = max(
        (p.element_size() for p in model.parameters() if p.is_floating_point()), default=4
    )
    dtype = mixed_precision.dtype
    setting = Setting(
        strategy=strategies_for(ranks.world_size, True)[0],
        checkpointed=0,
        world_size=ranks.world_size,
        compute_bytes=torch.empty((), dtype=dtype).element_size() if dtype else element,
        param_element_bytes=element,
        device_type=device.type,
        cuda_context_pending=device.type == "cuda" and not torch.cuda.is_initialized(),
        accumulation_steps=accumulation_steps,
        checkpoint_state_bytes=state_bytes() if device.type == "cpu" else 0,
    )
    if accumulation_steps > 1:
        reasons = [*reasons, accumulation_reason(accumulation_steps)]
    capability = (
        torch.cuda.get_device_capability(device)
        if device.type == "cuda" and torch.cuda.is_available()
        else None
    )
    return PlanInputs(
        stats=stats,
        profile=profile,
        world_size=ranks.world_size,
        num_nodes=ranks.num_nodes,
        usable_bytes=ranks.usable_bytes,
        setting=setting,
        hardware=hardware_for(device.type, capability, dtype is not None),
        num_blocks=len(blocks),
        mixed_precision=mixed_precision,
        reasons=(*reasons, f"optimizer state: {opt_reason}"),
    )


def accumulation_reason(steps: int) -> str:
    return (
        f"gradient accumulation over {steps} micro-batches: the gradients of the earlier ones "
        f"live beside each later one's activations (unsharded under FSDP, whose gradient sync "
        f"is off until the last; beside DDP's buckets), every gradient counted in each "
        f"candidate's peak; the trial step runs {steps} micro-batches per optimizer step"
    )


def worst(profiles: list[ActivationProfile | None]) -> ActivationProfile | None:
    """Every rank decides from the same data: the largest activation profile any rank traced,
    its blocks unlike where any rank's were (`ActivationProfile.unlike_blocks`: a batch of
    other shapes may run other operators)."""
    known = [p for p in profiles if p is not None]
    if not known:
        return None
    largest = max(known, key=lambda p: p.activation_bytes(0))
    unlike = next((p.unlike_blocks for p in known if p.unlike_blocks is not None), None)
    return replace(
        largest,
        unlike_blocks=largest.unlike_blocks or unlike,
        backward_rise_bytes=max(p.backward_rise_bytes for p in known),
        rise_into_buffers_bytes=max(p.rise_into_buffers_bytes for p in known),
        output_bytes=max(p.output_bytes for p in known),
        # what the estimate takes away, the least any rank's does
        block_output_bytes=_least(p.block_output_bytes for p in known),
        carried_bytes=max(p.carried_bytes for p in known),
        block_carried_bytes=_most(p.block_carried_bytes for p in known),
        block_output_left_bytes=_least(p.block_output_left_bytes for p in known),
        block_carried_left_bytes=_least(p.block_carried_left_bytes for p in known),
        forward_rise_bytes=max(p.forward_rise_bytes for p in known),
        block_cast_bytes=_most(p.block_cast_bytes for p in known),
        block_shared_bytes=_most(p.block_shared_bytes for p in known),
        block_forward_peak_bytes=_most(p.block_forward_peak_bytes for p in known),
        block_checkpointed_bytes=_most(p.block_checkpointed_bytes for p in known),
        block_checkpointed_into_buffers_bytes=_most(
            p.block_checkpointed_into_buffers_bytes for p in known
        ),
    )


def _most(figures: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """Each block's largest figure over the ranks' profiles; none where their blocks differ in
    number, or one has none (the formulas then count the checkpointed blocks' backward as
    before these figures, `ActivationProfile.checkpointed_moments`)."""
    return _each_block(figures, max)


def _least(figures: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """Each block's smallest figure over the ranks' profiles, for a figure the estimate takes
    away (what checkpointing leaves out of the output, what a block adds to it after the moment
    counted): the largest would take away more than some rank's output holds. None where their
    blocks differ in number, or one has none: nothing is taken away then."""
    return _each_block(figures, min)


def _each_block(
    figures: Iterable[tuple[int, ...]], pick: Callable[[tuple[int, ...]], int]
) -> tuple[int, ...]:
    each = list(figures)
    if len({len(f) for f in each}) != 1:
        return ()
    return tuple(pick(block) for block in zip(*each, strict=True))


def forced_checkpointing(request: Request, num_blocks: int) -> int | None:
    ac = request.activation_checkpointing
    if ac is None:
        return None
    if ac == -1:
        return num_blocks
    if ac > num_blocks:
        raise ValueError(
            f"activation_checkpointing={ac} but the model has only {num_blocks} repeated block(s)"
        )
    return ac


def blocks_reason(model: nn.Module, names: list[str]) -> str:
    if not names:
        return "no repeated blocks found: the model is one FSDP unit, not checkpointed per block"
    source = (
        "_no_split_modules"
        if getattr(model, "_no_split_modules", None)
        else "the repeated classes of its ModuleList/Sequential children"
    )
    reason = f"{len(names)} repeated blocks ({names[0]} .. {names[-1]}) from {source}"
    if is_transformers_layer(model.get_submodule(names[0])):
        reason += (
            "; a checkpointed one uses transformers' own checkpointing (non-reentrant, as "
            "gradient_checkpointing_enable sets it), which turns its KV cache off while training"
        )
    return reason
