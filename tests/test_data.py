"""shard_dataloader in one process (no process group): what it keeps, what it refuses, and the
epoch it advances; prepare(dataloader=...)'s argument check. The 2-rank behaviour (disjoint shares,
the warning) is in tests/test_ecosystem.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import autoshard
from autoshard._world import resolve
from autoshard.io.data import ShardedDataLoader, is_sharded, warn_if_unsharded

DATA = TensorDataset(torch.arange(10))


def _collate(rows: list[tuple[torch.Tensor]]) -> list[int]:
    return [int(r[0]) for r in rows]


def _order(loader: DataLoader) -> list[int]:
    return [i for batch in loader for i in batch]


def test_keeps_the_loader_settings() -> None:
    generator = torch.Generator().manual_seed(7)
    loader = DataLoader(
        DATA, batch_size=3, shuffle=True, drop_last=True, collate_fn=_collate, generator=generator
    )
    sharded = autoshard.shard_dataloader(loader)
    assert isinstance(sharded, ShardedDataLoader)
    assert isinstance(sharded.sampler, DistributedSampler)
    assert (sharded.batch_size, sharded.drop_last, sharded.collate_fn) == (3, True, _collate)
    assert sharded.generator is generator
    assert sharded.sampler.shuffle and sharded.sampler.drop_last
    assert sharded.sampler.seed == 7  # the generator's seed
    assert (sharded.sampler.num_replicas, sharded.sampler.rank) == (1, 0)  # no process group
    assert len(sharded) == 3  # 10 samples, batches of 3, the last one dropped


def test_sequential_loader_stays_in_order_and_keeps_workers() -> None:
    loader = DataLoader(DATA, batch_size=4, num_workers=1, persistent_workers=True)
    sharded = autoshard.shard_dataloader(loader)
    assert not sharded.sampler.shuffle
    assert sharded.num_workers == 1 and sharded.persistent_workers
    assert sharded.prefetch_factor == 2  # DataLoader's default with workers
    assert [b[0].tolist() for b in sharded] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_each_pass_is_the_next_epoch_and_set_epoch_rewinds() -> None:
    loader = DataLoader(DATA, batch_size=2, shuffle=True, collate_fn=_collate)
    sharded = autoshard.shard_dataloader(loader, seed=3)
    first, second = _order(sharded), _order(sharded)
    assert sharded.epoch == 1
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # epoch 1 reshuffled
    sharded.set_epoch(0)
    assert _order(sharded) == first and sharded.epoch == 0
    assert _order(sharded) == second  # and it goes on from there
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        sharded.set_epoch(-1)


def test_already_sharded_loaders_are_returned_as_they_are() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0)
    plain = DataLoader(DATA, batch_size=2, sampler=sampler)
    assert autoshard.shard_dataloader(plain) is plain
    ours = autoshard.shard_dataloader(DataLoader(DATA, batch_size=2))
    assert autoshard.shard_dataloader(ours) is ours
    batched = DataLoader(DATA, batch_sampler=BatchSampler(sampler, 2, drop_last=False))
    assert is_sharded(batched) and autoshard.shard_dataloader(batched) is batched


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(3))


class _MyLoader(DataLoader):
    pass


@pytest.mark.parametrize(
    ("loader", "error", "message"),
    [
        ("not a loader", TypeError, "loader must be a torch.utils.data.DataLoader, got str"),
        (DataLoader(_Stream()), ValueError, "loader reads an IterableDataset"),
        (_MyLoader(DATA), ValueError, "loader is a _MyLoader, a DataLoader subclass"),
        (
            DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 2, False)),
            ValueError,
            "loader uses a custom batch_sampler",
        ),
        (
            DataLoader(DATA, sampler=WeightedRandomSampler([1.0] * 10, 10)),
            ValueError,
            "loader's sampler is a WeightedRandomSampler",
        ),
        (
            DataLoader(DATA, sampler=RandomSampler(DATA, replacement=True)),
            ValueError,
            "loader's sampler is a RandomSampler",
        ),
    ],
)
def test_refuses_what_it_cannot_rebuild(loader: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        autoshard.shard_dataloader(loader)  # type: ignore[arg-type]


def test_seed_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="seed must be an int or None, got '1'"):
        autoshard.shard_dataloader(DataLoader(DATA), seed="1")  # type: ignore[arg-type]


def test_prepare_refuses_a_dataloader_of_the_wrong_type() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="dataloader must be a torch.utils.data.DataLoader or None"):
        autoshard.prepare(model, optimizer, torch.randn(2, 2), dataloader=[1, 2])  # type: ignore[arg-type]


def test_one_process_does_not_warn_about_an_unsharded_loader() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unsharded(DataLoader(DATA), resolve(init=False))
        autoshard.prepare(
            model, optimizer, torch.randn(2, 2), dataloader=DataLoader(DATA), trial_step=False
        )
