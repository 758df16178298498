"""The plan's fake steps kept on disk between launches (issue 24): a restart decides without them.

What costs `prepare` its seconds is running steps on fake tensors: the trace of the example batch
(`measure.facts.measure`) and one simulation per candidate run (`measure.simulate.simulate_all`).
Each result is a handful of byte counts, kept here as a JSON file named by a digest of everything
it depends on, so the same job started again reads them back instead:

- the model: every module's class, the source files of its classes (autoshard's own and torch's
  are covered by their versions below), the versions of the packages they come from, its plain
  attributes (dropout rates, flags, `training`), a Hugging Face config where there is one, its
  hooks, each parameter's and buffer's name, shape, dtype, device and `requires_grad`, and which
  of them are one tensor (tied weights);
- the optimizer's class and hyperparameters per group, the batch's structure, shapes and dtypes,
  the loss function's code, the compute dtype, the device (the GPU's name: kernel workspaces are
  measured on it), the simulated world size and the run itself;
- torch's and Python's versions, a digest of autoshard's own source (any change to it, a version
  bump or not, starts afresh), the CPU's kernel capability and the environment variables that
  change kernel or allocator memory.

Only what the plan is decided from is reused, never the decision: the usable memory is measured
at every launch, and the candidates are weighed again against it (a run the cache lacks is
simulated and added). The trial step still proves the choice.

The directory is `$AUTOSHARD_CACHE_DIR`, else `$XDG_CACHE_HOME/autoshard`, else
`~/.cache/autoshard`; `AUTOSHARD_CACHE=0` turns the cache off. Files are written whole (a
temporary file renamed over the name), an unreadable or unwritable one is skipped, and nothing
else in the directory is touched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from autoshard._torch_compat import tree_flatten
from autoshard.decide.estimate import Phase, Simulated
from autoshard.decide.profile import ActivationProfile

logger = logging.getLogger("autoshard")

FORMAT = 1  # of the files: a reader of another format ignores them
OFF = ("0", "off", "no", "false")
# Environment variables that change what kernels or the allocator hold
_ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_CUDA_ALLOC_CONF")
_PLAIN = (bool, int, float, str, type(None))
T = TypeVar("T")


def directory() -> Path | None:
    """Where entries are kept, or None with the cache turned off (`AUTOSHARD_CACHE=0`)."""
    if os.environ.get("AUTOSHARD_CACHE", "").strip().lower() in OFF:
        return None
    if chosen := os.environ.get("AUTOSHARD_CACHE_DIR"):
        return Path(chosen)
    if base := os.environ.get("XDG_CACHE_HOME"):
        return Path(base) / "autoshard"
    try:
        return Path.home() / ".cache" / "autoshard"
    except RuntimeError:  # no home directory to be found: no cache
        return None


def key(*parts: Any) -> str:
    """A digest of `parts` (JSON-able descriptions) and of the context every entry depends on."""
    text = json.dumps([_context(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def load(kind: str, digest: str, decode: Callable[[Any], T]) -> T | None:
    """`decode` of the value stored under `digest`, or None: absent, unreadable, of another
    format, or not what `decode` takes (a file edited by hand)."""
    root = directory()
    if root is None:
        return None
    try:
        entry = json.loads((root / kind / f"{digest}.json").read_text())
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        return decode(entry["value"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.debug("autoshard's cache entry %s/%s not read: %s", kind, digest, error)
        return None


def store(kind: str, digest: str, value: Any) -> None:
    """Keep `value` (JSON-able) under `digest`; skipped, with a debug line, where it cannot be."""
    root = directory()
    if root is None:
        return
    folder = root / kind
    written = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=folder, prefix=".", suffix=".tmp", delete=False
        ) as file:
            written = file.name
            json.dump({"format": FORMAT, "value": value}, file)
        os.replace(written, folder / f"{digest}.json")
    except OSError as error:
        logger.debug("autoshard's cache could not be written in %s: %s", folder, error)
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)


# ---------------------------------------------------------------------------------------------
# What an entry depends on


@functools.cache
def _context() -> dict[str, Any]:
    import autoshard

    return {
        "torch": torch.__version__,
        "python": sys.version_info[:2],
        "autoshard": _source_digest(Path(autoshard.__file__).parent),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "environment": {name: os.environ.get(name) for name in _ENVIRONMENT},
    }


def _source_digest(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def describe_model(model: nn.Module) -> list[Any]:
    """What the model's fake steps depend on (see the module docstring)."""
    first_name: dict[int, str] = {}
    tensors = []
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        tied = first_name.setdefault(id(tensor), name)
        shape = tuple(tensor.shape)
        tensors.append(
            (name, shape, str(tensor.dtype), tensor.device.type, tensor.requires_grad, tied)
        )
    configs: dict[int, str] = {}  # a config shared by many modules is described once
    modules = [
        (name, _describe_module(module, name, configs)) for name, module in model.named_modules()
    ]
    return [modules, tensors]


