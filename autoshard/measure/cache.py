"""The plan's fake steps kept on disk between launches (issue 24): a restart decides without them.

What costs `prepare` its seconds is running steps on fake tensors: the trace of the example batch
(`measure.facts.measure`) and one simulation per candidate run (`measure.simulate.simulate_all`).
Each result is a handful of byte counts, kept here as a JSON file named by a digest of everything
it depends on, so the same job started again reads them back instead:

- the model: every module's class, the source files of its classes (autoshard's own and torch's
  are covered by their versions below), the versions of the packages they come from, its other
  attributes (dropout rates, flags, `training`, a convolution's stride: numbers, strings and
  containers of them; dtypes; a tensor that is no buffer, by shape and dtype; the callables it
  holds, by their code; an object of settings, such as a dataclass of model arguments, by its
  own attributes, alike), a Hugging Face config where there is one (`to_dict` and its own
  attributes: the attention implementation is one `to_dict` leaves out), its hooks, each
  parameter's and buffer's name, shape, strides, dtype, device and `requires_grad`, and which
  of them are one tensor (tied weights);
- the module-level values the program's own code reads (`_globals_read`): a flag, a table, a
  function its forward or its loss calls (and what that reads in turn), by name and value, as
  attributes are (one that cannot be described, by its class alone). A script may set them as
  it runs, from its arguments or in a loop over variants, while its source file stays the same;
- the optimizer's class and, per group, its parameters by name and its hyperparameters; the
  batch's structure (mappings, a tokenizer's `BatchEncoding` included, and sequences), shapes,
  strides and dtypes; the loss function's code and what its closure holds; the compute dtype;
  the device (the GPU's name: kernel workspaces are measured on it); the simulated world size
  and the run itself;
- torch's and Python's versions, a digest of autoshard's own source (any change to it, a version
  bump or not, starts afresh), the CPU's kernel capability, the attention kernels torch may pick,
  cuDNN's switches, the default dtype and the environment variables that change kernel or
  allocator memory.

Where anything in that cannot be described (an object of a kind not listed), nothing is kept: an
entry never stands for what its name does not say. Nor is a trace measured on real tensors kept
(a step fake tensors cannot run: what it read back depends on the batch's values).

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
import dis
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import site
import sys
import sysconfig
import tempfile
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from autoshard._batch import uniform_value
from autoshard._torch_compat import compiled_module
from autoshard.decide.estimate import Phase, Simulated
from autoshard.decide.profile import ActivationProfile, MovingCall, PricedCall

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


def digest(describe: Callable[[], Any]) -> str | None:
    """The name of the entry that `describe()` (the parts it depends on) stands for, with the
    context every entry depends on; None where the cache is off, or where something in it cannot
    be described (an object of unknown kind: then nothing is kept for it, rather than an entry
    that might stand for something else)."""
    if directory() is None:
        return None
    try:
        text = json.dumps([_context(), _settings(), describe()], sort_keys=True, default=_encode)
    except Exception as error:  # noqa: BLE001 - whatever it is, the plan is made without
        logger.debug("autoshard's cache not used: %s: %s", type(error).__name__, error)
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _encode(value: Any) -> Any:
    """JSON for the few other kinds a description holds; anything else is refused."""
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, Path)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    raise TypeError(f"cannot describe a {type(value).__qualname__}")


def load(kind: str, name: str | None, decode: Callable[[Any], T]) -> T | None:
    """`decode` of the value stored under `name` (a `digest`), or None: no name, absent,
    unreadable, of another format, or not what `decode` takes (a file edited by hand)."""
    root = directory()
    if root is None or name is None:
        return None
    try:
        entry = json.loads((root / kind / f"{name}.json").read_text())
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        return decode(entry["value"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.debug("autoshard's cache entry %s/%s not read: %s", kind, name, error)
        return None


def store(kind: str, name: str | None, value: Any) -> None:
    """Keep `value` (JSON-able) under `name` (a `digest`); skipped, with a debug line, where it
    cannot be."""
    root = directory()
    if root is None or name is None:
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
        os.replace(written, folder / f"{name}.json")
    except OSError as error:
        logger.debug("autoshard's cache could not be written in %s: %s", folder, error)
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)


# ---------------------------------------------------------------------------------------------
# What an entry depends on


@functools.cache
def _context() -> dict[str, Any]:
    """What stays the same for the life of the process."""
    import autoshard

    return {
        "torch": torch.__version__,
        "python": sys.version_info[:2],
        "autoshard": _source_digest(Path(autoshard.__file__).parent),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _source_digest(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _settings() -> dict[str, Any]:
    """What a program may change as it runs: the attention kernels torch may pick, cuDNN's
    switches, the default dtype (of the tensors a forward makes from nothing: a mask, a
    table), the environment variables that change kernel or allocator memory."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    attention = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")
    return {
        "attention": [getattr(cuda, name)() for name in attention],
        "cudnn": [cudnn.enabled, cudnn.benchmark, cudnn.deterministic],
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default dtype": torch.get_default_dtype(),
        "environment": {name: os.environ.get(name) for name in _ENVIRONMENT},
    }


