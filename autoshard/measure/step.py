"""One training step of a fake model under torch's memory trackers (`measure.simulate`): the
breakdown at the peak of each moment of forward and backward, and at the optimizer step's peak,
as in a steady step."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from autoshard._batch import call_model, compute_loss, tensors_in, tensors_reached
from autoshard._torch_compat import (
    mem_trackers,
    storage_key,
    tracker_frees_cut_branches,
    tracker_frozen_safe,
    tracker_global_peak_only,
    tracker_reset_peak,
    tree_leaves,
)
from autoshard.decide.estimate import Phase, besides_grads
from autoshard.measure.rise import stored
from autoshard.measure.rng import states_counted
from autoshard.measure.workspace import Workspace
from autoshard.strategies.recipes import recipe
from autoshard.strategies.strategy import Strategy
from autoshard.wrap.branches import PlainBranches

if TYPE_CHECKING:
    from autoshard.measure.simulate import Setup


@contextmanager
def autograd_on() -> Iterator[None]:
    """Autograd on, whatever the caller's mode: a step traced or simulated is a training step,
    even where `plan` or `prepare` is called under `torch.no_grad()` or `torch.inference_mode()`
    (there every fake step failed, and the estimate left activations out)."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


# Optimizers whose step creates a group's state before its arithmetic (`_init_group`), so that
# the first step of an optimizer with one group of trained parameters peaks as a steady step
# does: the measured step may be the first (`_state_first`). SGD is not one: its momentum buffer
# is made inside the loop, parameter by parameter.
_STATE_FIRST = (torch.optim.Adam, torch.optim.AdamW)


def _state_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the first step's peak is a steady step's: the exact class (a subclass may
    override `step`) and one group with trained parameters. Groups step one after another, each
    creating its state as it starts, so a first step's earlier groups run without the later
    groups' state: AdamW's usual two groups (decayed weights first, then biases and norms) read
    the later group's state less than a steady step (a group of embeddings without decay after
    the weights: twice the embeddings' bytes)."""
    trained = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    return type(optimizer) in _STATE_FIRST and len(trained) <= 1


class BlockStart(NamedTuple):
    """What is alive as a block's forward begins (`Moments.starts`): the activations and
    temporaries (`held`), and of the earlier blocks' inputs among them, the bytes the model
    lets go of when it returns (`let_go`: a local of its forward, the first block's input that
    a frozen embedding made, the positions every block takes), which a checkpoint of those
    blocks keeps until its backward."""

    held: int
    let_go: int