def _describe_module(
    module: nn.Module, name: str = "", configs: dict[int, str] | None = None
) -> dict[str, Any]:
    cls = type(module)
    plain = {k: v for k, v in vars(module).items() if isinstance(v, _PLAIN)}
    config: Any = getattr(module, "config", None)
    described: Any = None
    if callable(getattr(config, "to_dict", None)):
        seen = configs if configs is not None else {}
        described = seen.get(id(config)) or config.to_dict()
        seen.setdefault(id(config), f"the config of {name!r}")
    hooks = {
        kind: [_qualname(h) for h in getattr(module, kind).values()]
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks")
        if getattr(module, kind, None)
    }
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "code": _code_of(cls),
        "plain": plain,
        "config": described,
        "hooks": hooks,
    }


# class -> what `_code_of` found: each class's files are read once per process
_code_by_class: dict[type, list[Any]] = {}


def _code_of(cls: type) -> list[Any]:
    """The digests of the files defining `cls` and its bases, and their packages' versions;
    torch's and autoshard's own are in the context already."""
    if cls not in _code_by_class:
        _code_by_class[cls] = [
            (base.__qualname__, _file_digest(base), _version(package))
            for base in cls.__mro__
            if (package := base.__module__.partition(".")[0])
            not in ("builtins", "torch", "autoshard")
        ]
    return _code_by_class[cls]


def _file_digest(cls: type) -> str | None:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:  # a built-in or compiled class
        return None
    return None if path is None else _digest_of_file(path)


def _digest_of_file(path: str) -> str | None:
    try:
        stat = os.stat(path)
        return _digest_of_version(path, stat.st_mtime_ns, stat.st_size)
    except OSError:
        return None


@functools.cache
def _digest_of_version(path: str, mtime_ns: int, size: int) -> str:
    """Read once per file and version of it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.cache
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _qualname(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def describe_optimizer(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Its class, and each group's size and hyperparameters (the state is made afresh)."""
    groups = [
        (len(group["params"]), {k: v for k, v in group.items() if k != "params"})
        for group in optimizer.param_groups
    ]
    return [_qualname(type(optimizer)), groups]


def describe_batch(batch: Any) -> list[Any]:
    """Its structure, and each leaf's shape, dtype and device (a tensor) or value."""
    leaves, spec = tree_flatten(batch)
    return [
        str(spec),
        [
            (tuple(x.shape), str(x.dtype), x.device.type)
            if isinstance(x, torch.Tensor)
            else (x if isinstance(x, _PLAIN) else type(x).__qualname__)
            for x in leaves
        ],
    ]


def describe_callable(fn: Callable[..., Any] | None) -> Any:
    """A loss function by its name and code (its source where Python has it)."""
    if fn is None:
        return None
    target = getattr(fn, "func", fn)
    try:
        code: Any = inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(getattr(target, "__code__", None), "co_code", b"").hex()
    extra: list[Any] = [
        repr(a) for a in (*getattr(fn, "args", ()), *getattr(fn, "keywords", {}).items())
    ]
    if isinstance(fn, nn.Module):
        extra.append(_describe_module(fn))
    return [_qualname(target), code, extra]


def describe_device(device: torch.device) -> list[Any]:
    """The device, by its name where the kernels measured on it differ between models."""
    name = None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    return [device.type, name, torch.version.cuda if device.type == "cuda" else None]


# ---------------------------------------------------------------------------------------------
# The values kept


def simulated_to_json(simulated: Simulated) -> dict[str, Any]:
    return asdict(simulated)


def simulated_from_json(value: dict[str, Any]) -> Simulated:
    def phase(x: dict[str, int] | None) -> Phase | None:
        return None if x is None else Phase(**x)

    return Simulated(
        backward=Phase(**value["backward"]),
        step=Phase(**value["step"]),
        degree=value["degree"],
        checkpointed_backward=phase(value.get("checkpointed_backward")),
    )


def profile_to_json(profile: ActivationProfile) -> dict[str, Any]:
    return {**asdict(profile), "compute_dtype": str(profile.compute_dtype).removeprefix("torch.")}


def profile_from_json(value: dict[str, Any]) -> ActivationProfile:
    fields_: dict[str, Any] = {
        k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
        for k, v in value.items()
    }
    fields_["compute_dtype"] = getattr(torch, value["compute_dtype"])
    return ActivationProfile(**fields_)
