"""Every private torch name autoshard reaches, in one place (issue 13).

Each entry of `SYMBOLS` is a "module:attribute.path" with what autoshard uses it for;
`tests/test_torch_compat.py` resolves each on the installed torch. A missing one raises
`MissingTorchSymbol` naming the symbol, the torch version and the feature that needs it, except
where autoshard already does without it (no pluggable FSDP2 comms, no tracker peak fields, no
oneDNN, no `_grouped_mm`): there the graceful path stays, and is decided here.

Checked: torch 2.13.0 (this repository's CPU environment), 2.11.0 and 2.15.0 (CI runs the suite
on each, .ci/run), 2.12.1 for the FSDP2 reset (`fsdp_reset_iter_state`). The GPU suite's
"compat" section (`benchmarks/_gpu_compat.py`) probes the same names on the GPU machine's 2.11.

The only changes to torch's own state are the context managers at the end
(`storage_resize_hook`, `fake_kernel`, `fsdp_comms_wrapped`): each undoes its change on every path
out, including a failure after the change is made and before the caller's body starts.

Heavy or optional private modules (the trackers, fake process group, fake-tensor internals, the
profiler) are imported only when a function here needs them, as before.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import sys
from collections import UserDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


class MissingTorchSymbol(ImportError):
    """A private torch name autoshard needs is not in the installed torch."""


@dataclass(frozen=True)
class Symbol:
    path: str  # "module:attr.attr" (the attribute part may be empty: the module itself)
    used_for: str

    @property
    def dotted(self) -> str:
        module, _, attr = self.path.partition(":")
        return f"{module}.{attr}" if attr else module


SYMBOLS: dict[str, Symbol] = {
    # Nested containers of tensors (batches, outputs, dispatch arguments); imported with autoshard.
    "tree_map": Symbol("torch.utils._pytree:tree_map", "walking batches and model outputs"),
    "tree_leaves": Symbol("torch.utils._pytree:tree_leaves", "the trial meter (wrap.meter)"),
    "tree_flatten": Symbol("torch.utils._pytree:tree_flatten", "kernel workspace measurement"),
    # Dispatch modes: the trial meter and the workspace mode subclass it; imported with autoshard.
    "TorchDispatchMode": Symbol(
        "torch.utils._python_dispatch:TorchDispatchMode", "the trial meter and workspace modes"
    ),
    "_disable_current_modes": Symbol(
        "torch.utils._python_dispatch:_disable_current_modes",
        "running a workspace probe for real under the fake mode",
    ),
    "_reparametrize_module": Symbol(
        "torch.nn.utils.stateless:_reparametrize_module",
        "the operator check: one block's parameters on meta inside a forward on fake tensors",
    ),
    "FSDPMemTracker": Symbol(
        "torch.distributed._tools.fsdp2_mem_tracker:FSDPMemTracker", "simulated FSDP2 steps"
    ),
    "MemTracker": Symbol("torch.distributed._tools.mem_tracker:MemTracker", "simulated steps"),
    "_MemRefType": Symbol(
        "torch.distributed._tools.mem_tracker:_MemRefType",
        "counting gradients of models with frozen parameters in the simulation",
    ),
    # Importing it registers the "fake" backend.
    "FakeStore": Symbol(
        "torch.testing._internal.distributed.fake_pg:FakeStore",
        "simulating any world size (the fake process group)",
    ),
    "FakeTensorMode": Symbol(
        "torch._subclasses.fake_tensor:FakeTensorMode", "tracing and simulating without memory"
    ),
    "FakeTensor": Symbol("torch._subclasses.fake_tensor:FakeTensor", "fp32 _grouped_mm fakes"),
    "OptimizedModule": Symbol(
        "torch._dynamo.eval_frame:OptimizedModule", "simulating a torch.compile'd model"
    ),
    "in_kernel_invocation_manager": Symbol(
        "torch._subclasses.fake_tensor:in_kernel_invocation_manager", "fp32 _grouped_mm fakes"
    ),
    "op_implementations_checks": Symbol(
        "torch._subclasses.fake_impls:op_implementations_checks", "fp32 _grouped_mm fakes"
    ),
    "_create_grouped_mm_output_tensor": Symbol(
        "torch._meta_registrations:_create_grouped_mm_output_tensor",
        "fp32 _grouped_mm fakes, and on meta in the operator check",
    ),
    "_EventType": Symbol(
        "torch._C._profiler:_EventType", "measuring CPU kernel workspace (profiler events)"
    ),
    "_is_profiler_enabled": Symbol(
        "torch.autograd.profiler:_is_profiler_enabled", "measuring CPU kernel workspace"
    ),
    "_get_default_group": Symbol(
        "torch.distributed.distributed_c10d:_get_default_group", "agreement between ranks"
    ),
    "_get_default_store": Symbol(
        "torch.distributed.distributed_c10d:_get_default_store", "agreement between ranks"
    ),
    # Graceful where absent: no fp32 fake kernel is installed (nothing runs through it).
    "_grouped_mm": Symbol(
        "torch:ops.aten._grouped_mm", "fp32 _grouped_mm fakes and its FLOPs (MoE experts)"
    ),
    # Graceful where absent: the simulation holds no gloo buffer for that collective.
    "_allgather_base_": Symbol(
        "torch:ops.c10d._allgather_base_", "gloo's buffers in the simulation (all-gather)"
    ),
    "_reduce_scatter_base_": Symbol(
        "torch:ops.c10d._reduce_scatter_base_", "gloo's buffers in the simulation (reduce-scatter)"
    ),
    # Graceful where absent: the kernel's workspace is not probed (the estimate misses it).
    "_linalg_eigh": Symbol("torch:ops.aten._linalg_eigh", "eigh's LAPACK workspace"),
    "_linalg_svd": Symbol("torch:ops.aten._linalg_svd", "svd's LAPACK workspace"),
    "_euclidean_dist": Symbol("torch:ops.aten._euclidean_dist", "cdist's matrix-product scratch"),
    "_safe_softmax": Symbol(
        "torch:ops.aten._safe_softmax", "the attention math path's softmax and its row mask"
    ),
    "_index_put_impl_": Symbol(
        "torch:ops.aten._index_put_impl_", "advanced indexing's in-place put, probed on CUDA"
    ),
    **{
        name: Symbol(f"torch:ops.aten.{name}", "the FFT's copy of an input not laid out for it")
        for name in ("_fft_r2c", "_fft_c2c", "_fft_c2r")
    },
    **{
        name: Symbol(f"torch:ops.aten.{name}", "the buffers an upsampling kernel holds")
        for name in (
            "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d",
            "_upsample_nearest_exact3d",
            "_upsample_bilinear2d_aa",
            "_upsample_bicubic2d_aa",
        )
    },
    # Graceful where absent: the CTC loss is refused by fake tensors (left to the formulas).
    "_ctc_loss": Symbol("torch:ops.aten._ctc_loss", "the CTC loss's variables in the simulation"),
    # Graceful where absent: the kernel's copy of an input not laid out for it is not probed.
    **{
        name: Symbol(f"torch:ops.aten.{name}", "a kernel's copy of an input not laid out for it")
        for name in (
            "_softmax",
            "_log_softmax",
            "_softmax_backward_data",
            "_log_softmax_backward_data",
            "_fused_rms_norm",
            "_fused_rms_norm_backward",
        )
    },
    # Graceful where absent: the simulation answers no yes/no read back (it fails as before).
    "_local_scalar_dense": Symbol(
        "torch:ops.aten._local_scalar_dense", "the real step's yes/no answers in the simulation"
    ),
    # Graceful where absent: a cast's output too large to make for real carries no value.
    "_to_copy": Symbol("torch:ops.aten._to_copy", "a mask of ones of any length, cast"),
    # Graceful where absent: the modelled step counts its bytes and its launch (a view it is).
    "_unsafe_view": Symbol(
        "torch:ops.aten._unsafe_view", "the modelled step's traffic: a view not marked as one"
    ),
    # Graceful where absent (a torch without oneDNN): the CPU counts as having no native bf16.
    "_is_mkldnn_bf16_supported": Symbol(
        "torch:ops.mkldnn._is_mkldnn_bf16_supported", "choosing bf16 or fp16 on CPU"
    ),
    # Graceful where absent: batch norm's outputs laid out as the real kernel's where it runs
    # through native_batch_norm alone.
    "_native_batch_norm_legit": Symbol(
        "torch:ops.aten._native_batch_norm_legit", "batch norm's output strides in the trace"
    ),
    "_BatchNorm": Symbol(
        "torch.nn.modules.batchnorm:_BatchNorm", "keeping batch norm in fp32 under FSDP2"
    ),
    "_current_graph_task_id": Symbol(
        "torch._C:_current_graph_task_id",
        "backward formulas' plain-tensor branches, simulated and in the trial (wrap.branches)",
    ),
    # Graceful where absent: gradients are summed out of place in the simulation, as before.
    "_current_autograd_node": Symbol(
        "torch._C:_current_autograd_node",
        "summing gradients in place where autograd's engine would (wrap.branches)",
    ),
    "_use_count": Symbol(
        "torch._C:TensorBase._use_count",
        "summing gradients in place where autograd's engine would (wrap.branches)",
    ),
    "_storage_Use_Count": Symbol(
        "torch._C:_storage_Use_Count",
        "summing gradients in place where autograd's engine would (wrap.branches)",
    ),
    "_is_zerotensor": Symbol(
        "torch._C:TensorBase._is_zerotensor",
        "summing gradients in place where autograd's engine would (wrap.branches)",
    ),
    "_engine_run_backward": Symbol(
        "torch.autograd.graph:_engine_run_backward",
        "where autograd's engine is entered: the place a backward formula reads a value back",
    ),
    # Not in torch.utils.flop_counter's __all__. Graceful where absent: torch's formulas count
    # unguarded (a formula that raises then fails the trace, as before issue 22).
    "flop_registry": Symbol(
        "torch.utils.flop_counter:flop_registry", "FLOP formulas that cannot abort the trace"
    ),
    # Graceful where absent: that kernel's FLOPs have only torch's formula (else count 0), and
    # its scratch is not probed (the estimate misses it).
    **{
        name: Symbol(
            f"torch:ops.aten.{name}",
            "FLOPs of fused attention torch cannot count (grouped-query on torch 2.11, the CPU "
            "kernel before 2.15), and its kernel's scratch",
        )
        for name in (
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
        )
    },
    # Graceful where absent: nothing is patched (the simulation then counts what it makes).
    "ShardingPropagator": Symbol(
        "torch.distributed.tensor._sharding_prop:ShardingPropagator",
        "DTensor's shape propagation kept out of the simulated step's memory",
    ),
    # Graceful where absent: a meta model whose fake trace fails is taken as one the batch does
    # not fit, as before.
    **{
        name: Symbol(
            f"torch._subclasses.fake_tensor:{name}",
            "telling a forward that needs real values from a batch that does not fit",
        )
        for name in (
            "DataDependentOutputException",
            "DynamicOutputShapeException",
            "UnsupportedOperatorException",
        )
    },
    # Graceful where absent: the device alone decides (cuda, xpu, mtia), every type supported.
    "_foreach_supported_types": Symbol(
        "torch.optim.optimizer:_foreach_supported_types",
        "simulating the optimizer step torch runs by default on the device trained on",
    ),
    "_get_foreach_kernels_supported_devices": Symbol(
        "torch.utils._foreach_utils:_get_foreach_kernels_supported_devices",
        "simulating the optimizer step torch runs by default on the device trained on",
    ),
    # Graceful where absent: an OOM in the trial step under FSDP2 is then an error.
    "TrainingState": Symbol(
        "torch.distributed.fsdp._fully_shard._fsdp_common:TrainingState",
        "recovering FSDP2 after an aborted trial step (torch before 2.13)",
    ),
}

# The fake-tensor module's logger, silenced during autoshard's own fake runs (measure.quiet).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def resolve(name: str) -> Any:
    """The object `SYMBOLS[name]` names; raises `MissingTorchSymbol` where this torch lacks it."""
    symbol = SYMBOLS[name]
    module_name, _, attrs = symbol.path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for attr in filter(None, attrs.split(".")):
            target = getattr(target, attr)
    except Exception as error:  # ImportError, AttributeError, or a failure inside the module
        raise MissingTorchSymbol(
            f"autoshard needs {symbol.dotted} for {symbol.used_for}; this torch "
            f"{torch.__version__} lacks it ({type(error).__name__}: {error})"
        ) from error
    return target


def missing(*names: str) -> str | None:
    """The first of `names` this torch lacks, as `MissingTorchSymbol`'s message; None if none."""
    for name in names:
        try:
            resolve(name)
        except MissingTorchSymbol as error:
            return str(error)
    return None


