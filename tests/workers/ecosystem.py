"""autoshard.save/load across strategies and world sizes, a save that fails mid-write, and
shard_dataloader / prepare(dataloader=) on 2 ranks.

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 ecosystem.py OUT_DIR
OUT_DIR/single holds a checkpoint written in one process (by tests/test_ecosystem.py) with its
tensors in OUT_DIR/single.pt. Each checkpoint this worker writes has its tensors, gathered to full
size, beside it in <name>.pt (written by rank 0 before the save, which synchronises the ranks).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Cases,
    ScalarNet,
    build,
    error_of,
    full,
    is_fsdp,
    local_batches,
    rank,
    train,
)
from torch.utils.data import DataLoader, TensorDataset

import autoshard

OUT = Path()  # set from the command line; the test imports this module for its helpers
STEPS = 3
SAVED_LR = 0.01  # the learning rate of every saved optimizer

cases = Cases()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, buffers and optimizer state at full size, by the plain module's names (a
    collective under FSDP2: call on every rank)."""
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    tensors = {
        n.removeprefix("module."): full(t).detach().clone() for n, t in model.state_dict().items()
    }
    state = {
        names[id(p)]: {k: full(v).detach().clone() for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    return {"tensors": tensors, "state": state, "lr": optimizer.param_groups[0]["lr"]}


def differences(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Names whose tensors are not bitwise equal (or missing), for the test to print."""
    problems = []
    for name, tensor in expected["tensors"].items():
        other = actual["tensors"].get(name)
        if other is None or not torch.equal(other, tensor):
            problems.append(name)
    if set(actual["state"]) != set(expected["state"]):
        problems.append(f"state keys {sorted(actual['state'])} != {sorted(expected['state'])}")
    for name, values in expected["state"].items():
        for key, tensor in values.items():
            other = actual["state"].get(name, {}).get(key)
            if other is None or not torch.equal(other, tensor):
                problems.append(f"{name}.{key}")
    if actual["lr"] != expected["lr"]:
        problems.append(f"lr {actual['lr']} != {expected['lr']}")
    return problems


def prepared(
    strategy: str, lr: float = 0.05, cls: type[torch.nn.Module] | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model (`_common.Net`, or `cls`), wrapped; by default with another learning rate
    than the saved one, which load must restore."""
    model, optimizer = build(lr=lr) if cls is None else build(lr=lr, cls=cls)
    wrapped, optimizer, _ = autoshard.prepare(
        model,
        optimizer,
        local_batches(1)[0],
        strategy=strategy,
        mixed_precision="no",
        trial_step=False,
    )
    return wrapped, optimizer


def save_with_reference(
    name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path | None = None
) -> None:
    out = OUT if out is None else out
    reference = full_state(model, optimizer)
    if not dist.is_initialized() or rank() == 0:
        torch.save(reference, out / f"{name}.pt")
    autoshard.save(out / name, model, optimizer)


def loaded_matches(
    name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path | None = None
) -> list[str]:
    out = OUT if out is None else out
    autoshard.load(out / name, model, optimizer)
    return differences(full_state(model, optimizer), torch.load(out / f"{name}.pt"))


# ---------------------------------------------------------------------------------------------
# Checkpoints: FULL_SHARD on 2 ranks -> DDP on 2 ranks -> one process (the test), and back


@cases.case
def full_shard_saves() -> dict[str, Any]:
    model, optimizer = prepared("full_shard", lr=SAVED_LR)
    train(model, optimizer, local_batches(STEPS))
    save_with_reference("fsdp", model, optimizer)
    return {"is_fsdp": is_fsdp(model), "state_entries": len(optimizer.state)}


@cases.case
def ddp_loads_full_shard() -> dict[str, Any]:
    model, optimizer = prepared("ddp")
    before = full_state(model, optimizer)
    problems = loaded_matches("fsdp", model, optimizer)
    changed = differences(before, full_state(model, optimizer))
    # go on training under DDP and save again, for the single process to load
    train(model, optimizer, local_batches(STEPS))
    save_with_reference("ddp", model, optimizer)
    return {"type": type(model).__name__, "problems": problems, "changed": len(changed)}


@cases.case
def scalars_round_trip() -> dict[str, Any]:
    """A model with parameters of no dimension (kept whole by FSDP2) saved under FULL_SHARD,
    loaded under FULL_SHARD and under DDP."""
    model, optimizer = prepared("full_shard", lr=SAVED_LR, cls=ScalarNet)
    train(model, optimizer, local_batches(STEPS))
    save_with_reference("scalars", model, optimizer)
    found = {}
    for strategy in ("full_shard", "ddp"):
        model, optimizer = prepared(strategy, cls=ScalarNet)
        found[strategy] = loaded_matches("scalars", model, optimizer)
    return found


@cases.case
def full_shard_loads_one_process() -> dict[str, Any]:
    model, optimizer = prepared("full_shard")
    return {"is_fsdp": is_fsdp(model), "problems": loaded_matches("single", model, optimizer)}


@cases.case
def full_shard_loads_its_own() -> dict[str, Any]:
    model, optimizer = prepared("full_shard")
    return {"problems": loaded_matches("fsdp", model, optimizer)}


# ---------------------------------------------------------------------------------------------
# A save that fails while writing leaves the checkpoint it would have replaced intact


@cases.case
def failed_save_keeps_the_old_checkpoint() -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = prepared("ddp", lr=SAVED_LR)
    train(model, optimizer, local_batches(STEPS))
    save_with_reference("atomic", model, optimizer)  # the complete, older checkpoint
    train(model, optimizer, local_batches(1))  # newer state, which the failed save must not leave
    original = FileSystemWriter.write_data

    def crash(self: Any, plan: Any, planner: Any) -> Any:
        if rank() == 1:  # one rank dies mid-write, after the other began writing
            raise OSError("simulated crash while writing")
        return original(self, plan, planner)

    FileSystemWriter.write_data = crash  # type: ignore[method-assign]
    try:
        failed = error_of(lambda: autoshard.save(OUT / "atomic", model, optimizer))
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]
    partial = OUT / ".atomic.autoshard-partial"
    left = partial.is_dir()
    refused = error_of(lambda: autoshard.load(partial, model, optimizer))
    fresh, fresh_optimizer = prepared("ddp")
    problems = loaded_matches("atomic", fresh, fresh_optimizer)
    autoshard.save(OUT / "atomic", model, optimizer)  # the next save clears what was left
    return {
        "failed": failed,
        "partial_left": left,
        "refused": refused,
        "problems": problems,
        "partial_after_next_save": partial.exists(),
        "siblings": sorted(p.name for p in OUT.iterdir() if "atomic" in p.name),
    }


@cases.case
def bad_path_on_one_rank_raises_on_both() -> dict[str, Any]:
    model, optimizer = prepared("ddp")
    before = full_state(model, optimizer)
    bad = 42 if rank() == 1 else None  # rank 0's paths are fine
    return {
        "save": error_of(lambda: autoshard.save(bad or OUT / "never", model, optimizer)),
        "load": error_of(lambda: autoshard.load(bad or OUT / "fsdp", model, optimizer)),
        "written": (OUT / "never").exists(),
        "changed": differences(full_state(model, optimizer), before),
    }


# ---------------------------------------------------------------------------------------------
# shard_dataloader: disjoint shares of one permutation, batching kept


def _collate(rows: list[tuple[torch.Tensor]]) -> list[int]:
    return [int(r[0]) for r in rows]


def _passes(size: int, drop_last: bool, seed_per_rank: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(100 + (rank() if seed_per_rank else 0))
    loader = DataLoader(
        TensorDataset(torch.arange(size)),
        batch_size=4,
        shuffle=True,
        drop_last=drop_last,
        collate_fn=_collate,
        generator=generator,
    )
    sharded = autoshard.shard_dataloader(loader)
    epochs = [[batch for batch in sharded] for _ in range(2)]
    return {
        "type": type(sharded).__name__,
        "len": len(sharded),
        "batch_size": sharded.batch_size,
        "drop_last": sharded.drop_last,
        "collate_is_kept": sharded.collate_fn is _collate,
        "epochs": epochs,
        "epoch": getattr(sharded, "epoch", None),
    }


cases.case(lambda: _passes(24, drop_last=False), name="shards_even")
cases.case(lambda: _passes(21, drop_last=False), name="shards_uneven")
cases.case(lambda: _passes(21, drop_last=True), name="shards_uneven_drop_last")
cases.case(lambda: _passes(24, drop_last=False, seed_per_rank=True), name="shards_seed_of_rank0")


@cases.case
def prepare_warns_once_about_an_unsharded_loader() -> dict[str, Any]:
    data = TensorDataset(torch.arange(8))
    counts = []
    for loader in (
        autoshard.shard_dataloader(DataLoader(data, batch_size=2, shuffle=True)),
        DataLoader(data, batch_size=2, shuffle=True),
        DataLoader(data, batch_size=2),
    ):
        model, optimizer = build()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autoshard.prepare(
                model, optimizer, local_batches(1)[0], dataloader=loader, trial_step=False
            )
        counts.append([str(w.message) for w in caught if "not sharded" in str(w.message)])
    dist.barrier()
    return {"messages": counts}


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    cases.main()
