"""Measure what one training step of `example_batch` holds, without real memory.

The model the user built is traced as it is: its parameters and the batch are converted to fake
tensors (`FakeTensorMode.from_tensor` allocates nothing) and the step runs through
`torch.func.functional_call`, so no copy of the model is made and none of its tensors change.
What is measured:

- the bytes autograd saves for backward, attributed to the block that saved them (saved-tensor
  hooks, storages deduplicated), and each block's input bytes: with these the activation memory of
  any number of checkpointed blocks is derived without tracing again;
- forward FLOPs per block (`FlopCounterMode`), the compute term of the cost model and the price of
  recomputing a checkpointed block. No FLOP formula can abort the trace (`_FlopFormulas`): the
  activations matter more than the count;
- the bytes read and written by the operators without a FLOP formula, and the operators run
  (`_Traffic`), per block and whole, forward and backward: the memory-bound and the launch-bound
  parts of the modelled step;
- the forward's FLOP-bound calls, each with its arguments' shapes and where it ran
  (`measure.priced`): what `measure.rates` runs again on the device for the model's own FLOP/s.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._batch import (
    LossFn,
    compute_loss,
    first_rows,
    leading_rows,
    split_batch,
    tensors_in,
)
from autoshard._torch_compat import (
    TorchDispatchMode,
    flop_formulas,
    grouped_mm,
    in_backward,
    is_batch_norm,
    op_overload,
    raw_flop_formula,
    sdpa_flop_ops,
    storage_key,
    tree_leaves,
    tree_map,
)
from autoshard.decide.profile import ActivationProfile
from autoshard.measure.answers import Recorder, agreed, found_together
from autoshard.measure.fake import batch_value, fake_mode, fake_tensor, wider_fake_kernels
from autoshard.measure.priced import MovingCalls, PricedCalls, moving_order, order
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
        # the tensors saved of each storage counted: a storage whose saved tensors are all gone
        # was freed (a branch whose graph forward dropped: routing scores reduced to indices),
        # and a later storage may take its address, its key (DeepSeek-V3's blocks then went
        # from 451,872 to 417,568 B, differing from run to run)
        self.saved: dict[int, list[weakref.ref[torch.Tensor]]] = {}
        self.closed = False  # forward done: what backward saves (a recomputation) is not counted

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if self.closed or key in self.existing:
            return tensor
        # a detached alias is what autograd keeps: returning the tensor itself makes a saved
        # output (sigmoid's, softmax's) hold its own grad_fn, a cycle no collector breaks
        tensor = tensor.detach()
        saved = self.saved.setdefault(key, [])
        alive = any(ref() is not None for ref in saved)
        saved.append(weakref.ref(tensor))
        if alive:  # the same storage, counted
            return tensor
        if self.current is not None:
            self.owner[key] = self.current
        else:
            self.owner[key] = "after" if self.after_blocks else "before"
        self.nbytes[key] = storage.nbytes()
        return tensor

    def forward_done(self) -> None:
        """Leaves out the storages freed in forward (their saved tensors all gone): nothing of
        them is saved for backward."""
        for key, saved in self.saved.items():
            if all(ref() is None for ref in saved):
                self.owner.pop(key, None)
                self.nbytes.pop(key, None)
        self.closed = True

    def enter(self, index: int) -> None:
        self.current = index

    def leave(self) -> None:
        self.current = None
        self.after_blocks = True

    def saved_by(self, owner: int | str) -> int:
        return sum(self.nbytes[k] for k, o in self.owner.items() if o == owner)


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
    made = _Made()
    hooks = [
        t.register_post_accumulate_grad_hook(made.gradient)
        for t in {id(t): t for t in state.values() if t.requires_grad}.values()
    ]
    attribution = _Attribution(len(blocks), existing)
    block_flops = [0] * len(blocks)
    formulas = _FlopFormulas()
    priced = formulas.mapping()
    counter = FlopCounterMode(display=False, custom_mapping=priced)
    counter.mod_tracker = _TotalsOnly()  # type: ignore[assignment]
    traffic = _Traffic(len(blocks), frozenset(priced), counter.get_total_flops)
    handles = _attribution_hooks(blocks, attribution, counter, block_flops, traffic)
    device_type = device_type_of(model, None if real else device)
    autocast = autocast_for(device_type, None if cast else autocast_dtype)
    cast_to = autocast_dtype if cast else None
    taken: dict[str, Any] = {}  # the forward's figures, taken before backward

    def step(model: nn.Module) -> None:
        with autocast:
            args, kwargs = split_batch(fake_batch)
            if cast_to is not None:
                args, kwargs = _floating_to((args, kwargs), cast_to)
            output = model(*args, **kwargs)
            if cast_to is not None:
                output = _floating_to(output, torch.float32)
        loss = compute_loss(output, fake_batch, loss_fn)
        taken["flops"] = counter.get_total_flops()
        taken["traffic"] = traffic.bytes, traffic.kernels
        # Only forward FLOPs are kept: an operator miscounted in backward changes no figure.
        taken["formulas"] = sorted(formulas.by_own), sorted(formulas.uncounted)
        attribution.forward_done()
        traffic.in_forward = False
        loss.backward()

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
        before_saved_bytes=attribution.saved_by("before"),
        after_saved_bytes=attribution.saved_by("after"),
        largest_saved_bytes=max(sizes, default=0),
        backward_rise_bytes=made.rise(),
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
        before_saved_bytes=line(one.before_saved_bytes, two.before_saved_bytes),
        after_saved_bytes=line(one.after_saved_bytes, two.after_saved_bytes),
        largest_saved_bytes=line(one.largest_saved_bytes, two.largest_saved_bytes),
        backward_rise_bytes=line(one.backward_rise_bytes, two.backward_rise_bytes),
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


class _FlopFormulas:
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
            own[grouped.overloadpacket] = _grouped_mm_flops
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


def _grouped_mm_flops(args: tuple[Any, ...]) -> int | None:
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


_ADD = torch.ops.aten.add.Tensor


def _stored(tensor: Any) -> bool:
    """Whether `tensor` is a plain strided tensor with a storage of its own to follow (not a
    sparse gradient, whose storage torch refuses, nor a DTensor)."""
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, DTensor)
        and tensor.layout is torch.strided
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


_UNSAFE_VIEW = op_overload("_unsafe_view")  # the reshape after a batched matmul


class _Made(TorchDispatchMode):
    """How far the bytes the step holds rise in backward above where they stood as it began
    (`rise`): the storages operators make in backward (not their inputs' views or in-place
    results), each from its making to its freeing, less the saved activations freed meanwhile
    (`saved`), the parameters' gradients left out (`gradient`). Forward's operators pass
    straight through."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (allocation, bytes: + made, - freed)
        self.alive: dict[int, int] = {}  # storage made in backward -> its allocation
        self.grads: set[int] = set()  # allocations that were a parameter's gradient
        self._sums: dict[int, tuple[int, ...]] = {}  # a sum's allocation -> its terms'
        self._saved: set[int] = set()  # the saved activations' storages
        self._made = itertools.count()
        self._backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not in_backward():
            return out
        self._backward = True
        inputs: set[int] | None = None  # their storages, found where an output needs them
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not _stored(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key in self.alive:
                continue
            if inputs is None:
                inputs = {
                    storage_key(t.untyped_storage())
                    for t in tree_leaves((args, kwargs))
                    if _stored(t)
                }
            if key in inputs:
                continue
            made, size = next(self._made), storage.nbytes()
            self.alive[key] = made
            self.events.append((made, size))
            weakref.finalize(storage, self._freed, key, made, size)
            if func is _ADD:  # the engine summing a tensor's gradients, or a formula
                self._sums[made] = tuple(
                    self.alive[k]
                    for t in args
                    if _stored(t) and (k := storage_key(t.untyped_storage())) in self.alive
                )
        return out

    def saved(self, tensor: torch.Tensor) -> None:
        """A tensor saved for backward (a `saved_tensors_hooks` pack hook): its storage's
        freeing in backward counts off."""
        if not _stored(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key not in self._saved:
            self._saved.add(key)
            weakref.finalize(storage, self._freed, key, next(self._made), storage.nbytes())

    def gradient(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (`register_post_accumulate_grad_hook`): its
        storage is the gradients', and so are the terms it was summed from (a parameter used
        twice: its first gradient waits for the second)."""
        grad = param.grad
        if grad is None or not _stored(grad):
            return
        made = self.alive.get(storage_key(grad.untyped_storage()))
        terms = [] if made is None else [made]
        while terms:
            term = terms.pop()
            if term not in self.grads:
                self.grads.add(term)
                terms.extend(self._sums.get(term, ()))

    def _freed(self, key: int, made: int, size: int) -> None:
        if self.alive.get(key) == made:
            del self.alive[key]
        self._saved.discard(key)
        if self._backward:
            self.events.append((made, -size))

    def rise(self) -> int:
        """How far the bytes held rose in backward, from where they stood as it began."""
        held = peak = 0
        for made, size in self.events:
            if made not in self.grads:
                held += size
                peak = max(peak, held)
        return peak


class _Traffic(TorchDispatchMode):
    """Counts the operators run (kernels: views, which move nothing, left out) and the bytes
    read and written by those without a FLOP formula (`_FlopFormulas`: matmuls, convolutions,
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
        self.marked: set[Any] = set()  # autograd nodes that start a block's backward

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
            if node is not None and node not in self.marked:
                self.marked.add(node)
                node.register_prehook(lambda grads, index=index: self._backward_of(index))

    def _backward_of(self, index: int) -> None:
        self.backward_in = index

    def done(self) -> None:
        self.marked.clear()
        self.backward_in = None


def _attribution_hooks(
    blocks: list[nn.Module],
    attribution: _Attribution,
    counter: Any,
    block_flops: list[int],
    traffic: _Traffic,
) -> list[Any]:
    handles = []
    for index, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
            if attribution.closed:  # a checkpoint's recomputation, in backward
                return  # (the block's forward figures were taken in forward)
            attribution.enter(index)
            attribution.inputs[index] += sum(
                t.untyped_storage().nbytes()
                for t in tensors_in((args, kwargs))
                if t.is_floating_point()
            )
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
    profile: ActivationProfile, block_names: list[str], source: dict[str, str]
) -> ActivationProfile:
    """The profile of the model whose blocks are `block_names`, from one traced with some of
    them (`source` maps each block to the traced block that stands for it, `layout.Layout.source`;
    a traced block keeps its name): every block saves, takes and computes what its source did.
    Every traced block's parameters must have had a gradient (`facts._profile` traces the whole
    model otherwise): the unused ones are the rest of the model's, as traced."""
    traced = list(dict.fromkeys(source[n] for n in block_names))  # the traced blocks, in order
    if len(traced) == len(block_names):
        return profile
    at = {name: i for i, name in enumerate(traced)}

    def each(traced_figures: tuple[int, ...]) -> tuple[int, ...]:
        if not traced_figures:  # a profile made without the figure
            return ()
        return tuple(traced_figures[at[source[n]]] for n in block_names)

    def whole(total: int, traced_figures: tuple[int, ...]) -> int:
        return total + sum(each(traced_figures)) - sum(traced_figures)

    return replace(
        profile,
        block_saved_bytes=each(profile.block_saved_bytes),
        block_input_bytes=each(profile.block_input_bytes),
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
