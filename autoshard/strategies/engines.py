"""How each engine wraps a module (`strategies.recipes.Engine`): FSDP2 `fully_shard` per block
then the root, DDP, autocast hooks for unsharded mixed precision, and activation checkpointing of
one block. Plain torch calls on the module they are given: `wrap.apply` decides when, and keeps
what was applied; the simulation (`measure.simulate`) wraps its fake copy through the same calls.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoshard._torch_compat import is_batch_norm, tree_map
from autoshard._world import World
from autoshard.strategies.recipes import Recipe, recipe
from autoshard.strategies.strategy import Strategy


def checkpoint_block(module: nn.Module) -> None:
    """Activation-checkpoint one block. A transformers layer is checkpointed the way transformers
    does it (`gradient_checkpointing_enable` with `use_reentrant=False`), for this layer only:
    while training, its checkpointed forward also drops the KV cache, whose update in the
    recomputation would make it save other tensors than the forward did (T5, Whisper:
    "CheckpointError: ... A different number of tensors was saved"), a cache passed by position
    too (`_checkpointed_without_cache`). Anything else gets its forward run inside torch's
    non-reentrant `checkpoint` (`CheckpointedForward`): the module tree and parameter names
    stay as they are."""
    if is_transformers_layer(module):
        setattr(module, "gradient_checkpointing", True)  # noqa: B010 - not a module attribute
        setattr(module, "_gradient_checkpointing_func", _checkpointed_without_cache)  # noqa: B010
        return
    if not isinstance(vars(module).get("forward"), CheckpointedForward):  # not twice
        module.forward = CheckpointedForward(module)  # type: ignore[method-assign]


class CheckpointedForward:
    """A block's forward run inside torch's non-reentrant `checkpoint`, set as the block's own
    `forward`: the class's, or the one the block already had (a method of it is called as the
    same function of whichever block holds this). An object, not a closure, so that a deep copy
    of the block (an EMA copy, say) copies it with the block and runs the copy's own
    parameters, and a pickled block keeps its checkpointing. Not torch's composable,
    hook-based `checkpoint`: from torch 2.13 a compiled model (`torch.compile`, AOTAutograd's
    backends, inductor among them) with such blocks raised "CheckpointError: ... Recomputed
    values for the following tensors have different metadata" in its backward; dynamo compiles
    a `checkpoint` call. The block's own hooks run once, around it, not again in the
    recomputation."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        own = vars(module).get("forward")
        bound = getattr(own, "__self__", None) is module
        # the function of a method of the block; else the block's own callable, or None
        self.function: Callable[..., Any] | None = own.__func__ if bound else None  # type: ignore[union-attr]
        self.own: Callable[..., Any] | None = None if bound else own

    def _target(self) -> Callable[..., Any]:
        if self.function is not None:
            return self.function.__get__(self.module)  # type: ignore[no-any-return]
        if self.own is not None:
            return self.own
        return type(self.module).forward.__get__(self.module)  # type: ignore[no-any-return]

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._target())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpointed(self._target(), *args, **kwargs)


