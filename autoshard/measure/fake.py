"""Fake copies for the simulation (`measure.simulate`): the model's structure, its optimizer and its
batch on fake tensors (`FakeTensorMode`: no real memory), and a process group whose collectives
do nothing."""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._batch import uniform_value
from autoshard._torch_compat import (
    TorchDispatchMode,
    as_fake,
    default_foreach,
    disable_current_modes,
    fake_kernel,
    fake_store,
    grouped_mm,
    grouped_mm_output,
    keep_children,
    meta_call,
    missing,
    op_overload,
    resolve,
    tree_map,
)
from autoshard.measure.answers import READ_BACK, answering, decided_draws, finding


def fake_mode() -> Any:
    """A FakeTensorMode that accepts real tensors (parameters, batches) as inputs, answers what
    a uniform draw compared with a bound outside its range reads back (`answers.decided_draws`),
    and refuses tensors of two dtypes where every real kernel does (`_SAME_DTYPE`)."""
    return _mode()(allow_non_fake_inputs=True)


aten = torch.ops.aten
# Operators whose fake kernels take two tensors of different dtypes that their real kernels
# refuse, on every device (the checks are in device-generic code, or in each device's kernel
# alike) and for a 0-dim source too: the two arguments' positions and names. Under autocast a
# bf16 expert output summed into an fp32 buffer in place (`index_add_`, DBRX) ran on fake
# tensors: the plan chose bf16, and the trial step failed on it. Under FSDP2's bf16 parameters
# a forward that upcasts an activation before a linear (`F.linear(x.float(), weight)`) did too.
_SAME_DTYPE = {
    aten.index_add.default: ((0, "self"), (3, "source")),
    aten.index_add_.default: ((0, "self"), (3, "source")),
    aten.index_copy.default: ((0, "self"), (3, "source")),
    aten.index_copy_.default: ((0, "self"), (3, "source")),
    aten.index_reduce.default: ((0, "self"), (3, "source")),
    aten.index_reduce_.default: ((0, "self"), (3, "source")),
    aten.index_put.default: ((0, "self"), (2, "values")),
    aten.index_put_.default: ((0, "self"), (2, "values")),
    aten.put.default: ((0, "self"), (2, "source")),
    aten.put_.default: ((0, "self"), (2, "source")),
    aten.mm.default: ((0, "self"), (1, "mat2")),
    aten.addmm.default: ((1, "mat1"), (2, "mat2")),
    aten.mv.default: ((0, "self"), (1, "vec")),
    aten.addmv.default: ((1, "mat"), (2, "vec")),
}


@functools.cache
def _mode() -> type:
    class DtypesChecked(decided_draws()):  # type: ignore[misc]
        def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in _SAME_DTYPE:
                _same_dtype(func, args, kwargs or {})
            return super().dispatch(func, types, args, kwargs)

    return DtypesChecked


class MixedDtypes(RuntimeError):
    """Two tensors of different dtypes that an operator's real kernel refuses (`_SAME_DTYPE`),
    refused on fake tensors too."""


