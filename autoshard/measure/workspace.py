"""Kernel workspace and the backend's buffers: memory a kernel or a collective takes from the
allocator for itself and gives back before it returns (oneDNN's reorders and scratchpad on CPU,
cuDNN's workspace on CUDA, gloo's copies of a collective's tensors).

Trackers at the dispatcher see a kernel's inputs and outputs only, and fake tensors run no kernel
at all, so the simulation cannot see it; the allocator can, and the job's peak includes it.
Measured on torch 2.13's CPU build (this machine has no native bf16): a bf16 3x3 convolution over a
16x16x32x32 input holds 4.5 MiB beyond its 0.5 MiB output, which put a checkpointed ResNet's
estimate 35% under its peak.

For the operators known to use a workspace (`OPERATORS`; losses and others that compute through
operators of their own, `COMPOSED`; `MATMULS` and `ACCUMULATIONS` in bf16 or fp16 on CPU;
reductions that convert their input on CPU, and every reduction on CUDA; any operator but an
elementwise one, a reduction or a view given an expanded tensor, which it may copy:
`copies_expanded`), each distinct call (operator, shapes, strides, dtypes, other arguments) is
run once for real on the planned device, on zero-filled tensors (or, where the workspace depends
on the values, `FILLERS`, on values that take the kernel's hungriest path), and the bytes it
held beyond its outputs are measured: on CUDA from the allocator's peak statistics, on CPU from
the profiler's memory events (the CPU allocator keeps no statistics). The default random
generators are left as they were (fused attention draws its dropout from them).
Inside the simulation each such call then allocates a fake block of that size for its duration,
so the tracker counts it at the moment it happens. Where the planned device is not this machine's
(what-if planning for CUDA without a GPU) nothing can be run, and the count of unmeasured calls is
reported instead.

Collectives: the simulation's process group is a fake one whose collectives do nothing, while
gloo, the backend of a job on CPU, copies through buffers of its own (torch 2.13, measured with
the profiler on 2 ranks; `tests/test_workspace.py` measures it again): `_allgather_base_` (FSDP2's
all-gather) allocates a block the size of its output, and its worker thread another once the
first is freed; `_reduce_scatter_base_` (FSDP2's gradient reduce-scatter) clones its input;
all-reduce and broadcast (DDP, HSDP's replicas) allocate nothing. So on CPU each simulated
all-gather holds a block of its output's size, and each reduce-scatter one of its input's size,
for the duration of the call: whisper's FULL_SHARD peak on 2 gloo ranks is at a backward
all-gather and holds that block (0.19 MiB, 5% of its peak). NCCL copies nothing through the
caching allocator; on CUDA nothing is added.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import (
    TorchDispatchMode,
    allocation_tag,
    argument_of,
    disable_current_modes,
    missing,
    mutates,
    op_overload,
    profiler_enabled,
    tree_flatten,
    tree_map,
)
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

aten = torch.ops.aten
# col2im (`F.fold`, and `F.unfold`'s backward): the CPU and the CUDA kernel alike (torch 2.11 to
# 2.15) make the output like the input (`at::empty_like`), then resize it down to the output's
# shape, and a storage never shrinks: the output holds a buffer the size of its input, 9 times
# its own for 3 x 3 patches, for as long as it lives. Fake tensors run torch's decomposition,
# whose output is its own size: a fold's forward and backward read 55% under the allocator's
# peak, an unfold's 29%. Its output in the simulation is a view of a buffer the input's size, on
# any device (what-if plans too); what it holds during the call (a contiguous copy of an input
# that is not) is probed as the others' is.
COL2IM = aten.col2im.default

# Fused attention, forward and backward: the CPU kernel's backward holds 1.06 to 1.13 times its
# query's size beyond its gradients (torch 2.13, 8 x 4 heads x 64 to 512 tokens x 64, fp32; a
# small model's estimate read 11% under the allocator's peak), its forward 0.06 times. The CUDA
# kernels allocate theirs through the caching allocator too (flash attention's backward
# accumulates the query's gradient in fp32); measured on the device as the others are.
ATTENTION = tuple(
    op_overload(name)
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    )
)

# Operators whose kernels allocate beyond their outputs (measured, see the module docstring):
# convolution forward and backward (oneDNN reorders; cuDNN workspace), batch-norm backward (a
# buffer the size of its input on CPU), the matrix exponential (its approximant's powers, see
# `FILLERS`; also its backward's), the decompositions LAPACK (cuSOLVER on CUDA) computes on a
# copy of their input and a workspace of their own, and kernels that copy their input. Beyond
# their outputs, on one 256x256 fp32 matrix on CPU (torch 2.13), in matrices of its size: eig
# 3.5, pinv 3.0, eigh 2.0, cdist's matrix-product form (`_euclidean_dist`) 2.0, svd 1.05, inv
# 1.0, kthvalue 1.0, qr 0.38, householder_product 0.38; im2col (`F.unfold`, and fold's
# backward) a buffer the size of its input, which it outgrows. None of it was in the estimate
# (cholesky, solve, det, slogdet, cdist's direct form, sort, topk, median and mode hold
# nothing; col2im's output keeps its input's buffer: `COL2IM`). The FFT (pocketfft on CPU,
# cuFFT's work area on CUDA): over a dimension other than the last its CPU kernel copies its input
# (an rfft over the sequence of 32 x 128 x 64 fp32 held 1 MiB, its backward's complex transform
# 2 MiB; a model of one such layer read 22% under the allocator's peak), over the last nothing.
# `_safe_softmax`, the softmax of attention's math path (`scaled_dot_product_attention` where no
# fused kernel takes the call: a mask that needs a gradient, as Doge's, query and value heads of
# two sizes, as DeepSeek's): one kernel to the dispatcher, whose body makes a boolean mask of
# its input's size (a quarter of an fp32 attention matrix) and its rows' `all` beside the
# softmax; a checkpointed block's recomputation puts it at the backward's peak (Doge and
# DeepSeek-V3 on CPU, every block checkpointed: 2.7% and 2.4% under the allocator's peak).
# Resampling an image (`F.interpolate`, `UPSAMPLING`): on CPU, twice the size of an 8x64x32x32
# input laid out NCHW, nearest, nearest-exact and bilinear held 5 times the input beyond their
# output (channels-last, or three times the size: nothing), bilinear down to half 1.25 times,
# antialiased bilinear twice (fp32 and bf16 alike; 1d and 3d, bicubic: next to nothing); a
# decoder upsampling its features (a U-Net's, an FPN's) peaks there. `roll` over k dimensions
# rolls one at a time through k - 1 copies (Swin's shifted windows roll over two: one copy of the
# hidden states). `isinf` compares the absolute values' copy.
# Any other operator is passed through untouched, but for an expanded input (`copies_expanded`).
UPSAMPLING = (
    aten.upsample_nearest1d.default,
    aten.upsample_nearest2d.default,
    aten.upsample_nearest3d.default,
    aten.upsample_linear1d.default,
    aten.upsample_bilinear2d.default,
    aten.upsample_bicubic2d.default,
    aten.upsample_trilinear3d.default,
    *map(op_overload, ("_upsample_nearest_exact1d", "_upsample_nearest_exact2d")),
    *map(op_overload, ("_upsample_nearest_exact3d", "_upsample_bilinear2d_aa")),
    op_overload("_upsample_bicubic2d_aa"),
)
OPERATORS = frozenset(
    op
    for op in (
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.native_batch_norm_backward.default,
        aten.linalg_matrix_exp.default,
        aten.linalg_eig.default,
        aten.linalg_pinv.default,
        aten.linalg_pinv.atol_rtol_float,
        aten.linalg_pinv.atol_rtol_tensor,
        op_overload("_linalg_eigh"),
        op_overload("_euclidean_dist"),
        op_overload("_linalg_svd"),
        aten.linalg_inv_ex.default,
        aten.linalg_qr.default,
        aten.linalg_householder_product.default,
        aten.kthvalue.default,
        aten.im2col.default,
        COL2IM,
        getattr(aten, "cudnn_batch_norm_backward", None),
        getattr(aten, "miopen_batch_norm_backward", None),
        *ATTENTION,
        *(op_overload(name) for name in ("_fft_r2c", "_fft_c2c", "_fft_c2r", "_safe_softmax")),
        *UPSAMPLING,
        aten.roll.default,
        aten.isinf.default,
    )
    if op is not None
)
# Matrix products in bf16 or fp16 on CPU: without native bf16 the kernel converts its operands
# through fp32 buffers of its own. Transformers' ViT under bf16 autocast on 2 ranks peaks in
# backward during one, 1.3% (91 KB) above the simulated peak, which read exact in fp32. Measured
# only there: on CUDA cuBLAS's workspace is counted apart (`measure.cublas`), and an fp32 product
# on CPU holds nothing, so probing it would only slow `prepare` down.
MATMULS = frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default))
# Index and scatter accumulation in bf16 or fp16 on CPU, in place: the kernel accumulates through
# fp32 buffers of its own (torch 2.13: `index_add_` over the last dimension of a 4x8x32x256 bf16
# tensor held twice its output beside it, over the first half of it; in fp32 nothing), which a
# forward that accumulates in place (an MoE layer summing its experts) holds. Not the functional
# forms: a backward formula calls them on fake tensors where the real step calls the in-place
# one (`index_select`'s, for a tensor subclass), so the simulation already holds a copy the real
# step does not; XLNet's relative shift under FSDP2 in bf16, every block checkpointed, reads
# 4.1% under the allocator's peak on CPU for that reason, and would read over it with the
# buffer added as well.
ACCUMULATIONS = frozenset((aten.index_add_.default, aten.scatter_add_.default))
REDUCED = (torch.bfloat16, torch.float16)
# CUDA's in-place kernels that the backward of `masked_select`, advanced indexing, `gather` and
# `index_select` call (their plain-tensor branch, `wrap.branches`), probed on CUDA only (on CPU
# they hold nothing beyond `ACCUMULATIONS`' buffers). `masked_scatter_` makes a prefix sum of
# the mask, an int64 per element of its destination, for the call (`masked_scatter__cuda`,
# torch 2.11 to 2.15): 2x fp32 logits picked with a boolean mask, 4x bf16 ones; `index_put_`
# with `accumulate` sorts its indices (int64 copies) and copies its values where the indexed
# dimensions are not adjacent (`index_put_with_sort_kernel`). Out of place the simulation held a
# copy of the destination, which hid part of it; in place nothing was probed.
CUDA_IN_PLACE = frozenset(
    op
    for op in (
        aten.masked_scatter_.default,
        aten.index_put_.default,
        op_overload("_index_put_impl_"),
        aten.index_add_.default,
        aten.scatter_add_.default,
    )
    if op is not None
)
# Operators whose kernel makes a dense copy of an input not laid out contiguously, for the call:
# softmax, log-softmax, layer norm and RMS norm, forward and backward (torch 2.13's CPU build,
# a 4x512x64 fp32 input transposed from 4x64x512: each held one copy of it beyond its outputs;
# GELU, group norm, sums, cumsum and sort none; the CUDA kernels call `contiguous()` alike). A
# convolutional feature encoder normalising over channels (wav2vec2's "layer" norm: a conv's
# output transposed into layer norm, data2vec-audio's and the large speech models') read 3.7% to
# 4.6% under the allocator's peak. Probed where an input is not contiguous.
CONTIGUOUS_COPIES = frozenset(
    op
    for op in (
        *map(op_overload, ("_softmax", "_log_softmax")),
        *map(op_overload, ("_softmax_backward_data", "_log_softmax_backward_data")),
        aten.native_layer_norm.default,
        aten.native_layer_norm_backward.default,
        *map(op_overload, ("_fused_rms_norm", "_fused_rms_norm_backward")),
    )
    if op is not None
)
# Elementwise operators on CPU given tensors of more than one dtype (a residual stream in fp32
# plus a layer's bf16 output under autocast, a boolean mask multiplied in): TensorIterator copies
# each input not of the common dtype into a temporary of it for the call
# (`promote_inputs_to_common_dtype`; on the CPU only, CUDA's kernels cast as they load). Torch
# 2.13, a 4x32x32 fp32 tensor plus a bf16 one, either way round, or times a boolean or int64 one:
# a 16,384 B copy; a bf16 one plus an fp32 row broadcast over it: its own copy, 16,384 B. A
# random-zoo model under bf16 autocast on one thread held such a copy at its forward's peak,
# which read 5,684 B under the allocator's (with two threads a matrix product's larger workspace
# hid it). Probed where they meet (`promotes`; a tensor of no dimensions is copied too, but that
# is one element); not where the call writes into an argument (in place, `out=`: checking a
# probe's size runs the call once on the fake arguments).

# Kernels that compute through other operators of their own, which the dispatcher (and so the
# tracker) sees as one call and fake tensors run as one: what they hold between them is the
# kernel's. Losses reduced to a number keep the unreduced loss (`mse_loss(x, y)` the squared
# differences), logsumexp `x - max`, dist `x - y`, renorm the norms' copy. Torch 2.13's CPU build,
# 4x32x64 inputs, beyond their outputs, in inputs' sizes: fp32 mse, smooth-L1 and Huber 1.0,
# binary cross-entropy with logits 2.0, logsumexp 1.03, dist 1.0, soft-margin's backward 2.0;
# bf16 (the mean through an fp32 copy, below) mse, smooth-L1 and Huber 3.0, binary
# cross-entropy and soft-margin 2.0, renorm 2.0. Without them and the buffer the result keeps
# (`KEEPS_UNREDUCED`), a model trained on its output's mse read 24% under the allocator's peak in
# fp32, 12% in bf16. On CUDA the same kernels hold the same intermediates: probed there as
# anywhere. Those that decompose before the dispatcher sees them (`l1_loss`, `kl_div`,
# `cosine_similarity`, cross-entropy's log-softmax and NLL) are seen piece by piece.
COMPOSED = frozenset(
    (
        aten.mse_loss.default,
        aten.smooth_l1_loss.default,
        aten.huber_loss.default,
        aten.soft_margin_loss.default,
        aten.soft_margin_loss_backward.default,
        aten.binary_cross_entropy.default,
        aten.binary_cross_entropy_with_logits.default,
        aten.multi_margin_loss.default,
        aten.logsumexp.default,
        aten.dist.default,
        aten.renorm.default,
    )
)
# Of those, the losses whose reduced output (one number) keeps the buffer the unreduced loss was
# written into: mse and smooth-L1 (their structured kernel sizes the output for the elementwise
# loss, then resizes it to no dimensions, and a storage never shrinks), soft-margin and binary
# cross-entropy (`resize_as_` of an output made like the input), CPU and CUDA kernels alike
# (torch 2.11 to 2.15). The loss a loop holds (`loss = F.mse_loss(out, target)`) holds as much as
# the model's output; fake kernels give it 4 bytes. Huber's, made apart, keeps nothing.
KEEPS_UNREDUCED = frozenset(
    (
        aten.mse_loss.default,
        aten.smooth_l1_loss.default,
        aten.soft_margin_loss.default,
        aten.binary_cross_entropy.default,
    )
)
# Reductions (the operators torch tags so: sum, mean, norms, ...) and the running sum and product.
# On CPU one whose input is not of the type it computes in copies the input into that type first
# (`make_reduction`): given a `dtype` other than its input's (`x.sum(dtype=torch.float32)`), or
# summing booleans or integers, which it does in int64 (`mask.sum(-1)`, `mask.cumsum(-1)`: 8
# times a boolean input); and a bf16 or fp16 mean sums an fp32 copy of its input (`mean_out`):
# 2.06 times a bf16 input beyond its output (torch 2.13; the random zoo's r27, a classifier
# pooling its last block's output, sharded in bf16, read 1.4% under the allocator's peak for it).
# On CUDA a reduction split across thread blocks stages its partial results in a buffer from the
# caching allocator (`Reduce.cuh`), a scan its temporary storage, and one given another dtype
# copies its input as on CPU (but for bf16 or fp16 to fp32): every one is probed there.
SCANS = frozenset((aten.cumsum.default, aten.cumprod.default))
FULL_PRECISION = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def skew_symmetric_on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor like (fake) square matrices `x` on `device`: skew-symmetric, each of 1-norm
    64. The matrix exponential picks its approximant's degree, and so how many matrix powers it
    holds at once, by the norm; 64 is past its every threshold (the highest degree, 18, from a
    1-norm of 1.09 in double and 3.01 in float; above that it scales the matrix down and squares
    the result), where its scratch stops growing, and the exponential of a skew-symmetric matrix
    is orthogonal, so nothing overflows. Measured on torch 2.13's CPU build, one 256x256 fp32
    matrix: zeros hold 4 matrices beside the output, norm 0.5 eight, norm 2 to 10^6 twelve. The
    orthogonal parametrization (`nn.utils.parametrizations.orthogonal`) feeds it skew-symmetric
    matrices of any norm: a trained orthogonal layer's estimate read 51% under the allocator's
    peak with zero-filled probes (tests/test_workspace.py), exact with these."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    values = values - values.transpose(-2, -1)
    norms = values.abs().sum(-2, keepdim=True).amax(-1, keepdim=True)
    values = values * (64 / norms.clamp_min(torch.finfo(torch.float64).tiny))
    real = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    return real.copy_(values)


# Operators whose workspace depends on their first argument's values: probed on these instead of
# zeros. Where the values are those of the hungriest path the probe takes the most the kernel can
# hold, whatever values the real step brings.
FILLERS: dict[Any, Callable[[torch.Tensor, torch.device], torch.Tensor]] = {
    aten.linalg_matrix_exp.default: skew_symmetric_on,
}

# gloo's own buffer during a collective, as a function of the call's (output, input) tensors
ALL_GATHER = op_overload("_allgather_base_")
REDUCE_SCATTER = op_overload("_reduce_scatter_base_")
GLOO_BUFFERS: dict[Any, Callable[[torch.Tensor, torch.Tensor], int]] = {
    op: size
    for op, size in (
        (ALL_GATHER, lambda output, input: output.nbytes),
        (REDUCE_SCATTER, lambda output, input: input.nbytes),
    )
    if op is not None
}

# (device type, operator, arguments' description) -> workspace bytes; None: it failed to run
_measured: dict[tuple[Any, ...], int | None] = {}
# calls met since `unmeasured_note` last ran that could not be measured -> why
_unmeasured: dict[tuple[Any, ...], str] = {}


def why_not(device: torch.device) -> str | None:
    """Why kernels cannot be measured on `device` here now, or None if they can."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here"
    if device.type not in ("cpu", "cuda"):
        return f"not measured on {device.type}"
    if device.type == "cpu" and (lacks := missing("_is_profiler_enabled", "_EventType")):
        return lacks
    if device.type == "cpu" and profiler_enabled():
        return "a profiler is running, and the CPU is measured with one"
    return None


