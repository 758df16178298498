"""The torch.distributed.checkpoint (DCP) side of save() and load(): what a checkpoint holds,
writing a model and optimizer's state, and reading it back into whatever layout they have now.

`get_state_dict` names every tensor by the plain module's qualified names (DDP's `module.` prefix
dropped, FSDP2's DTensors kept sharded); `dcp.save` writes each rank's shards; `dcp.load` reads
whatever layout the checkpoint has into the loading layout, resharding as needed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from autoshard._world import World
from autoshard.collective import agree_here


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds, from DCP's metadata (no tensor is read)."""

    shapes: dict[str, torch.Size]  # the model's tensors: qualified name -> global shape
    optimizer_state: dict[str, set[str]]  # parameter name -> names of its state entries

    @staticmethod
    def read(checkpoint: Path) -> Saved:
        from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

        metadata = FileSystemReader(str(checkpoint)).read_metadata()
        shapes: dict[str, torch.Size] = {}
        optimizer_state: dict[str, set[str]] = {}
        # planner_data maps each flattened key to its path in the nested state dict
        for key, place in (metadata.planner_data or {}).items():
            entry = metadata.state_dict_metadata.get(key)
            if len(place) == 2 and place[0] == "model" and isinstance(entry, TensorStorageMetadata):
                shapes[str(place[1])] = entry.size
            elif len(place) == 4 and place[:2] == ("optimizer", "state"):
                optimizer_state.setdefault(str(place[2]), set()).add(str(place[3]))
        return Saved(shapes, optimizer_state)


def state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What `save` writes, named by the plain module's names (FSDP2 shards stay shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    stepped = bool(optimizer.state)
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
    finally:
        if not stepped:
            # get_state_dict gives a fresh optimizer state by running one zero step (step=1, zero
            # moments); that is not the caller's state: save none, leave the optimizer as it was.
            optimizer.state.clear()
    if not stepped:
        optim_state["state"] = {}
    return {"model": model_state, "optimizer": optim_state}


def write(partial: Path, state: dict[str, Any], world: World) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(partial), no_dist=not world.distributed)


def _entries_to_load(
    entries: dict[str, dict[str, Any]], saved: dict[str, set[str]]
) -> dict[str, dict[str, Any]]:
    """The optimizer's state entries that the checkpoint fills, checked to match it one for one.

    get_state_dict gives every trainable parameter state to load into (it runs a zero step on an
    optimizer that has none); a parameter saved without state keeps none.
    """
    for name, keys in saved.items():
        have = set(entries.get(name, ()))
        if have != keys:
            hint = (
                " (torch creates state to load into with a zero step, which it skips while "
                "parameters hold gradients: call optimizer.zero_grad(set_to_none=True) first)"
                if not have
                else ""
            )
            raise ValueError(
                f"the checkpoint holds optimizer state {sorted(keys)} for '{name}', the optimizer "
                f"has {sorted(have)} to load it into{hint}; build the optimizer with the same "
                f"options as the saved one"
            )
    return {name: values for name, values in entries.items() if name in saved}


@contextlib.contextmanager
def dcp_errors(action: str, consequence: str) -> Iterator[None]:
    """Around a DCP save or load: a failure on any rank becomes a RuntimeError on every rank.

    DCP gathers each rank's exception into a CheckpointException, which derives from
    BaseException (torch 2.13), so `except Exception` in a training script would miss it. It also
    warns on every single-process save and load, even when asked for one with `no_dist=True`: one
    process is a supported case here, not a mistake to warn about.
    """
    from torch.distributed.checkpoint import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as error:
        ranks = sorted(error.failures)
        first = error.failures[ranks[0]]
        cause = first[0] if isinstance(first, tuple) else first
        if isinstance(cause, BaseException):
            error.__cause__ = cause  # what disk_full looks at
        raise RuntimeError(
            f"{action} failed on rank(s) {ranks}: {type(cause).__name__}: {cause}; {consequence}"
        ) from error


def read(
    checkpoint: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    saved: Saved,
    world: World,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    no_dist = not world.distributed
    partly = "the model and optimizer may hold part of it: load again or rebuild them"
    if optimizer is None:
        # agreed before DCP's collective read: a rank failing here alone must not leave the
        # others waiting in it
        model_state = agree_here(world, "load()", lambda: get_model_state_dict(model))
        with dcp_errors(f"load from {str(checkpoint)!r}", partly):
            dcp.load({"model": model_state}, checkpoint_id=str(checkpoint), no_dist=no_dist)
        set_model_state_dict(model, model_state)
        return
    had_state = bool(optimizer.state)

    def states_here() -> tuple[dict[str, Any], dict[str, Any]]:
        model_state, full = get_state_dict(model, optimizer)
        optim_state = cast(dict[str, Any], full)
        optim_state["state"] = _entries_to_load(optim_state["state"], saved.optimizer_state)
        return model_state, optim_state

    try:
        model_state, optim_state = agree_here(world, "load()", states_here)
    except BaseException:
        if not had_state:
            optimizer.state.clear()  # undo get_state_dict's zero step
        raise
    with dcp_errors(f"load from {str(checkpoint)!r}", partly):
        dcp.load(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=str(checkpoint),
            no_dist=no_dist,
        )
    set_model_state_dict(model, model_state)
    # Not strict: torch would refuse a trainable parameter without saved state, which is what an
    # optimizer that never updated that parameter saves (the model's tensors were matched above).
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(strict=False))


def disk_full(error: BaseException, where: Path) -> OSError | None:
    """An OSError saying "no space left on device at <where>" when that is what `error` (or its
    cause) came from: ENOSPC or EDQUOT, or the short write torch's zip writer reports as
    "unexpected pos" on a full disk."""
    import errno
    import shutil

    seen: BaseException | None = error
    short_write = False
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        short_write = short_write or "unexpected pos" in str(seen)
        seen = seen.__cause__ or seen.__context__
    if seen is None and short_write:
        directory = where.parent if where.parent.exists() else Path(".")
        if shutil.disk_usage(directory).free < 64 << 20:
            seen = error
    if seen is None:
        return None
    return OSError(
        errno.ENOSPC,
        f"no space left on device at {str(where)!r} ({type(seen).__name__}: {seen}); free some "
        f"space or save elsewhere: a checkpoint already there is unchanged and the partial one "
        f"was removed",
    )