def _same_dtype(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Raise as the real kernel of `func` does where its two tensors' dtypes differ."""
    (i, first), (j, second) = _SAME_DTYPE[func]
    a = args[i] if len(args) > i else kwargs.get(first)
    b = args[j] if len(args) > j else kwargs.get(second)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype == b.dtype:
        return
    raise MixedDtypes(
        f"{func.name().removeprefix('aten::')}(): {first} ({_short(a.dtype)}) and {second} "
        f"({_short(b.dtype)}) must have the same dtype, as its real kernel checks"
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def wider_fake_kernels(
    device_type: str,
    answers: Mapping[str, bool] | None = None,
    trains_on: str | None = None,
    found: tuple[tuple[str, int, int], ...] = (),
) -> Iterator[None]:
    """Fake-tensor kernels for operations whose fake version refuses what the real one runs,
    installed only while a trace or simulation runs (DESIGN.md section 3).

    With `answers` (`ActivationProfile.answers`), a boolean read back from a fake tensor where
    the real step read it is answered as the real step answered it (`measure.answers`); with
    `found` (`ActivationProfile.nonzero_found`), `nonzero` finds where the real step ran it the
    share of its input the real step found there, and the CTC loss its longest target
    (`answers.finding`).

    `torch._grouped_mm` (transformers 5 runs mixture-of-experts layers through it): its meta
    kernel in torch 2.13 requires bf16 inputs (the CUDA kernel's constraint), while the CPU
    kernel computes fp32 too. Its output is one new tensor of the shape the meta kernel gives
    (`_create_grouped_mm_output_tensor`), in the input dtype, and it saves nothing else: the
    fake output here is that tensor, so the trace and the trackers count what a real step holds.

    Normalisations on CPU under autocast save their statistics in another dtype than the fake
    kernel gives (`MixedNormStats`, entered here where the fake tensors are on `device_type`
    "cpu", below every mode the caller enters later; elsewhere it would only cost time: every
    operator passes through it, 7-10% of a plan's). `trains_on` is the device the real step
    runs on, where that is not `device_type` (a plan for GPUs made on fake CPU tensors).

    An LSTM layer on CPU (`mkldnn_rnn_layer`) saves a workspace for its backward whose size
    only oneDNN knows, and the meta kernel gives it empty (`_rnn_workspace_measured`).
    """
    with contextlib.ExitStack() as stack:
        if device_type == "cpu":
            stack.enter_context(MixedNormStats(cuda_layer_norm=trains_on == "cuda"))
        rnn = mkldnn_rnn() if device_type == "cpu" and trains_on in (None, "cpu") else None
        if rnn is not None:
            stack.enter_context(fake_kernel(rnn, _rnn_workspace_measured))
        op = grouped_mm()
        if op is not None:  # a torch without _grouped_mm: nothing runs through it
            stack.enter_context(fake_kernel(op, _grouped_mm_any_dtype))
        if answers and READ_BACK is not None:
            stack.enter_context(fake_kernel(READ_BACK, answering(answers)))
        for op, kernel in finding(found).items():  # a mask of one value: found without a real step
            stack.enter_context(fake_kernel(op, kernel))
        yield


# One layer of an LSTM on CPU (oneDNN): (output, hy, cy, workspace), the workspace saved for its
# backward. torch's meta kernel gives the workspace empty; oneDNN's is larger than the output
# (2,023,424 B against 131,072 B for 8 x 32 tokens of 128 features, torch 2.13): an LSTM's
# estimate read 20-32% under its allocator peak on 2 gloo ranks (a held-out sweep).
def mkldnn_rnn() -> Any:
    """`aten.mkldnn_rnn_layer.default`, or None on a torch without it."""
    return getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None)


# (shapes, strides, dtypes and other arguments of a call) -> its workspace's bytes
_rnn_workspaces: dict[tuple[Any, ...], int] = {}


def _rnn_workspace_measured(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The meta kernel's outputs, with the workspace as large as the real kernel makes it: run
    once for real on zero-filled tensors of each distinct call's shapes (on CPU, where this
    operator runs), and remembered. Where its tensors would take too much of the host memory
    free (as `measure.workspace` probes), the meta kernel's, as before."""
    from autoshard.measure.workspace import PROBE_SHARE, describe_call, zeros_on

    outputs = meta_call(fake_mode, func, args, kwargs)
    key = describe_call(args, kwargs)
    if key not in _rnn_workspaces:
        from autoshard._world import host_memory

        tensors = [x for x in (*args, *outputs) if isinstance(x, torch.Tensor)]
        if sum(t.nbytes for t in tensors) > host_memory().available_bytes * PROBE_SHARE:
            return NotImplemented
        with disable_current_modes():
            real_args, real_kwargs = tree_map(
                lambda x: zeros_on(x, torch.device("cpu")), (args, kwargs)
            )
            _rnn_workspaces[key] = func(*real_args, **real_kwargs)[3].untyped_storage().nbytes()
    output, hy, cy, _ = outputs
    workspace = torch.empty(_rnn_workspaces[key], dtype=torch.uint8, device="meta")
    device = args[0].fake_device
    return tuple(as_fake(fake_mode, t, device) for t in (output, hy, cy, workspace))


def _grouped_mm_any_dtype(
    fake_mode: Any,
    func: Any,
    mat_a: Any,
    mat_b: Any,
    offs: Any = None,
    bias: Any = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented  # torch's own meta kernel handles it
    return grouped_mm_output(fake_mode, mat_a, mat_b, offs, out_dtype)


# Normalisations whose CPU kernel keeps the statistics it saves for backward (mean and inverse
# standard deviation) in fp32 where a bf16/fp16 input meets an fp32 weight, bias or running
# statistic (autocast leaves a norm's parameters in fp32), while torch's fake kernel casts them to
# the input's dtype (torch 2.11 to 2.15). Their outputs are (output, mean, inverse std) alike.
# (An eager step's batch norm reaches `native_batch_norm` on every torch 2.11 to 2.15.)
NORMS = frozenset(
    (aten.native_batch_norm.default, aten.native_layer_norm.default, aten.native_group_norm.default)
)
# Given fp32 statistics, group norm's fake backward gives the input's gradient in fp32; the CPU
# kernel gives it in the input's dtype.
GROUP_NORM_BACKWARD = aten.native_group_norm_backward.default
# Backward kernels whose CPU kernel lays the input's gradient out contiguously, where the fake one
# keeps the input's strides (torch 2.11 to 2.15): layer norm's and log-softmax's. Given a
# transposed input (wav2vec2's "layer" feature encoder: a convolution's output transposed into a
# layer norm and back), the gradient transposed back is strided for real and contiguous on fake
# tensors, and the convolution's backward then copies it for real only: the simulation held a
# gradient fewer, 3.7% to 5.8% under the allocator's peak (data2vec-audio's ForCTC).
CONTIGUOUS_GRADIENTS = frozenset(
    op
    for op in (aten.native_layer_norm_backward.default, op_overload("_log_softmax_backward_data"))
    if op is not None
)
# Batch norm's forwards, (output, mean, inverse std) alike: the CPU kernel lays the output out in
# the input's suggested memory format, the fake one in the input's strides
# (`_in_suggested_format`). A step traced through `functional_call` reaches the legit ones.
_LEGIT = op_overload("_native_batch_norm_legit")
BATCH_NORMS = frozenset(
    {aten.native_batch_norm.default}
    | ({_LEGIT, resolve("_native_batch_norm_legit").no_stats} if _LEGIT is not None else set())
)
_REDUCED = (torch.bfloat16, torch.float16)


class MixedNormStats(TorchDispatchMode):
    """Makes the fake results of `NORMS` and `GROUP_NORM_BACKWARD` on CPU take the real kernels'
    dtypes, and those of `BATCH_NORMS` and `CONTIGUOUS_GRADIENTS` their layout
    (`_in_suggested_format`, `_contiguous_first`). Without the
    dtypes a ResNet under bf16 autocast was simulated 2 bytes per channel and statistic short for
    each batch norm its backward had not reached (1,984 B at its peak, whatever the batch),
    transformers' BERT 4 bytes per token for each layer norm, enough to report a largest batch
    one row too large. Enter it before (below) the memory tracker: the tracker sees the
    corrected results, and not the conversions made here.

    With `cuda_layer_norm` (a plan for GPUs simulated on CPU tensors), layer norm's statistics
    are CUDA's instead: fp32 (its accumulation type) for every bf16/fp16 input, whatever its
    weights' dtype (FSDP2's param_dtype makes them bf16), as torch's fake CUDA kernel gives them.
    The other normalisations' per-row statistics are dtype-alike on both devices (group norm's
    code is shared); batch norm's are per channel."""

    def __init__(self, cuda_layer_norm: bool = False) -> None:
        super().__init__()
        self.cuda_layer_norm = cuda_layer_norm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if (
            func not in NORMS
            and func is not GROUP_NORM_BACKWARD
            and func not in BATCH_NORMS
            and func not in CONTIGUOUS_GRADIENTS
        ):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first turns it into the local call, which comes back
        result = func(*args, **kwargs)
        if func in CONTIGUOUS_GRADIENTS:
            return _contiguous_first(result)
        if func is GROUP_NORM_BACKWARD:
            grad_input, *rest = result
            input = args[1]
            if grad_input is None or not _mixed_on_cpu(input, args[2:4]):
                return result
            return (grad_input.to(input.dtype), *rest)
        if func not in NORMS:
            fp32_stats = False  # a batch norm reached another way: its layout alone
        elif self.cuda_layer_norm and func is aten.native_layer_norm.default:
            fp32_stats = _reduced_on_cpu(args[0])
        else:
            fp32_stats = _mixed_on_cpu(args[0], (*args[1:], *kwargs.values()))
        output, *stats = result
        if func in BATCH_NORMS:
            output = _in_suggested_format(output, args[0])
        if fp32_stats:
            stats = [s.to(torch.float32) for s in stats]
        return (output, *stats)


def _contiguous_first(result: Any) -> Any:
    """A backward's result with the input's gradient (its first output, or its only one) laid
    out contiguously, as the CPU kernel makes it (`CONTIGUOUS_GRADIENTS`)."""
    first, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, None)
    if first is not None and not first.is_contiguous():
        first = first.contiguous()
    return first if rest is None else (first, *rest)


def _in_suggested_format(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Batch norm's output laid out as the CPU kernel lays it out: in the input's suggested
    memory format (channels-last where a 4-D or 5-D input is, else contiguous), where the fake
    kernel keeps the input's strides. A batch norm over a transposed sequence (PatchTST's,
    `BatchNorm1d` on (batch, features, time)) gave a contiguous tensor once transposed back on
    fake tensors, and a strided one for real, which each next linear copies and saves: the
    trace saw 65,536 B a block fewer than the real step (-6% to -7% on 2 gloo ranks)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    layout = formats.get(input.dim(), torch.contiguous_format)
    if layout is not torch.contiguous_format and (
        input.is_contiguous() or not input.is_contiguous(memory_format=layout)
    ):
        layout = torch.contiguous_format
    if output.is_contiguous(memory_format=layout):
        return output
    return output.contiguous(memory_format=layout)


def _mixed_on_cpu(input: Any, others: Any) -> bool:
    """A bf16/fp16 CPU input meeting an fp32 tensor (what the CPU kernels call mixed type)."""
    return _reduced_on_cpu(input) and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in others
    )