# Imported with autoshard (torch imports these modules itself): an older or newer torch without
# them fails here, with the message, rather than deep inside a module.
_pytree_map = resolve("tree_map")
tree_leaves = resolve("tree_leaves")
tree_flatten = resolve("tree_flatten")
TorchDispatchMode = resolve("TorchDispatchMode")
disable_current_modes = resolve("_disable_current_modes")


# ---------------------------------------------------------------------------------------------
# Functions over private names (resolved when called)


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context in which `module`'s parameters and buffers named in `tensors` are those tensors
    (what `torch.func.functional_call` does around its call, without calling the module)."""
    return resolve("_reparametrize_module")(module, tensors)


def mem_trackers() -> tuple[Any, Any]:
    """(FSDPMemTracker, MemTracker)."""
    return resolve("FSDPMemTracker"), resolve("MemTracker")


def fake_store() -> Any:
    """The fake process group's store; importing it registers the "fake" backend."""
    return resolve("FakeStore")()


def default_group() -> Any:
    return resolve("_get_default_group")()


def default_store() -> Any:
    return resolve("_get_default_store")()


def profiler_enabled() -> bool:
    """Whether a (Python) profiler is running in this process."""
    return bool(resolve("_is_profiler_enabled"))


def allocation_tag() -> Any:
    """The profiler event tag of an allocation (`_EventType.Allocation`)."""
    return resolve("_EventType").Allocation


