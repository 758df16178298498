"""shard_dataloader(): give each rank its own share of a map-style dataset, every epoch.

A DataLoader built for one process reads the whole dataset on every rank, so N ranks train on the
same samples N times over. This rebuilds it over a `DistributedSampler` with the same batching,
collation, workers and shuffling, and advances the sampler's epoch on every pass (forgetting
`sampler.set_epoch(epoch)` silently repeats the first epoch's order forever).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from autoshard._torch_compat import sampler_num_samples
from autoshard._world import World, resolve
from autoshard.collective import agree

# Everything a DataLoader keeps besides its dataset and sampler, carried over as it is.
_CARRIED = (
    "batch_size",
    "drop_last",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class ShardedDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader over a `DistributedSampler` that sets the sampler's epoch itself.

    Each pass over it (each `iter()`) uses the next epoch: 0, 1, 2, ...; `set_epoch(e)` makes the
    next pass use epoch `e` (then e + 1, ...), as when resuming. Every rank must make the same
    passes, so that their shuffles agree.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_epoch = 0

    @property
    def distributed_sampler(self) -> DistributedSampler[Any]:
        return cast(DistributedSampler[Any], self.sampler)

    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass; 0 before the first."""
        return int(self.distributed_sampler.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass shuffle for `epoch` (the passes after it continue from there)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next_epoch = epoch

    def __iter__(self) -> Any:
        self.distributed_sampler.set_epoch(self._next_epoch)
        self._next_epoch += 1
        return super().__iter__()


def shard_dataloader(loader: DataLoader[Any], *, seed: int | None = None) -> DataLoader[Any]:
    """Rebuild `loader` so that each rank reads a disjoint share of its dataset.

    Call it on every rank, after the process group exists or under torchrun (it initialises the
    process group as `prepare` does). The result is a `ShardedDataLoader`: the same dataset,
    batch size, `drop_last`, `collate_fn`, workers (`num_workers`, `worker_init_fn`,
    `persistent_workers`, `prefetch_factor`, multiprocessing context), `pin_memory`, `timeout` and
    generator, over a `DistributedSampler` that shuffles when the loader shuffled (its sampler was a
    `RandomSampler`). Its epoch advances by itself on each pass; `set_epoch` sets it.

    Every rank gets the same number of samples, so no rank runs out of batches while the others
    wait for it in a collective: with `drop_last=False` the last few samples are repeated to fill
    the shares (every sample is seen at least once), with `drop_last=True` the remainder of the
    dataset that does not divide among the ranks is left out of the epoch.

    A loader that is already sharded (its sampler is a `DistributedSampler`, or it came from this
    function) is returned as it is. In one process without a process group the result reads the
    whole dataset, in an order drawn per epoch from the seed, with the same methods, so a script
    runs unchanged under `python` and `torchrun`.

    Args:
        loader: a `torch.utils.data.DataLoader` over a map-style dataset, with the default
            sampler (`shuffle=True` or `False`) and no custom `batch_sampler`.
        seed: the shuffle's seed; default: the seed of the loader's (or its sampler's) generator,
            else `torch.initial_seed()`. Rank 0's seed is used on every rank: the shares must come
            from one permutation.

    Raises:
        TypeError: `loader` is not a DataLoader.
        ValueError: an IterableDataset, a custom sampler or batch_sampler, or a DataLoader
            subclass, which this cannot rebuild faithfully; `drop_last=True` with fewer samples
            than ranks x batch_size (every rank would get no batch). Raised on every rank when
            any rank's loader is refused.
    """
    world = resolve(init=True)

    def check_here() -> tuple[bool, bool, int]:
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}"
            )
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if is_sharded(loader):
            return True, False, 0
        shuffle = _check_rebuildable(loader)
        _check_batches(loader, world.world_size)
        return False, shuffle, _default_seed(loader) if seed is None else seed

    # Every rank checks its own loader and learns rank 0's seed in one agreement: a loader that
    # cannot be rebuilt on one rank raises on every rank, none waits for the others.
    answers = agree(world, "shard_dataloader()", check_here)
    sharded, shuffle, _ = answers[world.rank if world.distributed else 0]
    if sharded:
        return loader
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=world.world_size,
        rank=world.rank,
        shuffle=shuffle,
        seed=answers[0][2],
        drop_last=loader.drop_last,
    )
    kwargs = {name: getattr(loader, name) for name in _CARRIED}
    return ShardedDataLoader(loader.dataset, sampler=sampler, **kwargs)


