"""Measure what one training step of `example_batch` holds, without real memory.

The model the user built is traced as it is: its parameters and the batch are converted to fake
tensors (`FakeTensorMode.from_tensor` allocates nothing) and the step runs through
`torch.func.functional_call`, so no copy of the model is made and none of its tensors change.
What is measured:

- the bytes autograd saves for backward, attributed to the block that saved them (saved-tensor
  hooks, storages deduplicated), and each block's input bytes: with these the activation memory of
  any number of checkpointed blocks is derived without tracing again;
- forward FLOPs per block (`FlopCounterMode`), the compute term of the cost model and the price of
  recomputing a checkpointed block. No FLOP formula can abort the trace (`flops.FlopFormulas`): the
  activations matter more than the count;
- the bytes read and written by the operators without a FLOP formula, and the operators run
  (`traffic.Traffic`), per block and whole, forward and backward: the memory-bound and the
  launch-bound parts of the modelled step;
- how far backward rises above where it began, and what each block holds in its forward and its
  backward (`rise.BackwardRise`): the formulas' temporaries, and what a checkpointed block holds
  when it runs again in backward;
- the forward's FLOP-bound calls, each with its arguments' shapes and where it ran
  (`measure.priced`): what `measure.rates` runs again on the device for the model's own FLOP/s.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autoshard._batch import (
    LossFn,
    compute_loss,
    first_rows,
    leading_rows,
    split_batch,
    tensors_in,
    tensors_reached,
)
from autoshard._torch_compat import is_batch_norm, storage_key, tree_map, view_base
from autoshard.decide.profile import ActivationProfile
from autoshard.measure.answers import Recorder, agreed, found_together
from autoshard.measure.fake import batch_value, fake_mode, fake_tensor, wider_fake_kernels
from autoshard.measure.flops import FlopFormulas
from autoshard.measure.priced import moving_order, order
from autoshard.measure.rise import BackwardRise, stored
from autoshard.measure.traffic import Traffic
from autoshard.strategies.engines import is_transformers_layer, transformers_caches
from autoshard.wrap.snapshot import attributes_kept

logger = logging.getLogger("autoshard")


class _Attribution:
    """Tracks which block is running and which new storages each one saved for backward."""

    def __init__(self, n_blocks: int, existing: set[int]) -> None:
        self.current: int | None = None
        self.after_blocks = False
        self.existing = existing  # parameters, buffers and the batch: saved, but not new memory
        self.owner: dict[int, int | str] = {}
        self.nbytes: dict[int, int] = {}
        self.inputs = [0] * n_blocks
        # the storages blocks took as inputs: a tensor of each, alive while it is (a storage
        # freed may leave its key to another), and the block it counts for
        self.taken: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        # the tensors saved of each storage counted: a storage whose saved tensors are all gone
        # was freed (a branch whose graph forward dropped: routing scores reduced to indices),
        # and a later storage may take its address, its key (DeepSeek-V3's blocks then went
        # from 451,872 to 417,568 B, differing from run to run)
        self.saved: dict[int, list[weakref.ref[torch.Tensor]]] = {}
        self.closed = False  # forward done: what backward saves (a recomputation) is not counted
        self.casts: set[int] = set()  # the storages counted that are autocast's parameter copies
        # the storages a block counted that a later block, or the head, saved too (its output,
        # where its last operator saves it and so does the next block's first): checkpointing
        # the block alone does not free them
        self.shared: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if self.closed or key in self.existing:
            return tensor
        # a detached alias is what autograd keeps: returning the tensor itself makes a saved
        # output (sigmoid's, softmax's) hold its own grad_fn, a cycle no collector breaks
        detached = tensor.detach()
        alive = self._alive(key)
        saved = self.saved.setdefault(key, [])
        saved.append(weakref.ref(detached))
        here = self.current if self.current is not None else self._outside()
        if alive:  # the same storage, counted
            owner = self.owner.get(key)
            taker = self._taker(key)
            # (a block's own input, saved by the blocks after it too, counts as its input)
            if isinstance(owner, int) and owner != here and taker != owner:
                if key not in self.shared and taker == here:
                    # an earlier block's output this block takes and saves: counted once, there
                    self.inputs[here] -= storage.nbytes()
                self.shared.add(key)
            return detached
        self.owner[key] = here
        self.nbytes[key] = storage.nbytes()
        self.shared.discard(key)  # a storage freed may leave its key to another
        if _cached_cast(tensor):
            self.casts.add(key)
        else:
            self.casts.discard(key)
        return detached

    def _outside(self) -> str:
        return "after" if self.after_blocks else "before"

    def forward_done(self) -> None:
        """Leaves out the storages freed in forward (their saved tensors all gone): nothing of
        them is saved for backward."""
        for key in self.saved:
            if not self._alive(key):
                self.owner.pop(key, None)
                self.nbytes.pop(key, None)
        self.closed = True

    def held_by(
        self,
        output: Any,
        made_in: Callable[[int], int | None],
        beside_saved: bool,
        leave_cache: list[bool],
        outside: list[torch.Tensor],
    ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Bytes of the storages `output` holds, but the parameters' and the batch's, and with
        `beside_saved` (run after `forward_done`) but those saved for backward: in all, and of
        them those each block's forward made (`made_in`, by storage), which a deeper model has
        more of (the keys and values of a cache every attention block fills). Beside what is
        saved, what the output adds to backward (the logits beside a loss computed from them);
        after backward, all of them, what a loop that keeps the output until the next one
        replaces it carries into the next step's forward. Third, of each block's, those the
        output reaches through a transformers cache alone where the block `leave_cache`s (a
        checkpointed transformers layer leaves the cache out: it adds none of them then).
        Nothing is reached through the tensors `outside` (the parameters and their gradients)."""
        held: dict[int, int] = {}
        for tensor in tensors_reached(output, outside=outside):
            if not stored(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key not in self.existing and not (beside_saved and key in self.nbytes):
                held[key] = storage.nbytes()
        caches = transformers_caches()
        besides = {
            storage_key(t.untyped_storage())
            for t in tensors_reached(output, caches, outside)
            if stored(t)
        }
        by_block = [0] * len(self.inputs)
        in_cache = [0] * len(self.inputs)
        for key, size in held.items():
            block = made_in(key)
            if block is not None:
                by_block[block] += size
                if leave_cache[block] and key not in besides:
                    in_cache[block] += size
        return sum(held.values()), tuple(by_block), tuple(in_cache)

    def took(self, index: int, tensors: Iterable[torch.Tensor]) -> None:
        """Block `index` was called with `tensors`: its inputs are what it keeps when
        checkpointed, of any dtype (a boolean mask the model made: LongT5's local attention's
        786,432 B, kept to the block's backward, were left out). A storage another block took
        too (a mask, a position bias, an encoder's output for every decoder block), the batch's
        and the parameters' count once, where first taken, or not at all; one an earlier block
        saved (its own output) and this block saves again counts as that block's saved storage
        (`pack`), which checkpointing that block alone does not free (`shared`)."""
        for tensor in tensors:
            if not stored(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key in self.existing:
                continue
            if self._taker(key) is not None:
                continue
            self.taken[key] = (weakref.ref(tensor), index)
            self.inputs[index] += storage.nbytes()

    def _taker(self, key: int) -> int | None:
        """The block a storage taken as an input counts for, while it is alive."""
        taken = self.taken.get(key)
        return taken[1] if taken is not None and taken[0]() is not None else None

    def _alive(self, key: int) -> bool:
        """Whether a tensor saved of the storage `key` is alive."""
        return any(ref() is not None for ref in self.saved.get(key, ()))

    def enter(self, index: int) -> None:
        self.current = index

    def leave(self) -> None:
        self.current = None
        self.after_blocks = True

    def saved_by(self, owner: int | str, among: set[int] | None = None) -> int:
        """Bytes of the storages `owner` saved (of those `among`, where given)."""
        return sum(
            self.nbytes[k]
            for k, o in self.owner.items()
            if o == owner and (among is None or k in among)
        )


def _cached_cast(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a saved tensor, or a view of one) is autocast's copy of a parameter:
    the cast of a leaf that requires a gradient to autocast's dtype, which autocast keeps in its
    cache (`cache_enabled`, the default) to the end of the forward, saved or not, a checkpointed
    block's too (`ActivationProfile.block_cast_bytes`). An explicit cast of a parameter to that
    dtype looks the same, and is counted alike (a copy held longer than it is)."""
    if not torch.is_autocast_cache_enabled():
        return False
    base = view_base(tensor)
    base = tensor if base is None else base
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0" or not node.next_functions:
        return False
    source = node.next_functions[0][0]
    # AccumulateGrad: the node of a leaf that requires a gradient
    return source is not None and isinstance(getattr(source, "variable", None), torch.Tensor)


class _TotalsOnly:
    """What FlopCounterMode asks of its module tracker (torch 2.11 to 2.15: entered, left, and
    its `parents` read at each counted operator) where only the total is wanted: every count goes
    to "Global". torch's ModuleTracker hooks each module call's inputs for backward, which fails
    on a module called inside a custom autograd Function's forward, where an input requires grad
    but has no gradient function (Reformer's reversible layers: "Expected gradient function to
    be set"), and the whole trace was lost with it."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _TotalsOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def profile_step(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    autocast_dtype: torch.dtype | None,
    real: bool = False,
    device: torch.device | None = None,
    cast: bool = False,
) -> ActivationProfile:
    """Trace one forward and backward of `batch` under FakeTensorMode and measure it.

    With `cast`, `autocast_dtype` is computed as FSDP2's mixed precision computes it, not under
    autocast: the parameters cast to it (batch norms' kept, `cast_as_fsdp2`), the forward's
    floating inputs too, its floating outputs cast back to fp32.

    With `real`, the step runs on real tensors instead (for a batch that fake tensors cannot
    run, `profile_scaled`): on detached aliases of the parameters and copies of the buffers, so
    that neither the model's gradients nor its buffers (BatchNorm statistics) change, and with
    the random number generators restored after. With `device`, the fake tensors of a model on
    meta are made there (`fake_state`)."""
    from torch.utils.flop_counter import FlopCounterMode

    mode: Any
    recorder = Recorder()
    if real:
        mode = recorder
        aliases: dict[int, torch.Tensor] = {}
        state = {
            n: aliases.setdefault(id(t), t.detach().requires_grad_(t.requires_grad))
            for n, t in model.named_parameters(remove_duplicate=False)
        }
        state.update({n: t.clone() for n, t in model.named_buffers(remove_duplicate=False)})
        fake_batch = batch
    else:
        mode = fake_mode()
        state, fake_batch = fake_state(mode, model, batch, device)
    if cast and autocast_dtype is not None:
        assert not real, "a step with cast parameters is traced on fake tensors only"
        with mode:
            state = cast_as_fsdp2(model, state, autocast_dtype)
    existing = {
        storage_key(t.untyped_storage()) for t in [*state.values(), *tensors_in(fake_batch)]
    }
    attribution = _Attribution(len(blocks), existing)
    block_flops = [0] * len(blocks)
    formulas = FlopFormulas()
    priced = formulas.mapping()
    counter = FlopCounterMode(display=False, custom_mapping=priced)
    counter.mod_tracker = _TotalsOnly()  # type: ignore[assignment]
    traffic = Traffic(len(blocks), frozenset(priced), counter.get_total_flops)
    made = BackwardRise(lambda: traffic.block if traffic.in_forward else traffic.backward_in)
    hooks = [
        t.register_post_accumulate_grad_hook(made.gradient)
        for t in {id(t): t for t in state.values() if t.requires_grad}.values()
    ]
    handles = _attribution_hooks(blocks, attribution, counter, block_flops, traffic)
    device_type = device_type_of(model, None if real else device)
    autocast = autocast_for(device_type, None if cast else autocast_dtype)
    cast_to = autocast_dtype if cast else None
    taken: dict[str, Any] = {}  # the forward's figures, taken before backward
    leave_cache = [is_transformers_layer(block) for block in blocks]
    outside = list(state.values())  # what the output's autograd graph reaches, not the output's

    def step(model: nn.Module) -> None:
        with autocast:
            args, kwargs = split_batch(fake_batch)
            if cast_to is not None:
                args, kwargs = _floating_to((args, kwargs), cast_to)
            output = model(*args, **kwargs)
            if autocast_dtype is not None:
                # as FSDP2's output_dtype and the autocast hooks return it (`engines._Autocast`)
                output = _floating_to(output, torch.float32)
        loss = compute_loss(output, fake_batch, loss_fn)
        taken["forward_rise"] = made.forward_rise()
        taken["flops"] = counter.get_total_flops()
        taken["traffic"] = traffic.bytes, traffic.kernels
        # Only forward FLOPs are kept: an operator miscounted in backward changes no figure.
        taken["formulas"] = sorted(formulas.by_own), sorted(formulas.uncounted)
        attribution.forward_done()
        taken["output"] = attribution.held_by(output, made.made_in, True, leave_cache, outside)
        traffic.in_forward = False
        loss.backward()  # the output held through it, as a loop holding it does
        taken["carried"] = attribution.held_by(output, made.made_in, False, leave_cache, outside)

    try:
        with (
            torch.random.fork_rng(devices=[], enabled=real),
            attributes_kept(model),
            wider_fake_kernels(device_type),
            mode,
            counter,
            traffic,
            made,
            torch.autograd.graph.saved_tensors_hooks(_both(made.saved, attribution.pack), _unpack),
        ):
            # backward too runs on `state`: a block checkpointed with use_reentrant=True runs its
            # forward again in backward, which on the model's own parameters gave them (fake)
            # gradients and left the traced ones without (all reported unused)
            prefixed = {f"model.{name}": tensor for name, tensor in state.items()}
            torch.func.functional_call(_Step(model, step), prefixed, ())
    finally:
        traffic.done()
        for handle in [*handles, *hooks]:
            handle.remove()
    sizes = list(attribution.nbytes.values())
    return ActivationProfile(
        block_saved_bytes=tuple(attribution.saved_by(i) for i in range(len(blocks))),
        block_input_bytes=tuple(attribution.inputs),
        block_cast_bytes=tuple(
            attribution.saved_by(i, attribution.casts - attribution.shared)
            for i in range(len(blocks))
        ),
        block_shared_bytes=tuple(
            attribution.saved_by(i, attribution.shared) for i in range(len(blocks))
        ),
        before_saved_bytes=attribution.saved_by("before"),
        after_saved_bytes=attribution.saved_by("after"),
        largest_saved_bytes=max(sizes, default=0),
        backward_rise_bytes=made.rise(),
        rise_into_buffers_bytes=made.rise_into_buffers(),
        output_bytes=taken["output"][0],
        block_output_bytes=taken["output"][1],
        block_output_left_bytes=taken["output"][2],
        carried_bytes=taken["carried"][0],
        block_carried_bytes=taken["carried"][1],
        block_carried_left_bytes=taken["carried"][2],
        forward_rise_bytes=taken["forward_rise"],
        block_forward_peak_bytes=tuple(made.forward_peak.get(i, 0) for i in range(len(blocks))),
        block_checkpointed_bytes=_checkpointed(made, attribution, len(blocks), False),
        block_checkpointed_into_buffers_bytes=_checkpointed(made, attribution, len(blocks), True),
        block_forward_flops=tuple(block_flops),
        total_forward_flops=taken["flops"],
        compute_dtype=autocast_dtype or _param_dtype(model),
        unused_parameters=tuple(
            name
            for name, param in model.named_parameters()
            if param.requires_grad and state[name].grad is None
        ),
        answers=tuple(recorder.answers().items()),
        nonzero_found=recorder.found(),
        random_reads=tuple(mode.draws.random_reads.items()),
        batch_values_read=tuple(mode.known.reads.items()) if not real else (),
        flops_by_own_formula=tuple(taken["formulas"][0]),
        flops_uncounted=tuple(taken["formulas"][1]),
        block_forward_traffic=tuple(traffic.block_bytes),
        block_forward_kernels=tuple(traffic.block_kernels),
        block_backward_traffic=tuple(traffic.backward_bytes),
        block_backward_kernels=tuple(traffic.backward_kernels),
        forward_traffic=taken["traffic"][0],
        forward_kernels=taken["traffic"][1],
        backward_traffic=traffic.bytes - taken["traffic"][0],
        backward_kernels=traffic.kernels - taken["traffic"][1],
        priced_calls=traffic.priced_calls.result(),
        moving_calls=traffic.moving_calls.result(),
    )


def profile_scaled(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    loss_fn: LossFn | None,
    autocast_dtype: torch.dtype | None,
) -> tuple[ActivationProfile, str]:
    """The profile of `batch` measured on real tensors, for a step fake tensors cannot run (an
    operation with data-dependent output, say): at one and two rows of the batch, every figure
    extended linearly to its full rows (activations and FLOPs are a constant plus a per-row
    term). A batch of at most two rows runs as it is, and so does one whose first rows do not
    run apart (a packed multimodal batch: Qwen2-VL's image patches of every row in one tensor,
    whose rows are not the batch's, cut with the image sizes and no longer matching them).
    Returns the profile and how it was made.

    Real memory used: one step's activations at two rows, or at the whole batch where its rows
    do not run apart."""
    rows = leading_rows(batch)
    if rows is None or rows <= 2:
        return profile_step(model, blocks, batch, loss_fn, autocast_dtype, real=True), (
            "measured on real tensors"
        )
    try:
        one, two = (
            profile_step(model, blocks, first_rows(batch, rows, n), loss_fn, autocast_dtype, True)
            for n in (1, 2)
        )
    except Exception as error:  # noqa: BLE001 - the whole batch runs, or its error is raised
        whole = profile_step(model, blocks, batch, loss_fn, autocast_dtype, real=True)
        return whole, (
            f"measured on real tensors at the whole batch (cut to its first rows it did not "
            f"run: {type(error).__name__}: {str(error)[:120]})"
        )

    def line(a: int, b: int) -> int:
        return max(0, a + (rows - 1) * (b - a))

    def lines(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(line(x, y) for x, y in zip(a, b, strict=True))

    scaled = replace(
        two,
        block_saved_bytes=lines(one.block_saved_bytes, two.block_saved_bytes),
        block_input_bytes=lines(one.block_input_bytes, two.block_input_bytes),
        block_cast_bytes=lines(one.block_cast_bytes, two.block_cast_bytes),
        block_shared_bytes=lines(one.block_shared_bytes, two.block_shared_bytes),
        before_saved_bytes=line(one.before_saved_bytes, two.before_saved_bytes),
        after_saved_bytes=line(one.after_saved_bytes, two.after_saved_bytes),
        largest_saved_bytes=line(one.largest_saved_bytes, two.largest_saved_bytes),
        backward_rise_bytes=line(one.backward_rise_bytes, two.backward_rise_bytes),
        rise_into_buffers_bytes=line(one.rise_into_buffers_bytes, two.rise_into_buffers_bytes),
        output_bytes=line(one.output_bytes, two.output_bytes),
        block_output_bytes=lines(one.block_output_bytes, two.block_output_bytes),
        carried_bytes=line(one.carried_bytes, two.carried_bytes),
        forward_rise_bytes=line(one.forward_rise_bytes, two.forward_rise_bytes),
        block_forward_peak_bytes=lines(one.block_forward_peak_bytes, two.block_forward_peak_bytes),
        block_carried_bytes=lines(one.block_carried_bytes, two.block_carried_bytes),
        block_output_left_bytes=lines(one.block_output_left_bytes, two.block_output_left_bytes),
        block_carried_left_bytes=lines(one.block_carried_left_bytes, two.block_carried_left_bytes),
        block_checkpointed_bytes=lines(one.block_checkpointed_bytes, two.block_checkpointed_bytes),
        block_checkpointed_into_buffers_bytes=lines(
            one.block_checkpointed_into_buffers_bytes, two.block_checkpointed_into_buffers_bytes
        ),
        block_forward_flops=lines(one.block_forward_flops, two.block_forward_flops),
        total_forward_flops=line(one.total_forward_flops, two.total_forward_flops),
        answers=tuple(agreed([dict(one.answers), dict(two.answers)]).items()),
        nonzero_found=found_together([one.nonzero_found, two.nonzero_found]),
        random_reads=tuple({**dict(one.random_reads), **dict(two.random_reads)}.items()),
        flops_by_own_formula=tuple(sorted({*one.flops_by_own_formula, *two.flops_by_own_formula})),
        flops_uncounted=tuple(sorted({*one.flops_uncounted, *two.flops_uncounted})),
        block_forward_traffic=lines(one.block_forward_traffic, two.block_forward_traffic),
        block_backward_traffic=lines(one.block_backward_traffic, two.block_backward_traffic),
        forward_traffic=line(one.forward_traffic, two.forward_traffic),
        backward_traffic=line(one.backward_traffic, two.backward_traffic),
        priced_calls=(),  # at two rows: not the batch's shapes, which their timing needs
        moving_calls=(),
    )  # operators run: as at two rows (a row more runs the same kernels, only larger)
    return scaled, f"measured on real tensors at 1 and 2 of its {rows} rows and scaled"


def _checkpointed(
    made: BackwardRise, attribution: _Attribution, n_blocks: int, into_buffers: bool
) -> tuple[int, ...]:
    """For each block, the most it would hold checkpointed beyond what is saved before the
    blocks and the inputs of those before it (`ActivationProfile.block_checkpointed_bytes`):
    while its forward runs again, its input, the gradient reaching it and what its forward
    made; then in its backward, its saved activations and what the backward holds beside
    them."""
    start, held = made.held_in_blocks(n_blocks, into_buffers)
    recomputed = made.forward_held(n_blocks)
    return tuple(
        max(
            attribution.inputs[i] + start[i] + recomputed[i],
            attribution.saved_by(i) + held[i],
        )
        for i in range(n_blocks)
    )


def _both(
    saved: Callable[[torch.Tensor], None], pack: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def packed(tensor: torch.Tensor) -> torch.Tensor:
        saved(tensor)
        return pack(tensor)

    return packed


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Step(nn.Module):
    """The user's model as a child (its names under `model.`), and a whole step of it as the
    forward: under `torch.func.functional_call` the model computes on the tensors put in its
    place until the step ends, backward included."""

    def __init__(self, model: nn.Module, step: Any) -> None:
        super().__init__()
        self.model = model
        self.step = step

    def forward(self) -> None:
        self.step(self.model)


def cast_as_fsdp2(
    model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`state` (`fake_state`'s) with the floating parameters cast to `dtype`, as FSDP2's
    `MixedPrecisionPolicy(param_dtype=dtype)` gathers them (`engines.shard_module`), but batch
    norms', which it keeps in fp32; each a leaf requiring a gradient where the parameter does
    (tied ones stay one tensor). Run it under the state's fake mode."""
    kept = {
        f"{name}.{leaf}" if name else leaf
        for name, sub in model.named_modules(remove_duplicate=False)
        if is_batch_norm(sub)
        for leaf, _ in sub.named_parameters(recurse=False)
    }
    made: dict[int, torch.Tensor] = {}
    cast = dict(state)
    for name, _ in model.named_parameters(remove_duplicate=False):
        tensor = state[name]
        if name in kept or not tensor.is_floating_point() or tensor.dtype == dtype:
            continue
        if id(tensor) not in made:
            made[id(tensor)] = tensor.detach().to(dtype).requires_grad_(tensor.requires_grad)
        cast[name] = made[id(tensor)]
    return cast


def _floating_to(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its floating tensors cast to `dtype`, as FSDP2 casts a module's inputs and
    (`output_dtype`) the root's outputs."""

    def to(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(to, tree)


def fake_state(
    mode: Any, model: nn.Module, batch: Any, device: torch.device | None
) -> tuple[dict[str, torch.Tensor], Any]:
    """The model's parameters and buffers by name, and the batch, as fake tensors of `mode`
    (parameters requiring a gradient where they do; tied ones stay one tensor).

    A tensor on meta (a what-if model, its batch moved there too) is made on `device` where one
    is given: the device its simulation runs on (`fake.simulated_on`). On meta, no kernel but
    the reference ones exists: attention runs its math path and saves its score matrices,
    where the CPU's and CUDA's fused kernels save a row statistic; and autocast does not apply
    to meta tensors, so a bf16 step is traced in fp32 (a Llama-shaped model at 1024 tokens:
    2.3x the activations, and each block's share is what the checkpointing formulas free).
    """
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if device is None or tensor.device.type != "meta":
            return mode.from_tensor(tensor)
        if id(tensor) not in made:  # tied parameters stay one tensor
            with mode:
                made[id(tensor)] = fake_tensor(mode, tensor, device)
        return made[id(tensor)]

    state = {
        n: fake(p).requires_grad_(p.requires_grad)
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    state.update({n: fake(t) for n, t in model.named_buffers(remove_duplicate=False)})

    def fake_input(tensor: torch.Tensor) -> torch.Tensor:
        made = fake(tensor)
        batch_value(mode, made, tensor)
        return made

    fake_batch = tree_map(lambda x: fake_input(x) if isinstance(x, torch.Tensor) else x, batch)
    return state, fake_batch


def _attribution_hooks(
    blocks: list[nn.Module],
    attribution: _Attribution,
    counter: Any,
    block_flops: list[int],
    traffic: Traffic,
) -> list[Any]:
    handles = []
    for index, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
            if attribution.closed:  # a checkpoint's recomputation, in backward
                return  # (the block's forward figures were taken in forward)
            attribution.enter(index)
            attribution.took(index, tensors_in((args, kwargs)))
            block_flops[index] -= counter.get_total_flops()  # += at its end: each call's
            traffic.enter(index)

        def post(module: nn.Module, args: Any, kwargs: Any, out: Any, index: int = index) -> None:
            if attribution.closed:  # its recomputed outputs start its backward
                traffic.mark(index, out)
                return
            attribution.leave()
            block_flops[index] += counter.get_total_flops()
            traffic.leave(index, out)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return handles


def autocast_for(device_type: str, dtype: torch.dtype | None) -> Any:
    """Autocast to `dtype` on `device_type` (mixed precision), or nothing where it is None."""
    return (
        torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    )


def device_type_of(model: nn.Module, device: torch.device | None = None) -> str:
    """The device type the model's step runs on; for a what-if model built on meta, `device`'s
    (`fake_state` makes its tensors there), or the CPU's."""
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":  # a what-if model built on meta
        return "cpu" if device is None else device.type
    return param.device.type


def _param_dtype(model: nn.Module) -> torch.dtype:
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


def extended(
    profile: ActivationProfile,
    block_names: list[str],
    source: dict[str, str],
    backward_source: dict[str, str] | None = None,
) -> ActivationProfile:
    """The profile of the model whose blocks are `block_names`, from one traced with some of
    them (`source` maps each block to the traced block that stands for it, `layout.Layout.source`;
    a traced block keeps its name): every block saves, takes and computes what its source did,
    and holds in its backward what its `backward_source` did (`layout.Layout.source`'s
    `backward`; default `source`). Every traced block's parameters must have had a gradient
    (`facts._profile` traces the whole model otherwise): the unused ones are the rest of the
    model's, as traced."""
    traced = list(dict.fromkeys(source[n] for n in block_names))  # the traced blocks, in order
    if len(traced) == len(block_names):
        return profile
    at = {name: i for i, name in enumerate(traced)}
    backward_source = backward_source or source

    def each(traced_figures: tuple[int, ...], by: dict[str, str] = source) -> tuple[int, ...]:
        if not traced_figures:  # a profile made without the figure
            return ()
        return tuple(traced_figures[at[by[n]]] for n in block_names)

    def whole(total: int, traced_figures: tuple[int, ...]) -> int:
        return total + sum(each(traced_figures)) - sum(traced_figures)

    return replace(
        profile,
        block_saved_bytes=each(profile.block_saved_bytes),
        block_input_bytes=each(profile.block_input_bytes),
        block_cast_bytes=each(profile.block_cast_bytes),
        block_shared_bytes=each(profile.block_shared_bytes),
        output_bytes=whole(profile.output_bytes, profile.block_output_bytes),
        block_output_bytes=each(profile.block_output_bytes),
        carried_bytes=whole(profile.carried_bytes, profile.block_carried_bytes),
        block_carried_bytes=each(profile.block_carried_bytes),
        block_output_left_bytes=each(profile.block_output_left_bytes),
        block_carried_left_bytes=each(profile.block_carried_left_bytes),
        block_forward_peak_bytes=each(profile.block_forward_peak_bytes),
        block_checkpointed_bytes=each(profile.block_checkpointed_bytes, backward_source),
        block_checkpointed_into_buffers_bytes=each(
            profile.block_checkpointed_into_buffers_bytes, backward_source
        ),
        block_forward_flops=each(profile.block_forward_flops),
        total_forward_flops=whole(profile.total_forward_flops, profile.block_forward_flops),
        block_forward_traffic=each(profile.block_forward_traffic),
        block_forward_kernels=each(profile.block_forward_kernels),
        block_backward_traffic=each(profile.block_backward_traffic),
        block_backward_kernels=each(profile.block_backward_kernels),
        forward_traffic=whole(profile.forward_traffic, profile.block_forward_traffic),
        forward_kernels=whole(profile.forward_kernels, profile.block_forward_kernels),
        backward_traffic=whole(profile.backward_traffic, profile.block_backward_traffic),
        backward_kernels=whole(profile.backward_kernels, profile.block_backward_kernels),
        priced_calls=tuple(  # in the order the whole model's trace gives them
            sorted(
                (replace(c, block_calls=each(c.block_calls)) for c in profile.priced_calls),
                key=order,
            )
        ),
        moving_calls=tuple(
            sorted(
                (replace(c, block_calls=each(c.block_calls)) for c in profile.moving_calls),
                key=moving_order,
            )
        ),
    )