def _checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function` under torch's non-reentrant `checkpoint`; run eagerly, its recomputation lets
    autocast's casts go (`_recomputed_casts_let_go`). Compiled, the graph casts explicitly and
    keeps no cache, and dynamo takes no `context_fn` but dispatch modes."""
    if torch.compiler.is_compiling():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return checkpoint(
        function, *args, use_reentrant=False, context_fn=_recomputed_casts_let_go, **kwargs
    )


def _checkpointed_without_cache(function: Any, *args: Any) -> Any:
    """transformers' checkpointed layer call (`function` the layer's forward, its keyword
    arguments bound): torch's non-reentrant checkpoint, with any KV cache among the arguments by
    position left out, as the layer leaves out one given by keyword. GPT-2 passes its cache by
    position and leaves it out only where its model's own flag is set
    (`gradient_checkpointing_enable`), not a layer's: the cross-attention's keys and values,
    read from the cache in the recomputation, were not saved again ("CheckpointError: ... A
    different number of tensors was saved"; a vision encoder-decoder with a GPT-2 decoder could
    not be checkpointed)."""
    caches = transformers_caches()
    return _checkpointed(function, *(None if isinstance(arg, caches) else arg for arg in args))


def _recomputed_casts_let_go() -> tuple[Any, Any]:
    """A checkpointed block's contexts (`context_fn`): none around its forward; around its
    recomputation in backward, one that lets autocast's casts of its parameters go as it ends.
    The recomputation runs under autocast as the forward did, and leaving that autocast clears
    the cache only where it is the outermost: inside the user's own `torch.autocast` around
    backward, every recomputed block's cast parameters stayed cached to the end of backward,
    beside every gradient (the `_Autocast` hooks clear the forward's as the model returns)."""
    recomputation = contextlib.ExitStack()
    recomputation.callback(torch.clear_autocast_cache)  # as it exits, raised through or not
    return contextlib.nullcontext(), recomputation


def transformers_caches() -> tuple[type, ...]:
    """transformers' KV cache class (`cache_utils.Cache`) where transformers is imported, as a
    tuple for `isinstance`: a checkpointed transformers layer leaves it out
    (`_checkpointed_without_cache`)."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return (cache,) if isinstance(cache, type) else ()


def is_transformers_layer(module: nn.Module) -> bool:
    """A transformers layer that checkpoints itself (`GradientCheckpointingLayer`)."""
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__.startswith("transformers")
        for cls in type(module).__mro__
    )


class _Autocast:
    """Forward hooks that run a module under autocast and return floating outputs in fp32 (as
    accelerate does), so a loss computed outside the model keeps full precision. Hooks rather
    than a patched `forward`: the module still deep-copies (EMA, eval copies) and pickles."""

    # forwards in flight under any model's hooks: a prepared model inside another's forward
    # leaves its casts to the outer one's exit
    in_flight = 0

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.active: list[Any] = []  # one context per forward in flight (re-entrant calls)

    # Run eagerly where the module is compiled after it was wrapped (`torch.compile(model)` as
    # torch's DDP documents): dynamo tracing the context's `__enter__` never ran it, and the
    # forward hook's `__exit__` then raised ("'autocast' object has no attribute 'prev'").
    @torch.compiler.disable
    def enter(self, module: nn.Module, args: Any) -> None:
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self.active.append(context)
        _Autocast.in_flight += 1

    @torch.compiler.disable
    def leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        self.active.pop().__exit__(None, None, None)
        _Autocast.in_flight -= 1
        if not _Autocast.in_flight:
            # Leaving the outermost autocast clears its cache of parameters' casts; inside the
            # user's own `torch.autocast` this exit is not the outermost, and the cache would
            # keep a cast copy of every trained parameter alive until the user's exits: through
            # the loss, and through backward where it runs inside, beside every gradient. The
            # plan counts each copy only while autograd saves it (as after the outermost exit).
            # Clearing keeps the values (a later forward casts again), and frees nothing
            # autograd still holds.
            torch.clear_autocast_cache()
        return tree_map(_to_fp32, output)


def autocast_hooks(module: nn.Module, device_type: str, dtype: torch.dtype) -> list[Any]:
    """Run `module` under autocast; returns the hook handles that undo it."""
    hooks = _Autocast(device_type, dtype)
    return [
        module.register_forward_pre_hook(hooks.enter, prepend=True),
        # always_call: the context is left even when forward raises (an OOM in the trial step)
        module.register_forward_hook(hooks.leave, always_call=True),
    ]


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def sync_from_rank0(module: nn.Module, device: torch.device) -> None:
    """Broadcast parameters and buffers from rank 0 before sharding, as DDP does on construction:
    FSDP2 takes each rank's own slice, so ranks initialised differently would train a mixture.
    NCCL moves only CUDA tensors: a tensor still on the host goes through a device copy, one at a
    time, so the whole model is never on the device at once."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if device.type == "cpu" or tensor.device == device:
                dist.broadcast(tensor.data, src=0)
                continue
            staged = tensor.data.to(device)
            dist.broadcast(staged, src=0)
            tensor.data.copy_(staged)
            del staged


def shard_module(
    module: nn.Module,
    block_names: list[str],
    mesh: Any,
    strategy: Strategy,
    dtype: torch.dtype | None,
) -> None:
    """`fully_shard` each block, then the root, over `mesh` (also `measure.simulate`'s fake mesh); a
    2-D mesh (replicate, shard) makes it HSDP. Blocks reshard after forward as the recipe says;
    the root as torch's default does."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    r = recipe(strategy)
    reshard = r.reshard_after_forward
    offload = CPUOffloadPolicy() if r.offload else OffloadPolicy()
    reduce = torch.float32 if dtype is not None else None
    # Blocks keep their outputs in the compute dtype; only the root casts back to fp32, so a loss
    # computed outside the model is in full precision as under autocast, without fp32 copies
    # between blocks. A loss computed inside forward (Hugging Face style) runs in param_dtype.
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
    outer = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce, output_dtype=reduce)
    if dtype is not None:
        # Batch norm keeps its running statistics in fp32, and its kernel wants input, weight and
        # statistics in one dtype: cast to param_dtype it fails ("expected scalar type BFloat16
        # but found Float"). As autocast does, it runs in fp32: each one its own FSDP2 unit that
        # keeps fp32 parameters, takes its input in fp32 and hands its output back in dtype.
        norm = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype
        )
        for sub in module.modules():
            if is_batch_norm(sub) and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(
                    sub,
                    mesh=mesh,
                    reshard_after_forward=reshard,
                    mp_policy=norm,
                    offload_policy=offload,
                )
    whole = _kept_whole(module, mesh)
    for name in block_names:
        fully_shard(
            module.get_submodule(name),
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=inner,
            offload_policy=offload,
            ignored_params=whole,
        )
    # The root's resharding is left to torch's default (None: stay gathered, since backward needs
    # the root first), as torchtitan leaves it; `set_unit_resharding` keeps it so in place.
    fully_shard(module, mesh=mesh, mp_policy=outer, offload_policy=offload, ignored_params=whole)


def _kept_whole(module: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """The parameters of no dimension (CLIP's and SigLIP's `logit_scale`, a learned temperature,
    a ReZero gate), which FSDP2 has no dimension to shard by and refuses ("fully_shard doesn't
    support scalar parameters"): every strategy that shards was ruled out for such a model. They
    stay whole on every rank (`ignored_params`), the same object (the optimizer's), on the
    device the units move to, and each gradient is averaged over the mesh as it is accumulated,
    as FSDP2 averages the others (an average of a sum of micro-batches' averages is the
    average of their sum: averaged in every backward, gradient sync off or on)."""
    whole = {param for param in module.parameters() if param.dim() == 0}
    if not whole:
        return whole
    device = _mesh_device(mesh)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    size = mesh.size()

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        for group in groups:  # summed over each dimension of the mesh: over all of it
            dist.all_reduce(grad, group=group)
        grad.div_(size)

    for param in whole:
        if param.device != device:
            param.data = param.data.to(device)
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
    return whole


def _mesh_device(mesh: Any) -> torch.device:
    """The device FSDP2 moves a unit's parameters to over `mesh` (the current one of its type)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def set_unit_resharding(module: nn.Module, reshard_after_forward: bool) -> None:
    """Switch every FSDP2 unit under the root (blocks, batch norms) between ZeRO-2 and ZeRO-3 in
    place, as `shard_module` would have built it; the root keeps torch's default."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if sub is not module and isinstance(sub, FSDPModule):
            sub.set_reshard_after_forward(reshard_after_forward, recurse=False)


def layer_drop(model: nn.Module) -> str | None:
    """Where `model` skips whole layers at random in training (LayerDrop, Fan et al. 2019: an
    attribute named `layerdrop`, `encoder_layerdrop`, `layer_drop`, ... holding a probability
    above 0, as transformers' M2M100, NLLB-MoE, SpeechT5, Wav2Vec2 and Informer and fairseq keep
    it), said as "'encoder.layerdrop' is 0.05"; None where it does not. A step then leaves the
    skipped layers' parameters without a gradient, on some ranks and not others, whatever the
    traced step did: DDP must look for unused parameters every step, or it fails at the first
    step that skips one. Read whether or not the model is in training mode now (a model loaded
    by `from_pretrained` is in eval mode until the loop calls `train()`)."""
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if (
                "layerdrop" in attribute.replace("_", "").lower()
                and isinstance(value, float)
                and 0 < value <= 1
            ):
                where = f"{name}.{attribute}" if name else attribute
                return f"'{where}' is {value}"
    return None


def sparse_gradients(model: nn.Module) -> str | None:
    """Where `model` makes sparse gradients (an `Embedding` or `EmbeddingBag` built with
    sparse=True), said as "'emb' (Embedding, sparse=True)"; None where it does not."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            return f"'{name}' ({type(module).__name__}, sparse=True)"
    return None


# torch optimizers whose step fails on FSDP2's sharded parameters (DTensors), on every torch 2.11
# to 2.15: Adafactor's RMS of a parameter (a norm, a partial placement) raised to a power in place
# ("aten.pow_.Scalar: in-place operations that require placement changes are not supported")
_NOT_ON_SHARDS = tuple(
    getattr(torch.optim, name) for name in ("Adafactor",) if hasattr(torch.optim, name)
)


def cannot_shard(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Why FSDP2 cannot train `model` with `optimizer` at all, said so that the caller knows
    what would let it, or None where it can."""
    sparse = sparse_gradients(model)
    if sparse is not None:
        return (
            f"{sparse} makes sparse gradients, which FSDP2 reduce-scatters as dense tensors "
            f"(fsdp::chunk_cat has no sparse kernel); sparse=False would let it shard the model"
        )
    renormed = next(
        (
            name
            for name, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None
        ),
        None,
    )
    if renormed is not None:
        return (
            f"'{renormed}' (max_norm={model.get_submodule(renormed).max_norm}) renormalises its "
            f"weight in place in the forward, which under FSDP2 writes to the gathered copy and "
            f"is lost, silently (the shard keeps the old rows); max_norm=None would let it shard "
            f"the model"
        )
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and id(param) not in optimized
    ]
    if outside:
        return (
            f"{len(outside)} trainable parameter(s) are in no optimizer given to prepare (e.g. "
            f"'{outside[0]}'): FSDP2 replaces every parameter with its shard, so another "
            f"optimizer built on them before prepare would update nothing, silently; one "
            f"optimizer over every trainable parameter (or requires_grad=False on those not "
            f"trained) would let it shard the model"
        )
    refused = next((c for c in _NOT_ON_SHARDS if isinstance(optimizer, c)), None)
    if refused is not None:
        return (
            f"torch's {refused.__name__} step fails on FSDP2's sharded parameters (an in-place "
            f"power of a norm's partial placement, torch 2.11 to 2.15); another optimizer would "
            f"shard it"
        )
    return None


def make_ddp(module: nn.Module, device: torch.device, find_unused: bool) -> nn.Module:
    """`DistributedDataParallel` as autoshard builds it."""
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients are views into the all-reduce buckets, saving one full
    # copy of the gradients (DESIGN.md section 3 measured that copy on gloo).
    # find_unused_parameters costs a graph walk every step: only when the trace found
    # parameters without a gradient, which otherwise make DDP fail on the second step, or the
    # model drops layers at random (`layer_drop`).
    return nn.parallel.DistributedDataParallel(
        module,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        find_unused_parameters=find_unused,
    )


def make_mesh(r: Recipe, world: World) -> Any:
    """The device mesh `r` shards over. An explicit mesh: without it FSDP2 may pick CUDA on a
    CPU/gloo job (DESIGN.md section 3). A hybrid recipe replicates across nodes and shards within
    each (a 2-D mesh: HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if r.hybrid:
        return init_device_mesh(
            world.device.type,
            (world.num_nodes, world.world_size // world.num_nodes),  # as the plan counted them
            mesh_dim_names=("replicate", "shard"),
        )
    return init_device_mesh(world.device.type, (world.world_size,))
