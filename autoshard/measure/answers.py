"""Yes/no questions a step asks of its data, answered in the simulation as the real step answered.

Fake tensors hold no values, so a step that reads one back to decide what to do next stops there:
`nn.Transformer` checks whether its mask is causal (`bool((mask == causal).all())`), and the
simulation failed on it with `DataDependentOutputException`, leaving every strategy's estimate to
the formulas (26% above nn.Transformer's measured peak under FSDP2). Where the batch cannot be
traced on fake tensors, its activations are measured on real tensors instead (`measure.trace`);
that real step also records each boolean it read back and where in the code it was read
(`Recorder`). The simulation's fake kernel then gives the same answer at the same place
(`answering`).

Only booleans are answered, and only where every real step measured (one and two rows of the
batch) read the same value at that place: a yes/no that does not change with the rows (is the
mask causal, is there padding) takes the same branch at the batch's full size. A number read back
(a count of tokens, a size) is not answered: it can grow with the batch, and the simulation then
fails as before and falls back to the formulas, saying so.

One yes/no needs no real step: a uniform draw in [0, 1) compared with a bound outside that range
has one answer whatever was drawn (`DecidedDraws`). transformers' LayerDrop before 5.21 (BART,
mBART, Marian, Pegasus, Whisper, ...) draws `torch.rand([])` for every layer in training and
compares it with its drop probability, 0.0 by default: never below it. Without this a model of
those built on meta could not be planned at all (no real values to trace), and one built on a
device was traced on real tensors for it.

One output's size is answered as well: what `nonzero` finds (`torch.where(mask)`, the usual way to
route tokens to experts by hand, or to pick the rows a padding mask keeps), and what indexing
with a boolean mask (`logits[labels != -100]`) and `masked_select` select. Their counts depend on
the values, and fake tensors refuse them (`DynamicOutputShapeException`), which left every
strategy of a hand-written mixture of experts to the formulas (-10.4% under DDP against its
allocator peak), and a loss over the labels kept +4.7%. The real steps record, at each place, how
many elements were found of how many searched (`Recorder.found`); the simulation's `nonzero` and
`masked_select` then find that share of their own input at the same place (`finding`): the
tokens routed to an expert, in all, and the rows a mask keeps scale with the batch, where a count
at one or two rows would not. The share is that of the rows measured: a batch whose first rows
keep more or fewer elements than the rest (more padding) is simulated as if every row were like
them, as its activations are scaled from them already.

So is the CTC loss's (`F.ctc_loss`, every speech model's ForCTC head): it saves its forward
variables for backward, rows x time x (2 x the longest target + 1), the longest target a value of
the labels, and fake tensors refuse it, which left every CTC model to the formulas (-4.2% to
+11.9% against the allocator's peak). The longest target comes from lengths the fake step knows
(numbers, `torch.full`: `known.Known`), else from the real steps, which record it at each place
against the targets' mean length (the longest target of the batch, not a row's: a batch of more
rows finds a target as long), else it is taken as long as the labels' rows, or as all the
targets one after another, the most it can be.

A bound inside (0, 1) leaves the answer to the draw: the step branches at random, as LayerDrop
with a probability above 0 and hand-written stochastic depth (`if torch.rand(()) < p: return x`)
skip whole layers. Such a read-back gets the likelier answer, in the trace (fake or real) and the
simulation alike: for a drop probability below one half, the branch that keeps the layer, whose
memory the estimate must hold. Where it was read is kept (`random_reads`): a step that skips
layers at random on each rank apart needs DDP to look for unused parameters every step, and
rules FSDP2 out (`strategies.recipes`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import torch

from autoshard._torch_compat import (
    TorchDispatchMode,
    engine_entry,
    fake_empty,
    op_overload,
    op_overloads,
    resolve,
    writes_arguments,
)
from autoshard.measure.known import Known, transformers_reads_known_values

READ_BACK = op_overload("_local_scalar_dense")  # what `bool(tensor)` and `.item()` run
NONZERO = torch.ops.aten.nonzero.default  # what `torch.where(mask)` and `mask.nonzero()` run
# Indexing with a boolean mask (`logits[labels != -100]`): the real kernel finds the mask's
# elements below the dispatcher, the fake one by calling `nonzero` on it, at the same place
INDEX = torch.ops.aten.index.Tensor
MASKED_SELECT = torch.ops.aten.masked_select.default
# The CTC loss (`F.ctc_loss`): lengths as tensors, or as lists of numbers
CTC_LOSS = op_overloads("_ctc_loss", "Tensor", "default")
_MASKS = (torch.bool, torch.uint8)
# The frames that name a place in the code: the innermost ones of the model's own code, which is
# outside torch or in torch.nn (nn.Transformer's); not autoshard's, nor torch's machinery (dispatch,
# modes, hooks, `Module.__call__`, whose lines differ with the hooks a module has).
_FRAMES = 2
_AUTOSHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_NN = os.path.join(_TORCH, "nn", "")
_MACHINERY = (_AUTOSHARD, os.path.join(_NN, "modules", "module.py"))


def _model_code(filename: str) -> bool:
    if filename.startswith(_MACHINERY):
        return False
    return not filename.startswith(_TORCH) or filename.startswith(_NN)


def asked_at() -> str:
    """Where the current read-back was asked for: the innermost frames of the model's code (the
    line and its caller), as "file:line < file:line"; none beyond autoshard's call of the model,
    nor beyond autograd's engine: a backward formula's is asked at "" (as on a device's own
    backward thread, where no Python frame is below the engine)."""
    places: list[str] = []
    entry = engine_entry()
    frame: FrameType | None = inspect.currentframe()
    while frame is not None and len(places) < _FRAMES:
        name = frame.f_code.co_filename
        if places and name.startswith(_AUTOSHARD):
            break
        # autograd's engine entered here: an operator of a backward formula has no line of the
        # model's between it and there, and none beyond it is the model's (the callers of
        # autoshard, of its trace and of its simulation, which differ)
        if frame.f_code is entry:
            break
        if _model_code(name):
            places.append(f"{name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(places)


class Recorder(TorchDispatchMode):
    """Records each boolean a real step reads back from a tensor, by where it was read. A place
    read with both values is dropped (`answers`). A uniform draw compared with a bound is read
    back as `DecidedDraws` answers it (`Draws`). What `nonzero` found, and in how many
    elements, by place (`found`)."""

    def __init__(self) -> None:
        super().__init__()
        self._read: dict[str, set[bool]] = {}
        self._found: dict[str, tuple[int, int]] = {}
        self.draws = Draws()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        decided = self.draws.answer(args[0]) if func is READ_BACK else None
        result = func(*args, **(kwargs or {})) if decided is None else decided
        if func is READ_BACK and args[0].dtype == torch.bool:
            self._read.setdefault(asked_at(), set()).add(bool(result))
        elif func is NONZERO:
            self._count(result.shape[0], args[0].numel())
        elif func is INDEX:
            for mask in args[1]:
                if isinstance(mask, torch.Tensor) and mask.dtype in _MASKS:
                    self._count(int(mask.count_nonzero()), mask.numel())
        elif func is MASKED_SELECT:
            self._count(result.numel(), _broadcast_numel(args[0], args[1]))
        elif func in CTC_LOSS:
            # the longest target, against the targets' mean length: (longest x rows, elements)
            log_probs, targets, _, target_lengths = args[:4]
            rows = log_probs.shape[1] if log_probs.dim() == 3 else 1
            self._count(_longest(target_lengths) * rows, targets.numel())
        self.draws.follow(func, args, result)
        return result

    def _count(self, found: int, searched: int) -> None:
        place = asked_at()
        before = self._found.get(place, (0, 0))
        self._found[place] = (before[0] + found, before[1] + searched)

    def answers(self) -> dict[str, bool]:
        return {place: next(iter(seen)) for place, seen in self._read.items() if len(seen) == 1}

    def found(self) -> tuple[tuple[str, int, int], ...]:
        """(place, elements `nonzero` found there, elements it searched), over the step; for a
        CTC loss, its longest target times its rows, and its targets' elements."""
        return tuple((place, *counts) for place, counts in self._found.items())


