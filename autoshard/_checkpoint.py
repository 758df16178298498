"""save() and load(): checkpoints that move between strategies and world sizes.

Built on torch.distributed.checkpoint (DCP, see _dcp.py), which reshards on load: a checkpoint
written by FULL_SHARD on 8 ranks loads into DDP on 2 or into one plain process. This module checks
the arguments (agreeing across ranks, so that none is left waiting in a collective) and makes the
write atomic.

A save is atomic. Every rank writes into a hidden sibling directory `.<name>.autoshard-partial`;
once DCP has finished (its `.metadata` is written last, by the coordinator, after every rank's
data), rank 0 writes the marker file `autoshard.json` and renames the directory into place. An
existing checkpoint at the path is first renamed aside to `.<name>.autoshard-old` and deleted only
after the new one is in place. `load` refuses a directory without the marker, so an interrupted
save never loads as complete; the next `save` to the same path clears what it left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard._dcp import Saved, dcp_errors, read, write
from autoshard._optim import unowned_parameters
from autoshard._world import World, resolve

MARKER = "autoshard.json"
_DCP_METADATA = ".metadata"
FORMAT = 1


def save(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Write the model's parameters and buffers and the optimizer's state to directory `path`.

    Call it on every rank (it is collective). The tensors are saved as each rank holds them
    (FSDP2 shards stay shards, DDP's replicas are written once), keyed by the plain module's
    names, so `load` can read them under any strategy and world size, or in one process.

    Args:
        path: the checkpoint directory, on a filesystem every rank sees. Missing parent
            directories are created. An existing checkpoint there is replaced atomically; any
            other existing file or non-empty directory is refused.
        model: the module as `prepare` returned it (DistributedDataParallel, an FSDP2 module or a
            plain module).
        optimizer: the optimizer to save with it, or None for the model only. An optimizer that
            has not stepped yet is saved without state (its hyper-parameters only).

    Returns:
        The checkpoint's path.

    Raises:
        TypeError, ValueError: bad arguments (on every rank, before anything is written).
        RuntimeError: writing failed on some rank (on every rank; a checkpoint already at `path`
            is unchanged).
    """
    world = resolve(init=True)
    target: Path | None = None
    error: Exception | None = None
    try:
        target = _check_path(path)
        _check_save_target(target)
        _check_model_and_optimizer(model, optimizer)
    except (TypeError, ValueError) as caught:
        error = caught
    _raise_everywhere(world, error)
    assert target is not None  # else _raise_everywhere raised
    partial, old = _siblings(target)
    _on_rank0(world, lambda: _clear_leftovers(target, partial, old))
    with dcp_errors(f"save to {str(target)!r}", "a checkpoint already there is unchanged"):
        write(partial, model, optimizer, world)
    marker = {
        "format": FORMAT,
        "torch": torch.__version__,
        "world_size": world.world_size,
        "model": type(model).__name__,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }
    _on_rank0(world, lambda: _publish(partial, target, old, marker))
    return target


def load(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read a checkpoint written by `save` into `model` (and `optimizer`), in place.

    Call it on every rank (it is collective), after `prepare` or on the plain module in one
    process: the checkpoint is resharded to however `model` is laid out now.

    Args:
        path: a directory written by `autoshard.save`.
        model: DistributedDataParallel, an FSDP2 module or a plain module, with the same parameter
            names and shapes as the saved one.
        optimizer: receives the saved state and hyper-parameters (learning rate included), or
            None to load the model only.

    Raises:
        TypeError, ValueError: bad arguments, a path that is not a complete checkpoint, or a
            model whose names or shapes differ from the checkpoint's (on every rank, before the
            model or optimizer is changed), or an optimizer of another class or options.
        RuntimeError: reading failed on some rank.
    """
    world = resolve(init=True)
    error: Exception | None = None
    try:
        checkpoint = _check_path(path)
        _check_model_and_optimizer(model, optimizer)
        marker = _read_marker(checkpoint)
        _check_optimizer_class(optimizer, marker.get("optimizer"), checkpoint)
        saved = Saved.read(checkpoint)
        _check_model_matches(model, saved.shapes, checkpoint)
    except (TypeError, ValueError) as caught:
        error = caught
    _raise_everywhere(world, error)
    read(checkpoint, model, optimizer, saved, world)


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
    if target.is_dir() and not (target / MARKER).exists() and any(target.iterdir()):
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
    if not checkpoint.is_dir():
        _, old = _siblings(checkpoint)
        hint = (
            f"; a save that was interrupted while replacing it left the previous checkpoint at "
            f"{str(old)!r} (the next save to this path puts it back first)"
            if old.is_dir()
            else ""
        )
        raise ValueError(f"no checkpoint directory at {str(checkpoint)!r}{hint}")
    marker = checkpoint / MARKER
    if not marker.exists() or not (checkpoint / _DCP_METADATA).exists():
        raise ValueError(
            f"{str(checkpoint)!r} is not a complete autoshard checkpoint (no {MARKER} or "
            f"{_DCP_METADATA}): it was not written by autoshard.save, or its save did not finish; "
            f"load an earlier checkpoint"
        )
    content: dict[str, Any] = json.loads(marker.read_text())
    if content.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has format {content.get('format')!r}, this autoshard "
            f"reads format {FORMAT}; load it with the autoshard version that wrote it"
        )
    return content


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


def _raise_everywhere(world: World, error: Exception | None) -> None:
    if not world.distributed:
        if error is not None:
            raise error
        return
    messages: list[Any] = [None] * world.world_size
    own = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(messages, own)
    if error is not None:
        raise error
    failed = next(((r, m) for r, m in enumerate(messages) if m is not None), None)
    if failed is not None:
        rank, (kind, message) = failed
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        raise cls(f"rank {rank} failed ({kind}): {message}")


def _on_rank0(world: World, action: Any) -> None:
    """Run `action` on rank 0 only; every rank returns (or raises) once it is done."""
    error: Exception | None = None
    if world.rank == 0:
        try:
            action()
        except OSError as caught:
            error = caught
    _raise_everywhere(world, error)


# ---------------------------------------------------------------------------------------------
# Writing and reading


def _siblings(target: Path) -> tuple[Path, Path]:
    """Where a save writes before it is complete, and where it moves the checkpoint it replaces."""
    return (
        target.parent / f".{target.name}.autoshard-partial",
        target.parent / f".{target.name}.autoshard-old",
    )


def _clear_leftovers(target: Path, partial: Path, old: Path) -> None:
    """Undo what an interrupted save left: a half-written directory is deleted; a checkpoint
    renamed aside is put back if nothing replaced it, else deleted (the replacement is complete)."""
    if partial.exists():
        shutil.rmtree(partial)
    if old.exists():
        if target.exists():
            shutil.rmtree(old)
        else:
            old.rename(target)
    target.parent.mkdir(parents=True, exist_ok=True)


def _publish(partial: Path, target: Path, old: Path, marker: dict[str, Any]) -> None:
    """Mark the written directory complete, then move it into place (rank 0, after DCP finished:
    the coordinator writes DCP's metadata only once every rank's data is written)."""
    staged = partial / f"{MARKER}.tmp"
    with open(staged, "w") as handle:
        json.dump(marker, handle)
        handle.flush()
        os.fsync(handle.fileno())
    staged.rename(partial / MARKER)
    if target.exists():
        target.rename(old)
    partial.rename(target)
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
