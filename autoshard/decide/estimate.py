"""Per-rank memory footprint of one candidate, as a breakdown of named terms.

Every term below is a formula over what was measured (parameter sizes, optimizer state, the traced
activations); the comment on each says what it counts and where the rule comes from. The peak is
the larger of two phases: forward/backward (activations alive) and the optimizer step (activations
freed, optimizer temporaries alive).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from autoshard.decide.profile import ActivationProfile
from autoshard.strategies.recipes import Engine, recipe
from autoshard.strategies.strategy import Strategy

# CUDA's caching-allocator rounding and fragmentation, as a share of the tensor bytes. The CPU has
# no caching allocator and the trial step there measures every allocation, so no margin: the 5%
# CPU gap in DESIGN.md section 3 (DDP 404 MiB allocator peak vs 383 MiB tracked) was DDP's bucket
# copy of the gradients under gradient_as_bucket_view=False, which autoshard does not use.
ALLOCATOR_MARGIN = 0.05
# A CUDA context not created yet costs this much once it is (hundreds of MiB: DESIGN.md section 3).
CUDA_CONTEXT_BYTES = 512 * 2**20
# NCCL's own buffers per communicator: NCCL_BUFFSIZE (4 MiB) x channels, rounded up.
NCCL_BUFFER_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ModelStats:
    """Sizes of the model and optimizer, unsharded, measured once before any candidate.

    Attributes:
        param_bytes: all parameters in their stored dtype.
        trainable_bytes: parameters with requires_grad (they get gradients and optimizer state).
        floating_numel: elements of floating-point parameters (cast under mixed precision).
        block_numel: floating elements of each repeated block (an FSDP unit each).
        optimizer_bytes: optimizer state after its first step (`optimizer.optimizer_state_bytes`).
        optimizer_reason: how optimizer_bytes was counted.
        input_bytes: bytes of the example batch.
        buffer_bytes: the model's buffers, in the formulas' parameters term.
        step_temporary_bytes: intermediates the optimizer step holds at once, unsharded
            (`optimizer.step_temporary_bytes`); None: assumed as large as all gradients.
        host_step_temporary_bytes: the same for the step on the host (CPU offload), where torch's
            optimizers default to the loop; None: as `step_temporary_bytes`.
        step_traffic_bytes: bytes the optimizer step reads and writes, unsharded, and
        step_operators: the operators it runs (`optimizer.step_traffic`; the cost model's),
            both over the accumulation steps: one micro-batch's share.
    """

    param_bytes: int
    trainable_bytes: int
    floating_numel: int
    block_numel: tuple[int, ...]
    optimizer_bytes: int
    optimizer_reason: str
    input_bytes: int
    step_temporary_bytes: int | None = None
    # (rows, elements per row, element bytes) of each parameter: FSDP2 shards dim 0
    param_rows: tuple[tuple[int, int, int], ...] = ()
    # the same of each trainable parameter (each has a gradient)
    grad_rows: tuple[tuple[int, int, int], ...] = ()
    host_step_temporary_bytes: int | None = None
    step_traffic_bytes: int = 0
    step_operators: int = 0
    # the model's buffers (rotary tables, masks, batch norms' statistics): on every rank, whole
    buffer_bytes: int = 0

    @property
    def root_numel(self) -> int:
        """Elements outside the blocks: the root FSDP unit (embeddings, head, final norm)."""
        return self.floating_numel - sum(self.block_numel)


def model_stats(
    model: nn.Module,
    blocks: list[nn.Module],
    optimizer_bytes: int,
    reason: str,
    input_bytes: int,
    step_temporary_bytes: int | None = None,
    host_step_temporary_bytes: int | None = None,
    step_traffic: tuple[int, int] = (0, 0),
) -> ModelStats:
    params = list(model.parameters())
    return ModelStats(
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        trainable_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        floating_numel=sum(p.numel() for p in params if p.is_floating_point()),
        block_numel=tuple(
            sum(p.numel() for p in b.parameters() if p.is_floating_point()) for b in blocks
        ),
        optimizer_bytes=optimizer_bytes,
        optimizer_reason=reason,
        input_bytes=input_bytes,
        step_temporary_bytes=step_temporary_bytes,
        host_step_temporary_bytes=host_step_temporary_bytes,
        step_traffic_bytes=step_traffic[0],
        step_operators=step_traffic[1],
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        param_rows=tuple(_rows(p) for p in params),
        grad_rows=tuple(_rows(p) for p in params if p.requires_grad),
    )


def _rows(param: torch.Tensor) -> tuple[int, int, int]:
    rows = param.shape[0] if param.dim() else 1
    return rows, param.numel() // max(rows, 1), param.element_size()


def shard_bytes(stats: ModelStats, degree: int, rank: int = 0) -> int:
    """Bytes of one rank's FSDP2 shard of every parameter: `torch.chunk` along dim 0 gives each
    rank ceil(rows / degree) rows while they last, so rank 0's shard is the largest."""
    total = 0
    for rows, per_row, size in stats.param_rows:
        chunk = -(-rows // degree)
        total += max(0, min(chunk, rows - rank * chunk)) * per_row * size
    return total


def _shards(shapes: tuple[tuple[int, int, int], ...], degree: int, rank: int) -> list[int]:
    """Bytes of `rank`'s FSDP2 shard of a parameter of each of `shapes` (`shard_bytes`)."""
    sizes = []
    for rows, per_row, size in shapes:
        chunk = -(-rows // degree)
        sizes.append(max(0, min(chunk, rows - rank * chunk)) * per_row * size)
    return sizes


def per_parameter_ratio(
    stats: ModelStats, simulated: tuple[int, int], planned: tuple[int, int]
) -> float:
    """At most how much a per-parameter optimizer step's temporaries grow from one rank's shards
    (degree, rank) to another's. That step holds a few copies of one or two parameters' shards
    at a time, not of all (foreach's), so the ratio of all shards is not a bound: a parameter of
    fewer rows than ranks (experts stacked in one tensor) keeps its shard while the others
    shrink. The bound: the largest growth of any one trainable parameter's shard; where the
    first rank holds none of a parameter the second holds, twice the ratio of their largest
    shards (the step holds between two and three copies of one parameter, for Adam's two
    intermediates and the one before them; one and two for one intermediate)."""
    # each (rows, per row, element size) once: the bound is the same, and a deep model has a
    # handful of shapes in thousands of parameters (and hundreds of candidates to bound)
    shapes = tuple(dict.fromkeys(stats.grad_rows))
    before, after = _shards(shapes, *simulated), _shards(shapes, *planned)
    if not before or max(before) == 0:
        return 1.0
    ratio = max((b / a for a, b in zip(before, after, strict=True) if a > 0), default=1.0)
    if any(a == 0 < b for a, b in zip(before, after, strict=True)):
        ratio = max(ratio, 2 * max(after) / max(before))
    return ratio


def shard_ratio(stats: ModelStats, simulated: int, planned: int) -> float:
    """How much larger a rank's shard is at `planned` ranks than at `simulated` ranks."""
    if simulated == planned or not stats.param_rows:
        return 1.0
    return shard_bytes(stats, planned) / max(shard_bytes(stats, simulated), 1)


@dataclass(frozen=True)
class Footprint:
    """Estimated per-rank peak bytes of one candidate, term by term, at the moment of the peak
    (see `estimate`): activations are 0 when the optimizer step is the peak, and comm_buffers
    too but for DDP's first buckets on CUDA (`retired_bucket_bytes`)."""

    params: int
    grads: int
    optimizer_state: int
    activations: int
    comm_buffers: int
    temporaries: int
    overheads: int
    # cuBLAS/cuBLASLt workspaces the step's matmuls allocate and keep (`measure.cublas`): an
    # allocation no tensor shows, in the allocator's figures like one
    workspace: int = 0

    @property
    def peak(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Phase:
    """Bytes alive at one peak of a simulated step, per rank, by term (`measure.simulate`)."""

    params: int  # stored parameters: sharded under FSDP2
    buffers: int
    grads: int  # sharded under FSDP2
    optimizer_state: int
    activations: int  # saved for backward, and the batch
    comm_buffers: int  # FSDP2's all-gather outputs, unsharded parameters and gradients
    temporaries: int

    def scaled(self, ratio: float) -> Phase:
        """The sharded terms at another sharding degree (`shard_ratio`)."""
        return replace(
            self,
            params=round(self.params * ratio),
            grads=round(self.grads * ratio),
            optimizer_state=round(self.optimizer_state * ratio),
        )


@dataclass(frozen=True)
class Simulated:
    """Two simulated steps of one strategy with no block checkpointed: the breakdown at the
    forward/backward peak and at the optimizer step's peak, at sharding degree `degree`."""

    backward: Phase
    step: Phase
    degree: int
    # the forward/backward peak with every block checkpointed, where that was simulated too
    checkpointed_backward: Phase | None = None
    # some group's optimizer step ran parameter by parameter (not foreach, not fused)
    per_parameter_step: bool = False
    # The moment of forward and backward with the most bytes besides gradients (with every
    # block checkpointed: `checkpointed_accumulating`). Unwrapped or under FSDP2 with gradient
    # accumulation, every gradient of the earlier micro-batches is alive at each moment (FSDP2's
    # whole until reduced in the last micro-batch): this one is the peak
    # then, which may be another than `backward` (a forward carrying the last micro-batch's
    # output, where backward's peak held its own gradients). None: the same as the peak.
    accumulating: Phase | None = None
    checkpointed_accumulating: Phase | None = None
    # The forward's peak (up to the model's return): a moment autocast's cached copies of the
    # parameters are alive through, a checkpointed block's too (`ActivationProfile.
    # block_cast_bytes`). None: not told apart from `backward`.
    forward: Phase | None = None
    # The moments of forward and backward that are the peak once the sharded terms are scaled
    # to another degree or moved to the host (`measure.step.peaks`; with every block
    # checkpointed: `checkpointed_peaks`): `backward` is the peak at `degree` alone. Empty:
    # `backward` at any degree.
    peaks: tuple[Phase, ...] = ()
    checkpointed_peaks: tuple[Phase, ...] = ()
    # The activations and temporaries alive as each block's forward begins, in the order of the
    # blocks (`measure.step.Moments.starts`; with every block
    # checkpointed: `checkpointed_starts`): what checkpointing the first k blocks frees is the
    # difference of the two at the k-th (`checkpointing_frees`). Empty: not recorded.
    starts: tuple[int, ...] = ()
    checkpointed_starts: tuple[int, ...] = ()
    # Of the earlier blocks' inputs alive as each block's forward begins, in the order of the
    # blocks, the bytes the run with none checkpointed lets go of as the model returns
    # (`measure.step.BlockStart.let_go`): what checkpointing the first k blocks keeps beyond
    # that run from there until their backward (`checkpointing_keeps`). Empty: not recorded.
    let_go_at_return: tuple[int, ...] = ()

    def scaled(self, ratio: float, per_parameter: float) -> Simulated:
        """The sharded terms at another shard size: the parameters, gradients and optimizer
        state of both phases by `ratio` (`shard_ratio`), and the optimizer step's temporaries,
        which it makes over this rank's shards: a foreach step one copy of them all (`ratio`;
        left unscaled, a 16,384-rank plan simulated on 8 carried an eighth of a 405B model's
        parameters as temporaries), a per-parameter step copies of one at a time
        (`per_parameter`, `per_parameter_ratio`)."""
        temporaries = per_parameter if self.per_parameter_step else ratio

        def scaled(phase: Phase | None) -> Phase | None:
            return phase.scaled(ratio) if phase is not None else None

        return replace(
            self,
            backward=self.backward.scaled(ratio),
            step=replace(
                self.step.scaled(ratio),
                temporaries=round(self.step.temporaries * temporaries),
            ),
            checkpointed_backward=scaled(self.checkpointed_backward),
            accumulating=scaled(self.accumulating),
            checkpointed_accumulating=scaled(self.checkpointed_accumulating),
            forward=scaled(self.forward),
            peaks=tuple(p.scaled(ratio) for p in self.peaks),
            checkpointed_peaks=tuple(p.scaled(ratio) for p in self.checkpointed_peaks),
        )


@dataclass(frozen=True)
class Setting:
    """What a candidate is, for the estimator: how it shards, checkpoints and casts."""

    strategy: Strategy
    checkpointed: int
    world_size: int
    compute_bytes: int  # element size of the compute dtype (2 under bf16/fp16)
    param_element_bytes: int  # element size of the stored parameters (4 for fp32)
    device_type: str
    cuda_context_pending: bool
    shard_degree: int | None = None  # ranks a parameter is sharded over; None: world_size
    accumulation_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    # cuBLAS/cuBLASLt workspaces a step allocates per rank (`measure.cublas`); 0 off CUDA,
    # where kernels' scratch is held per call in the simulation (`measure.workspace`)
    library_workspace_bytes: int = 0
    # DDP looks for parameters without a gradient every step (find_unused_parameters=True: the
    # trace left some without one, or the model skips layers at random): it never rebuilds its
    # buckets (`retired_bucket_bytes`)
    find_unused: bool = False
    # what each checkpointed block keeps beside its input until its backward, device memory on
    # this device: the CPU generator's state on the CPU (`measure.rng`); 0 elsewhere
    checkpoint_state_bytes: int = 0


def estimate(
    stats: ModelStats,
    profile: ActivationProfile | None,
    s: Setting,
    simulated: Simulated | None = None,
) -> Footprint:
    """The per-rank peak of one candidate, broken down at the moment it happens: from its
    simulation when there is one (`from_simulation`), else from formulas (`analytic`)."""
    if simulated is not None:
        return from_simulation(stats, profile, s, simulated)
    return analytic(stats, profile, s)


def from_simulation(
    stats: ModelStats, profile: ActivationProfile | None, s: Setting, sim: Simulated
) -> Footprint:
    """The simulated peaks, moved to this candidate's sharding degree and checkpointed blocks.

    Checkpointing the first k blocks frees what the activation profile says they save beyond
    their inputs (plus the recompute peak, `activation_bytes`), derived at the forward's peak
    and at the peak as backward begins (`_checkpointed`). The peak is the larger of the two
    phases. Overheads are what no tensor shows: on CUDA the
    context, NCCL's buffers and the caching allocator's rounding (ALLOCATOR_MARGIN of tensors).
    """
    degree = s.shard_degree or s.world_size
    sharded = recipe(s.strategy).sharded
    ratio = shard_ratio(stats, sim.degree, degree) if sharded else 1.0
    per_parameter = per_parameter_ratio(stats, (sim.degree, 0), (degree, 0)) if sharded else 1.0
    at_degree = sim.scaled(ratio, per_parameter)
    if recipe(s.strategy).offload:  # state lives in host memory, the step runs there
        at_degree = _on_device(at_degree)
    step = at_degree.step
    # The peak among the moments that are the peak at some degree: the simulation's own, at
    # its degree, may be another moment at this one (`measure.step.peaks`).
    checkpointed = _moments(at_degree.checkpointed_backward, at_degree.checkpointed_peaks)
    every = max(checkpointed, key=_sum, default=None)
    # with every block checkpointed, the most activations and temporaries alive at any moment
    every_held = max((p.activations + p.temporaries for p in checkpointed), default=None)
    frees = checkpointing_frees(at_degree, s.checkpointed)
    keeps = checkpointing_keeps(at_degree, s.checkpointed)
    backward = max(
        (
            _checkpointed(
                moment,
                every,
                profile,
                s,
                forward=at_degree.forward,
                held=every_held,
                frees=frees,
                keeps=keeps,
            )
            for moment in _moments(at_degree.backward, at_degree.peaks)
        ),
        key=_sum,
    )
    if (
        recipe(s.strategy).engine is not Engine.DDP
        and s.accumulation_steps > 1
        and at_degree.accumulating is not None
    ):
        # Every gradient alive from the second micro-batch on, at every moment: the moment with
        # the most bytes besides them is the peak where it is another than backward's
        # (taken for a moment of the forward, which it mostly is). FSDP2 likewise: through the
        # last micro-batch's backward the units not reduced yet hold their accumulated gradients
        # whole, the others their shards (what the simulated moment holds): never more than
        # every gradient whole, which stands in for the moment's own.
        every = at_degree.checkpointed_accumulating
        accumulating = _checkpointed(
            at_degree.accumulating, every, profile, s, besides_grads, frees=frees, keeps=keeps
        )

        def every_gradient(p: Phase) -> Phase:
            return replace(p, grads=max(p.grads, stats.trainable_bytes))

        backward = max(every_gradient(backward), every_gradient(accumulating), key=_sum)
    else:
        accumulated = accumulated_grad_bytes(stats, s, backward.grads)
        backward = replace(backward, grads=backward.grads + accumulated)
    retired = retired_bucket_bytes(stats, s)
    backward = replace(backward, comm_buffers=backward.comm_buffers + retired)
    step = replace(step, comm_buffers=step.comm_buffers + retired)
    phase = max(backward, step, key=_sum)
    terms = (
        phase.params + phase.buffers,
        phase.grads,
        phase.optimizer_state,
        phase.activations,
        phase.comm_buffers,
        phase.temporaries,
    )
    return Footprint(*terms, overhead_bytes(sum(terms), s), s.library_workspace_bytes)


def _moments(peak: Phase | None, peaks: tuple[Phase, ...]) -> tuple[Phase, ...]:
    """A simulation's peak and the moments that are the peak at another degree."""
    return () if peak is None else (peak, *peaks)


def checkpointing_frees(sim: Simulated, k: int) -> int | None:
    """What checkpointing the first k blocks lets go of, by the simulations with none and with
    every block checkpointed: the activations and temporaries alive as the k-th block's forward
    begins in the one, less those in the other (the blocks before it saved all they save in the
    one, their inputs and the generator's states in the other; all else alike). None where
    either did not record them, or k is none or every block."""
    plain, every = sim.starts, sim.checkpointed_starts
    if len(plain) != len(every) or not 0 < k < len(plain):
        return None
    return max(0, plain[k] - every[k])


def checkpointing_keeps(sim: Simulated, k: int) -> int:
    """What checkpointing the first k blocks keeps from the model's return until their
    backward beyond the run with none checkpointed: the earlier blocks' inputs alive as the
    k-th block's forward begins in both runs (so not in `checkpointing_frees`) that the
    unchecked model lets go of as it returns (the first block's input a frozen embedding made,
    held by a local of the model's forward; the positions every block takes). The peft LoRA
    decoder: 33,024 B, what the estimate was under at 1, 2 and 3 of 4 blocks checkpointed.
    0 where not recorded."""
    let_go = sim.let_go_at_return
    if len(let_go) != len(sim.starts) or not 0 < k < len(let_go):
        return 0
    return max(0, let_go[k])


def _on_device(sim: Simulated) -> Simulated:
    """`sim` with the parameters, gradients and optimizer state in host memory (CPU offload),
    where the optimizer step runs too: every moment's sharded terms scaled to nothing."""
    step = sim.step
    return replace(sim.scaled(0.0, 0.0), step=Phase(0, step.buffers, 0, 0, step.activations, 0, 0))


def _checkpointed(
    moment: Phase,
    every: Phase | None,
    profile: ActivationProfile | None,
    s: Setting,
    key: Callable[[Phase], int] | None = None,
    forward: Phase | None = None,
    held: int | None = None,
    frees: int | None = None,
    keeps: int = 0,
) -> Phase:
    """A simulated forward/backward moment (`moment`, with no block checkpointed) with the
    first `s.checkpointed` blocks checkpointed; `every`: the same moment simulated with every
    block checkpointed, where that ran, the larger by `key` (default: the total).

    Checkpointing a block frees what it saved beyond its input as backward begins; in the
    forward, where autocast computes (unwrapped, DDP), not the copies of its parameters
    autocast keeps in its cache until the model returns (`ActivationProfile.block_cast_bytes`;
    MRA's blocks under bf16: 294,912 B each, which a checkpointed block was credited and its
    forward kept). `forward` is the forward's own peak where the simulation told it apart, else
    `moment` is taken for one too. Each checkpointed block keeps the generator's state beside
    its input (`Setting.checkpoint_state_bytes`). `held`: the most activations and temporaries
    alive at any moment of `every`'s run (`_Calibration`).

    `frees`: what checkpointing the k blocks lets go of by the simulations
    (`checkpointing_frees`), where they recorded it; it stands for the trace's figures, and
    `every` for each moment of the blocks checkpointed (once the backward reaches block j < k,
    the blocks after it have let go of theirs, the ones before it hold their inputs, as with
    every block checkpointed): the peak is that of the moments of either run. `keeps`: what
    their checkpoints keep that the unchecked run lets go of by the model's return
    (`checkpointing_keeps`)."""
    key = key or _sum
    k = s.checkpointed
    if every is not None and profile is not None and k >= len(profile.block_saved_bytes):
        return every  # simulated as it is
    if profile is None or not k:
        return moment
    if frees is not None and every is not None:
        less = _simulated_less(moment, forward, frees, keeps, profile, s, key)
        return max(less, every, key=key)
    # FSDP2 computes with parameters it casts itself (comm buffers): autocast's copies, which
    # the trace (under autocast) counts as saved, are nothing checkpointing frees there
    never = profile.cached_casts(k) if recipe(s.strategy).sharded else 0
    # as backward begins, the output held through it without what the checkpointed
    # transformers layers leave out of it (their caches' keys and values)
    output = profile.output_held(0) - profile.output_held(k)
    saved = profile.activation_bytes(0) - profile.activation_bytes(k) - never
    n = len(profile.block_saved_bytes)
    # what checkpointing every block frees by the trace, its copies under FSDP2 left out
    every_saved = profile.kept_bytes(0) - profile.kept_bytes(n) - profile.cached_casts(n)
    # that run's most, less the generator states its blocks kept (added apart, for k blocks)
    held = None if held is None else held - n * s.checkpoint_state_bytes
    calibration = _Calibration(held, every_saved, profile.output_held(0) - profile.output_held(n))
    derived = _less(moment, saved, profile, s, output, calibration)
    # in the forward, the previous step's output carried through it without what they leave
    # out of it; not the forward's own output, which holds only the blocks' run so far
    kept = profile.kept_bytes(0) - profile.kept_bytes(k, casts_cached=True)
    carried = profile.carried(0) - profile.carried(k)
    in_forward = moment if forward is None else forward
    calibration = replace(calibration, output=profile.carried(0) - profile.carried(n))
    derived = max(derived, _less(in_forward, kept, profile, s, carried, calibration), key=key)
    derived = replace(derived, activations=derived.activations + k * s.checkpoint_state_bytes)
    # Checkpointing moves the peak later into backward, where gradients have accumulated
    # and recomputed blocks are gathered: never below the peak with every block checkpointed
    # (fewer checkpointed blocks only keep more alive).
    if every is not None and key(every) > key(derived):
        return every
    return derived


def _simulated_less(
    moment: Phase,
    forward: Phase | None,
    frees: int,
    keeps: int,
    profile: ActivationProfile,
    s: Setting,
    key: Callable[[Phase], int],
) -> Phase:
    """A moment with no block checkpointed (`moment`, and the forward's `forward` where told
    apart) with the first k checkpointed, where the simulations say what that frees (`frees`,
    at a block's forward start). In backward, what the k blocks leave out of the model's output
    goes too, and where autocast computes (unwrapped, DDP) the copies of their parameters, which
    its cache held at the forward's start with or without checkpointing and the blocks then
    saved, checkpointed or not (`ActivationProfile.cached_casts`); in the forward, what they
    leave out of the previous step's output carried through it. The larger of the two by
    `key`, with what their checkpoints keep that the unchecked run lets go of by the model's
    return (`keeps`), which may be before the forward's peak (BERT's embedding output, held
    by its encoder's forward, which returns before the head computes the logits: 32,768 B
    under where it came off the backward alone); over by that where it is after."""
    k = s.checkpointed
    casts = 0 if recipe(s.strategy).sharded else profile.cached_casts(k)
    output = profile.output_held(0) - profile.output_held(k)
    carried = profile.carried(0) - profile.carried(k)
    in_backward = _taken_off(moment, frees + output + casts)
    in_forward = _taken_off(moment if forward is None else forward, frees + carried)
    less = max(in_backward, in_forward, key=key)
    return replace(less, activations=less.activations + keeps)


def _taken_off(moment: Phase, freed: int) -> Phase:
    """`moment` with `freed` bytes let go: off the activations first, then the temporaries (the
    trackers file some saved tensors as temporaries: those first seen in backward)."""
    from_activations = min(freed, moment.activations)
    return replace(
        moment,
        activations=moment.activations - from_activations,
        temporaries=max(0, moment.temporaries - (freed - from_activations)),
    )


@dataclass(frozen=True)
class _Calibration:
    """What checkpointing every block frees in the simulation's terms, against the trace's
    (`_less`): `held`, the most activations and temporaries alive at any moment of the run with
    every block checkpointed (None: not simulated); `saved`, what the trace says checkpointing
    every block frees; `output`, what every checkpointed block leaves out of the model's output
    (its caches' keys and values), which comes off apart."""

    held: int | None
    saved: int
    output: int


def _less(
    moment: Phase,
    freed: int,
    profile: ActivationProfile,
    s: Setting,
    output: int = 0,
    calibration: _Calibration | None = None,
) -> Phase:
    """`moment` with `freed` bytes of the profile's saved activations let go, and `output`
    bytes of a model output's."""
    # The profile is traced under autocast; FSDP2's mixed precision instead computes in the
    # parameters' cast dtype throughout, saving fewer bytes (no fp32 islands, no cast weight
    # copies, taken off `freed` already). What checkpointing frees is scaled to the
    # simulation's terms, the lesser of two ways: by the moment's activations and temporaries
    # against all the trace saved, and, where the run with every block checkpointed was
    # simulated, by what that freed (this moment's activations and temporaries above the most
    # of that run's) against what the trace says it frees. The first counts the head's and
    # the loss's bytes, as large in both, and temporaries no block saves: 3.2%, 7.9%, 15.1%
    # under with 2, 4, 6 of 8 blocks of the zoo's Llama checkpointed (FULL_SHARD, bf16).
    # The second takes the blocks' bytes in proportion to the trace's, which a head that saves
    # the last block's fp32 output under autocast and a copy of it under FSDP2 breaks.
    traced = profile.activation_bytes(0) - sum(profile.block_cast_bytes)
    simulated = moment.activations + moment.temporaries
    if recipe(s.strategy).sharded:
        shares = [freed * simulated // traced if 0 < simulated < traced else freed]
        if calibration is not None and calibration.held is not None and calibration.saved > 0:
            every = max(0, simulated - calibration.held - calibration.output)
            shares.append(freed * every // calibration.saved)
        freed = min(shares)
    return _taken_off(moment, freed + output)


def _sum(phase: Phase) -> int:
    return sum(getattr(phase, f.name) for f in fields(phase))


def besides_grads(phase: Phase) -> int:
    """A moment's bytes other than its gradients: what orders the moments where every gradient
    is alive at each (earlier micro-batches' under gradient accumulation, unwrapped)."""
    return _sum(phase) - phase.grads


def analytic(stats: ModelStats, profile: ActivationProfile | None, s: Setting) -> Footprint:
    """The per-rank peak of one candidate from formulas, broken down at the moment it happens.

    A step has three candidate peaks (steady state, `zero_grad(set_to_none=True)` between
    steps): early in backward, with every activation alive, the gradients resident then and the
    gathered parameters; at the end of forward, with every activation alive beside the previous
    step's output, which the loop still holds; and at the optimizer step, with activations and
    gathered parameters freed but every gradient and the optimizer's temporaries alive. The
    largest is the peak.
    """
    n = (s.shard_degree or s.world_size) if recipe(s.strategy).sharded else 1
    # ZeRO (Rajbhandari et al. 2020, section 5): stage 2 shards gradients and optimizer state,
    # stage 3 the parameters too. FSDP2 keeps the stored parameter sharded under both; what
    # differs is how much is unsharded at once (comm_buffers).
    # FSDP2 shards parameters, never buffers; offload leaves them on the device
    params = -(-stats.param_bytes // n) + stats.buffer_bytes
    grads = -(-stats.trainable_bytes // n)
    optimizer_state = -(-stats.optimizer_bytes // n)
    # the batch, and the model's output where it holds more than backward saves: a loop holds
    # both through backward and the optimizer step
    held = stats.input_bytes + (profile.output_held(s.checkpointed) if profile is not None else 0)
    comm = _unsharded_bytes(stats, s) + retired_bucket_bytes(stats, s)
    # Backward holds the gradient of the largest saved activation next to the activation itself,
    # and at least as much as the trace's backward rose above where it began; where gradients
    # are summed into buffers holding them already (DDP's buckets, a micro-batch after the
    # first), each new one is alive until it is summed, and counts in that rise.
    backward_temp = 0
    saved = 0
    within = None
    # each checkpointed block's generator state, kept until its backward
    state = s.checkpoint_state_bytes
    states = max(s.checkpointed, 0) * state
    if profile is not None:
        into_buffers = recipe(s.strategy).engine is Engine.DDP or s.accumulation_steps > 1
        rise = profile.rise_into_buffers_bytes if into_buffers else profile.backward_rise_bytes
        backward_temp = max(2 * profile.largest_saved_bytes, rise)
        saved = profile.activation_bytes(s.checkpointed) + states
        within = profile.checkpointed_moments(s.checkpointed, into_buffers)
        if within is not None:  # the head's and the unchecked blocks' backward: all kept
            saved = profile.kept_bytes(s.checkpointed) + states
    in_backward = _grads_in_backward(stats, s, grads)

    def in_phase(
        grads_made: int, activations: int, temporaries: int
    ) -> tuple[int, int, int, int, int, int]:
        if recipe(s.strategy).offload:  # the state in host memory: not in the device's peak
            # but earlier micro-batches' gradients, unsharded on the device until reduced
            accumulated = accumulated_grad_bytes(stats, s, 0)
            return (stats.buffer_bytes, accumulated, 0, activations, comm, temporaries)
        grads_held = grads_made + accumulated_grad_bytes(stats, s, grads_made)
        return (params, grads_held, optimizer_state, activations, comm, temporaries)

    backward = in_phase(in_backward, held + saved, backward_temp)
    # the forward at its most, the previous step's output still held (a loop lets it go once
    # the model returns the next one), beside the gradients that exist before backward (DDP's
    # buckets): at its end with its transients' most, and in each checkpointed block's
    if profile is not None:
        before_backward = grads if recipe(s.strategy).engine is Engine.DDP else 0
        previous = profile.carried(s.checkpointed)
        # autocast (unwrapped, DDP) keeps its copies of the parameters to the model's return,
        # the checkpointed blocks' too
        cached = not recipe(s.strategy).sharded
        in_forward = max(saved, profile.kept_bytes(s.checkpointed, cached) + states)
        forwards = [
            in_phase(before_backward, held + previous + in_forward, profile.forward_rise_bytes),
            *(
                in_phase(before_backward, stats.input_bytes + previous + alive + state * (j + 1), 0)
                for j, alive in enumerate(profile.checkpointed_forwards(s.checkpointed, cached))
            ),
        ]
        backward = max(backward, *forwards, key=sum)
    # a checkpointed block's backward, its saved activations recomputed, with what it holds;
    # unwrapped, the gradients of all after it are made by then
    unwrapped = recipe(s.strategy).engine is Engine.NONE
    before = 0  # gradient bytes of the blocks before block j
    for j, (alive, rest) in enumerate(within or ()):
        made = max(in_backward, grads - before) if unwrapped else grads
        # blocks 0..j's generator states, and the one its recomputation takes
        alive += state * (j + 2)
        backward = max(backward, in_phase(made, held + alive, rest), key=sum)
        before += stats.block_numel[j] * s.param_element_bytes
    # A foreach optimizer materialises one parameter-sized list of intermediates at the step
    # (Adam's sqrt(exp_avg_sq) in torch/optim/adam.py `_multi_tensor_adam`); a single-tensor step
    # one parameter's worth (`optimizer.step_temporary_bytes`).
    if stats.step_temporary_bytes is None:
        step_temp = grads if stats.optimizer_bytes else 0
    else:
        step_temp = -(-stats.step_temporary_bytes // n)
    # after backward the output holds what backward saved of it too (logits a loss squared)
    after = held
    if profile is not None:
        after = max(held, stats.input_bytes + profile.carried(s.checkpointed))
    step = (params, grads, optimizer_state, after, retired_bucket_bytes(stats, s), step_temp)
    if recipe(s.strategy).offload:  # the step runs in host memory
        step = (stats.buffer_bytes, 0, 0, after, 0, 0)
    terms = max(backward, step, key=sum)
    return Footprint(*terms, overhead_bytes(sum(terms), s), s.library_workspace_bytes)


def overhead_bytes(tensor_bytes: int, s: Setting) -> int:
    """What no tensor shows, beside `tensor_bytes` of tensors at the peak (`Footprint.overheads`),
    whichever way the peak was found: on CUDA the caching allocator's rounding (ALLOCATOR_MARGIN
    of the tensors), a context not created yet and NCCL's buffers; on the CPU, none."""
    if s.device_type != "cuda":
        return 0
    overheads = int(ALLOCATOR_MARGIN * tensor_bytes)
    overheads += CUDA_CONTEXT_BYTES if s.cuda_context_pending else 0
    overheads += NCCL_BUFFER_BYTES if s.world_size > 1 else 0
    return overheads


def retired_bucket_bytes(stats: ModelStats, s: Setting) -> int:
    """DDP's first gradient buckets, which NCCL still holds when the second step peaks (CUDA).

    DDP all-reduces its buckets asynchronously; NCCL keeps every tensor of such a collective
    (`stashed_for_allocator_safety_`) until its watchdog, polling every 100 ms, has seen the work
    complete, and frees them only when the next collective is enqueued. At the second step's
    forward DDP rebuilds its buckets in the order gradients arrived (`_rebuild_buckets`: new
    buckets allocated, the old ones dropped), so the first step's buckets, every gradient's bytes,
    stay allocated beside the new ones into the second step's backward, which peaks at its start,
    before a bucket is ready to be enqueued. On an H100 and an H200 (torch 2.11) a 200M-parameter
    GPT under DDP at world 1 measured its estimate plus its parameters' fp32 bytes (-13.0%) over
    a loop's third and fourth steps, which its fast steps reached before a watchdog poll; gloo
    frees them at once (the CPU measurement equals the estimate without them). Counted in both
    phases: an optimizer step that comes before a poll finds them still there. None where DDP
    looks for unused parameters: it then never rebuilds its buckets
    (`Reducer::should_rebuild_buckets`, torch 2.11 to 2.15, without `static_graph`, which
    autoshard does not set)."""
    if s.device_type != "cuda" or recipe(s.strategy).engine is not Engine.DDP or s.find_unused:
        return 0
    return stats.trainable_bytes


def _grads_in_backward(stats: ModelStats, s: Setting, grads: int) -> int:
    """Gradients alive early in backward, next to the activations.

    DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view=True), which
    exist from construction on: all of them. Without a wrapper, gradients appear block by block
    as activations are freed: about the largest unit's worth coexists with all activations.
    Under FSDP2 the unsharded gradients in flight are in comm_buffers (reduce-scatter input);
    the sharded ones accumulate as backward goes, next to those buffers: all of them are
    counted (an upper bound: with a small batch the end of backward is the peak).
    """
    if recipe(s.strategy).engine is not Engine.NONE:
        return grads
    largest_unit = max(max(stats.block_numel, default=0), stats.root_numel)
    return min(grads, largest_unit * s.param_element_bytes)


def accumulated_grad_bytes(stats: ModelStats, s: Setting, counted: int) -> int:
    """Gradients of earlier micro-batches alive beside a later one's activations under gradient
    accumulation, beyond the `counted` bytes of gradients the backward peak already holds.

    Unwrapped, every gradient lives in `param.grad` from the first micro-batch on: what the
    backward peak does not count yet. Under DDP's `no_sync` the reducer stands aside and autograd
    accumulates into gradients of its own, beside the buckets (counted already): every gradient
    once more (GPT-2 on 2 gloo ranks measured 15% above the plan that left them out, by its
    trainable bytes). FSDP2 with `set_requires_gradient_sync(False)` keeps each unit's unsharded
    gradient, in the reduce dtype (fp32 under mixed precision,
    `FSDPParam.to_accumulated_grad_if_needed`), until the last micro-batch reduce-scatters it:
    every gradient, unsharded, beside the sharded ones counted (an upper bound by those: the
    formulas' moment holds every shard). Added by formula: the simulation runs one micro-batch;
    `from_simulation` takes every gradient whole in place of a simulated moment's own instead,
    unwrapped and under FSDP2 (each unit holds its whole gradient or, reduced, its shard).
    """
    if s.accumulation_steps <= 1:
        return 0
    if recipe(s.strategy).engine is Engine.NONE:
        return max(0, stats.trainable_bytes - counted)
    return stats.trainable_bytes


def _unsharded_bytes(stats: ModelStats, s: Setting) -> int:
    """Parameters all-gathered by FSDP2 and gradients waiting for reduce-scatter.

    FSDP2 all-gathers into a separate unsharded buffer in the compute dtype. SHARD_GRAD_OP keeps
    every unit unsharded from its forward until its backward; FULL_SHARD reshards each block after
    forward, holding at most the current and the prefetched block (bounded by the two largest),
    plus the root, which FSDP2 never reshards after forward (`fully_shard` docstring).
    Reduce-scatter needs the unsharded gradient of one unit in flight, and its output overlaps
    the next one's: the two largest blocks' worth, or the root's, whose gradients (the
    embeddings', a tied vocabulary's) wait for its reduce-scatter at the end of backward.
    """
    if not recipe(s.strategy).sharded:
        return 0
    element = s.compute_bytes
    two_largest = sum(sorted(stats.block_numel, reverse=True)[:2])
    reduce_scatter = max(two_largest, stats.root_numel) * s.param_element_bytes
    if not recipe(s.strategy).reshard_after_forward:
        return stats.floating_numel * element + reduce_scatter
    gathered = min(stats.root_numel + two_largest, stats.floating_numel)
    return gathered * element + reduce_scatter


def host_bytes(stats: ModelStats, s: Setting) -> int:
    """Host memory one rank needs under CPU offload: its shard of parameters and gradients in
    pinned memory, its optimizer state and the optimizer step's temporaries (the step runs on
    the CPU) in pageable memory.

    FSDP2's `CPUOffloadPolicy(pin_memory=True)`, its default, pins each parameter's padded shard
    (`FSDPParam`: `padded_sharded_param.pin_memory()`) and copies each gradient shard to the host
    with `non_blocking=True`, which allocates pinned memory too. torch's caching host allocator
    rounds every pinned allocation up to a power of two (`CachingHostAllocator.h`, every torch
    from 2.11 to 2.15 by default) and keeps freed blocks cached: a 17 MiB shard holds 32 MiB.
    """
    if not recipe(s.strategy).offload:
        return 0
    n = s.shard_degree or s.world_size
    # the step runs on the host, on CPU tensors: torch's default there is the loop, not foreach
    on_host = stats.host_step_temporary_bytes
    temporaries = on_host if on_host is not None else (stats.step_temporary_bytes or 0)
    pageable = -(-(stats.optimizer_bytes + temporaries) // n)
    if not stats.param_rows:  # shapes unknown: each shard as its share of the bytes
        return pageable + -(-(stats.param_bytes + stats.trainable_bytes) // n)
    return pageable + _pinned_shards(stats.param_rows, n) + _pinned_shards(stats.grad_rows, n)


def _pinned_shards(rows: tuple[tuple[int, int, int], ...], degree: int) -> int:
    """Pinned host bytes of rank 0's shard of each tensor (the largest: `torch.chunk` along dim
    0), each rounded up to a power of two as torch's caching host allocator allocates it."""
    total = 0
    for count, per_row, size in rows:
        nbytes = -(-count // degree) * per_row * size
        total += 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
    return total