def _reduced_on_cpu(input: Any) -> bool:
    return (
        isinstance(input, torch.Tensor) and input.device.type == "cpu" and input.dtype in _REDUCED
    )


def unavailable() -> str | None:
    """Why simulation cannot run with this torch, or None. The trackers are private torch APIs."""
    lacks = missing("FSDPMemTracker", "MemTracker", "FakeStore")
    if lacks is not None:
        return f"torch {torch.__version__} lacks the memory trackers ({lacks})"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception as error:  # ImportError, or any failure inside torch's module
        return f"torch {torch.__version__} lacks the memory trackers ({error})"
    return None


@contextlib.contextmanager
def caches_emptied(model: Any) -> Iterator[None]:
    """Empties, on the way out, each function cache (`functools.lru_cache`, `functools.cache`)
    of the model's code that the planning filled: a cached function computes a tensor once per
    key, and on fake tensors it kept a fake one, which every later real forward of the process
    then computed with, without an error (transformers' BEiT builds its relative position index
    so: the user's training ran on fake tensors, its loss and gradients fake). The caches looked
    at are those of the modules' classes (methods, also behind a decorator's closure, as
    transformers' `compile_compatible_method_lru_cache` keeps them) and of the modules that
    define those classes: a cache elsewhere (a helper module of the user's) is not seen. A cache
    the planning did not fill (no miss) is left as it was."""
    caches = _function_caches(model) if isinstance(model, nn.Module) else []
    misses = [cache.cache_info().misses for cache in caches]
    try:
        yield
    finally:
        for cache, before in zip(caches, misses, strict=True):
            if cache.cache_info().misses != before:
                cache.cache_clear()