def tracked_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    setup: Setup,
    strategy: Strategy,
    labelled: list[tuple[nn.Module, str]] | None = None,
    named: list[tuple[nn.Module, str]] | None = None,
) -> tuple[dict[str, list[Phase]], Phase, dict[str, BlockStart]]:
    """The breakdowns of each moment of forward and backward (`Moments`, over the `labelled`
    blocks, the model's repeated blocks in order, each with its label), at the optimizer
    step's peak of a steady step, and the bytes that checkpointing may free as each of the
    `named` blocks (the model's blocks in order, by name) begins its forward
    (`Moments.starts`). Each moment has its peak, or, where blocks are labelled (to be
    extended), the bytes after each of its operators (where this torch's tracker lets them be
    read; else its peak).

    The optimizer state is alive and unchanged through forward and backward, so it adds to
    that peak without moving it: where a first step peaks as a steady one does (`_state_first`)
    the one measured step creates it, and it is added to the forward/backward peak afterwards.
    Any other optimizer first takes an unmeasured step from zero gradients (which allocates what
    a full first step would).
    With every block checkpointed (`setup.checkpoint_all`) only forward and backward run: the
    step is the unchecked simulation's, and the caller takes that run's state (`simulate.combine`).

    A loop keeps the output until the next one replaces it (`outputs = model(**batch)` of the
    next step or micro-batch): what it holds after backward is alive through the next forward
    beside what that forward makes (`carried`), up to the model's return; and the loss, through
    the optimizer step and the next forward, until the next loss replaces it."""
    FSDPMemTracker, MemTracker = mem_trackers()

    from autoshard.strategies.engines import autocast_hooks

    if not recipe(strategy).sharded and setup.dtype is not None:
        autocast_hooks(model, setup.device.type, setup.dtype)
    in_place = strategy == Strategy.DDP  # DDP's buckets: every gradient lives from construction
    stepped = not setup.checkpoint_all and not _state_first(optimizer)
    if stepped:
        _first_step(model, optimizer, keep_grads=in_place)
    elif in_place:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    inputs = tensors_in(batch)
    tracker: Any
    if recipe(strategy).sharded:
        tracker = frozen_safe(FSDPMemTracker(model, optimizer))
        tracker.track_inputs(tuple(inputs))
        tracker.track_external(optimizer)
    else:
        tracker = frozen_safe(MemTracker())
        tracker.track_external(model, optimizer, *inputs)  # the batch counts as "Other": inputs
    moments = Moments(tracker, labelled or [], named or [])
    moments.recording = tracker_global_peak_only(tracker, moments.observe)
    # inside the tracker, which so sees the workspace blocks and the generator states kept
    trains_on = setup.trains_on or setup.device
    with (
        tracker,
        Workspace(trains_on),
        states_counted(trains_on),
        PlainBranches(),
        moments.marked(),
    ):
        # the output is held through backward and the optimizer step, as a loop holding it
        # does (`outputs = model(**batch); outputs.loss.backward()`)
        output = [call_model(model, batch)]
        moments.returned()
        moments.mark(LOSS)
        # held through backward and the optimizer step, as a loop holding it does
        loss = [compute_loss(output[0], batch, setup.loss_fn)]
        moments.mark(HEAD)
        loss[0].backward()
        moments.mark(None)
        backward = moments.result()
        kept = [*model.parameters(), *model.buffers(), *inputs]
        if setup.checkpoint_all:
            return (
                carried(backward, *let_go(tracker, output, loss, kept)),
                Phase(**dict.fromkeys(_TERMS, 0)),
                moments.starts(),
            )
        # The step's peak: what is alive as it starts (parameters, gradients, state), plus the
        # most its intermediates add. Taken as a difference of totals, not from the tracker's
        # breakdown at its peak, which files optimizer state under other names mid-step.
        before = _phase(tracker, "current")
        tracker_reset_peak(tracker)
        optimizer.step()
        added = max(0, total(tracker, "peak") - total(before))
        created = 0 if stepped else _phase(tracker, "current").optimizer_state
        step = replace(
            before,
            optimizer_state=before.optimizer_state + created,
            temporaries=before.temporaries + added - created,
        )
        optimizer.zero_grad(set_to_none=not in_place)
        backward = carried(backward, *let_go(tracker, output, loss, kept))
    with_created = {
        label: [with_state(phase, created) for phase in phases]
        for label, phases in backward.items()
    }
    return with_created, step, moments.starts()


# A block's input as `Moments` follows it: a reference to its storage, which dies with it, and
# the storage's bytes
_Input = tuple["weakref.ref[torch.UntypedStorage]", int]

# Labels of the moments of forward and backward (`Moments`)
FORWARD = "forward"  # up to the first block
AFTER_BLOCKS = "forward after the blocks"  # the head, up to the model's return
LOSS = "the loss"  # computed of the output, where the model's forward did not
HEAD = "head backward"  # from the loss down to the last block's backward


# Instants a moment not `aligned` keeps before they are first cut down to its `peaks`, and
# then twice as many as were left
_UNALIGNED = 256


