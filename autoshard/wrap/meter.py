"""The CPU trial step's peak: live tensor bytes as the dispatcher sees them.

torch's `MemTracker` measures the same, but its `ModTracker` keeps the tracked step's parameters
alive after it exits (seen on torch 2.13: 50 of 53 parameters of a small GPT outlived the model,
tracker and optimizer, which on a fallback from DDP to FSDP2 would keep the unsharded model). This
meter installs no module or autograd hooks: it counts the storages already held (parameters,
buffers, gradients, optimizer state, as local shards under FSDP2), adds every new storage an
operation returns until Python lets go of it, and follows `UntypedStorage.resize_`, through which
FSDP2 allocates and frees its gathered parameters. C++-side buffers (gloo's) stay invisible.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoshard._batch import tensors_in
from autoshard._torch_compat import TorchDispatchMode, storage_resize_hook, tree_leaves


class LiveBytes(TorchDispatchMode):
    """Use as a context manager; `peak` is the most bytes alive at once while it was active."""

    def __init__(self, held: list[Any], batch: Any = None) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # id(storage) -> bytes counted, until it dies
        self._undo = contextlib.ExitStack()  # what __enter__ changed in torch, undone on exit
        for tensor in held:
            self._track(tensor)
        # the batch's storages at its tensors' bytes (`batch_storages`): a slice of a dataset
        # kept whole in memory counts as the slice, also where the step makes a view of it
        for storage, nbytes in batch_storages(batch, torch.device("cpu"), held):
            self._count(storage, nbytes)
        self.peak = self.current

    def _storage(self, tensor: Any) -> Any:
        if hasattr(tensor, "to_local"):  # a DTensor: its local shard is what is stored here
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        try:
            return tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a subclass or sparse tensor
            return None

    def _track(self, tensor: Any) -> None:
        storage = self._storage(tensor)
        if storage is not None:
            self._count(storage)

    def _count(self, storage: Any, nbytes: int | None = None) -> None:
        key = id(storage)
        if key in self._bytes:
            return
        self._bytes[key] = storage.nbytes() if nbytes is None else nbytes
        self._add(self._bytes[key])
        # the Python storage object lives as long as the storage (PyObject preservation)
        weakref.finalize(storage, _release, weakref.ref(self), key)

    def _resized(self, storage: Any) -> None:
        key = id(storage)
        if key not in self._bytes:
            self._count(storage)
            return
        self._add(storage.nbytes() - self._bytes[key])
        self._bytes[key] = storage.nbytes()

    def _add(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def __enter__(self) -> LiveBytes:
        meter = weakref.ref(self)

        def resized(storage: torch.UntypedStorage) -> None:
            tracker = meter()
            if tracker is not None:
                tracker._resized(storage)

        # if entering the mode fails, the `with` here undoes the patch; else it is kept for exit
        with contextlib.ExitStack() as undo:
            undo.enter_context(storage_resize_hook(resized))
            super().__enter__()
            self._undo = undo.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._undo.close()


def _release(meter_ref: Any, key: int) -> None:
    meter = meter_ref()
    if meter is not None:
        meter._add(-meter._bytes.pop(key, 0))


def held_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """What a step starts with: parameters, their gradients, buffers, optimizer state."""
    tensors: list[Any] = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return tensors


def batch_storages(batch: Any, device: torch.device, held: list[Any]) -> list[tuple[Any, int]]:
    """The storages of the batch's tensors on `device` but those the tensors `held` (parameters,
    buffers, optimizer state) store, each with its tensors' bytes as the estimate counts the
    batch (their elements; at most the storage's: a slice of a dataset kept whole in memory is
    its slice). A loop holds the batch through the step."""
    known = {key for t in held if (key := _storage_key(t)) is not None}
    found: dict[int, tuple[Any, int]] = {}
    for tensor in tensors_in(batch):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = _storage_key(local)
        if key is None or key in known or local.device != device:
            continue
        storage = local.untyped_storage()
        nbytes = found.get(key, (storage, 0))[1] + local.numel() * local.element_size()
        found[key] = (storage, min(nbytes, storage.nbytes()))
    return list(found.values())


def _storage_key(tensor: Any) -> int | None:
    """Where a plain tensor's storage lies (None: no tensor, or one with no storage to read)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):  # a subclass without a storage
        return None


@contextlib.contextmanager
def caller_peak_kept(device: torch.device) -> Iterator[None]:
    """Let the body reset the CUDA allocator's peak statistics to measure its own peak, and give
    the caller's back afterwards: `max_memory_allocated` then reports at least what it did before.

    The allocator has no setter for its peak: if the caller's peak was higher than anything since
    the reset, one block bringing the allocated bytes up to it is allocated and freed again
    (rounded up to the allocator's 512-byte granularity, so the peak lands on it or up to one
    block-split threshold, 1 MiB, above). If that block needed a new segment, the unused cache is
    released afterwards (`empty_cache`). The reserved peak (`max_memory_reserved`) cannot be put
    back: it stays what the body left.
    """
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.max_memory_allocated(device)
    try:
        yield
    finally:
        _raise_allocated_peak(device, before)


def _raise_allocated_peak(device: torch.device, peak: int) -> None:
    missing = peak - torch.cuda.memory_allocated(device)
    if torch.cuda.max_memory_allocated(device) >= peak or missing <= 0:
        return
    reserved = torch.cuda.memory_reserved(device)
    try:
        block = torch.empty(-(-missing // 512) * 512, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:  # the memory is no longer there: the peak stays lower
        return
    del block
    if torch.cuda.memory_reserved(device) > reserved:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def memory_cap(device: torch.device, limit: int | None, held: int) -> Iterator[None]:
    """Enforce memory_limit for real on CUDA, so that an over-budget rung really runs out of
    memory; the caller's own fraction is put back afterwards.

    The limit is the training's (the plan fits it as it fits free memory, which the process's
    other tensors are already missing from), while the allocator's cap counts the whole process:
    the cap is the limit plus what is allocated beyond the training's `held` bytes."""
    if device.type != "cuda" or limit is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(device) if getter is not None else 1.0  # the caller's own cap, if any
    # The cap is checked only when the allocator reserves a new segment: blocks already cached
    # (a caller's freed tensors) would be reused beyond it. Release them first.
    torch.cuda.empty_cache()
    unrelated = max(0, torch.cuda.memory_allocated(device) - held)
    cap = min(previous, (limit + unrelated) / total, 1.0)
    torch.cuda.set_per_process_memory_fraction(cap, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)


def held_bytes(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    batch: Any = None,
) -> int:
    """Bytes of the model's parameters and buffers and the optimizer's state on `device`: this
    rank's shards under FSDP2 (a DTensor's `numel` is the whole tensor's: counted so, a sharded
    model held world-size times its shards, and the CUDA trial took the process's other tensors
    for the training's and its cap left them out of the limit); and the `batch`'s there
    (`batch_storages`: the estimate counts the batch; taken for another tensor of the process,
    it was left out of the trial's measured peak, and its cap let a step exceed the limit by
    it)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(nbytes for _, nbytes in batch_storages(batch, device, tensors)) + sum(
        t.numel() * t.element_size()
        for t in local
        if isinstance(t, torch.Tensor) and t.device == device
    )