def _function_caches(model: nn.Module) -> list[Any]:
    classes = {klass for module in model.modules() for klass in type(module).__mro__}
    defined_in = {sys.modules.get(klass.__module__) for klass in classes} - {None}
    found: dict[int, Any] = {}
    for owner in [*classes, *defined_in]:
        for value in list(vars(owner).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, types.FunctionType):  # a decorator's wrapper: its closure
                candidates = [_content(cell) for cell in value.__closure__ or ()]
            else:
                candidates = [value]
            found.update((id(c), c) for c in candidates if isinstance(c, _FUNCTION_CACHE))
    return list(found.values())


# What `functools.lru_cache` and `functools.cache` make of a function
_FUNCTION_CACHE = type(functools.lru_cache(maxsize=None)(lambda: None))


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int, device_type: str) -> Iterator[Any]:
    """A DeviceMesh over a fake process group of `world_size` ranks, this process being `rank`.

    Inside a job (a process group exists) the fake group is a new group over the real ranks:
    every rank must call this at the same point, as for any `new_group`. Without one, a fake
    default group is created and destroyed again. Python's random number generator is left as
    it was: torch's fake collectives draw their work ids from it (`random.randint`), which moved
    the user's stream at every plan.
    """
    state = random.getstate()
    try:
        with _fake_mesh(world_size, rank, device_type) as mesh:
            yield mesh
    finally:
        random.setstate(state)