def describe_model(model: nn.Module) -> list[Any]:
    """What the model's fake steps depend on (see the module docstring). A `torch.compile`d
    model is the module it compiles, marked so: dynamo's own settings, which no description
    covers, change nothing a fake step does (it compiles nothing under a dispatch mode)."""
    inner = compiled_module(model)
    if inner is not None:
        return ["torch.compile", *describe_model(inner)]
    first_name: dict[int, str] = {}
    tensors = []
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        tied = first_name.setdefault(id(tensor), name)
        tensors.append((name, *_describe_tensor(tensor), tied))
    configs: dict[int, str] = {}  # a config shared by many modules is described once
    with _one_description():  # a class's globals once, not once per module of that class
        modules = [
            (name, _describe_module(module, name, configs))
            for name, module in model.named_modules()
        ]
    return [modules, tensors]


def _describe_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    layout = tensor.stride() if tensor.layout == torch.strided else str(tensor.layout)
    shape = tuple(tensor.shape)
    # its class too: torch's optimizers step a Parameter subclass otherwise (`fake._implementation`)
    kind = f"{type(tensor).__module__}.{type(tensor).__qualname__}"
    return shape, layout, str(tensor.dtype), tensor.device.type, tensor.requires_grad, kind


def _describe_module(
    module: nn.Module, name: str = "", configs: dict[int, str] | None = None
) -> dict[str, Any]:
    """A module by its class (and that class's code), its attributes other than parameters,
    buffers and submodules (numbers, strings, flags and containers of them, the callables it
    holds: a convolution's stride, an activation chosen per layer), a Hugging Face config, its
    hooks."""
    cls = type(module)
    attributes = {
        key: _attribute(value)
        for key, value in vars(module).items()
        if key not in ("_parameters", "_buffers", "_modules", "config")
        and not key.endswith("hooks")
    }
    config: Any = getattr(module, "config", None)
    described: Any = None
    if config is not None:
        seen = configs if configs is not None else {}
        if id(config) not in seen:
            seen[id(config)] = f"the config of {name!r}"
            described = _describe_config(config)
        else:
            described = seen[id(config)]
    hooks = {
        kind: [describe_callable(h) for h in getattr(module, kind).values()]
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks")
        if getattr(module, kind, None)
    }
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "code": _code_of(cls),
        "globals": _globals_read(cls),
        "attributes": attributes,
        "config": described,
        "hooks": hooks,
    }


def _describe_config(config: Any) -> Any:
    """A Hugging Face config: what `to_dict` gives, and its own plain attributes beside (the
    attention implementation is one `to_dict` leaves out)."""
    own = {k: _attribute(v) for k, v in vars(config).items()}
    whole = config.to_dict() if callable(getattr(config, "to_dict", None)) else None
    return [type(config).__qualname__, own, whole]