class Moments:
    """The bytes of each moment of forward and backward, by label: after each of its operators
    (`aligned`, to be extended), else its `peaks` (where this torch's tracker lets each
    operator's bytes be read; else the tracker's peak within it).

    Hooks on each block mark where its forward begins and, on its outputs, where its backward
    begins (the gradient of its output is ready). The moments: the forward up to the first
    block, each block's forward, the rest of the forward (the head, up to the model's return),
    the loss where the model did not compute it, the head's backward (down to the last block),
    then each block's backward, the first block's running to the end of backward. A block's
    label names the same block of the model at every depth simulated (`layout.Stretch.label`),
    so that a model simulated at two depths has the same moments at both and each can be
    extended to the full depth on its own (`simulate._extend_moments`): the peak's moment can
    move with depth (the head's backward with few blocks, the end of backward or of forward
    with many), which one global peak per depth misses (a 22-block Llama under DDP with every
    block checkpointed: 18.66 GiB extended that way, 19.19 GiB simulated whole)."""

    def __init__(
        self,
        tracker: Any,
        labelled: list[tuple[nn.Module, str]],
        named: list[tuple[nn.Module, str]],
    ) -> None:
        self.tracker = tracker
        self.labelled = labelled
        self.named = named
        # the activations and temporaries alive as each named block's forward began, by its
        # name, in the order they ran
        self.held_at: list[tuple[str, int]] = []
        # the named blocks' inputs, by storage: a reference that dies with it, and its bytes
        self.inputs: dict[int, _Input] = {}
        # the earlier blocks' inputs alive as each named block's forward began, in the order
        # they ran; then, once the model returned, the bytes of those it let go of
        self.inputs_at: list[list[_Input]] = []
        self.let_go: list[int] = []
        self.seen: dict[str, Phase] = {}
        self.label: str | None = FORWARD
        self.in_backward = False
        self.recording = False  # `observe` sees every operator
        # every instant kept, each moment's k-th operator to be extended with its k-th at
        # another depth; else each moment's `peaks`
        self.aligned = bool(labelled)
        self.series: dict[str, list[Phase]] = {}
        self.cut_at: dict[str, int] = {}  # a moment's instants cut to its peaks beyond these

    def observe(self, snapshots: dict[Any, dict[Any, int]]) -> None:
        """The bytes after one operator, kept under the current moment (`recording`)."""
        if self.label is None:
            return
        phase = _as_phase(snapshots)
        series = self.series.setdefault(self.label, [])
        if not series or series[-1] != phase:  # an operator that allocated or freed
            series.append(phase)
            if not self.aligned and len(series) > self.cut_at.get(self.label, _UNALIGNED):
                series[:] = peaks(series)
                self.cut_at[self.label] = max(_UNALIGNED, 2 * len(series))

    def result(self) -> dict[str, list[Phase]]:
        """Each moment's bytes after each of its operators where recorded and `aligned`, its
        `peaks` where recorded, else its peak."""
        if self.recording:
            if self.aligned:
                return self.series
            return {label: list(peaks(series)) for label, series in self.series.items()}
        return {label: [phase] for label, phase in self.seen.items()}

    def mark(self, label: str | None) -> None:
        """Close the current moment with the tracker's peak within it (unless `recording`,
        which keeps every instant), and start `label`'s."""
        self.in_backward = self.in_backward or label == HEAD
        if self.label is not None and not self.recording:
            phase = _phase(self.tracker, "peak")
            before = self.seen.get(self.label)
            if before is None or total(phase) > total(before):
                self.seen[self.label] = phase
        tracker_reset_peak(self.tracker)
        self.label = label

    def starts(self) -> dict[str, BlockStart]:
        """What was alive as each named block's forward began, by the block's name: what
        checkpointing the first k blocks lets go of is the difference of the activations and
        temporaries at the k-th between the runs with none and with every block checkpointed
        (`estimate.checkpointing_frees`). Not where the last one ends: a forward hook's
        arguments still hold the block's input there, which its forward let go of. Of the
        earlier blocks' inputs alive there, what the model let go of as it returned
        (`returned`) both runs held at the k-th block's start, and only the checkpoints keep
        after it (`estimate.checkpointing_keeps`). Empty where the blocks did not run once
        each, in their order (a block called twice, blocks run out of order), or the model's
        return was not seen."""
        names = [name for _, name in self.named]
        if not names or [name for name, _ in self.held_at] != names:
            return {}
        if len(self.let_go) != len(names):
            return {}
        return {
            name: BlockStart(held, let_go)
            for (name, held), let_go in zip(self.held_at, self.let_go, strict=True)
        }

    def returned(self) -> None:
        """The model returned: of the earlier blocks' inputs alive as each named block began,
        the bytes now let go of (`BlockStart.let_go`)."""
        self.let_go = [sum(n for ref, n in alive if ref() is None) for alive in self.inputs_at]

    @contextmanager
    def marked(self) -> Iterator[None]:
        """Each block hooked for the duration: its forward, and its backward (the gradient of
        its output ready), each start a moment; the last block's end starts the head's. Each
        named block's forward start is kept (`starts`)."""
        handles = [
            hook
            for block, label in self.labelled
            for hook in (
                block.register_forward_pre_hook(self._forward_starts(label)),
                block.register_forward_hook(self._hook_outputs(label)),
            )
        ]
        handles += [
            block.register_forward_pre_hook(self._keep_held(name), with_kwargs=True)
            for block, name in self.named
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keep_held(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            # not a checkpointed block's forward run again in backward
            if not self.in_backward:
                phase = _phase(self.tracker, "current")
                self.held_at.append((name, phase.activations + phase.temporaries))
                self.inputs_at.append([i for i in self.inputs.values() if i[0]() is not None])
                self._keep_inputs((args, kwargs))

        return hook

    def _keep_inputs(self, inputs: Any) -> None:
        """A block's tensor inputs, by storage, as a checkpoint of it keeps them: references
        that die with them (as the trackers' own), which tell whether the model let go of
        them as it returned (`returned`)."""
        for tensor in tree_leaves(inputs):
            if stored(tensor):
                storage = tensor.untyped_storage()
                key = storage_key(storage)
                # not one let go of whose place a later storage took
                if key not in self.inputs or self.inputs[key][0]() is None:
                    self.inputs[key] = (weakref.ref(storage), storage.nbytes())

    def _forward_starts(self, label: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            # not a checkpointed block's forward run again in backward
            if not self.in_backward:
                self.mark(f"forward {label}")

        return hook

    def _hook_outputs(self, label: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.in_backward and module is self.labelled[-1][0]:
                self.mark(AFTER_BLOCKS)
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self.mark(label))

        return hook


def let_go(
    tracker: Any, output: list[Any], loss: list[Any], kept: list[torch.Tensor]
) -> tuple[int, int]:
    """Bytes the step's output and its loss (each the one item of its list, let go here) alone
    hold after the step (`released`): the loss first, and of it only what the output does not
    reach (a model's own loss, `output.loss`, is the output's)."""
    of_loss = released(tracker, loss, [*kept, *tensors_reached(output[0], outside=kept)])
    return released(tracker, output, kept), of_loss


def released(tracker: Any, output: list[Any], kept: list[torch.Tensor]) -> int:
    """Bytes the step's output (the one item of `output`, let go here) alone holds after the
    step: what the tracker frees as it goes (with a graph its tensors keep: a checkpointed
    block that fills a cache again when recomputed leaves keys whose gradient functions hold
    the block's input), and at least the storages it reaches but the `kept` ones (the
    parameters, the buffers, the batch)."""
    known = {storage_key(t.untyped_storage()) for t in kept if stored(t)}
    reached = {
        storage_key(t.untyped_storage()): t.untyped_storage().nbytes()
        for t in tensors_reached(output[0], outside=kept)
        if stored(t)
    }
    floor = sum(n for key, n in reached.items() if key not in known)
    before = total(tracker, "current")
    output.clear()
    return max(before - total(tracker, "current"), floor)


def carried(moments: dict[str, list[Phase]], size: int, loss: int = 0) -> dict[str, list[Phase]]:
    """The `moments` with `size` bytes more alive through each moment of the forward: the
    previous step's output (`released`), which a loop lets go only once the model returns the
    next one; and `loss` bytes more through those and the loss's own moment: the previous step's
    loss, let go only once the next one is computed (`loss = loss_fn(output, batch)`). A loss is
    one number, but the one some kernels return keeps the buffer of the unreduced loss, the
    output's size (`workspace.KEEPS_UNREDUCED`: mse's). Counted with the activations, as the
    output held through backward is."""

    def held(label: str) -> int:
        return size + loss if in_forward(label) else loss if label == LOSS else 0

    return {
        label: [replace(phase, activations=phase.activations + held(label)) for phase in phases]
        for label, phases in moments.items()
    }


def of_forward(moments: dict[str, list[Phase]]) -> dict[str, list[Phase]]:
    """The `moments` of the model's forward (`in_forward`): autocast's cached copies of the
    parameters are alive through them, a checkpointed block's too."""
    return {label: phases for label, phases in moments.items() if in_forward(label)}


def in_forward(label: str) -> bool:
    """Whether a moment's `label` is one of the model's forward (up to its return)."""
    # a block's forward is `f"{FORWARD} {label}"` (`Moments._forward_starts`), as AFTER_BLOCKS is
    return label == FORWARD or label.startswith(f"{FORWARD} ")


def peak_of(moments: dict[str, list[Phase]], key: Callable[[Phase], int] | None = None) -> Phase:
    """The forward/backward peak: the largest of any moment (by `key`, default its total)."""
    return max((phase for phases in moments.values() for phase in phases), key=key or total)


def peaks(phases: Iterable[Phase]) -> tuple[Phase, ...]:
    """Of `phases`, those that can be the largest once the sharded terms (parameters, gradients,
    optimizer state: `sharded_bytes`) are scaled by some factor from 0 up, with or without
    checkpointing's share of the rest let go: the largest by total first, then the upper convex
    hull of (sharded bytes, the others) and of (sharded bytes, what checkpointing never frees:
    buffers, gathered parameters and gradients), the largest besides gradients
    (`estimate.besides_grads`) and the one with the most activations and temporaries
    (`estimate._Calibration`). A simulation on 8 ranks picked its peak at 8 ranks' shards; a
    plan for 16,384 ranks (shards 2,048 times smaller) peaks where the most activations are
    alive, and CPU offload (the state in host memory, factor 0) too: a 405B-shaped model with
    every block checkpointed, its moment ending backward with 184 GiB of gradients at 8 ranks
    (3 GiB of activations), had 34 GiB of activations alive at another. Checkpointing k blocks
    lets go of activations and temporaries alone (`estimate._less`): exactly the largest
    unwrapped and under DDP; under FSDP2, whose share depends on each moment's own bytes, with
    none checkpointed, not always with some."""
    distinct = list(dict.fromkeys(phases))
    if not distinct:
        return ()
    # Of moments at one point the one that stays largest: with the most that checkpointing
    # never frees (on the hull of the others), with the most checkpointing may free (on the
    # hull of what it never frees)
    kept = [
        *_upper_hull(distinct, lambda p: total(p) - sharded_bytes(p), _never_freed),
        *_upper_hull(distinct, _never_freed, total),
    ]
    largest = max(distinct, key=total)
    extra = max(distinct, key=besides_grads)
    held = max(distinct, key=lambda p: p.activations + p.temporaries)
    return tuple(dict.fromkeys((largest, *kept, extra, held)))


def _upper_hull(
    phases: list[Phase], other: Callable[[Phase], int], prefer: Callable[[Phase], int]
) -> list[Phase]:
    """The phases on the upper convex hull of (`sharded_bytes`, `other` bytes) from the most
    `other` bytes to the most sharded: each the largest of other + r x sharded for some r >= 0
    (and every such largest is one of them); of phases at one point, the one `prefer`red."""
    by_point: dict[tuple[int, int], Phase] = {}
    for phase in phases:
        point = (sharded_bytes(phase), other(phase))
        if point not in by_point or prefer(phase) > prefer(by_point[point]):
            by_point[point] = phase
    hull: list[tuple[int, int]] = []  # left to right
    for point in sorted(by_point):
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) >= 0:
            hull.pop()
        hull.append(point)
    most_other = max(range(len(hull)), key=lambda i: (hull[i][1], i))
    return [by_point[point] for point in hull[most_other:]]


def _never_freed(phase: Phase) -> int:
    """A moment's bytes that checkpointing frees nothing of (`estimate._less`)."""
    return phase.buffers + phase.comm_buffers


def _turn(o: tuple[int, int], a: tuple[int, int], b: tuple[int, int]) -> int:
    """Positive where o -> a -> b turns left (a is under the line from o to b)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def sharded_bytes(phase: Phase) -> int:
    """A moment's bytes that FSDP2 shards (and CPU offload moves to the host)."""
    return phase.params + phase.grads + phase.optimizer_state


def with_state(phase: Phase, state: int) -> Phase:
    """`phase` with `state` more bytes of optimizer state alive."""
    return replace(phase, optimizer_state=phase.optimizer_state + state)


_TERMS = tuple(f.name for f in fields(Phase))


def _first_step(model: nn.Module, optimizer: torch.optim.Optimizer, keep_grads: bool) -> None:
    """Create the optimizer's state with one update from zero gradients, in foreach form where the
    optimizer has it (one fake dispatch per list rather than per tensor)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    saved = [g.get("foreach") for g in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True
        optimizer.step()
    except Exception:  # noqa: BLE001 - no foreach form: the plain step creates the same state
        for group, value in zip(optimizer.param_groups, saved, strict=True):
            group["foreach"] = value
        optimizer.step()
    finally:
        for group, value in zip(optimizer.param_groups, saved, strict=True):
            if "foreach" in group:
                group["foreach"] = value
    if keep_grads:
        for param in params:
            param.grad.zero_()  # type: ignore[union-attr]
    else:
        optimizer.zero_grad(set_to_none=True)


def frozen_safe(tracker: Any) -> Any:
    """`tracker`, made to track models with frozen parameters (LoRA, frozen embeddings): its
    gradient hooks go on trainable parameters only (`_torch_compat.tracker_frozen_safe`); and to
    free a branch the forward cuts from the loss when the real step does
    (`_torch_compat.tracker_frees_cut_branches`)."""
    return tracker_frees_cut_branches(tracker_frozen_safe(tracker))


def total(source: Any, kind: str = "") -> int:
    if isinstance(source, Phase):
        return sum(getattr(source, f.name) for f in fields(Phase))
    return sum(s.get("Total", 0) for s in source.get_tracker_snapshot(kind).values())


def _phase(tracker: Any, kind: str) -> Phase:
    """The tracker's breakdown ("peak" or "current"), summed over devices, in autoshard's
    terms."""
    return _as_phase(tracker.get_tracker_snapshot(kind))


def _as_phase(snapshots: dict[Any, dict[Any, int]]) -> Phase:
    """A tracker's bytes by device and category, summed over devices, in autoshard's terms."""
    by_name: dict[str, int] = {}
    for snapshot in snapshots.values():
        for key, value in snapshot.items():
            name = getattr(key, "value", key)
            by_name[name] = by_name.get(name, 0) + value

    def get(*names: str) -> int:
        return sum(by_name.get(n, 0) for n in names)

    return Phase(
        params=get("Parameter", "Sharded Param"),
        buffers=get("Buffer"),
        grads=get("Gradient", "Sharded Grad"),
        optimizer_state=get("Optstate", "OptState"),
        activations=get("Activation", "Inputs", "Other"),
        comm_buffers=get("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
        temporaries=get("Temp"),
    )
