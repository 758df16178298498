"""save() and load(): checkpoints that move between strategies and world sizes.

Built on torch.distributed.checkpoint (DCP): `get_state_dict` names every tensor by the plain
module's qualified names (DDP's `module.` prefix dropped, FSDP2's DTensors kept sharded), `dcp.save`
writes each rank's shards, and `dcp.load` reads whatever layout the checkpoint has into whatever
layout the loading model has (resharding as needed), so a checkpoint written by FULL_SHARD on 8
ranks loads into DDP on 2 or into one plain process.

A save is atomic. Every rank writes into a hidden sibling directory `.<name>.autoshard-partial`;
once DCP has finished (its `.metadata` is written last, by the coordinator, after every rank's
data), rank 0 writes the marker file `autoshard.json` and renames the directory into place. An
existing checkpoint at the path is first renamed aside to `.<name>.autoshard-old` and deleted only
after the new one is in place. `load` refuses a directory without the marker, so an interrupted
save never loads as complete; the next `save` to the same path clears what it left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
    with _dcp_errors(f"save to {str(target)!r}", "a checkpoint already there is unchanged"):
        _write(partial, model, optimizer, world)
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
            model or optimizer is changed).
    """
    world = resolve(init=True)
    error: Exception | None = None
    try:
        checkpoint = _check_path(path)
        _check_model_and_optimizer(model, optimizer)
        marker = _read_marker(checkpoint)
        if optimizer is not None and marker.get("optimizer") is None:
            raise ValueError(
                f"checkpoint {str(checkpoint)!r} holds no optimizer state (it was saved without "
                f"an optimizer); call load(path, model) to load the model only"
            )
        saved = _Saved.read(checkpoint)
        _check_model_matches(model, saved.shapes, checkpoint)
    except (TypeError, ValueError) as caught:
        error = caught
    _raise_everywhere(world, error)
    _read(checkpoint, model, optimizer, saved, world)


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


@dataclass(frozen=True)
class _Saved:
    """What a checkpoint holds, from DCP's metadata (no tensor is read)."""

    shapes: dict[str, torch.Size]  # the model's tensors: qualified name -> global shape
    optimizer_state: set[tuple[str, str]]  # (parameter name, state name) of each state entry

    @staticmethod
    def read(checkpoint: Path) -> _Saved:
        from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

        metadata = FileSystemReader(str(checkpoint)).read_metadata()
        shapes, optimizer_state = {}, set()
        # planner_data maps each flattened key to its path in the nested state dict
        for key, place in (metadata.planner_data or {}).items():
            entry = metadata.state_dict_metadata.get(key)
            if len(place) == 2 and place[0] == "model" and isinstance(entry, TensorStorageMetadata):
                shapes[str(place[1])] = entry.size
            elif len(place) == 4 and place[:2] == ("optimizer", "state"):
                optimizer_state.add((str(place[2]), str(place[3])))
        return _Saved(shapes, optimizer_state)


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


def _write(
    partial: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, world: World
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict[str, Any]
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        stepped = bool(optimizer.state)
        model_state, optim_state = get_state_dict(model, optimizer)
        if not stepped:
            # get_state_dict gives a fresh optimizer state by running one zero step (step=1, zero
            # moments); that is not the caller's state: save none and leave the optimizer as it was.
            optimizer.state.clear()
            optim_state["state"] = {}
        state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=str(partial), no_dist=not world.distributed)


@contextlib.contextmanager
def _dcp_errors(action: str, consequence: str) -> Iterator[None]:
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
        raise RuntimeError(
            f"{action} failed on rank(s) {ranks}: {type(cause).__name__}: {cause}; {consequence}"
        ) from error


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


def _read(
    checkpoint: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    saved: _Saved,
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
        model_state = get_model_state_dict(model)
        with _dcp_errors(f"load from {str(checkpoint)!r}", partly):
            dcp.load({"model": model_state}, checkpoint_id=str(checkpoint), no_dist=no_dist)
        set_model_state_dict(model, model_state)
        return
    # get_state_dict gives every parameter state to load into (it runs a zero step on an optimizer
    # that has none); keep only what the checkpoint holds, so that a parameter saved without state
    # is loaded without state.
    model_state, optim_state = get_state_dict(model, optimizer)
    entries: dict[str, dict[str, Any]] = optim_state["state"]  # type: ignore[assignment]
    held = saved.optimizer_state
    optim_state["state"] = {
        name: {k: v for k, v in values.items() if (name, k) in held}
        for name, values in entries.items()
        if any((name, k) in held for k in values)
    }
    with _dcp_errors(f"load from {str(checkpoint)!r}", partly):
        dcp.load(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=str(checkpoint),
            no_dist=no_dist,
        )
    set_model_state_dict(model, model_state)
    # Not strict: torch would refuse a trainable parameter without saved state, which is what an
    # optimizer that never updated that parameter saves (the model's tensors were matched above).
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(strict=False))
