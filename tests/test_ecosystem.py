"""Checkpoints and data on 2 gloo ranks (tests/workers/ecosystem.py, one torchrun launch), and
the checkpoints they write loaded back here, in this one process with no process group.

The round trip: a checkpoint written in this process and one written by FULL_SHARD on 2 ranks are
loaded by FULL_SHARD and DDP on 2 ranks; DDP trains on and saves; this process loads the DDP and
FULL_SHARD checkpoints into the plain module. Every load must give back the saved parameters,
buffers, optimizer state (AdamW's exp_avg, exp_avg_sq, step) and learning rate bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _dist import Launch, launch

sys.path.insert(0, str(Path(__file__).parent / "workers"))

import ecosystem  # noqa: E402
from _common import ScalarNet, build, global_batches, train  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("ecosystem"))


@pytest.fixture(scope="module")
def run(out: Path) -> Launch:
    # One process, the whole global batch: what the 2-rank FULL_SHARD run loads.
    model, optimizer = build(lr=ecosystem.SAVED_LR)
    train(model, optimizer, global_batches(ecosystem.STEPS))
    ecosystem.save_with_reference("single", model, optimizer, out)
    return launch("ecosystem", out)


def _no_problems(ranks: list[dict[str, Any]]) -> None:
    for r, data in enumerate(ranks):
        assert data["problems"] == [], f"rank {r}: not bitwise equal: {data['problems']}"


def test_launch_finished_cleanly(run: Launch) -> None:
    if run.timed_out or run.returncode != 0:
        pytest.fail(run.report("the launch did not finish cleanly"), pytrace=False)


def test_full_shard_checkpoint_loads_under_ddp(run: Launch) -> None:
    assert all(r["is_fsdp"] and r["state_entries"] > 0 for r in run.case("full_shard_saves"))
    ranks = run.case("ddp_loads_full_shard")
    assert {r["type"] for r in ranks} == {"DistributedDataParallel"}
    assert all(r["changed"] > 0 for r in ranks), "the fresh model already equalled the checkpoint"
    _no_problems(ranks)


def test_one_process_checkpoint_loads_under_full_shard(run: Launch) -> None:
    ranks = run.case("full_shard_loads_one_process")
    assert all(r["is_fsdp"] for r in ranks)
    _no_problems(ranks)


def test_full_shard_checkpoint_loads_under_full_shard(run: Launch) -> None:
    _no_problems(run.case("full_shard_loads_its_own"))


def test_a_checkpoint_of_parameters_of_no_dimension_loads_under_full_shard_and_ddp(
    run: Launch, out: Path
) -> None:
    """FSDP2 keeps them whole (`engines._kept_whole`): plain tensors beside the DTensors."""
    for r, data in enumerate(run.case("scalars_round_trip")):
        assert data == {"full_shard": [], "ddp": []}, f"rank {r}: not bitwise equal: {data}"
    model, optimizer = build(lr=0.05, cls=ScalarNet)
    assert ecosystem.loaded_matches("scalars", model, optimizer, out) == []


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_rank_checkpoints_load_in_one_process(run: Launch, out: Path, name: str) -> None:
    run.case("ddp_loads_full_shard")  # wrote both checkpoints
    model, optimizer = build(lr=0.05)
    assert ecosystem.loaded_matches(name, model, optimizer, out) == []


def test_failed_save_keeps_the_old_checkpoint(run: Launch) -> None:
    for r, data in enumerate(run.case("failed_save_keeps_the_old_checkpoint")):
        assert data["failed"]["raised"], f"rank {r}: the save with a crashing writer returned"
        assert data["failed"]["type"] == "RuntimeError"
        assert (
            "failed on rank(s) [1]: OSError: simulated crash while writing"
            in (data["failed"]["message"])
        )
        assert not data["partial_left"], "a failed save removes its partial directory"
        assert data["refused"]["type"] == "ValueError"
        assert "no checkpoint directory at" in data["refused"]["message"]
        assert data["problems"] == [], f"rank {r}: the old checkpoint changed: {data['problems']}"
        assert not data["partial_after_next_save"]
        assert data["siblings"] == ["atomic", "atomic.pt"]


def test_bad_argument_on_one_rank_raises_on_both(run: Launch) -> None:
    rank0, rank1 = run.case("bad_path_on_one_rank_raises_on_both")
    for call in ("save", "load"):
        assert rank1[call]["type"] == "TypeError"
        assert rank1[call]["message"].startswith("path must be a str or os.PathLike")
        assert rank0[call]["type"] == "TypeError"
        assert rank0[call]["message"].startswith(
            f"rank 1 failed in {call}() with TypeError: path must be"
        )
    assert not rank0["written"]
    assert rank0["changed"] == rank1["changed"] == []


def _shares(run: Launch, case: str) -> tuple[list[dict[str, Any]], list[list[list[int]]]]:
    """Each rank's data, and per epoch each rank's indices in the order read."""
    ranks = run.case(case)
    epochs = [[[i for batch in r["epochs"][e] for i in batch] for r in ranks] for e in range(2)]
    return ranks, epochs


def _assert_kept(ranks: list[dict[str, Any]], drop_last: bool) -> None:
    for r in ranks:
        assert r["type"] == "ShardedDataLoader" and r["epoch"] == 1
        assert (r["batch_size"], r["drop_last"], r["collate_is_kept"]) == (4, drop_last, True)
        assert len(r["epochs"][0]) == r["len"]
        full = r["epochs"][0][:-1] if not drop_last else r["epochs"][0]
        assert all(len(b) == 4 for b in full)


@pytest.mark.parametrize("case", ["shards_even", "shards_seed_of_rank0"])
def test_ranks_read_disjoint_shares_covering_the_dataset(run: Launch, case: str) -> None:
    ranks, epochs = _shares(run, case)
    _assert_kept(ranks, drop_last=False)
    for first, second in epochs:
        assert len(first) == len(second) == 12
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(24))
    assert epochs[0] != epochs[1], "the second pass did not reshuffle"


def test_uneven_dataset_pads_without_drop_last(run: Launch) -> None:
    ranks, epochs = _shares(run, "shards_uneven")
    _assert_kept(ranks, drop_last=False)
    for first, second in epochs:
        assert len(first) == len(second) == 11  # equal shares: 21 samples, one read twice
        assert set(first + second) == set(range(21))


def test_uneven_dataset_drops_the_remainder_with_drop_last(run: Launch) -> None:
    ranks, epochs = _shares(run, "shards_uneven_drop_last")
    _assert_kept(ranks, drop_last=True)
    for first, second in epochs:
        assert len(first) == len(second) == 8  # 10 samples each: two full batches of 4
        assert not set(first) & set(second)


def test_prepare_warns_once_about_an_unsharded_loader(run: Launch) -> None:
    for messages in (
        r["messages"] for r in run.case("prepare_warns_once_about_an_unsharded_loader")
    ):
        sharded, unsharded, again = messages
        assert sharded == [] and again == []
        assert len(unsharded) == 1
        assert "not sharded across the 2 ranks (its sampler is a RandomSampler)" in unsharded[0]
        assert "autoshard.shard_dataloader(loader)" in unsharded[0]