def found_together(
    runs: Iterable[tuple[tuple[str, int, int], ...]],
) -> tuple[tuple[str, int, int], ...]:
    """What several real steps' `nonzero` found, by place, added up."""
    total: dict[str, tuple[int, int]] = {}
    for run in runs:
        for place, found, searched in run:
            before = total.get(place, (0, 0))
            total[place] = (before[0] + found, before[1] + searched)
    return tuple((place, *counts) for place, counts in total.items())


def _broadcast_numel(a: torch.Tensor, b: torch.Tensor) -> int:
    return torch.broadcast_shapes(a.shape, b.shape).numel()


def finding(found: Iterable[tuple[str, int, int]]) -> dict[Any, Callable[..., Any]]:
    """Fake kernels (`_torch_compat.fake_kernel`) for `nonzero` (which the fake kernel of
    indexing with a mask calls) and `masked_select`. A mask that carries one value
    (`known.Known`: a mask of ones compared with a number, a language id made by `torch.ones`)
    finds all of its elements or none, wherever it is asked, the backward's indexing included.
    Otherwise, at a place where the real steps found elements, an output of the share of its
    input's elements they found there (rounded); elsewhere torch's own (which raises). A place
    not met is looked up by its line alone, as `answering` does. And for the CTC loss, whose
    saved variables' size is its longest target's (`ctc_loss`)."""
    found = tuple(found)
    shares = {place: n / searched for place, n, searched in found if searched}
    by_line = found_together(((_line(place), n, searched),) for place, n, searched in found)
    lines = {line: n / searched for line, n, searched in by_line if searched}

    def share_of(fake_mode: Any, mask: Any) -> float | None:
        known = getattr(fake_mode, "known", None)
        value = known.value(mask) if isinstance(known, Known) else None
        if value is not None:
            return 1.0 if value else 0.0  # nonzero counts NaN, as `bool` does
        return _looked_up(shares, lines) if shares else None

    def nonzero(fake_mode: Any, func: Any, tensor: Any) -> Any:
        share = share_of(fake_mode, tensor)
        if share is None:
            return NotImplemented
        rows = round(share * tensor.numel())
        return fake_empty(fake_mode, (rows, tensor.dim()), torch.long, tensor.fake_device)

    def masked_select(fake_mode: Any, func: Any, tensor: Any, mask: Any) -> Any:
        share = share_of(fake_mode, mask)
        if share is None:
            return NotImplemented
        rows = round(share * _broadcast_numel(tensor, mask))
        return fake_empty(fake_mode, (rows,), tensor.dtype, tensor.fake_device)

    def ctc_loss(
        fake_mode: Any, func: Any, log_probs: Any, targets: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """The loss and the forward variables it saves for backward, (rows, time, 2 x the
        longest target + 1) (`ctc_loss_cpu_template`, and CUDA's alike): the longest target
        from the lengths where they are known, else as the real steps found it against the
        targets' mean length at this place, else as long as the targets' rows (padded labels)
        or all of them (labels one after another), the most it can be."""
        if log_probs.dim() != 3:
            return NotImplemented
        time, rows = log_probs.shape[0], log_probs.shape[1]
        target_lengths = args[1] if len(args) > 1 else kwargs.get("target_lengths")
        longest = _known_longest(fake_mode, target_lengths)
        share = _looked_up(shares, lines) if longest is None and shares else None
        if longest is None and share is not None:
            longest = round(share * targets.numel() / max(rows, 1))
        if longest is None:
            longest = targets.shape[1] if targets.dim() == 2 else targets.numel()
        device = log_probs.fake_device
        return (
            fake_empty(fake_mode, (rows,), log_probs.dtype, device),
            fake_empty(fake_mode, (rows, time, 2 * longest + 1), log_probs.dtype, device),
        )

    return {
        NONZERO: nonzero,
        MASKED_SELECT: masked_select,
        **dict.fromkeys(CTC_LOSS, ctc_loss),
    }


def _longest(lengths: Any) -> int:
    """The largest of a CTC loss's real target lengths (a tensor or a list of numbers)."""
    if isinstance(lengths, torch.Tensor):
        return int(lengths.max()) if lengths.numel() else 0
    return max(lengths, default=0)


def _known_longest(fake_mode: Any, lengths: Any) -> int | None:
    """The largest of a CTC loss's target lengths where the fake step knows them: numbers, or
    a tensor carrying its values (`known.Known`); else None."""
    if not isinstance(lengths, torch.Tensor):
        return _longest(lengths) if lengths is not None else None
    known = getattr(fake_mode, "known", None)
    held = known.held(lengths) if isinstance(known, Known) else None
    if held is None:
        return None
    return _longest(held) if isinstance(held, torch.Tensor) else int(held)


def agreed(runs: Iterable[Mapping[str, bool]]) -> dict[str, bool]:
    """The answers every run gave alike (a place one run did not reach is left out)."""
    runs = list(runs)
    if not runs:
        return {}
    return {
        place: value
        for place, value in runs[0].items()
        if all(run.get(place) == value for run in runs[1:])
    }


def _short_place(place: str) -> str:
    """A place as its files' names and lines: "modeling.py:40 < modeling.py:12"."""
    return " < ".join(os.path.basename(frame) for frame in place.split(" < "))


def _line(place: str) -> str:
    """The innermost frame of a place: the line that asked."""
    return place.split(" < ", 1)[0]


def _by_line(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` by the line that asked alone, where every place asking on that line has the same
    value: a checkpointed block's forward run again in backward asks on the same line from
    another caller (torch's checkpoint, not the model's code)."""
    lines: dict[str, set[Any]] = {}
    for place, value in values.items():
        lines.setdefault(_line(place), set()).add(value)
    return {line: next(iter(seen)) for line, seen in lines.items() if len(seen) == 1}


def _looked_up(values: Mapping[str, Any], lines: Mapping[str, Any]) -> Any:
    """The value for the place asking now: its own, else its line's (`_by_line`), else None."""
    place = asked_at()
    found = values.get(place)
    return found if found is not None else lines.get(_line(place))


def answering(answers: Mapping[str, bool]) -> Callable[..., Any]:
    """A fake kernel for `READ_BACK` (`_torch_compat.fake_kernel`): the recorded answer for a
    boolean read at a place the real step read it, else torch's own (which raises)."""
    lines = _by_line(answers)

    def kernel(fake_mode: Any, func: Any, tensor: Any) -> Any:
        if tensor.dtype == torch.bool and (answer := _looked_up(answers, lines)) is not None:
            return answer
        return NotImplemented

    return kernel


aten = torch.ops.aten
# Operators whose every element is drawn uniformly from [0, 1)
_DRAWS = (aten.rand.default, aten.rand.generator, aten.rand_like.default)
# A comparison of such a draw with a bound: its answer for every element, where the bound decides
# it (None where the draw decides)
_COMPARED: dict[Any, Callable[[float], bool | None]] = {
    aten.lt.Scalar: lambda bound: True if bound >= 1 else False if bound <= 0 else None,
    aten.le.Scalar: lambda bound: True if bound >= 1 else False if bound < 0 else None,
    aten.gt.Scalar: lambda bound: False if bound >= 1 else True if bound < 0 else None,
    aten.ge.Scalar: lambda bound: False if bound >= 1 else True if bound <= 0 else None,
}


_SIGNS = {aten.lt.Scalar: "<", aten.le.Scalar: "<=", aten.gt.Scalar: ">", aten.ge.Scalar: ">="}


def _likelier(func: Any, bound: float) -> bool:
    """The likelier answer of a uniform draw in [0, 1) compared with `bound` inside it (a draw
    is below the bound with probability `bound`); at one half, False."""
    below = func in (aten.lt.Scalar, aten.le.Scalar)
    return bound > 0.5 if below else bound < 0.5


class Draws:
    """A step's uniform draws, its comparisons of one with a bound, and the answer a read-back
    of such a comparison gets (the module's docstring); `random_reads`: where a read-back was
    left to the draw ("file:line < file:line": "torch.rand() < 0.1")."""

    def __init__(self) -> None:
        # by identity: a tensor's == is elementwise, its truth a read-back
        self._draws = torch.utils.weak.WeakIdKeyDictionary()
        self._compared = torch.utils.weak.WeakIdKeyDictionary()  # tensor: (answer, random)
        self.random_reads: dict[str, str] = {}

    def answer(self, tensor: Any) -> bool | None:
        """The answer a read-back of `tensor` gets, or None (its own value); a read-back the
        draw decides is noted, and so is one of a draw itself."""
        if tensor in self._compared:
            answer, random = self._compared[tensor]
            if random is not None:
                self.random_reads.setdefault(asked_at(), random)
            return bool(answer)
        if tensor in self._draws:
            self.random_reads.setdefault(asked_at(), "torch.rand() read back")
        return None

    def follow(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """Note what `func` made of the draws held."""
        if (self._draws or self._compared) and writes_arguments(func):
            # a draw or an answer written over in place, or through a view, is neither any
            # more: forget them all (LayerDrop compares its draw at once); with none held,
            # every operator of the step passes here at no more cost than this test
            self._draws = torch.utils.weak.WeakIdKeyDictionary()
            self._compared = torch.utils.weak.WeakIdKeyDictionary()
        elif func in _DRAWS and isinstance(out, torch.Tensor):
            self._draws[out] = True
        elif (
            func in _COMPARED
            and isinstance(out, torch.Tensor)
            and len(args) == 2
            and args[0] in self._draws
            and isinstance(args[1], (int, float))
            and not isinstance(args[1], bool)
        ):
            bound = float(args[1])
            answer = _COMPARED[func](bound)
            if answer is None:
                self._compared[out] = (
                    _likelier(func, bound),
                    f"torch.rand() {_SIGNS[func]} {bound:g}",
                )
            else:
                self._compared[out] = (answer, None)


@functools.cache
def decided_draws() -> type:
    """A FakeTensorMode that answers the read-back of a uniform draw compared with a bound
    (the module's docstring), and of a tensor whose every element is one known value
    (`known.Known`), before its dispatch cache is consulted; every other read-back as torch's
    fake mode does (or the `answering` kernel). It overrides `dispatch`, which
    `__torch_dispatch__` calls on every torch 2.11 to 2.15; a torch that did not call it would
    leave every draw undecided, and every value unknown, as before. While it is entered,
    transformers reads the known values as the real step does
    (`known.transformers_reads_known_values`)."""
    base = resolve("FakeTensorMode")

    class DecidedDraws(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.draws = Draws()
            self.known = Known()
            self._reading: list[contextlib.AbstractContextManager[None]] = []

        def __enter__(self):  # type: ignore[no-untyped-def]
            reading = transformers_reads_known_values()
            reading.__enter__()
            self._reading.append(reading)
            try:
                return super().__enter__()
            except BaseException:
                self._reading.pop().__exit__(None, None, None)
                raise

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            try:
                return super().__exit__(*exc)
            finally:
                self._reading.pop().__exit__(None, None, None)

        def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is READ_BACK and args:
                answer = self.draws.answer(args[0])
                if answer is None:
                    answer = self.known.read_back(args[0])
                    if answer is not None and self.known.from_batch(args[0]):
                        place = asked_at()
                        read = f"{answer} read back at {_short_place(place)}"
                        self.known.reads.setdefault(place, read)
                if answer is not None:
                    return answer
            out = super().dispatch(func, types, args, kwargs)
            self.draws.follow(func, args, out)
            self.known.follow(func, args, kwargs or {}, out)
            return out

    return DecidedDraws