@contextlib.contextmanager
def _fake_mesh(world_size: int, rank: int, device_type: str) -> Iterator[Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    store = fake_store()  # importing the fake group registers the "fake" backend, used below
    # A DeviceMesh equals another of the same ranks, device and dimension names whatever its
    # process group, and DTensor's sharding caches key on that equality: a fake mesh equal to
    # the real one would hand the real model's DTensors the fake group (seen: the real
    # gradients ended up on the destroyed fake group). A name of its own keeps them apart.
    global _meshes_made
    _meshes_made += 1
    names = (f"autoshard_simulated_{_meshes_made}",)
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError("a fake group inside a job has the job's size")
        # use_local_synchronization: a hashed name, no global group counter moved, nothing
        # exchanged: safe where only some ranks call it (a plan() on rank 0)
        group = dist.new_group(backend="fake", use_local_synchronization=True)
        try:
            yield DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=store)
    try:
        yield init_device_mesh(device_type, (world_size,), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


_meshes_made = 0


def fake_copy(
    model: nn.Module, mode: Any, device: torch.device, block_names: list[str], kept: list[str]
) -> tuple[nn.Module, list[str]]:
    """The model's structure with fake parameters and buffers (tied ones stay tied), keeping only
    the blocks `kept` of its blocks."""
    memo: dict[int, Any] = {}
    prefixes = _dropped(block_names, kept)
    kept_ids = {
        id(p)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not n.startswith(prefixes)
    }
    with mode:
        for param in (p for p in model.parameters() if id(p) in kept_ids):
            memo[id(param)] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device),
                requires_grad=param.requires_grad,
            )
        for buffer in model.buffers():
            memo[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return shallow_copy(model, block_names, kept, memo)


def shallow_copy(
    model: nn.Module,
    block_names: list[str],
    kept: list[str],
    tensors: dict[int, Any] | None = None,
) -> tuple[nn.Module, list[str]]:
    """The model's module tree with only the blocks `kept` of its blocks, and their names in it.

    Parameters and buffers are the model's own (not copied: the copy costs no tensor memory)
    unless `tensors` maps their ids to replacements. The blocks kept must be the first of their
    ModuleList/Sequential, which holds blocks only (`measure.layout`): their names stay."""
    memo: dict[int, Any] = dict(tensors) if tensors is not None else {}
    prefixes = _dropped(block_names, kept)
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:  # a tensor the kept part uses (tied ones too) is shared
        if not name.startswith(prefixes):
            memo.setdefault(id(tensor), tensor)
    dropped = [name for name in block_names if name not in set(kept)]
    for name in dropped:  # not copied at all
        memo[id(model.get_submodule(name))] = None
    copied = copy.deepcopy(model, memo)
    for parent in dict.fromkeys(name.rpartition(".")[0] for name in dropped):
        count = sum(1 for name in kept if name.rpartition(".")[0] == parent)
        keep_children(copied.get_submodule(parent), count)
    return copied, [name for name in block_names if name in set(kept)]


def _dropped(block_names: list[str], kept: list[str]) -> tuple[str, ...]:
    """The name prefixes of the blocks not kept."""
    keep = set(kept)
    return tuple(f"{name}." for name in block_names if name not in keep)


def simulated_on(device: torch.device) -> torch.device:
    """Where fake steps for ranks training on `device` run: there, except a what-if plan for
    GPUs on a machine without one, simulated on fake CPU tensors."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def fake_tensor(mode: Any, x: Any, device: torch.device) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "meta":  # made as from_tensor would: its strides and its gradient kept
        made = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        batch_value(mode, made, x)  # a batch's tensor moved to meta keeps its one value
        return made.requires_grad_(x.requires_grad)
    made = mode.from_tensor(x)
    batch_value(mode, made, x)
    return made.to(device)


def batch_value(mode: Any, fake: torch.Tensor, real: torch.Tensor) -> None:
    """`fake`, made of the batch's `real`, carries the one value all its elements hold, if they
    do (`known`: the real step's branches on it are taken in the simulation too)."""
    known = getattr(mode, "known", None)
    if known is not None:
        known.note(fake, uniform_value(real), from_batch=True)


def fake_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    fake: nn.Module,
    device_type: str | None,
    sharded: bool = False,
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters over the fake parameters (no state yet). With
    `device_type`, running the implementation the real one runs on a device of that type, its
    parameters sharded by FSDP2 or not (`_implementation`); None leaves the choice to torch."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    fake_params = dict(fake.named_parameters(remove_duplicate=False))
    groups = []
    for group in optimizer.param_groups:
        params = [fake_params[names[id(p)]] for p in group["params"] if names[id(p)] in fake_params]
        options = {k: v for k, v in group.items() if k != "params"}
        if device_type is not None:
            options.update(_implementation(optimizer, group, device_type, sharded))
        groups.append({**options, "params": params})
    rebuilt: torch.optim.Optimizer = type(optimizer)([g for g in groups if g["params"]])  # type: ignore[call-arg]
    return rebuilt


# torch's optimizers whose step, given neither `foreach` nor `fused`, takes foreach where it can
# (`_default_to_fused_or_foreach`, torch 2.11-2.15). Others keep their own default (Adafactor,
# and many outside torch, run the loop).
_DEFAULTS_TO_FOREACH = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "RMSprop",
        "NAdam",
        "RAdam",
        "Adamax",
        "ASGD",
        "Rprop",
        "Adadelta",
    )
    if hasattr(torch.optim, name)
)