class Workspace(TorchDispatchMode):
    """Adds each known kernel's workspace, and on CPU gloo's buffer of each FSDP2 collective, as a
    fake allocation alive during the call. Enter it inside (after) the memory tracker, so that
    the tracker sees the block."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.cannot = why_not(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in GLOO_BUFFERS and self.device.type == "cpu":
            return _held_during(GLOO_BUFFERS[func](*args[:2]), self.device, func, args, kwargs)
        if not _has_workspace(func, args, kwargs, self.device):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns it into the local call, which comes back
        return self._with_workspace(func, args, kwargs)

    def _with_workspace(self, func: Any, args: Any, kwargs: Any) -> Any:
        """`func`'s result, with its workspace (measured once per distinct call) held during it;
        where it cannot be measured, without, and the call noted."""
        call = _IN_BUFFERS.get(func, func)
        key = (self.device.type, str(func), describe_call(args, kwargs))
        cannot = self.cannot
        if key not in _measured and cannot is None:
            cannot = _too_large(func, args, kwargs) if self.device.type == "cpu" else None
            if cannot is None:
                _measured[key] = _probe(func, args, kwargs, self.device)
        nbytes = _measured.get(key)
        if nbytes is None:
            _unmeasured[key] = cannot or "it failed to run here"
            return call(*args, **kwargs)
        return _held_during(nbytes, self.device, call, args, kwargs)


def _has_workspace(func: Any, args: Any, kwargs: Any, device: torch.device) -> bool:
    if func in OPERATORS or func in COMPOSED or (func in CUDA_IN_PLACE and device.type == "cuda"):
        return True
    if (reduces(func) or func in SCANS) and (device.type == "cuda" or converts(args, kwargs)):
        return True
    if (
        (func in MATMULS or func in ACCUMULATIONS)
        and device.type == "cpu"
        and any(isinstance(a, torch.Tensor) and a.dtype in REDUCED for a in args)
    ):
        return True
    if func in CONTIGUOUS_COPIES and any(
        isinstance(a, torch.Tensor) and not dense(a) for a in args
    ):
        return True
    if device.type == "cpu" and promotes(func, args):
        return True
    return any(isinstance(a, torch.Tensor) and expanded(a) for a in args) and copies_expanded(func)


def reduces(func: Any) -> bool:
    """Whether `func` is a reduction (torch's tag) that leaves its arguments as they were."""
    if getattr(func, "namespace", None) != "aten":
        return False  # a higher-order operator has neither tags nor a schema
    return torch.Tag.reduction in func.tags and not mutates(func)


def converts(args: Any, kwargs: Any) -> bool:
    """Whether a reduction on CPU works on a converted copy of its input (the first tensor): one
    given a `dtype` other than its own, one not of full precision (booleans and integers are
    summed in int64, a bf16 or fp16 mean in fp32; a probe of one that converts nothing finds
    nothing held)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return False
    dtype = kwargs.get("dtype")
    return first.dtype not in FULL_PRECISION or (dtype is not None and dtype != first.dtype)


def promotes(func: Any, args: Any) -> bool:
    """Whether `func` is an elementwise operator given tensors of more than one dtype, which on
    CPU it copies to their common one for the call (see above), and leaves every argument as it
    was, drawing no random numbers (a generator passed to it would move)."""
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim()}
    if len(dtypes) < 2 or getattr(func, "namespace", None) != "aten":
        return False  # a higher-order operator has neither tags nor a schema
    tags = func.tags
    return (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and not mutates(func)
    )


def dense(x: torch.Tensor) -> bool:
    """Whether `x` is laid out contiguously, as a kernel that copies any other layout wants it
    (`CONTIGUOUS_COPIES`); sparse and nested tensors count as such (nothing to tell)."""
    return x.layout != torch.strided or x.is_nested or x.is_contiguous()


def expanded(x: torch.Tensor) -> bool:
    """Whether `x` repeats its elements along a dimension (a stride of 0 over more than one
    element): an `expand`ed view, such as the gradient `out.sum()` hands to `out`'s operator.
    Sparse and nested tensors are not (a COO tensor's strides read 0)."""
    if x.layout != torch.strided or x.is_nested:
        return False
    strides = x.stride()
    return 0 in strides and any(s == 0 and n > 1 for s, n in zip(strides, x.shape, strict=True))


def copies_expanded(func: Any) -> bool:
    """Whether `func`, given an expanded tensor, may make a dense copy of it inside its kernel.

    Measured on torch 2.13's CPU build with the loss `out.sum()`, whose gradient is a view of one
    element expanded to `out`'s shape: the matrix product (a linear layer's backward), softmax's,
    log-softmax's, layer norm's and embedding's backward each copy it into a block of its full
    size for the duration of the call, which the fake kernels do not allocate (a linear layer
    under `.sum()` read 11% under the allocator's peak, a softmax 17%). cuBLAS is given
    contiguous matrices the same way. Elementwise operators and reductions read strides as they
    are (no copy: sum, mean, amax, var, prod, norm, argmax, max, any), views copy nothing. Not
    run here: operators outside aten, those that write into an argument (in place, `out=`:
    checking a probe's size runs the call once on the fake arguments) and those that draw random
    numbers (a generator passed to one would move)."""
    if getattr(func, "namespace", None) != "aten" or func.is_view:
        return False  # a higher-order operator has neither tags nor a schema
    tags = func.tags
    return (
        torch.Tag.pointwise not in tags
        and torch.Tag.reduction not in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and not mutates(func)
    )


# A probe on CPU is not run where its tensors alone would take more than this share of the host
# memory available: a kernel's scratch can be several times its output (the bf16 convolution
# above: 9 times), and the kernel that runs out of host memory gets the process killed, not an
# exception. An LLM's head in bf16 on CPU, [tokens, d] @ [d, vocab], comes to gigabytes.
PROBE_SHARE = 1 / 8


def _too_large(func: Any, args: Any, kwargs: Any) -> str | None:
    """Why a CPU probe of this call is not run (its tensors too large for the host memory
    available now), else None. Its output's size comes from the fake kernel."""
    from autoshard._world import host_memory

    with disable_current_modes():  # the tracker below must not count this extra output
        output = func(*args, **kwargs)  # on fake tensors: no memory, no kernel
    tensors = [x for x in tree_flatten((args, kwargs, output))[0] if isinstance(x, torch.Tensor)]
    need = sum(t.numel() * t.element_size() for t in tensors)
    available = host_memory().available_bytes
    if need <= available * PROBE_SHARE:
        return None
    return f"too large to run here: its tensors alone take {need:,} B of {available:,} B free"


def _held_during(nbytes: int, device: torch.device, func: Any, args: Any, kwargs: Any) -> Any:
    """`func`'s result, with a block of `nbytes` allocated (on the current modes' tensors: fake
    inside the simulation) for the duration of the call."""
    block = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
    result = func(*args, **kwargs)
    del block
    return result


def _col2im_into_input_buffer(
    input: torch.Tensor, output_size: Any, kernel_size: Any, *more: Any
) -> Any:
    """col2im's output, written into a view of a new buffer as large as its input where that is
    larger (`COL2IM`); on the current modes' tensors: fake inside the simulation."""
    channels = input.shape[-2] // (kernel_size[0] * kernel_size[1])
    shape = (*input.shape[:-2], channels, *output_size)
    numel = max(input.numel(), math.prod(shape))
    buffer = torch.empty(numel, dtype=input.dtype, device=input.device)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]  # contiguous
    output = buffer.as_strided(shape, strides)
    return COL2IM.overloadpacket.out(input, output_size, kernel_size, *more, out=output)


def _into_unreduced_buffer(func: Any) -> Callable[..., Any]:
    """`func` (a loss, `KEEPS_UNREDUCED`) with its output, where reduced, in a new buffer the size
    of the unreduced loss (its input and target broadcast), as the real kernel leaves it; on the
    current modes' tensors: fake inside the simulation."""

    def call(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        if argument_of(func, "reduction", args, kwargs) == _NO_REDUCTION:
            return result
        numel = math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape))
        buffer = torch.empty(numel, dtype=result.dtype, device=result.device)
        return buffer.as_strided(result.shape, result.stride()).copy_(result)

    return call


