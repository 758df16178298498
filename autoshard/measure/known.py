"""Values a step on fake tensors knows without running: a tensor whose every element is one value.

Fake tensors hold no values, and transformers takes that for tracing a graph: its
`is_tracing(tensor)` is true for a fake tensor (`is_fake_tensor`), and where it is, the mask code
does not look whether the batch's attention mask is all ones. The real step looks: a mask of all
ones is dropped, attention runs with `is_causal` and, for grouped-query attention, on the key and
value heads as they are (`enable_gqa`). The simulation built the mask and repeated the keys and
values for every head (`repeat_kv`), both saved for backward: a Qwen2-shaped model (14 heads, 2
key/value heads) given the tokenizer's `attention_mask` of ones was estimated 6.7% above its
measured peak at 512 tokens and 19.5% above at 2,048, where the same batch without the mask was
exact.

So the simulation follows such values as the real step would compute them (`Known`):

- a batch tensor made fake from a real one whose elements are all one value
  (`uniform_value`: an attention mask of ones, token type ids of zeros) carries that value;
- so does a small tensor made full of one value (`torch.ones`, `zeros`, `full`, their `_like`
  and `new_` forms);
- an operator of torch's own (`aten`, `prims`) whose every tensor argument carries a value is
  run for real on the CPU on those values, each argument an expanded scalar (no memory of its
  size), where its output is not too large (`KNOWN_NUMEL`): its output carries a value where its
  elements are all one value (a cast, a view, a slice, a comparison with a number, a sum, `all`),
  held as its dtype holds it. A larger output is known where its value does not depend on the
  sizes: an elementwise operator or a cast is run on one element of each argument, and a view
  carries its input's value. So a mask of ones is known at any length, as the real step finds it
  at any length (the largest-batch search plans batches of millions of tokens). Operators that
  draw random numbers, or leave their output's memory as they found it (`empty_like`), are not
  run;
- a tensor of positions (`torch.arange`) not too large carries its contents, each element's
  value, and so does the output of an operator run on known values whose elements differ:
  transformers' packed-sequence check reads whether the positions it made run 0, 1, 2, ... (a
  model trained with `use_cache=False`, as `gradient_checkpointing_enable` sets it, given no
  attention mask), and the real step then drops the mask;
- an operator that writes into a tensor forgets every value held in that tensor's storage, as
  does any operator of another library (a collective: its result is the other ranks' too), and
  a tensor given another storage (`set_`, `.data =`) carries no value any more;
- reading a value back (`bool(t)`, `t.item()`) from a tensor that carries one gives it, where
  fake tensors would raise.

And transformers is told that a fake boolean tensor carrying a value (a padding mask, as its mask
code holds one), or any tensor the step made whose values are known (not the batch's: its
packed-sequence indices), is not one it must trace around (`transformers_reads_known_values`:
its `is_fake_tensor` is wrapped while a fake mode of autoshard's runs, and put back when the last
one exits), so its mask code takes the real step's branch: a mask of all ones is dropped, one
with padding is built, as they are for real.

A batch tensor whose values differ (token ids, positions given in the batch, a padded mask)
carries none, nor does what is computed from it, and every question asked of it goes as before:
transformers builds the mask, a read-back raises. A batch moved to meta for a model on meta keeps
the one value of each tensor that had one (`_batch.batch_for_meta`), so a what-if plan takes the
same branch.

The plan is then the example batch's: where the step branched on a value of the batch's, it is
noted (`Known.reads`, `ActivationProfile.batch_values_read`) and the plan says so, since a
training batch with padding takes the branch that holds more.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from autoshard._batch import uniform_value
from autoshard._torch_compat import (
    disable_current_modes,
    op_overload,
    storage_key,
    writes_arguments,
    written_arguments,
)

__all__ = ["KNOWN_NUMEL", "Known", "transformers_reads_known_values", "uniform_value"]

aten = torch.ops.aten
# The most elements of a tensor made full of one value for it to carry that value, of a tensor
# whose elements differ for it to carry its contents (positions made by `arange`, what is computed
# from them), and of an operator's output for the operator to be run for real on known values
# (its arguments are expanded scalars, or those contents): a batch's mask or a sequence's
# positions, not a tensor of activations. A million int64 elements take 8 MiB of host memory
# while the fake tensor holding them lives. A larger output of an operator whose value does not
# depend on the sizes is known all the same (`Known._follow_large`).
KNOWN_NUMEL = 1 << 20
# Factories whose output's contents their arguments decide: positions
_ARANGE = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
# The operators run for real on known values: torch's own
_RUN = frozenset({"aten", "prims"})
# Operators that read a tensor's metadata only (`prim::device`, which `Tensor.to` asks)
_METADATA = frozenset({"prim"})
# Operators whose output's value does not depend on its sizes, besides the elementwise ones
# (`torch.Tag.pointwise`): casts (`Tensor.to`, `.bool()`) and a copy into another tensor's dtype
_ANY_SIZE = frozenset(op for op in (op_overload("_to_copy"), aten.copy.default) if op is not None)


def _fill_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`full`'s and `full_like`'s fill value: their second argument."""
    return kwargs.get("fill_value", args[1] if len(args) > 1 else None)