def _implementation(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device_type: str, sharded: bool
) -> dict[str, bool]:
    """`{"foreach": ...}` where the group leaves the choice to torch: what torch chooses for the
    group's real parameters on a device of `device_type` (DTensors where FSDP2 shards them).
    Left to torch on fake tensors, which it does not count as foreach-capable, the simulated step
    ran the per-parameter loop where a CUDA step runs foreach, whose intermediates for a whole
    group are alive at once (AdamW: one fp32 copy of every parameter): the step's peak was
    underestimated by up to the parameters' size, on a GPU host and on a CPU host planning for
    GPUs alike."""
    if "foreach" not in group or group["foreach"] is not None:
        return {}
    # torch's default applies only where `fused` is not given either (False included)
    if group.get("fused") is not None or group.get("differentiable"):
        return {}
    known = next((c for c in type(optimizer).__mro__ if c in _DEFAULTS_TO_FOREACH), None)
    if known is None or type(optimizer).step is not getattr(known, "step", None):
        return {}  # its own step, and its own default
    trained = [p for p in group["params"] if p.requires_grad]
    foreach = default_foreach(trained, device_type, sharded)
    # Adam and AdamW keep the loop for a tensor learning rate without `capturable` (torch 2.11-2.15)
    lr = group.get("lr")
    if isinstance(optimizer, torch.optim.Adam) and isinstance(lr, torch.Tensor):
        foreach = foreach and bool(group.get("capturable"))
    return {"foreach": foreach}


def per_parameter_step(optimizer: torch.optim.Optimizer, device_type: str, sharded: bool) -> bool:
    """Whether some group with trainable parameters steps parameter by parameter in the
    simulation (`fake_optimizer`): neither foreach nor fused, or an optimizer of its own."""
    for group in optimizer.param_groups:
        if not any(p.requires_grad for p in group["params"]):
            continue
        options = {**group, **_implementation(optimizer, group, device_type, sharded)}
        if not options.get("fused") and not options.get("foreach"):
            return True
    return False