_NO_REDUCTION = 0  # `reduction="none"` as the aten operators take it

# The calls whose real output keeps a buffer larger than itself, as the simulation makes them
_IN_BUFFERS: dict[Any, Callable[..., Any]] = {
    COL2IM: _col2im_into_input_buffer,
    **{op: _into_unreduced_buffer(op) for op in KEEPS_UNREDUCED},
}


def unmeasured_note(device: torch.device) -> str | None:
    """A note for the plan on the calls met (since the last note) whose workspace is not in the
    estimate, else None."""
    reasons = [why for key, why in _unmeasured.items() if key[0] == device.type]
    _unmeasured.clear()
    if not reasons:
        return None
    why = "; ".join(sorted(set(reasons)))
    kinds = "convolution, batch-norm, matrix-product, linear-algebra, attention, FFT, "
    kinds += "resampling, loss, reduction or copying"
    calls = f"{len(reasons)} distinct {kinds} call(s)"
    return f"kernel workspace of {calls} not counted ({why})"


def take_unmeasured() -> dict[tuple[Any, ...], str]:
    """The calls met since the last note or take that could not be measured (a simulation
    worker's, `measure.pool`, for its caller's note), forgotten here."""
    taken = dict(_unmeasured)
    _unmeasured.clear()
    return taken


