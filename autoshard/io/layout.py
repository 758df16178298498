"""A checkpoint on disk: the marker that lists and checksums every file autoshard wrote, and the
renames that replace a checkpoint so that `path` holds a whole one at every instant.

A save writes everything into the hidden sibling `.<name>.autoshard-partial`; the marker
`autoshard.json` (every file's sha256, and a digest of the marker itself) is written last. Then
the checkpoint at `path`, if any, is renamed aside to `.<name>.autoshard-old`, the new one is
renamed into place, and the old one is deleted. A process killed at any point leaves either the
old checkpoint at `path`, or the new one, or (between the two renames) nothing at `path` and the
old one, whole, at `.<name>.autoshard-old`, which `load(path)` then reads. The next save puts back
or deletes what an interrupted one left.

Files a user keeps inside a checkpoint directory (not listed in its marker) are carried into the
new one as hard links (copies where the filesystem has none) before the old one is deleted. A
`path` that is a symbolic link is replaced as a link: the directory it points to is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

MARKER = "autoshard.json"
DCP_METADATA = ".metadata"
FORMAT = 2
_WRITER = "autoshard"


def siblings(target: Path) -> tuple[Path, Path]:
    """Where a save writes before it is complete, and where it moves the checkpoint it replaces."""
    return (
        target.parent / f".{target.name}.autoshard-partial",
        target.parent / f".{target.name}.autoshard-old",
    )


def new_marker(files: dict[str, str], info: dict[str, Any]) -> dict[str, Any]:
    content = {
        **info,
        "format": FORMAT,
        "written_by": _WRITER,
        "id": uuid.uuid4().hex,
        "files": dict(sorted(files.items())),
    }
    return {**content, "digest": _digest_of(content)}


def _digest_of(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_marker(directory: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint, checked whole; a ValueError says what is wrong."""
    path = directory / MARKER
    damaged = f"checkpoint {str(directory)!r} is damaged: its {MARKER} is not valid"
    try:
        content = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{damaged} JSON ({error}); load an earlier checkpoint") from error
    if not isinstance(content, dict) or content.get("written_by") != _WRITER:
        if isinstance(content, dict) and content.get("format") == 1:
            raise ValueError(
                f"checkpoint {str(directory)!r} has format 1 (no checksums), this autoshard reads "
                f"format {FORMAT}; load it with the autoshard version that wrote it and save again"
            )
        raise ValueError(
            f"{str(path)!r} is not an autoshard checkpoint marker (it is not a JSON object "
            f"written by autoshard.save); load a directory that autoshard.save wrote"
        )
    if content.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint {str(directory)!r} has format {content.get('format')!r}, this autoshard "
            f"reads format {FORMAT}; load it with the autoshard version that wrote it"
        )
    rest = {k: v for k, v in content.items() if k != "digest"}
    files = content.get("files")
    valid = isinstance(files, dict) and all(isinstance(v, str) for v in files.values())
    if not valid or content.get("digest") != _digest_of(rest):
        raise ValueError(
            f"{damaged} (its own digest does not match its content): it was changed or "
            f"corrupted after the save; load an earlier checkpoint"
        )
    return content


def owned_by_autoshard(directory: Path) -> set[str] | None:
    """The names autoshard wrote in `directory`, if it is an autoshard checkpoint; None if it
    holds no marker; a ValueError if it holds a marker autoshard did not write."""
    if not (directory / MARKER).exists():
        return None
    try:
        content = json.loads((directory / MARKER).read_bytes())
    except (OSError, ValueError):
        content = None
    if not isinstance(content, dict) or content.get("format") not in (1, FORMAT):
        raise ValueError(
            f"{str(directory)!r} holds a file named {MARKER} that autoshard did not write; save "
            f"would replace this directory, so choose another path (nothing was written)"
        )
    files = content.get("files")
    if isinstance(files, dict):
        return {MARKER, *files}
    # format 1 listed nothing: DCP's own files are autoshard's
    return {MARKER, DCP_METADATA, *(p.name for p in directory.glob("*.distcp"))}


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of the files to checksum (every rank reads a disjoint part)."""
    return [n for i, n in enumerate(sorted(names)) if i % world_size == rank]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(directory: Path, marker: dict[str, Any], rank: int, world_size: int) -> None:
    """Check this rank's share of the files against the marker's checksums."""
    files: dict[str, str] = marker["files"]
    for name in share(list(files), rank, world_size):
        path = directory / name
        if not path.is_file():
            raise ValueError(
                f"checkpoint {str(directory)!r} is damaged: {name}, listed in its {MARKER}, is "
                f"missing; load an earlier checkpoint (nothing was loaded)"
            )
        if sha256_of(path) != files[name]:
            raise ValueError(
                f"checkpoint {str(directory)!r} is damaged: {name} does not match the sha256 its "
                f"save recorded; it was changed or corrupted after the save: load an earlier "
                f"checkpoint (nothing was loaded)"
            )


def locate(path: Path) -> tuple[Path, str | None]:
    """The directory to load for `path`: itself, or the previous checkpoint kept aside by a save
    interrupted between its two renames (with a note saying so)."""
    if path.is_dir():
        return path, None
    _, old = siblings(path)
    if not os.path.lexists(path) and (old / MARKER).exists():
        return old, (
            f"no checkpoint at {str(path)!r}: a save to it was interrupted while replacing it; "
            f"loading the previous checkpoint it kept aside at {str(old)!r} (the next save to "
            f"this path puts it back first)"
        )
    raise ValueError(f"no checkpoint directory at {str(path)!r}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def remove_partial(partial: Path) -> None:
    if os.path.lexists(partial):
        _remove(partial)


def clear_leftovers(target: Path, partial: Path, old: Path) -> None:
    """Undo what an interrupted save left: a half-written directory is deleted; a checkpoint
    renamed aside is put back if nothing replaced it, else deleted (the replacement is whole)."""
    remove_partial(partial)
    if os.path.lexists(old):
        if os.path.lexists(target):
            _remove(old)
        else:
            old.rename(target)
    target.parent.mkdir(parents=True, exist_ok=True)


def carry_user_files(target: Path, partial: Path) -> list[str]:
    """Hard-link (or copy) into the new checkpoint what a user keeps inside the one it replaces;
    a symbolic link at `target` is replaced as a link, so what it points to is left alone."""
    if target.is_symlink() or not target.is_dir():
        return []
    ours = owned_by_autoshard(target) or set()
    carried = []
    for entry in sorted(target.iterdir()):
        if entry.name in ours or os.path.lexists(partial / entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, partial / entry.name, symlinks=True, copy_function=_link)
        else:
            _link(str(entry), str(partial / entry.name))
        carried.append(entry.name)
    return carried


def _link(source: str, destination: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def publish(partial: Path, target: Path, old: Path, marker: dict[str, Any]) -> None:
    """Mark the written directory complete, then move it into place (rank 0, once every rank's
    data is written)."""
    staged = partial / f"{MARKER}.tmp"
    with open(staged, "w") as handle:
        json.dump(marker, handle)
        handle.flush()
        os.fsync(handle.fileno())
    staged.rename(partial / MARKER)
    _fsync_dir(partial)
    if os.path.lexists(target):
        target.rename(old)
    partial.rename(target)
    _fsync_dir(target.parent)
    if os.path.lexists(old):
        _remove(old)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