def is_sharded(loader: DataLoader[Any]) -> bool:
    """Whether each rank already reads its own share: a DistributedSampler (or ours) draws it."""
    if isinstance(loader, ShardedDataLoader):
        return True
    batch_sampler = getattr(loader, "batch_sampler", None)
    return isinstance(loader.sampler, DistributedSampler) or isinstance(
        getattr(batch_sampler, "sampler", None), DistributedSampler
    )


def _check_rebuildable(loader: DataLoader[Any]) -> bool:
    """Refuse what cannot be rebuilt over a DistributedSampler; return whether it shuffles."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"loader reads an IterableDataset ({type(loader.dataset).__name__}), which decides "
            f"itself what it yields, so no sampler can shard it; split the stream inside its "
            f"__iter__ by torch.distributed.get_rank() (and torch.utils.data.get_worker_info())"
        )
    if type(loader) is not DataLoader:
        raise ValueError(
            f"loader is a {type(loader).__name__}, a DataLoader subclass; rebuilding it as a plain "
            f"DataLoader would drop what the subclass adds: build it with "
            f"sampler=torch.utils.data.DistributedSampler(dataset) instead"
        )
    if loader.batch_sampler is not None and loader.batch_size is None:
        raise ValueError(
            f"loader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}), which "
            f"cannot be split among ranks from outside; build it on a "
            f"torch.utils.data.DistributedSampler instead of the full index range"
        )
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return False
    # Without replacement and num_samples, a RandomSampler permutes the whole dataset each epoch.
    if (
        isinstance(sampler, RandomSampler)
        and not sampler.replacement
        and not sampler_num_samples(sampler)
    ):
        return True
    raise ValueError(
        f"loader's sampler is a {type(sampler).__name__}, which shard_dataloader cannot split "
        f"among ranks (it rebuilds loaders made with shuffle=True or shuffle=False); for a subset "
        f"wrap the dataset in torch.utils.data.Subset and shuffle it, otherwise shard the sampler "
        f"yourself by rank"
    )


def _check_batches(loader: DataLoader[Any], world_size: int) -> None:
    """drop_last=True with fewer samples than ranks x batch_size gives every rank zero batches."""
    if not loader.drop_last or loader.batch_size is None:
        return
    samples = len(loader.dataset)  # type: ignore[arg-type]
    share = samples // world_size
    if share < loader.batch_size:
        raise ValueError(
            f"the dataset has {samples} sample(s): with drop_last=True each of the {world_size} "
            f"rank(s) gets {share}, fewer than batch_size={loader.batch_size}, so every rank "
            f"would get zero batches; use drop_last=False, a batch_size of at most "
            f"{max(share, 1)}, fewer ranks, or more data"
        )


def _default_seed(loader: DataLoader[Any]) -> int:
    generator = getattr(loader.sampler, "generator", None) or loader.generator
    if isinstance(generator, torch.Generator):
        return int(generator.initial_seed())
    return int(torch.initial_seed())


_warned_unsharded = False


def check_dataloader(dataloader: Any) -> None:
    """prepare(dataloader=...) takes a DataLoader or None."""
    if dataloader is not None and not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"dataloader must be a torch.utils.data.DataLoader or None, got "
            f"{type(dataloader).__name__}"
        )


def warn_if_unsharded(dataloader: DataLoader[Any] | None, world: World) -> None:
    """Once per process: under several ranks, say so when every rank reads the whole dataset.
    An IterableDataset is not judged: it may split its stream by rank itself."""
    global _warned_unsharded
    if (
        dataloader is None
        or world.world_size < 2
        or _warned_unsharded
        or isinstance(dataloader.dataset, IterableDataset)
        or is_sharded(dataloader)
    ):
        return
    _warned_unsharded = True
    warnings.warn(
        f"the dataloader passed to prepare() is not sharded across the {world.world_size} ranks "
        f"(its sampler is a {type(dataloader.sampler).__name__}): every rank reads the whole "
        f"dataset, so each step trains {world.world_size} times on the same samples; use "
        f"loader = autoshard.shard_dataloader(loader)",
        UserWarning,
        stacklevel=3,
    )
