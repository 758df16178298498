"""Whether blocks the layout calls alike run the same operators (issue 24): the check that lets a
model be traced and simulated with a few periods of its blocks and extended.

`measure.alike` compares blocks by what they hold (classes, attributes, parameter shapes), which
tells sliding- from global-attention layers where each layer keeps its kind. A block can also
compute by its position alone: a forward that reads `self.layer_idx % 4`, a parent that calls
every sixth block with a longer sequence. Such blocks hold the same, and a shallow copy would run
only the first positions' kind: the extension would stand for blocks it never ran. So the whole
model's forward runs once on fake tensors (no memory, no backward), each block inside it on meta
tensors where it can (`operators_by_block`), and each block's operators are recorded (name, and each
output's shape and dtype) with what autograd saves for backward (a parent checkpointing its first
blocks, or running some without gradients, runs the same operators in them but saves otherwise:
Megatron's "block" recomputation), with those the model runs after it before the next (a parent
adding a mid-depth head after one block): every block, and what follows it, must run what the block
one period before it ran, from the third period on (the first two always run in the shallow copies,
so they may differ: a first layer fed by the embedding's dtype). What follows a list's last block
(the head, the next list) is its own."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoshard._batch import split_batch
from autoshard._torch_compat import (
    TorchDispatchMode,
    disable_current_modes,
    grouped_mm,
    grouped_mm_meta_output,
    reparametrized,
    tree_flatten,
    tree_leaves,
    tree_map,
)
from autoshard.measure.fake import fake_mode, wider_fake_kernels
from autoshard.measure.layout import SHALLOW, Layout
from autoshard.measure.trace import autocast_for, device_type_of, fake_state
from autoshard.wrap.snapshot import attributes_kept

logger = logging.getLogger("autoshard")

# A block's operators: each operator's name with its outputs' shapes and dtypes, in order
Operators = tuple[tuple[str, tuple[tuple[tuple[int, ...], str], ...]], ...]


def first_unlike(
    model: nn.Module,
    blocks: list[nn.Module],
    names: list[str],
    repeats: Layout,
    batch: Any,
    autocast_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> str | None:
    """Where two blocks that `repeats` extends one from the other run different operators, or
    the model runs different ones after them (a parent acting after the middle block): a
    sentence naming them and the first operator that differs; None where every block, and what
    follows it, runs its period's. Raises what the forward raises (the caller then trusts the
    attributes). `device`: where a model on meta runs (`trace.fake_state`)."""
    inside, after = operators_by_block(model, blocks, batch, autocast_dtype, device)
    at = {name: i for i, name in enumerate(names)}
    for stretch in repeats.stretches:
        if stretch.periods == 0:
            continue  # all lead: every block of it runs in each copy
        first = stretch.lead + (SHALLOW[0] - 1) * stretch.period  # the third period
        for i in range(first + stretch.period, len(stretch.names)):
            block, before = stretch.names[i], stretch.names[i - stretch.period]
            mine, theirs = inside[at[block]], inside[at[before]]
            if mine != theirs:
                return (
                    f"blocks {before} and {block} hold the same but run different operators "
                    f"({_first_difference(theirs, mine)})"
                )
            last = i == len(stretch.names) - 1  # what follows a list's last block is its own
            mine, theirs = after[at[block]], after[at[before]]
            if not last and mine != theirs:
                return (
                    f"the model runs different operators after blocks {before} and {block}, "
                    f"which hold the same ({_first_difference(theirs, mine)})"
                )
    return None


def operators_by_block(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    autocast_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> tuple[list[Operators], list[Operators]]:
    """The operators each of `blocks` runs in one forward of `batch`, and those run after it
    until the next block begins, each with what autograd saved (no backward: no memory is used
    and nothing of the model changes, its attributes put back).

    The model runs on fake tensors; each block inside it on meta tensors, its inputs and
    weights made there and its outputs made back, since this is the check's only cost that
    grows with depth and a meta operator costs a fraction of a fake one (no fake-tensor
    bookkeeping, no device query per operator). Where any block cannot run on meta (a routing
    that reads values, a tensor kept outside its parameters, a list it was given and appends
    to), every block runs on fake tensors again: each block is compared with another run the
    same way. What meta cannot tell apart: blocks that choose by their device (`x.is_cuda`)
    and by their position at once; and a tensor a block caches outside the model (a global
    table) is left there on meta, where it was left on fake tensors before."""
    try:
        return _recorded(model, blocks, batch, autocast_dtype, device, meta=True)
    except Exception:  # noqa: BLE001 - a block that cannot run on meta; fake tensors can
        logger.debug("the blocks could not run on meta; on fake tensors", exc_info=True)
    return _recorded(model, blocks, batch, autocast_dtype, device, meta=False)


def _recorded(
    model: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    autocast_dtype: torch.dtype | None,
    device: torch.device | None,
    meta: bool,
) -> tuple[list[Operators], list[Operators]]:
    mode = fake_mode()
    state, fake_batch = fake_state(mode, model, batch, device)
    device_type = device_type_of(model, device)
    recorder = _Recorder(len(blocks))
    handles = [
        hook
        for index, block in enumerate(blocks)
        for hook in (
            block.register_forward_pre_hook(lambda *_, i=index: recorder.enter(i)),
            block.register_forward_hook(lambda *_, i=index: recorder.leave(i)),
        )
    ]
    autocast = autocast_for(device_type, autocast_dtype)
    on_meta = _OnMeta(mode, recorder, device, device_type)
    try:
        # with autograd, and what it saves recorded: a block the parent checkpoints or runs
        # without gradients by its position runs the same operators but saves otherwise
        with (
            attributes_kept(model),
            contextlib.ExitStack() as blocks_on_meta,
            wider_fake_kernels(device_type),
            mode,
            recorder,
            torch.autograd.graph.saved_tensors_hooks(recorder.saved, _nothing),
            autocast,
        ):
            if meta:
                for block in {id(b): b for b in blocks}.values():
                    blocks_on_meta.enter_context(on_meta.running(block))
            args, kwargs = split_batch(fake_batch)
            torch.func.functional_call(model, state, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if on_meta.failed is not None:  # raised inside a block, and caught by the model
        raise RuntimeError(f"a block could not run on meta ({on_meta.failed})")
    return [tuple(ran) for ran in recorder.inside], [tuple(ran) for ran in recorder.after]


class _OnMeta:
    """Runs blocks on meta tensors inside a forward on fake tensors: each call's inputs and the
    block's parameters and buffers made on meta (strides, dtypes and gradients kept; an input
    that is not a leaf stays one, so that an in-place operator on it runs), the fake mode set
    aside while the block runs and the recorder kept, tensors made without a device made on
    meta (no memory, no draw from the user's random generator), autocast's casts made as it
    makes them (`_Autocast`), and the outputs made back as fake tensors on the device of the
    block's (first floating-point) input. `failed`: what a block raised, which makes every later
    block raise too (kept as text: an exception would hold the frames, and through them the
    user's parameters, in a reference cycle)."""

    def __init__(
        self, mode: Any, recorder: _Recorder, device: torch.device | None, device_type: str
    ) -> None:
        self.mode, self.recorder, self.device = mode, recorder, device
        self.autocast = _Autocast(device_type)
        self.failed: str | None = None
        # by id: (fake, meta); the fake one kept so that its id is no other tensor's
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextlib.contextmanager
    def running(self, block: nn.Module) -> Iterator[None]:
        forward = block.forward
        own = "forward" in vars(block)

        @functools.wraps(forward)  # its signature kept: a parent may read it
        def on_meta(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._call(block, forward, args, kwargs)
            except Exception as error:
                self.failed = self.failed or f"{type(error).__name__}: {error}"
                raise

        block.forward = on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            if own:
                block.forward = forward  # type: ignore[method-assign]
            else:
                del block.forward

    def _call(self, block: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self.failed is not None:
            raise RuntimeError(f"an earlier block could not run on meta ({self.failed})")
        made: dict[int, torch.Tensor] = {}
        with disable_current_modes():
            fakes = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = tree_map(lambda t: self._meta(t, made), (args, kwargs))
            given, layout = tree_flatten(inputs)
            weights = {
                name: self._weight(t)
                for named in (block.named_parameters, block.named_buffers)
                for name, t in named(remove_duplicate=False)
            }
            with (
                self.recorder,
                self.autocast,
                reparametrized(block, weights),
                torch.device("meta"),
            ):
                out = forward(*inputs[0], **inputs[1])
            # The containers it was given are copies: what a block put in them (a list of
            # hidden states the parent reads, a key for the next block) its parent never sees
            left, left_layout = tree_flatten(inputs)
            if left_layout != layout or any(a is not b for a, b in zip(left, given, strict=True)):
                raise RuntimeError("a block changed the containers it was given")
            floating = [t for t in fakes if t.is_floating_point()] or fakes
            device = floating[0].device if floating else self.device or torch.device("cpu")
            with self.mode:
                return tree_map(lambda t: self._fake(t, device), out)

    def _weight(self, tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in self.weights:  # tied weights stay one tensor
            self.weights[id(tensor)] = (tensor, self._meta(tensor, {}))
        return self.weights[id(tensor)][1]

    @staticmethod
    def _meta(tensor: Any, made: dict[int, torch.Tensor]) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if id(tensor) not in made:
            meta = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
            ).requires_grad_(tensor.requires_grad)
            made[id(tensor)] = meta if tensor.is_leaf else meta.clone()
        return made[id(tensor)]

    @staticmethod
    def _fake(tensor: Any, device: torch.device) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
        fake.requires_grad_(tensor.requires_grad)
        return fake.clone() if tensor.requires_grad and not tensor.is_leaf else fake


class _Recorder(TorchDispatchMode):
    """Records each operator run inside a block under that block, and each run between blocks
    under the block before; device queries (`prim.device`, one per fake tensor an operator
    meets) are no operators."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.inside: list[list[Any]] = [[] for _ in range(n_blocks)]
        self.after: list[list[Any]] = [[] for _ in range(n_blocks)]
        self.ran: list[Any] | None = None  # where the operator run now goes; None: before any

    def enter(self, index: int) -> None:
        self.ran = self.inside[index]

    def leave(self, index: int) -> None:
        self.ran = self.after[index]

    def saved(self, tensor: torch.Tensor) -> None:
        """Saved for backward (nothing is kept: no backward runs)."""
        if self.ran is not None:
            self.ran.append(("saved for backward", ((tuple(tensor.shape), str(tensor.dtype)),)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _GROUPED_MM and _on_meta_in_fp32(*args, **(kwargs or {})):
            out = _grouped_mm_output(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if self.ran is not None and func is not _DEVICE:
            outputs = tuple(
                (tuple(t.shape), str(t.dtype))
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor)
            )
            self.ran.append((str(func), outputs))
        return out


_DEVICE = torch.ops.prim.device.default


class _Autocast(TorchFunctionMode):
    """Autocast's casts, made for a block on meta, where autocast does not apply: where it is on,
    the floating-point inputs (fp64 aside) of each torch function it runs in lower precision are
    cast to its dtype, and of each it runs in fp32 to fp32, above autograd as autocast casts
    (the casts recorded, and what autograd saves the cast tensors). Without them a block that
    casts by its position (`y.float()` in every eighth, a branch on `y.dtype`) would run what
    the others run. From torch's lists of autocast's operators (the amp documentation's "Autocast
    Op Reference"), by the name of the torch function or Tensor method; a function made of
    others (einsum of bmm) by its parts' list. Other operators run on their inputs' dtypes, as
    autocast's "promote" ones then do."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.lower, self.fp32 = _AUTOCAST.get(device_type, _AUTOCAST["cuda"])

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if torch.is_autocast_enabled(self.device_type):
            name = getattr(func, "__name__", "")
            cast_to = (
                torch.get_autocast_dtype(self.device_type)
                if name in self.lower
                else torch.float32
                if name in self.fp32
                else None
            )
            if cast_to is not None:
                args, kwargs = tree_map(lambda t: _cast(t, cast_to), (args, kwargs))
        return func(*args, **kwargs)


def _cast(tensor: Any, dtype: torch.dtype) -> Any:
    eligible = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    if not eligible or tensor.dtype in (dtype, torch.float64):
        return tensor
    return tensor.to(dtype)


_LOWER = frozenset(
    {
        "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "addmm", "addmv",
        "addr", "addbmm", "baddbmm", "chain_matmul", "multi_dot", "einsum", "tensordot",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "conv_tbc", "prelu", "scaled_dot_product_attention",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    }
)  # fmt: skip
_FP32_BOTH = frozenset(  # in fp32 on CUDA and on the CPU alike: losses, cdist, prod
    {
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "cdist", "prod",
    }
)  # fmt: skip
_AUTOCAST: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cuda": (
        _LOWER,
        _FP32_BOTH
        | {
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
            "layer_norm", "group_norm", "norm", "normalize", "cosine_similarity", "softmax",
            "softmin", "log_softmax", "cumsum", "cumprod", "sum", "dist", "pdist", "renorm",
            "logsumexp",
        },
    ),
    "cpu": (
        _LOWER,
        _FP32_BOTH
        | {
            "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "grid_sample", "quantile",
            "nanquantile", "stft", "trace", "cholesky", "inverse", "pinverse",
        },
    ),
}  # fmt: skip


# `torch._grouped_mm` (transformers 5's mixture-of-experts layers): its meta kernel takes bf16
# only, the CUDA kernel's constraint, and autocast, which makes the inputs bf16 on the GPU, does
# not apply to meta tensors. Its output is made as the fake kernel makes it (`measure.fake`).
_GROUPED_MM = grouped_mm()


def _on_meta_in_fp32(mat_a: torch.Tensor, mat_b: torch.Tensor, *_: Any, **__: Any) -> bool:
    on_meta = type(mat_a) is torch.Tensor and mat_a.device.type == "meta"  # not a fake one
    return on_meta and (mat_a.dtype, mat_b.dtype) != (torch.bfloat16, torch.bfloat16)


def _grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return grouped_mm_meta_output(mat_a, mat_b, offs, out_dtype)


def _first_difference(a: Operators, b: Operators) -> str:
    for x, y in zip(a, b, strict=False):
        if x != y:
            return f"{_said(x)} against {_said(y)}"
    longer, count = (a, len(b)) if len(a) > len(b) else (b, len(a))
    return f"{len(longer) - count} more operator(s), the first {_said(longer[count])}"


def _said(op: tuple[str, tuple[tuple[tuple[int, ...], str], ...]]) -> str:
    name, outputs = op
    return f"{name} -> " + ", ".join(f"{list(shape)} {dtype}" for shape, dtype in outputs)


def _nothing(packed: None) -> torch.Tensor:
    raise RuntimeError("the operator check runs no backward")