def is_batch_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, resolve("_BatchNorm"))


def in_backward() -> bool:
    """Whether this thread runs the autograd engine's backward now (a graph task). Asked for
    every operator of a traced backward: the function is resolved once."""
    return bool(_graph_task_id()() != -1)


@functools.cache
def engine_entry() -> Any:
    """The code object of the Python function that enters autograd's engine
    (`loss.backward()`, `torch.autograd.grad`), to recognise its frame on a stack."""
    return resolve("_engine_run_backward").__code__


def autograd_node() -> Any:
    """The autograd node whose backward this thread runs now (None outside backward)."""
    return _autograd_node()()


def holders(tensor: torch.Tensor) -> tuple[int, int]:
    """How many references hold `tensor` and its storage, as autograd's engine counts them to
    decide whether it may sum into the tensor in place (references of the caller included)."""
    storage = tensor.untyped_storage()._cdata
    return int(_use_count()(tensor)), int(_storage_use_count()(storage))


def is_zero_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one of autograd's immutable tensors of zeros (`_efficientzerotensor`)."""
    return bool(resolve("_is_zerotensor")(tensor))


@functools.cache
def engine_sums_seen() -> bool:
    """Whether this torch lets autoshard see which node runs and who holds a gradient."""
    names = ("_current_autograd_node", "_use_count", "_storage_Use_Count", "_is_zerotensor")
    return missing(*names) is None


