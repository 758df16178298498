"""How a batch is fed to the model and turned into a loss: one convention, used by the trace and
by the trial step alike."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from autoshard._torch_compat import disable_current_modes, tree_map

LossFn = Callable[[Any, Any], torch.Tensor]
# How many elements of a batch tensor's first row are compared first, before all of them: token
# ids and images differ there, so a tensor that is not one value is told from its first few
_FIRST_LOOK = 1024
# The one value of the real tensor a meta tensor of the batch was moved from (`batch_for_meta`):
# an attribute, so that it goes with the tensor where the tensor is pickled (a worker process)
_ONE_VALUE = "autoshard_one_value"


def uniform_value(tensor: Any) -> bool | int | float | None:
    """The one value every element of a batch tensor holds, or None (elements differ; no
    elements; not a plain tensor with values: fake, sparse, a subclass), at any size: the real
    step drops a mask of ones of any length, and the largest-batch search plans batches far
    larger than the example. A tensor on meta has the value of the real one `batch_for_meta`
    moved it from, if any."""
    if type(tensor) is not torch.Tensor:
        return None
    if tensor.device.type == "meta":
        return getattr(tensor, _ONE_VALUE, None)
    if tensor.layout != torch.strided or tensor.is_complex() or tensor.numel() == 0:
        return None
    try:
        with disable_current_modes(), torch.no_grad():  # the real values, inside a fake mode too
            values = tensor.detach()  # as laid out: no copy of a large non-contiguous batch
            first = values[(0,) * values.dim()]
            leading = values[(0,) * (values.dim() - 1)][:_FIRST_LOOK] if values.dim() else values
            if not (_all_equal(leading, first) and _all_equal(values, first)):
                return None
            return first.item()
    except (RuntimeError, TypeError):  # a dtype without comparisons (bits, some float8)
        return None


def _all_equal(values: torch.Tensor, first: torch.Tensor) -> bool:
    same = values == first
    if values.is_floating_point():  # 0.0 and -0.0 are equal, but 1 / x tells them
        same &= values.signbit() == first.signbit()
    return bool(same.all())


def _with_one_value(tensor: torch.Tensor, value: Any) -> torch.Tensor:
    """`tensor`, a new meta tensor of the batch's, given `value` as its one value (None: none)."""
    if value is not None and tensor.device.type == "meta":
        setattr(tensor, _ONE_VALUE, value)
    return tensor


def _cut_alike(tensor: torch.Tensor, made: torch.Tensor) -> torch.Tensor:
    """`made`, rows cut or repeated from batch tensor `tensor`, with the one value of `tensor`
    where it is a meta tensor that has one (a real tensor's values go with it)."""
    return _with_one_value(made, getattr(tensor, _ONE_VALUE, None))


def split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Mapping is passed as keyword arguments, a tuple/list as positional ones, anything else
    (a tensor) as the single argument: the conventions of Hugging Face and of plain scripts."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call_model(model: Callable[..., Any], batch: Any) -> Any:
    args, kwargs = split_batch(batch)
    return model(*args, **kwargs)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """`loss_fn(output, batch)` when given, else `output.loss` (or `output["loss"]`), else the
    output summed in fp32, which exercises the same memory as a real loss of that output."""
    if loss_fn is not None:
        loss: Any = loss_fn(output, batch)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"loss_fn(output, batch) must return a scalar tensor, got {type(loss).__name__}"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"loss_fn(output, batch) must return a scalar tensor, got shape "
                f"{tuple(loss.shape)}; reduce it (e.g. .mean())"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "loss_fn(output, batch) returned a loss that does not require grad (detached, "
                "built from .item()/.detach() or under torch.no_grad()), so backward cannot "
                "train the model; compute it from the model's output with autograd on"
            )
        return loss
    loss = getattr(output, "loss", None)  # Hugging Face ModelOutput
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tensors_in(output) if t.is_floating_point()]
    if not tensors:
        raise ValueError(
            "cannot derive a loss from the model's output: it has no `loss` and no floating-point "
            "tensor; pass loss_fn=lambda output, batch: ... to prepare()"
        )
    return sum((t.float().sum() for t in tensors), torch.zeros((), device=tensors[0].device))