# Operators that make a tensor of one value whatever their tensor argument holds: the value from
# their arguments (`full`'s fill value is its second argument, `full_like`'s and `new_full`'s
# too; the others' is fixed)
_FACTORIES: dict[Any, Any] = {
    aten.ones.default: lambda args, kwargs: 1,
    aten.zeros.default: lambda args, kwargs: 0,
    aten.full.default: _fill_value,
    aten.ones_like.default: lambda args, kwargs: 1,
    aten.zeros_like.default: lambda args, kwargs: 0,
    aten.full_like.default: _fill_value,
    aten.new_ones.default: lambda args, kwargs: 1,
    aten.new_zeros.default: lambda args, kwargs: 0,
    aten.new_full.default: lambda args, kwargs: kwargs.get("fill_value", args[2]),
    aten.scalar_tensor.default: lambda args, kwargs: args[0],
}


def _held(value: Any, dtype: torch.dtype) -> bool | int | float | None:
    """`value` as a tensor of `dtype` holds it (an int wrapped, a float rounded or made
    infinite), or None where it cannot hold it (NaN as an integer)."""
    try:
        with disable_current_modes():
            return torch.tensor(value).to(dtype).item()
    except (RuntimeError, TypeError, ValueError, OverflowError):
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return found


class Known:
    """The values the fake tensors of one mode carry (the module's docstring)."""

    def __init__(self) -> None:
        # fake tensor: (its one value, or its contents as a real CPU tensor where its elements
        # differ; its storage; whether the value comes from the example batch)
        self._values = torch.utils.weak.WeakIdKeyDictionary()
        self._storages: set[int] = set()  # where values are held (some may be gone)
        # where the step branched on a value of the example batch, and what it read there
        # (`ActivationProfile.batch_values_read`)
        self.reads: dict[str, str] = {}

    def note(self, fake: Any, value: Any, from_batch: bool = False) -> None:
        """`fake` carries `value` (None: nothing): one value, or its contents as a real tensor of
        its shape (held as one value where its elements are all one; not held above
        `KNOWN_NUMEL` elements). `from_batch`: a value of the example batch's, or
        computed from one."""
        if value is None or not isinstance(fake, torch.Tensor) or fake.is_complex():
            return
        if isinstance(value, torch.Tensor):
            value = _contents_held(value, fake)
            if value is None:
                return
        key = _storage(fake)
        held = value if isinstance(value, torch.Tensor) else _held(value, fake.dtype)
        if key is not None and held is not None:
            self._values[fake] = (held, key, from_batch)
            self._storages.add(key)

    def from_batch(self, tensor: Any) -> bool:
        """Whether the value `tensor` carries comes from the example batch."""
        held = self._values.get(tensor) if isinstance(tensor, torch.Tensor) else None
        return held is not None and held[2]

    def value(self, tensor: Any) -> bool | int | float | None:
        """The one value every element of `tensor` carries, or None (none known, or its
        elements differ)."""
        held = self.held(tensor)
        return None if isinstance(held, torch.Tensor) else held

    def held(self, tensor: Any) -> Any:
        """What `tensor` carries: its one value, its contents (a real CPU tensor of its shape),
        or None; none where its storage is no longer the one it had (`set_`, `.data =`, which
        no operator's schema says it writes)."""
        if not self._values or not isinstance(tensor, torch.Tensor):
            return None
        held = self._values.get(tensor)
        if held is None:
            return None
        if _storage(tensor) != held[1]:
            del self._values[tensor]
            return None
        return held[0]

    def read_back(self, tensor: Any) -> bool | int | float | None:
        """What a read-back of one-element `tensor` gives, where it carries a value."""
        value = self.value(tensor)
        return None if value is None or tensor.numel() != 1 else value

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Note the value of what `func` made, where it is known; forget what it wrote over."""
        factory = _FACTORIES.get(func)
        if func in _ARANGE:
            self._follow_arange(func, args, kwargs, out)
            return
        if factory is None and not self._values:
            return  # nothing carries a value: every operator of most steps passes here
        namespace = getattr(func, "namespace", None)
        if namespace in _METADATA:
            return
        if namespace not in _RUN:
            # an operator of another library (a collective: its result is the other ranks' too,
            # and its schema may not say it writes): what it touched is forgotten
            self._forget(_tensors((args, kwargs)))
            return
        if writes_arguments(func):
            # what it writes into is forgotten (not the mask `index_put_` writes through)
            written = written_arguments(func, args, kwargs)
            self._forget(_tensors((args, kwargs) if written is None else written))
            return
        if factory is None:
            values: dict[int, Any] = {}
            batch = False
            for tensor in _tensors((args, kwargs)):
                value = self.held(tensor)
                if value is None:
                    return  # an activation, a parameter: most operators stop here
                values[id(tensor)] = value
                batch = batch or self.from_batch(tensor)
            if not values or _unknowable(func):
                return
        outputs = _tensors(out)
        if not outputs:
            return
        small = all(o.numel() <= KNOWN_NUMEL for o in outputs)
        if factory is not None:
            if small:
                with contextlib.suppress(IndexError, KeyError):
                    self.note(outputs[0], factory(args, kwargs))
            return
        if not small:
            if not any(isinstance(v, torch.Tensor) for v in values.values()):
                self._follow_large(func, args, kwargs, outputs, values, batch)
            return
        try:
            ran = _run_on_values(func, args, kwargs, values)
        except Exception:  # an operator the expanded values cannot run: nothing known
            return
        for fake, real in zip(outputs, _tensors(ran), strict=False):
            self.note(fake, real, batch)

    def _follow_arange(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Positions (`arange`, of numbers, not of read-back tensors) carry their contents where
        they are few enough to hold (`KNOWN_NUMEL`)."""
        outputs = _tensors(out)
        if len(outputs) != 1 or outputs[0].numel() > KNOWN_NUMEL or _tensors((args, kwargs)):
            return
        try:
            ran = _run_on_values(func, args, kwargs, {})
        except Exception:  # arguments the CPU cannot take: nothing known
            return
        self.note(outputs[0], ran)

    def _follow_large(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: list[torch.Tensor],
        values: dict[int, Any],
        batch: bool,
    ) -> None:
        """`follow` for an output too large to make for real: its value where the sizes do not
        decide it (a view of one value holds that value; an elementwise operator or a cast
        gives, at any size, what it gives on one element)."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func.is_view and source is not None:
            for fake in outputs:
                if fake.dtype == source.dtype:  # not a view as another dtype (its bits)
                    self.note(fake, values[id(source)], batch)
            return
        if not (torch.Tag.pointwise in func.tags or func in _ANY_SIZE) or len(outputs) != 1:
            return
        try:
            ran = _tensors(_run_on_values(func, args, kwargs, values, one_element=True))
        except Exception:  # an operator the values cannot run: nothing known
            return
        if len(ran) == 1 and ran[0].numel() == 1 and ran[0].dtype == outputs[0].dtype:
            self.note(outputs[0], uniform_value(ran[0]), batch)

    def _forget(self, written: list[torch.Tensor]) -> None:
        keys = {_storage(t) for t in written}
        if None in keys:  # a tensor without a storage of its own (sparse): forget them all
            self._values = torch.utils.weak.WeakIdKeyDictionary()
            self._storages = set()
            return
        for tensor in written:
            self._values.pop(tensor, None)
        keys &= self._storages
        if not keys:
            return
        for tensor, (_, key, _) in list(self._values.items()):
            if key in keys:
                del self._values[tensor]
        self._storages -= keys


def _contents_held(real: torch.Tensor, fake: torch.Tensor) -> Any:
    """What a fake tensor of `real`'s values carries: their one value where all are one, else
    `real` itself (as `fake`'s dtype) where small enough to hold; None where neither."""
    if real.shape != fake.shape:
        return None
    one = uniform_value(real)
    if one is not None:
        return one
    if real.numel() > KNOWN_NUMEL or real.layout != torch.strided:
        return None
    with disable_current_modes():
        return real.detach().to(fake.dtype)


def _unknowable(func: Any) -> bool:
    """An operator whose output's values its inputs do not decide: a random draw, or memory
    left as it was found (`empty_like`)."""
    return torch.Tag.nondeterministic_seeded in func.tags or "empty" in func.__name__.split(".")[0]


def _storage(tensor: torch.Tensor) -> int | None:
    """The storage `tensor` is a view of, or None (sparse and other layouts have none)."""
    if tensor.layout != torch.strided:
        return None
    try:
        return storage_key(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _run_on_values(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    values: dict[int, Any],
    *,
    one_element: bool = False,
) -> Any:
    """`func` run for real on the CPU, each tensor argument an expanded scalar of its value; with
    `one_element`, each a tensor of one element with as many dimensions (so that dtypes promote
    as they do at full size)."""

    def real(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if isinstance(values[id(item)], torch.Tensor):  # contents: as they are
                return values[id(item)]
            scalar = torch.tensor(values[id(item)], dtype=item.dtype)
            if one_element:
                return scalar.reshape((1,) * item.dim())
            return scalar.expand(item.shape)
        if isinstance(item, torch.device):
            return torch.device("cpu")
        if isinstance(item, (list, tuple)):
            return type(item)(real(i) for i in item)
        return item

    with disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        return func(*real(args), **{k: real(v) for k, v in kwargs.items()})


def _mask_of_known_value(tensor: Any) -> bool:
    """A fake boolean tensor that carries a value (a padding mask as transformers' mask code
    holds it), or a tensor the step made whose values are known (positions, the packed-sequence
    indices computed from them). Of the batch's, only masks: transformers also asks `is_tracing`
    of token ids, to guard reading other tensors the fake step does not know (`pad_token_id in
    input_ids[:, [-1, 0]]`), where answering no would make the step fail."""
    known = getattr(getattr(tensor, "fake_mode", None), "known", None)
    if not isinstance(known, Known) or known.held(tensor) is None:
        return False
    if not known.from_batch(tensor):
        return True
    value = known.value(tensor)
    if value is None or getattr(tensor, "dtype", None) != torch.bool:
        return False
    from autoshard.measure.answers import asked_at  # answers holds the fake mode: no cycle

    read = f"transformers' mask code found the attention mask all {str(bool(value)).lower()}"
    known.reads.setdefault(asked_at(), read)
    return True


_depth = 0  # autoshard's fake modes entered and not yet exited


@contextlib.contextmanager
def transformers_reads_known_values() -> Iterator[None]:
    """transformers' `is_fake_tensor` false for a fake tensor that carries a value, while this
    runs (nested: until the outermost exits); a no-op where transformers is not imported."""
    global _depth
    module = sys.modules.get("transformers.utils.import_utils")
    original: Any = getattr(module, "is_fake_tensor", None) if _depth == 0 else None
    if original is not None:
        wrapped = original

        def is_fake_tensor(x: Any) -> bool:
            return bool(wrapped(x)) and not _mask_of_known_value(x)

        module.is_fake_tensor = is_fake_tensor  # type: ignore[union-attr]
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if original is not None:
            module.is_fake_tensor = original  # type: ignore[union-attr]
