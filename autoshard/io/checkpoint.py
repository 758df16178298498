"""save() and load(): checkpoints that move between strategies and world sizes, and cannot lie.

Built on torch.distributed.checkpoint (DCP, see dcp.py), which reshards on load: a checkpoint
written by FULL_SHARD on 8 ranks loads into DDP on 2 or into one plain process. This module checks
the arguments, agreeing across ranks (`collective`: whatever fails on one rank raises on every rank,
none waits), and `io.layout` makes the write atomic and checksummed:

- `save` writes into a hidden sibling directory and publishes it with renames, so `load(path)`
  reads the old checkpoint or the new one, whole, whenever the save is killed; a failed save
  removes what it wrote (and says "no space left on device at <path>" when that was the cause);
  nothing autoshard did not write is deleted (a user's files inside a checkpoint are carried
  into the new one; a directory that is not an autoshard checkpoint is refused).
- `load` verifies every file against the sha256 the save recorded before anything is changed,
  checks that every rank reads the same checkpoint, and puts the model and optimizer back as
  they were if reading fails part way.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard._world import World, resolve
from autoshard.collective import PeerTimeout, agree, agree_here
from autoshard.decide.optimizer import unowned_parameters
from autoshard.io.dcp import Saved, dcp_errors, disk_full, read, state_to_save, write
from autoshard.io.layout import (
    DCP_METADATA,
    MARKER,
    carry_user_files,
    clear_leftovers,
    locate,
    new_marker,
    owned_by_autoshard,
    publish,
    read_marker,
    remove_partial,
    sha256_of,
    share,
    siblings,
    verify,
)
from autoshard.wrap.snapshot import restore, take_snapshot


def save(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Write the model's parameters and buffers and the optimizer's state to directory `path`.

    Call it on every rank (it is collective). The tensors are saved as each rank holds them
    (FSDP2 shards stay shards, DDP's replicas are written once), keyed by the plain module's
    names, so `load` can read them under any strategy and world size, or in one process.

    Args:
        path: the checkpoint directory, on a filesystem every rank sees. Missing parent
            directories are created. An existing checkpoint there is replaced atomically (files
            you added inside it are kept); a symbolic link there is replaced, not what it points
            to; any other existing file or non-empty directory is refused.
        model: the module as `prepare` returned it (DistributedDataParallel, an FSDP2 module or a
            plain module).
        optimizer: the optimizer to save with it, or None for the model only. An optimizer that
            has not stepped yet is saved without state (its hyper-parameters only).

    Returns:
        The checkpoint's path.

    Raises:
        TypeError, ValueError: bad arguments (on every rank, before anything is written).
        OSError: no space left on device at `path` (errno ENOSPC), on every rank.
        RuntimeError: writing failed on some rank (on every rank). Whatever failed, a
            checkpoint already at `path` is unchanged and the partial one is removed.
    """
    world = resolve(init=True)

    def check_here() -> Path:
        target = _check_path(path)
        _check_save_target(target)
        _check_model_and_optimizer(model, optimizer)
        return target

    target = agree_here(world, "save()", check_here)
    partial, old = siblings(target)
    _on_rank0(world, lambda: clear_leftovers(target, partial, old))
    info = {
        "torch": torch.__version__,
        "world_size": world.world_size,
        "model": type(model).__name__,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }
    try:
        # Built (and any failure agreed) before DCP's first collective.
        state = agree_here(world, "save()", lambda: state_to_save(model, optimizer))
        with dcp_errors(f"save to {str(target)!r}", "a checkpoint already there is unchanged"):
            write(partial, state, world)
        del state
        files = _checksums(partial, world)
        _on_rank0(world, lambda: _finish(partial, target, old, new_marker(files, info)))
    except BaseException as error:
        # Every rank is past writing (DCP and the agreements end together); with a peer gone,
        # rank 0 removes it without waiting for the others.
        with contextlib.suppress(Exception):
            if isinstance(error, PeerTimeout):
                if world.rank == 0:
                    remove_partial(partial)
            else:
                _on_rank0(world, lambda: remove_partial(partial))
        full = disk_full(error, target)
        if full is not None:
            raise full from error
        raise
    return target


def _checksums(partial: Path, world: World) -> dict[str, str]:
    """Every written file's sha256, each rank hashing a share of them."""

    def hash_share() -> dict[str, str]:
        names = [p.name for p in partial.iterdir() if p.is_file()]
        mine = share(names, world.rank, world.world_size)
        return {name: sha256_of(partial / name) for name in mine}

    files: dict[str, str] = {}
    for part in agree(world, "save()", hash_share):
        files.update(part)
    return files


def _finish(partial: Path, target: Path, old: Path, marker: dict[str, Any]) -> None:
    carry_user_files(target, partial)
    publish(partial, target, old, marker)