def merge_unmeasured(calls: dict[tuple[Any, ...], str]) -> None:
    """Adds calls taken elsewhere (`take_unmeasured`) to those the next note says."""
    _unmeasured.update(calls)


def describe_call(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What determines a call's workspace: each tensor's shape, strides and dtype, every other
    argument's value (a key for what was measured of it)."""
    flat, spec = tree_flatten((args, kwargs))
    return str(spec), *(
        (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x for x in flat
    )


def _probe(func: Any, args: Any, kwargs: Any, device: torch.device) -> int | None:
    """Bytes `func` holds beyond its outputs when run for real on `device` (None if it cannot
    run here: too little memory, an unsupported combination)."""
    # the fake mode and the tracker too: this runs for real; a random draw (attention's dropout)
    # leaves the default generators as they were, so the user's step draws what it would have
    devices = [device] if device.type == "cuda" else []
    with disable_current_modes(), torch.random.fork_rng(devices, device_type=device.type):
        try:
            real_args, real_kwargs = tree_map(lambda x: zeros_on(x, device), (args, kwargs))
            if (filler := FILLERS.get(func)) is not None:
                real_args = (filler(args[0], device), *real_args[1:])
            func(*real_args, **real_kwargs)  # once to warm up: first calls build kernels
            if device.type == "cuda":
                return _held_cuda(func, real_args, real_kwargs, device)
            return _held_cpu(func, real_args, real_kwargs)
        except Exception:  # noqa: BLE001 - reported as unmeasured; the trial step still checks
            logger.debug("measuring the workspace of %s failed", func, exc_info=True)
            return None


def zeros_on(x: Any, device: torch.device) -> Any:
    """A real zero-filled tensor like (fake) tensor `x` on `device`; any other value as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).zero_()


def _held_cuda(func: Any, args: Any, kwargs: Any, device: torch.device) -> int:
    """The allocator's peak during the call, less what is still allocated after it (its outputs
    and everything allocated before)."""
    with caller_peak_kept(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = func(*args, **kwargs)
        torch.cuda.synchronize(device)
        held = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        del result
    return max(0, held)


@contextmanager
def _stderr_closed() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null for the duration (kineto writes to it directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _held_cpu(func: Any, args: Any, kwargs: Any) -> int | None:
    """From the profiler's allocation events: the most allocated at once inside the call, less
    what is still allocated when it returns (its outputs)."""
    if profiler_enabled():
        return None  # the caller's own profiler is running: a second one cannot start
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_closed():  # kineto prints a line to stderr as it starts and one as it stops
        prof.__enter__()
    try:
        result = func(*args, **kwargs)
    finally:
        with _stderr_closed():
            prof.__exit__(None, None, None)
    del result
    sizes: list[tuple[int, int]] = []
    allocation = allocation_tag()
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        if event.tag == allocation:
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    live = most = 0
    for _, size in sorted(sizes):
        live += size
        most = max(most, live)
    return most - max(live, 0)