@functools.cache
def _autograd_node() -> Callable[[], Any]:
    return resolve("_current_autograd_node")  # type: ignore[no-any-return]


@functools.cache
def _use_count() -> Callable[[torch.Tensor], int]:
    return resolve("_use_count")  # type: ignore[no-any-return]


@functools.cache
def _storage_use_count() -> Callable[[int], int]:
    return resolve("_storage_Use_Count")  # type: ignore[no-any-return]


@functools.cache
def _graph_task_id() -> Callable[[], int]:
    return resolve("_current_graph_task_id")  # type: ignore[no-any-return]


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 natively on this CPU (False on a torch without oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def storage_key(storage: torch.UntypedStorage) -> int:
    """The storage's identity in C++: the same for every Python view of it."""
    return int(storage._cdata)


def mutates(op: Any) -> bool:
    """Whether operator overload `op` writes into one of its arguments (in-place, `out=`)."""
    return bool(op._schema.is_mutable)


def argument_of(op: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The value of operator overload `op`'s argument `name` in a call with `args` and `kwargs`:
    as given, else its default (None where `op` takes no such argument)."""
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else kwargs.get(name, argument.default_value)
    return None


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (None: not a view)."""
    return tensor._base if tensor._is_view() else None


def compiled_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a `torch.compile`d model (an OptimizedModule) compiles, else None. Where
    dynamo was never imported no model is one (and it is not imported here: it is heavy)."""
    if "torch._dynamo.eval_frame" not in sys.modules:
        return None
    if not isinstance(model, resolve("OptimizedModule")):
        return None
    inner: torch.nn.Module = model._orig_mod
    return inner


def compiled_runs_eagerly() -> Any:
    """A context in which `torch.compile`d code runs eagerly, its frames never seen by dynamo.
    Dynamo refuses a frame it meets under a torch dispatch mode (the planning's fake steps and
    trace, the CPU trial's meter) and remembers that for the frame's code, for good: a
    compiled model that autoshard ran so was never compiled again, in training either, nor
    any other model of the same class (`torch.compiler.set_stance`)."""
    return torch.compiler.set_stance("force_eager")


def sampler_num_samples(sampler: torch.utils.data.RandomSampler) -> int | None:
    """The `num_samples` a RandomSampler was built with (None: the whole dataset)."""
    value: int | None = sampler._num_samples
    return value


def needs_real_values(error: BaseException) -> bool:
    """Whether a fake-tensor run failed because fake tensors cannot give what the forward asks
    for: a value read back (`.item()`, a Python condition on a tensor), an output whose shape
    depends on values (`nonzero`), or an operator with no fake kernel."""
    kinds = []
    for name in (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
    ):
        try:
            kinds.append(resolve(name))
        except MissingTorchSymbol:
            continue
    return isinstance(error, tuple(kinds))


def default_foreach(params: list[torch.Tensor], device_type: str, sharded: bool = False) -> bool:
    """Whether torch's optimizers take their foreach implementation, given neither `foreach` nor
    `fused`, for `params` once they are on a device of `device_type`, as DTensors where `sharded`
    (FSDP2 makes every parameter one): a device with foreach kernels, and every parameter of a
    type they accept (plain tensors, Parameters, and DTensors once `torch.distributed.tensor` is
    imported): `_default_to_fused_or_foreach`, torch 2.11 to 2.15. (A fake tensor is not such a
    type: left to itself, a simulated step runs the loop.)"""
    from torch.distributed.tensor import DTensor

    try:
        devices = resolve("_get_foreach_kernels_supported_devices")()
        types = tuple(resolve("_foreach_supported_types"))
    except MissingTorchSymbol:
        return device_type in ("cuda", "xpu", "mtia")
    kinds = [DTensor] if sharded else [type(p) for p in params]
    return device_type in devices and all(kind in types for kind in kinds)


def keep_children(parent: torch.nn.Module, count: int) -> None:
    """Keep only the first `count` children of `parent` that are set, renamed "0", "1", ..."""
    kept = [m for m in parent._modules.values() if m is not None][:count]
    parent._modules = {str(i): m for i, m in enumerate(kept)}


# ---------------------------------------------------------------------------------------------
# FSDP2 internals (sync.fsdp_sync_points)


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """An FSDP2 unit's param groups (`_fsdp_param_groups`; older FSDP2: one `_fsdp_param_group`)."""
    return _state_groups(module._get_fsdp_state())  # type: ignore[operator]


def _state_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [getattr(state, "_fsdp_param_group", None)]
    return [g for g in groups if g is not None]


def has_pluggable_comms(groups: list[Any]) -> bool:
    return all(
        hasattr(g, "_all_gather_comm") and hasattr(g, "_reduce_scatter_comm") for g in groups
    )


@contextlib.contextmanager
def fsdp_comms_wrapped(groups: list[Any], wrap: Callable[[Any], Any]) -> Iterator[bool]:
    """Each param group's all-gather and reduce-scatter comm objects replaced by `wrap(comm)`,
    put back on every way out; yields False, changing nothing, where this FSDP2 has no pluggable
    comms."""
    if not has_pluggable_comms(groups):
        yield False
        return
    originals = [(g, g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
    try:  # a failure while wrapping (in `wrap`) puts back the groups already wrapped
        for group, all_gather, reduce_scatter in originals:
            group._all_gather_comm = wrap(all_gather)
            group._reduce_scatter_comm = wrap(reduce_scatter)
        yield True
    finally:
        for group, all_gather, reduce_scatter in originals:
            group._all_gather_comm = all_gather
            group._reduce_scatter_comm = reduce_scatter


# ---------------------------------------------------------------------------------------------
# FSDP2 after an exception aborted forward or backward (wrap.trial)

# What torch 2.13's `FSDPState._reset_iter_state` resets, as torch 2.11 and 2.12 name it.
_STATE_FIELDS = ("_comm_ctx", "_state_ctx", "_device_handle", "_modules_to_run_forward")
_GROUP_FIELDS = (
    "_all_gather_result",
    "_post_reduce_event",
    "_all_reduce_state",
    "_reshard_after_forward_event",
    "_wait_all_gather_streams_on_event",
    "_partial_reduce_output",
    "_post_forward_indices",
    "_training_state",
    "_to_sharded",
)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """torch's pytree map, which also maps into what pytree leaves whole where `fn` leaves it as
    it is, each on a shallow copy: a dataclass instance nobody registered with pytree (a batch
    or an output given as a @dataclass), each field mapped; a `UserDict` (transformers'
    `BatchEncoding`, what a tokenizer and its data collators return), each value mapped. Not
    other mappings of their own kind, whose copy may share what it holds with the caller's.
    (Where `fn` makes something else of it, as autoshard's own dataclasses are turned back into
    tensors, that is the answer.)"""

    def leaf(x: Any) -> Any:
        mapped = fn(x)
        if mapped is not x or isinstance(x, type):
            return mapped
        if dataclasses.is_dataclass(x):
            mapped = copy.copy(x)
            for field in dataclasses.fields(x):
                object.__setattr__(mapped, field.name, tree_map(fn, getattr(x, field.name)))
        elif isinstance(x, UserDict):  # its copy has a dict of its own: the caller's unchanged
            mapped = copy.copy(x)
            for key in list(x.keys()):
                mapped[key] = tree_map(fn, x[key])
        return mapped

    return _pytree_map(leaf, tree)


def fsdp_reduces_mixed_dtypes() -> bool:
    """Whether FSDP2 reduce-scatters gradients of two dtypes in one group: from torch 2.15 (its
    copy-in operator `fsdp.chunk_cat_mixed_dtype`); before, it asserts one gradient dtype per
    group ("FSDP reduce-scatter expects uniform gradient dtype")."""
    import torch.distributed.fsdp  # noqa: F401 - registers the fsdp operators

    return hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype")


def fsdp_reset_iter_state(root: torch.nn.Module) -> bool:
    """FSDP2's per-iteration state put back to idle and sharded after an exception aborted
    forward or backward, the failed iteration's gradients dropped: `reset_iter_state` (torch
    2.13 on), else the same steps on the private fields of torch 2.11 and 2.12. False, changing
    nothing, where this torch has neither."""
    public = getattr(root, "reset_iter_state", None)
    if public is not None:
        public()
    elif not reset_iter_state_by_fields(root):
        return False
    _drop_unsharded_grads(root._get_fsdp_state())  # type: ignore[operator]
    return True


def reset_iter_state_by_fields(root: torch.nn.Module) -> bool:
    """torch 2.13's `FSDPState._reset_iter_state`, step by step, on the fields of earlier FSDP2;
    False, changing nothing, where one is missing."""
    state = root._get_fsdp_state()  # type: ignore[operator]
    if state._is_root is None:  # never ran forward (no lazy init): nothing to reset
        return True
    states = state._state_ctx.all_states
    groups = [g for each in states for g in _state_groups(each)]
    fields = [(s, _STATE_FIELDS) for s in states] + [(g, _GROUP_FIELDS) for g in groups]
    if missing("TrainingState") or not all(hasattr(o, f) for o, names in fields for f in names):
        return False
    idle = resolve("TrainingState").IDLE
    _reset_comm_ctx(state._comm_ctx, state._device_handle.current_stream())
    for each in states:
        each._modules_to_run_forward.clear()
        each._training_state = idle
    for group in groups:
        _reset_group(group, idle)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False
    return True


def _wait(stream: Any, event: Any) -> None:
    if event is not None:
        stream.wait_event(event)


def _reset_comm_ctx(ctx: Any, stream: Any) -> None:
    """In-flight collectives waited for and forgotten (2.11 keeps one `reduce_scatter_state`,
    2.12 a list `reduce_scatter_states`, 2.13 also `_last_post_reduce_events`)."""
    if (gathered := ctx.all_gather_state) is not None:
        _wait(stream, gathered.event)
    ctx.all_gather_state = None
    scatters = [*getattr(ctx, "reduce_scatter_states", ())]
    scatters.append(getattr(ctx, "reduce_scatter_state", None))
    for reduce_scatter in filter(None, scatters):
        _wait(stream, reduce_scatter.event)
    if hasattr(ctx, "reduce_scatter_states"):
        ctx.reduce_scatter_states.clear()
    if hasattr(ctx, "reduce_scatter_state"):
        ctx.reduce_scatter_state = None
    for event in getattr(ctx, "_last_post_reduce_events", {}).values():
        _wait(stream, event)
    if hasattr(ctx, "_last_post_reduce_events"):
        ctx._last_post_reduce_events.clear()
    ctx.post_forward_order.clear()


def _reset_group(group: Any, idle: Any) -> None:
    """torch 2.13's `FSDPParamGroup._reset_iter_state`."""
    stream = group.device_handle.current_stream()
    if (gathered := group._all_gather_result) is not None:
        _wait(stream, gathered.all_gather_event)
        if isinstance(gathered.all_gather_work, torch.distributed.Work):
            gathered.all_gather_work.wait()
        group._all_gather_result = None
    _wait(stream, group._post_reduce_event)
    group._post_reduce_event = None
    if group._all_reduce_state is not None:
        _wait(stream, group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = idle
    group._to_sharded()


def _drop_unsharded_grads(state: Any) -> None:
    """Gradients an aborted backward left on unsharded parameters whose group's post-backward
    never ran: the next backward would add to them. torch 2.15's reset_iter_state drops them
    itself; 2.13's keeps them (tests/test_torch_compat.py)."""
    for each in state._state_ctx.all_states:
        for group in _state_groups(each):
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                if "unsharded_accumulated_grad" in vars(param):  # a property from torch 2.15
                    param.unsharded_accumulated_grad = None


# ---------------------------------------------------------------------------------------------
# Process-wide patches, each undone on every path


@contextlib.contextmanager
def storage_resize_hook(after: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """`torch.UntypedStorage.resize_` calls `after(storage)` once each resize is done (FSDP2
    allocates and frees its gathered parameters through it); the original is put back on exit."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        after(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def sharding_propagation_untracked() -> Iterator[None]:
    """DTensor's shape propagation run with no dispatch mode active, for the duration.

    The first time DTensor meets an operator and argument list (the optimizer step's, on FSDP2's
    sharded parameters) it runs the operator on fake tensors of the *global* shapes to learn its
    output's (`ShardingPropagator._propagate_tensor_meta_non_cached`), under the fake mode it
    finds active: inside the simulation that is the simulation's own, under the memory tracker,
    which counted those tensors as the step's (AdamW's foreach step over a FULL_SHARD model read
    4 unsharded copies of the parameters; torch 2.11 propagates again at every step). With no
    mode active it makes a fake mode of its own, which nothing tracks."""
    try:
        propagator = resolve("ShardingPropagator")
    except MissingTorchSymbol:
        yield
        return
    original = propagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:
        yield
        return

    def untracked(self: Any, op_schema: Any) -> Any:
        with disable_current_modes():
            return original(self, op_schema)

    propagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        propagator._propagate_tensor_meta_non_cached = original


def clear_cublas_workspaces() -> bool:
    """Free every cuBLAS/cuBLASLt workspace this process holds (torch builds them again at the
    next matmul); False where this torch has no such call (a CPU build)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def writes_arguments(func: Any) -> bool:
    """Whether operator overload `func` may write into any of its arguments (in place, `out=`),
    as its schema says; True for one without a schema."""
    schema = getattr(func, "_schema", None)
    return schema is None or bool(schema.is_mutable)


def written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The arguments operator overload `func` writes into (in place, `out=`), as its schema
    says: `index_put_` writes its first, not its indices; None for one without a schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    written = []
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        if position < len(args) and not argument.kwarg_only:
            written.append(args[position])
        elif argument.name in kwargs:
            written.append(kwargs[argument.name])
    return written


def op_overloads(name: str, *overloads: str) -> tuple[Any, ...]:
    """The `overloads` of operator `SYMBOLS[name]` this torch has (none without it)."""
    try:
        packet = resolve(name)
    except MissingTorchSymbol:
        return ()
    return tuple(getattr(packet, o) for o in overloads if o in packet.overloads())


def op_overload(name: str) -> Any:
    """The default overload of operator `SYMBOLS[name]`, or None on a torch without it."""
    try:
        return resolve(name).default
    except MissingTorchSymbol:
        return None


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formula of each operator (packet) `FlopCounterMode` counts; {} without it."""
    try:
        return dict(resolve("flop_registry"))
    except MissingTorchSymbol:
        return {}


def raw_flop_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """`formula` marked (`_get_raw`) to be called as torch's registry entries are, with the
    operator's own arguments and `out_val`, when given to `FlopCounterMode(custom_mapping=...)`:
    unmarked, the counter would pass shapes instead."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


def sdpa_flop_ops() -> dict[Any, bool]:
    """The fused attention operators (packets) whose FLOPs torch cannot count (torch 2.11 under
    grouped-query attention; the CPU kernel, which has no formula before torch 2.15), each with
    whether it is a backward; those this torch lacks left out."""
    ops = {}
    for name in SYMBOLS:
        if name.startswith("_scaled_dot_product_"):
            try:
                ops[resolve(name)] = name.endswith("_backward")
            except MissingTorchSymbol:
                continue
    return ops


def grouped_mm() -> Any:
    """`torch.ops.aten._grouped_mm.default`, or None on a torch without it."""
    return op_overload("_grouped_mm")


@contextlib.contextmanager
def fake_kernel(op: Any, kernel: Callable[..., Any]) -> Iterator[None]:
    """`kernel(fake_mode, func, *args, **kwargs)` consulted before torch's own fake kernel of
    `op` (it may return NotImplemented to defer), while inside. On exit it is removed and the
    fake-tensor cache forgets what it answered, so that torch's kernel answers again."""
    checks = resolve("op_implementations_checks")
    entry = (lambda func: func is op, kernel)
    checks.insert(0, entry)
    try:
        yield
    finally:
        checks.remove(entry)
        _forget_cached(op)


def _forget_cached(func: Any) -> None:
    """Drop fake-tensor dispatch results of `func` (FakeTensorMode's cache is shared by every
    mode). Private fields; nothing is dropped where they differ."""
    cache = getattr(resolve("FakeTensorMode"), "cache", None)
    if not isinstance(cache, dict):
        return
    for key in [k for k in cache if getattr(k, "key", (None,))[:1] == (func,)]:
        del cache[key]


def meta_call(fake_mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What torch's own meta kernel of `func` gives for these fake tensors (meta tensors), for a
    fake kernel (`fake_kernel`) that changes part of it; `as_fake` makes them fake again."""
    with resolve("in_kernel_invocation_manager")(fake_mode):
        return func(*args, **kwargs)


def as_fake(fake_mode: Any, tensor: torch.Tensor, device: torch.device) -> Any:
    """A meta tensor as a fake tensor of `fake_mode` on `device`."""
    return resolve("FakeTensor")(fake_mode, tensor, device)


def fake_empty(fake_mode: Any, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> Any:
    """A new fake tensor of `fake_mode`, of this shape and dtype on `device`, for a fake kernel
    (`fake_kernel`) whose output's size it decides itself."""
    with resolve("in_kernel_invocation_manager")(fake_mode):
        out = torch.empty(shape, dtype=dtype, device="meta")
    return resolve("FakeTensor")(fake_mode, out, device)


def grouped_mm_output(fake_mode: Any, mat_a: Any, mat_b: Any, offs: Any, out_dtype: Any) -> Any:
    """A fake tensor of the shape and dtype torch's meta kernel gives `_grouped_mm`'s output."""
    with resolve("in_kernel_invocation_manager")(fake_mode):
        out = grouped_mm_meta_output(mat_a, mat_b, offs, out_dtype)
    return resolve("FakeTensor")(fake_mode, out, mat_a.fake_device)


def grouped_mm_meta_output(mat_a: Any, mat_b: Any, offs: Any, out_dtype: Any) -> Any:
    """The tensor torch's meta kernel gives as `_grouped_mm`'s output, in any input dtype."""
    return resolve("_create_grouped_mm_output_tensor")(mat_a, mat_b, offs, out_dtype)


# ---------------------------------------------------------------------------------------------
# torch's memory trackers' private fields (measure.step); each left alone where they differ


def tracker_frozen_safe(tracker: Any) -> Any:
    """`tracker`, made to track models with frozen parameters (LoRA, frozen embeddings).

    torch's MemTracker installs a gradient hook on every parameter of each module it enters,
    and `register_hook` raises on a tensor that does not require grad ("cannot register a hook
    on a tensor that doesn't require gradient", DESIGN.md section 3). Here the hooks go on the
    trainable parameters only: a frozen one gets no gradient to count."""
    original = getattr(tracker, "_track_module_params_and_buffers", None)
    handles: Any = getattr(tracker, "_param_to_grad_hook_handles", None)
    if original is None or not hasattr(handles, "get"):  # a WeakIdKeyDictionary on torch 2.13
        return tracker
    grad_kind = resolve("_MemRefType").GRAD

    def count_grad(grad: torch.Tensor | None) -> None:
        if grad is not None:
            tracker._update_and_maybe_create_winfos(grad, grad_kind)

    def track(module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        tracked: tuple[int, int] = original(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and handles.get(param) is None:
                    handles[param] = (
                        param.register_hook(count_grad),
                        param.register_post_accumulate_grad_hook(lambda p: count_grad(p.grad)),
                    )
        return tracked

    tracker._track_module_params_and_buffers = track
    return tracker


_PEAK_FIELDS = ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")


def tracker_frees_cut_branches(tracker: Any) -> Any:
    """`tracker`, made to free what a forward cuts from the loss as the real step does.

    torch's module tracker hooks each module's inputs for backward (`register_multi_grad_hook`,
    mode "all"), whose hook keeps the inputs' autograd nodes to count them when backward starts:
    each node then holds a hook that holds it, a cycle, and the graph behind it is freed at the
    step's end, not when nothing needs it any more. A forward that cuts a branch from the loss
    (a quantizer's `argmin` with no straight-through path, a teacher's output detached) freed it
    at once in the real step and kept it to the end in the simulation: an audio codec's estimate
    read 110% above its allocator's peak, a reduced quantizer's 36%. Here the input hooks are
    registered in mode "any" (the first gradient to reach a module's inputs ends its backward,
    not the last): they keep no node. autoshard reads the tracker's totals and categories,
    which do not depend on where a module's backward is taken to end."""
    modules: Any = getattr(tracker, "_mod_tracker", None)
    original = getattr(modules, "_fw_pre_hook", None)
    module: Any = sys.modules.get(type(modules).__module__)  # where its hook finds it
    register = getattr(module, "register_multi_grad_hook", None)
    if original is None or register is None:
        return tracker  # a torch whose trackers differ: a cut branch is held as before

    def any_input(tensors: Any, fn: Any, *, mode: str = "all") -> Any:
        return register(tensors, fn, mode="any")

    def pre_hook(mod: torch.nn.Module, inputs: Any) -> Any:
        module.register_multi_grad_hook = any_input
        try:
            return original(mod, inputs)
        finally:
            module.register_multi_grad_hook = register

    modules._fw_pre_hook = pre_hook
    return tracker


def tracker_global_peak_only(
    tracker: Any, observe: Callable[[dict[Any, dict[Any, int]]], None] | None = None
) -> bool:
    """Keep only the tracker-wide peak. After every operator torch's trackers also update each
    tracked module's peak by walking every module tracked so far, which is a fifth of a
    simulation's time on the demo model and unused by autoshard. With `observe`, it is handed
    the current bytes by device and category after every operator (not to be kept: the tracker
    updates it in place). False where this torch's tracker lacks the fields (nothing changed)."""
    if not all(hasattr(tracker, name) for name in _PEAK_FIELDS):
        return False

    def update(peak_state: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
                tracker._peak_mem[device] = snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(snapshot)
        if observe is not None:
            observe(tracker._curr_mem_snap)

    tracker._update_peak_stats = update
    return True


def tracker_reset_peak(tracker: Any) -> None:
    """Start a new peak from the current bytes (without the fields the phases share the peak of
    the whole step, which only overestimates)."""
    if hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap"):
        tracker._peak_mem = {}
        tracker._peak_mem_snap = {}