def load(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read a checkpoint written by `save` into `model` (and `optimizer`), in place.

    Call it on every rank (it is collective), after `prepare` or on the plain module in one
    process: the checkpoint is resharded to however `model` is laid out now. Every file is checked
    against the checksum its save recorded before anything is changed; if reading fails part way,
    the model and optimizer are put back as they were (from a host copy of this rank's share).

    Args:
        path: a directory written by `autoshard.save` (or a symbolic link to one).
        model: DistributedDataParallel, an FSDP2 module or a plain module, with the same parameter
            names and shapes as the saved one.
        optimizer: receives the saved state and hyper-parameters (learning rate included), or
            None to load the model only.

    Raises:
        TypeError, ValueError: bad arguments, a path that is not a complete checkpoint, a damaged
            checkpoint (naming the file), ranks that see different checkpoints at `path`, or a
            model whose names or shapes differ from the checkpoint's (on every rank, before the
            model or optimizer is changed), or an optimizer of another class or options.
        RuntimeError: reading failed on some rank (the model and optimizer are unchanged).
    """
    world = resolve(init=True)

    def check_here() -> tuple[Path, str, Saved, str | None]:
        _check_model_and_optimizer(model, optimizer)
        checkpoint, note = locate(_check_path(path))
        marker = _read_marker(checkpoint)
        verify(checkpoint, marker, world.rank, world.world_size)
        _check_optimizer_class(optimizer, marker.get("optimizer"), checkpoint)
        saved = _read_metadata(checkpoint)
        _check_model_matches(model, saved.shapes, checkpoint)
        return checkpoint, str(marker["id"]), saved, note

    answers = agree(world, "load()", check_here)
    checkpoint, _, saved, note = answers[world.rank if world.distributed else 0]
    ids = {a[1] for a in answers}
    if len(ids) > 1:
        raise ValueError(
            f"the ranks see different checkpoints at {str(path)!r} (a save to it ran while they "
            f"looked, or their filesystems differ); every rank must load the same checkpoint: "
            f"load again once no save is running, from a path every rank sees alike"
        )
    if note is not None and world.rank == 0:
        warnings.warn(note, UserWarning, stacklevel=2)
    kept = take_snapshot(model, optimizer, torch.device("cpu"))
    try:
        read(checkpoint, model, optimizer, saved, world)
    except BaseException:
        restore(kept, model, optimizer, torch.device("cpu"), clear_grads=False)
        raise


def _read_metadata(checkpoint: Path) -> Saved:
    try:
        return Saved.read(checkpoint)
    except Exception as error:  # the checksums matched: written by a torch this one cannot read
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} cannot be read: DCP's {DCP_METADATA} fails to load "
            f"({type(error).__name__}: {error}); it was written by torch {torch.__version__!r} "
            f"or another version: load it with the torch that wrote it"
        ) from error


# ---------------------------------------------------------------------------------------------
# Argument checks: each names the problem and the fix


def _check_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a str or os.PathLike naming a checkpoint directory, got "
            f"{type(path).__name__}"
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"path must be a text path, got bytes {text!r}; decode it first")
    if not text:
        raise ValueError("path is empty; give the checkpoint directory, e.g. 'checkpoints/step100'")
    return Path(text)


def _check_save_target(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise ValueError(
            f"path {str(target)!r} exists and is not a directory; save writes a checkpoint "
            f"directory: choose another path or remove the file"
        )
    if not target.is_dir() or not any(target.iterdir()):
        return
    if owned_by_autoshard(target) is None:  # raises for a marker autoshard did not write
        raise ValueError(
            f"path {str(target)!r} is a non-empty directory that is not an autoshard checkpoint "
            f"(no {MARKER}); save replaces the directory it writes to, so choose another path or "
            f"empty it yourself"
        )


def _check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.DataParallel):
        raise ValueError(
            "model is wrapped in torch.nn.DataParallel, whose parameter names carry a 'module.' "
            "prefix that other layouts lack; pass model.module"
        )
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    foreign = unowned_parameters(model, optimizer)
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that model does not own; pass the "
            f"model and optimizer that prepare() returned together (the optimizer is re-bound to "
            f"the wrapped parameters)"
        )


def _check_optimizer_class(optimizer: Any, saved: str | None, where: Path) -> None:
    if optimizer is None:
        return
    if saved is None:
        raise ValueError(
            f"checkpoint {str(where)!r} holds no optimizer state (it was saved without an "
            f"optimizer); call load(path, model) to load the model only"
        )
    if type(optimizer).__name__ != saved:
        raise ValueError(
            f"checkpoint {str(where)!r} holds {saved} state, the optimizer is a "
            f"{type(optimizer).__name__}; build the optimizer it was saved from, or call "
            f"load(path, model) to load the model only"
        )


def _read_marker(checkpoint: Path) -> dict[str, Any]:
    if not (checkpoint / MARKER).exists() or not (checkpoint / DCP_METADATA).exists():
        raise ValueError(
            f"{str(checkpoint)!r} is not a complete autoshard checkpoint (no {MARKER} or "
            f"{DCP_METADATA}): it was not written by autoshard.save, or its save did not finish; "
            f"load an earlier checkpoint"
        )
    return read_marker(checkpoint)


def _check_model_matches(model: nn.Module, saved: dict[str, torch.Size], where: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict[str, Any] = get_model_state_dict(model)
    current = {k: v.shape for k, v in state.items()}
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(where)!r} does not match the model: {len(missing)} tensor(s) of the "
            f"model are not in it {missing[:3]}, {len(unexpected)} saved tensor(s) are not in "
            f"the model {unexpected[:3]}; load it into the same architecture that saved it"
        )
    wrong = [(k, tuple(saved[k]), tuple(s)) for k, s in current.items() if saved[k] != s]
    if wrong:
        name, was, now = wrong[0]
        raise ValueError(
            f"checkpoint {str(where)!r} does not match the model: {len(wrong)} tensor(s) differ "
            f"in shape, e.g. '{name}' saved as {was}, model has {now}; load it into the same "
            f"architecture that saved it"
        )


# ---------------------------------------------------------------------------------------------
# Agreement: every rank raises when any rank must, instead of leaving the others in a collective


def _on_rank0(world: World, action: Any) -> None:
    """Run `action` on rank 0 only; every rank returns (or raises) once it is done."""
    agree(world, "save()", lambda: action() if world.rank == 0 else None)