def forward_error(model: nn.Module, batch: Any, dtype: torch.dtype | None) -> Exception | None:
    """Run the model's forward once on `batch`, for real, and return what it raised (or None).

    Used where the fake trace failed, to tell a batch that does not fit the model (the real
    forward fails too) from an operation fake tensors cannot run. Nothing is changed: eval mode
    (no running statistics move), no autograd graph, the RNG restored afterwards; what the
    forward caches on the model is the caller's to put back (`wrap.snapshot.attributes_kept`)."""
    training = {module: module.training for module in model.modules()}
    devices = {p.device for p in model.parameters()}
    cuda = [d.index or 0 for d in devices if d.type == "cuda"]
    device_type = next(iter(devices)).type if devices else "cpu"
    autocast = (
        torch.autocast(device_type, dtype=dtype)
        if dtype is not None and device_type != "meta"
        else contextlib.nullcontext()
    )
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), autocast:
            call_model(model, batch)
    except Exception as error:
        return error
    finally:
        for module, mode in training.items():
            module.training = mode
    return None


def batch_to(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to `device`."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def batch_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(batch))


def leading_rows(batch: Any) -> int | None:
    """The batch's rows: the leading size of its first tensor (None: no tensor)."""
    tensors = [t for t in tensors_in(batch) if t.dim() > 0]
    return tensors[0].shape[0] if tensors else None


def batch_rows(batch: Any, batch_size: int | None = None) -> tuple[int | None, str]:
    """The example batch's size along its batch dimension, and how it was found (or why there
    is none): the leading size its tensors share, or `batch_size` as the caller named it where
    they do not share one (a shared mask of one row, a table of positions)."""
    sizes = [t.shape[0] for t in tensors_in(batch) if t.dim() > 0]
    if not sizes:
        return None, "the example batch has no tensor with a batch dimension"
    if batch_size is not None:
        if batch_size not in sizes:
            return None, (
                f"no tensor of the example batch has batch_size={batch_size} rows (their leading "
                f"sizes: {sorted(set(sizes))})"
            )
        return batch_size, f"the {sizes.count(batch_size)} tensor(s) of {batch_size} rows, as named"
    if len(set(sizes)) > 1:
        return None, (
            f"the example batch's tensors differ in their leading size ({sorted(set(sizes))}): "
            f"name the batch size with batch_size="
        )
    return sizes[0], f"the leading dimension its {len(sizes)} tensor(s) share"


def resized(batch: Any, rows: int, n: int) -> Any:
    """`batch` with every tensor of `rows` leading rows cut to its first `n`, or repeated whole
    and cut to `n` where `n` is more (a probe's batch: only its shapes matter to the plan)."""
    if n <= rows:
        return first_rows(batch, rows, n)
    times = -(-n // rows)
    return tree_map(
        lambda x: (
            _cut_alike(x, torch.cat([x] * times)[:n])
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == rows
            else x
        ),
        batch,
    )


def first_rows(batch: Any, rows: int, n: int) -> Any:
    """`batch` with every tensor of `rows` leading rows cut to its first `n`."""
    return tree_map(
        lambda x: (
            _cut_alike(x, x[:n])
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == rows
            else x
        ),
        batch,
    )


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (and in a Hugging Face ModelOutput)."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    if hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        obj = obj.to_tuple()
    tree_map(visit, obj)
    return found


def tensors_reached(
    obj: Any, skip: tuple[type, ...] = (), outside: Iterable[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """Every tensor a model's output reaches: in containers, and in the attributes of the
    objects it holds (a Hugging Face ModelOutput's cache: `DynamicCache.layers[i].keys`, every
    layer's keys and values, alive as long as the output is), and through its tensors' autograd
    graphs to the leaves they hold and their gradients (a tensor a forward made with
    `requires_grad_()`, MRA's attention without its CUDA kernel) and the tensors a custom
    autograd Function kept on its context, each object visited once; not
    through a module, a class or a function, nor through an object of the types `skip`, nor to
    or through the tensors `outside` (the parameters, which the graph reaches, and their
    gradients are not the output's)."""
    found: dict[int, torch.Tensor] = {}
    # what was seen, kept alive while the walk goes on: a graph node's Python object may be made
    # when asked for and freed after (torch 2.11), and its id given to the next one
    seen: dict[int, Any] = {id(t): t for t in outside}
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if id(x) not in found and id(x) not in seen:
                found[id(x)] = x
                # a non-leaf's .grad, unless retained, is None (and warns)
                stack.extend((x.grad_fn, x.grad if x.is_leaf or x.retains_grad else None))
            continue
        if id(x) in seen:
            continue
        if isinstance(x, Node):
            seen[id(x)] = x
            stack.append(getattr(x, "variable", None))  # AccumulateGrad's leaf
            stack.extend(function for function, _ in x.next_functions)
            # a custom autograd Function's context: the tensors its forward kept on it
            # (`ctx.mask`), not what else it holds (FSDP2's keeps its parameter group)
            stack.extend(t for t in _attributes(x) if isinstance(t, torch.Tensor))
            continue
        if isinstance(x, (*_NOT_OUTPUT, *skip)) or callable(x):
            continue
        seen[id(x)] = x
        stack.extend(_members(x))
    return list(found.values())


# What an output's walk does not enter (`tensors_reached`), besides what is callable (a module,
# a class, a function): a Python module too, whose globals are not the output's
_NOT_OUTPUT = (
    str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, ModuleType,
)  # fmt: skip


def _members(x: Any) -> list[Any]:
    """What an object of an output holds: a container's items, else its attributes; nothing
    where they cannot be read (a custom mapping's `values` or `__getattr__` that raises), as
    what the walk cannot read it cannot count, and must not fail the estimate for."""
    try:
        if isinstance(x, Mapping):
            return list(x.values())
        if isinstance(x, (list, tuple, set, frozenset, deque)):
            return list(x)
    except Exception:  # noqa: BLE001 - see above
        return []
    return _attributes(x)


def _attributes(x: Any) -> list[Any]:
    """The values of an object's instance attributes, in its `__dict__` and in the `__slots__`
    of its class and their bases, read without its `__getattr__`; those that cannot be read are
    left out."""
    values: list[Any] = []
    try:
        values.extend(object.__getattribute__(x, "__dict__").values())
    except Exception:  # noqa: BLE001 - no __dict__, or one that cannot be read
        pass
    for cls in type(x).__mro__:
        slots = vars(cls).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # a private name, mangled
                name = f"_{cls.__name__.lstrip('_')}{name}"
            try:
                values.append(object.__getattribute__(x, name))
            except Exception:  # noqa: BLE001 - a slot not set, or a descriptor that raises
                pass
    return values


def on_meta(model: torch.nn.Module) -> bool:
    """Every parameter and buffer of `model` is on the meta device (a what-if model)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def batch_for_meta(model: torch.nn.Module, batch: Any) -> tuple[Any, str | None]:
    """For a model on the meta device, the batch with its tensors on meta too (the trace needs
    only shapes, and meta parameters cannot meet CPU inputs), and a note saying so; otherwise
    the batch as it is."""
    if batch is None or not on_meta(model):
        return batch, None
    meta = torch.device("meta")
    moved = tree_map(
        lambda x: (
            _with_one_value(x.to(meta), uniform_value(x))
            if isinstance(x, torch.Tensor) and x.device != meta
            else x
        ),
        batch,
    )
    return moved, (
        "the model is on the meta device: the example batch's tensors were moved there too "
        "(their shapes and dtypes count, and the one value of a tensor whose elements are all "
        "one, such as an attention mask of ones); a tensor inside an object other than a list, "
        "tuple or dict cannot be moved: build such a batch on meta yourself"
    )