# How far into objects an attribute is described (a module's settings object, its fields, their
# containers): deeper than that, it is refused
_DEPTH = 6


def _attribute(value: Any, depth: int = 0) -> Any:
    """A module's (or its config's) attribute other than its parameters, buffers and submodules:
    numbers, strings and containers of them as they are; dtypes, devices and enums by name; a
    tensor that is no buffer by its shape, strides and dtype; a callable by its code; another
    module by its class's code and its parameters; an object holding settings (a dataclass of
    model arguments, a namespace) by its class and its attributes, described alike. Raises
    TypeError for anything else (a lock, an object without attributes), so that nothing is kept
    rather than an entry that ignores it: a forward may read anything it holds."""
    if _plain(value):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, enum.Enum)):
        return _encode(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", *_describe_tensor(value)]
    if isinstance(value, type):
        return ["class", f"{value.__module__}.{value.__qualname__}", _code_of(value)]
    if isinstance(value, nn.Module):  # held outside `_modules`: not the model's, but it may run
        tensors = [(n, *_describe_tensor(t)) for n, t in value.named_parameters()]
        return ["module", f"{type(value).__module__}.{type(value).__qualname__}", tensors]
    if callable(value):
        return describe_callable(value)
    if depth >= _DEPTH:
        raise TypeError(f"cannot describe a {type(value).__qualname__} nested {depth} deep")
    if isinstance(value, (set, frozenset)):
        members = [_attribute(v, depth + 1) for v in value]
        return ["set", sorted(members, key=lambda m: json.dumps(m, default=_encode))]
    if isinstance(value, (tuple, list)):
        return [type(value).__qualname__, [_attribute(v, depth + 1) for v in value]]
    if isinstance(value, Mapping):  # keys by value, or (a function, say) as described
        items = [[_key(k, depth + 1), _attribute(v, depth + 1)] for k, v in value.items()]
        return [type(value).__qualname__, sorted(items, key=lambda item: item[0])]
    fields = getattr(value, "__dict__", None)
    if not isinstance(fields, dict):
        raise TypeError(f"cannot describe a {type(value).__qualname__}")
    cls = type(value)
    described = {str(k): _attribute(v, depth + 1) for k, v in fields.items()}
    return ["object", f"{cls.__module__}.{cls.__qualname__}", described]


def _key(key: Any, depth: int) -> str:
    """A mapping's key, as text that is the same in another process (a function's `repr` holds
    its address)."""
    if _plain(key) or isinstance(key, enum.Enum):
        return repr(key)
    return json.dumps(_attribute(key, depth), sort_keys=True, default=_encode)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


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
    except (OSError, TypeError):  # a built-in class, or one of a __main__ without a file
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


def describe_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[Any]:
    """Its class, and each group's parameters (by name) and hyperparameters; its state is made
    afresh in the simulation."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    groups = [
        (
            [names.get(id(p), "?") for p in group["params"]],
            {k: _value(v) for k, v in group.items() if k != "params"},
        )
        for group in optimizer.param_groups
    ]
    return [type(optimizer).__module__, type(optimizer).__qualname__, groups]


def describe_batch(batch: Any) -> Any:
    """Its structure (the mappings' and sequences' kinds and keys), and each tensor's shape,
    strides, dtype and device, and the one value all its elements hold where they do (the fake
    steps follow it: `known`, an attention mask of ones); other values as they are. An object of
    another kind is refused (`digest` then keeps nothing): it may hold tensors that would go
    undescribed."""
    if isinstance(batch, torch.Tensor):
        return [_describe_tensor(batch), uniform_value(batch)]
    if isinstance(batch, Mapping):
        items = sorted((str(k), describe_batch(v)) for k, v in batch.items())
        return [type(batch).__qualname__, items]
    if isinstance(batch, (tuple, list)):
        return [type(batch).__qualname__, [describe_batch(v) for v in batch]]
    return _value(batch)


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, nn.Module):
        return _describe_module(value)
    if callable(value) and not isinstance(value, type):
        return describe_callable(value)
    if _plain(value) or isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return value
    if isinstance(value, (tuple, list)):
        return [_value(v) for v in value]
    raise TypeError(f"cannot describe a {type(value).__qualname__}")


def describe_callable(fn: Callable[..., Any] | None) -> Any:
    """A function by its name and code (its source where Python has it) and what its closure
    holds; a `functools.partial` by its function and arguments; another callable object (a loss
    module, an instance with `__call__`) by its class's code and attributes."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        arguments = [_value(a) for a in fn.args]
        keywords = {k: _value(v) for k, v in fn.keywords.items()}
        return ["partial", describe_callable(fn.func), arguments, keywords]
    if isinstance(fn, nn.Module):
        return _describe_module(fn)
    code = getattr(fn, "__code__", None)
    if code is None:  # a built-in, a method of one, or an object with __call__
        owner = getattr(fn, "__self__", fn)
        if inspect.isbuiltin(fn) or isinstance(owner, type(torch)):
            return [getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))]
        described = [type(fn).__qualname__, _code_of(type(fn)), describe_batch(vars(fn))]
        return [*described, _globals_read(type(fn))]
    try:
        source: Any = inspect.getsource(fn)
    except (OSError, TypeError):
        source = code.co_code.hex()
    cells = [_value(c.cell_contents) for c in getattr(fn, "__closure__", None) or ()]
    return [getattr(fn, "__module__", None), fn.__qualname__, source, cells, _globals_read(fn)]


@functools.lru_cache(maxsize=1024)
def _own_code(module: str | None) -> bool:
    """Whether the module named `module` is the program's own code: not torch's or autoshard's,
    nor Python's own or an installed package's (one under site-packages: described by their
    versions), though a package installed in editable mode, whose files stay where they were
    written, is."""
    package = str(module or "").partition(".")[0]
    if package in ("", "torch", "autoshard") or package in sys.stdlib_module_names:
        return False
    loaded = sys.modules.get(package)
    places = [getattr(loaded, "__file__", None), *getattr(loaded, "__path__", ())]
    real = [os.path.realpath(str(place)) for place in places if place]
    return not any(place.startswith(installed) for place in real for installed in _installed())


@functools.cache
def _installed() -> tuple[str, ...]:
    """Where installed packages are (site-packages and its kin)."""
    paths = sysconfig.get_paths()
    places = {paths[key] for key in ("purelib", "platlib") if key in paths}
    places.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    if site.ENABLE_USER_SITE:
        places.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(p), "") for p in places)


@functools.cache
def _global_loads(code: types.CodeType) -> frozenset[str]:
    """The global names `code` loads, in it and in the functions, lambdas and comprehensions
    defined inside it (`self.model` is an attribute, not the global `model`)."""
    names = {
        str(instruction.argval)
        for instruction in dis.get_instructions(code)
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_loads(constant)
    return frozenset(names)


def _functions_of(obj: Any) -> list[Any]:
    """The functions whose global loads `obj` stands for: a function itself; a class's own
    methods (static, class and property ones too), and those of its bases of the program's own
    code."""
    if not isinstance(obj, type):
        return [obj]
    found: list[Any] = []
    for cls in obj.__mro__:
        if not _own_code(cls.__module__):
            continue
        for member in vars(cls).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                found.extend(f for f in (member.fget, member.fset) if f is not None)
            elif inspect.isfunction(member):
                found.append(member)
    return found


# While one description is made: the functions whose loads it has followed already (a
# recursion, or a helper two functions call), and what each class's methods read
_following = threading.local()


@contextlib.contextmanager
def _one_description() -> Iterator[None]:
    """Inside: one description is being made (the outermost call opens it)."""
    if hasattr(_following, "codes"):
        yield
        return
    _following.codes, _following.classes = set(), {}
    try:
        yield
    finally:
        del _following.codes, _following.classes


def _globals_read(obj: Any) -> dict[str, Any]:
    """The module-level values a function or a class of the program's own code (`_own_code`; an
    installed package's are left to its version) reads, by module and name: modules by their
    names (the program's own by their files and their plain values: `cfg.X = args.x`),
    functions and classes by their code and, in turn, what they read (each followed once per
    description); a logger by its name; anything else as a module's attribute is
    (`_attribute`), or by its class alone where it cannot be described (a lock, an array): as
    before globals were read, the value is then not in the name, and the cache is still used.
    A decorated function is the one it wraps."""
    if isinstance(obj, types.ModuleType):
        return {}
    with _one_description():
        if isinstance(obj, type) and obj in _following.classes:
            return dict(_following.classes[obj])
        read: dict[str, Any] = {}
        for function in _functions_of(obj):
            with contextlib.suppress(ValueError):  # a cycle of `__wrapped__`: the outer one
                function = inspect.unwrap(function)
            code = getattr(function, "__code__", None)
            namespace = getattr(function, "__globals__", None)
            if code is None or not isinstance(namespace, dict) or id(code) in _following.codes:
                continue
            module = namespace.get("__name__")  # where the code was written
            if not _own_code(module):
                continue
            _following.codes.add(id(code))
            for name in sorted(_global_loads(code)):
                if name in namespace and f"{module}.{name}" not in read:
                    read[f"{module}.{name}"] = _global_value(namespace[name])
        if isinstance(obj, type):
            _following.classes[obj] = read
        return read


def _global_value(value: Any) -> Any:
    if isinstance(value, types.ModuleType):
        if not _own_code(value.__name__):
            return ["module", value.__name__]
        path = getattr(value, "__file__", None)
        plain = {k: v for k, v in vars(value).items() if not k.startswith("__") and _plain(v)}
        return ["module", value.__name__, path and _digest_of_file(path), sorted(plain.items())]
    if isinstance(value, logging.Logger):
        return ["logger", value.name]
    try:
        if isinstance(value, type):
            return [_attribute(value), _globals_read(value)]
        return _attribute(value)  # a function: by its code, what it reads among it
    except (TypeError, ValueError, RecursionError):
        return ["undescribed", f"{type(value).__module__}.{type(value).__qualname__}"]


def describe_device(device: torch.device) -> list[Any]:
    """The device, by its name where the kernels measured on it differ between models."""
    name = None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    return [device.type, name, torch.version.cuda if device.type == "cuda" else None]


# ---------------------------------------------------------------------------------------------
# The values kept


def simulated_to_json(simulated: Simulated) -> dict[str, Any]:
    # the moments' tuples as the lists JSON reads back
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(simulated).items()}


def simulated_from_json(value: dict[str, Any]) -> Simulated:
    def phase(x: Any) -> Phase:
        return Phase(**{k: _int(v) for k, v in x.items()})

    def maybe(name: str) -> Phase | None:
        x = value.get(name)
        return None if x is None else phase(x)

    return Simulated(
        backward=phase(value["backward"]),
        step=phase(value["step"]),
        degree=_int(value["degree"]),
        checkpointed_backward=maybe("checkpointed_backward"),
        per_parameter_step=bool(value["per_parameter_step"]),
        accumulating=maybe("accumulating"),
        checkpointed_accumulating=maybe("checkpointed_accumulating"),
        forward=maybe("forward"),
        peaks=tuple(map(phase, value["peaks"])),
        checkpointed_peaks=tuple(map(phase, value["checkpointed_peaks"])),
        starts=tuple(map(_int, value.get("starts", ()))),
        checkpointed_starts=tuple(map(_int, value.get("checkpointed_starts", ()))),
        let_go_at_return=tuple(map(_int, value.get("let_go_at_return", ()))),
    )


def profile_to_json(profile: ActivationProfile) -> dict[str, Any]:
    return {**asdict(profile), "compute_dtype": str(profile.compute_dtype).removeprefix("torch.")}


def profile_from_json(value: dict[str, Any]) -> ActivationProfile:
    dtype = getattr(torch, value["compute_dtype"])
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a dtype: {value['compute_dtype']!r}")
    return ActivationProfile(
        block_saved_bytes=tuple(map(_int, value["block_saved_bytes"])),
        block_input_bytes=tuple(map(_int, value["block_input_bytes"])),
        block_cast_bytes=tuple(map(_int, value["block_cast_bytes"])),
        block_shared_bytes=tuple(map(_int, value["block_shared_bytes"])),
        before_saved_bytes=_int(value["before_saved_bytes"]),
        after_saved_bytes=_int(value["after_saved_bytes"]),
        largest_saved_bytes=_int(value["largest_saved_bytes"]),
        backward_rise_bytes=_int(value["backward_rise_bytes"]),
        rise_into_buffers_bytes=_int(value["rise_into_buffers_bytes"]),
        output_bytes=_int(value["output_bytes"]),
        block_output_bytes=tuple(map(_int, value["block_output_bytes"])),
        carried_bytes=_int(value["carried_bytes"]),
        block_carried_bytes=tuple(map(_int, value["block_carried_bytes"])),
        block_output_left_bytes=tuple(map(_int, value["block_output_left_bytes"])),
        block_carried_left_bytes=tuple(map(_int, value["block_carried_left_bytes"])),
        forward_rise_bytes=_int(value["forward_rise_bytes"]),
        block_forward_peak_bytes=tuple(map(_int, value["block_forward_peak_bytes"])),
        block_checkpointed_bytes=tuple(map(_int, value["block_checkpointed_bytes"])),
        block_checkpointed_into_buffers_bytes=tuple(
            map(_int, value["block_checkpointed_into_buffers_bytes"])
        ),
        block_forward_flops=tuple(map(_int, value["block_forward_flops"])),
        total_forward_flops=_int(value["total_forward_flops"]),
        compute_dtype=dtype,
        unused_parameters=tuple(map(_str, value["unused_parameters"])),
        answers=tuple((_str(place), bool(answer)) for place, answer in value["answers"]),
        nonzero_found=tuple(
            (_str(place), _int(found), _int(searched))
            for place, found, searched in value["nonzero_found"]
        ),
        random_reads=tuple((_str(place), _str(what)) for place, what in value["random_reads"]),
        batch_values_read=tuple(
            (_str(place), _str(what)) for place, what in value["batch_values_read"]
        ),
        flops_by_own_formula=tuple(map(_str, value["flops_by_own_formula"])),
        flops_uncounted=tuple(map(_str, value["flops_uncounted"])),
        unlike_blocks=None if value["unlike_blocks"] is None else _str(value["unlike_blocks"]),
        block_forward_traffic=tuple(map(_int, value["block_forward_traffic"])),
        block_forward_kernels=tuple(map(_int, value["block_forward_kernels"])),
        block_backward_traffic=tuple(map(_int, value["block_backward_traffic"])),
        block_backward_kernels=tuple(map(_int, value["block_backward_kernels"])),
        forward_traffic=_int(value["forward_traffic"]),
        forward_kernels=_int(value["forward_kernels"]),
        backward_traffic=_int(value["backward_traffic"]),
        backward_kernels=_int(value["backward_kernels"]),
        priced_calls=tuple(
            PricedCall(
                _str(c["operator"]),
                _str(c["arguments"]),
                _int(c["flops"]),
                tuple(map(_int, c["block_calls"])),
                _int(c["other_calls"]),
            )
            for c in value["priced_calls"]
        ),
        moving_calls=tuple(
            MovingCall(
                _str(c["operator"]),
                _str(c["arguments"]),
                _int(c["moved"]),
                tuple(map(_int, c["block_calls"])),
                _int(c["other_calls"]),
            )
            for c in value["moving_calls"]
        ),
    )


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"not a count: {x!r}")
    return x


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"not a name: {x!r}")
    return x
