"""Per-candidate simulation: a training step of the real wrapping, on fake tensors, measured by
torch's own memory trackers (DESIGN.md section 3).

For each strategy the model is copied with fake parameters (`FakeTensorMode`: no real memory), the
copy is wrapped exactly as `_apply` wraps the real one (FSDP2 `fully_shard` per block and root,
mixed-precision policy included) over a *fake* process group (its collectives do nothing), and a
step runs under `MemTracker` / `FSDPMemTracker`. The tracker's breakdown at two moments is kept:
the forward/backward peak and the optimizer step's peak, as in a steady step (with the optimizer
state alive: `_two_steps`). Kernel workspace, which no tracker sees, is measured for real once per
distinct convolution call and held as a fake block during each (`_workspace`).

What is derived instead of simulated again:

- activation checkpointing: every block checkpointed is simulated (forward and backward only)
  where it matters; k < L checkpointed blocks are derived from it and from what
  `ActivationProfile` says each block saves (`_estimate.estimate`);
- depth: a model of 16 or more alike blocks is simulated at 3, 4 and 5 blocks and every term
  extended linearly to its full depth (terms are sums over blocks plus a constant);
- sharding degree: sharded parameters, gradients and optimizer state are rescaled from the degree
  simulated to the one planned (`_estimate.shard_ratio`), so a 1024-rank job is simulated on 8.

DDP is simulated unwrapped with every gradient allocated before the step and zeroed in place:
with `gradient_as_bucket_view=True` the gradients are views of DDP's buckets, which live from
construction on. The trackers see tensors only; C++-side buffers (gloo/NCCL) are not in it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autoshard._batch import LossFn, call_model, compute_loss, tensors_in
from autoshard._estimate import ModelStats, Phase, Simulated, shard_bytes
from autoshard._strategy import Strategy
from autoshard._workspace import Workspace, unmeasured_note

logger = logging.getLogger("autoshard")

# The largest sharding degree simulated directly; larger degrees are rescaled from it. Sharding
# each parameter into N fake chunks costs O(N) per parameter: a 7B model took 24 s at N=1024.
MAX_SIMULATED_DEGREE = 8
# Depths simulated for a deep model whose blocks are all alike: the first two give the line,
# the third checks it. Deeper than FSDP2's window (the block in backward, the one prefetched and
# one reduce-scattering), so that every term grows by whole blocks.
_SHALLOW = (3, 4, 5)
# Only worth it when the three shallow runs cost well under one whole run.
_MIN_DEPTH_TO_EXTEND = 16
# How far the third depth may lie off the line through the first two (of its total).
_LINEARITY_TOLERANCE = 0.01


@dataclass(frozen=True)
class Setup:
    """What the simulation needs besides the model: the same for every strategy."""

    block_names: list[str]
    batch: Any
    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype | None  # mixed-precision compute dtype
    device: torch.device
    checkpoint_all: bool = False  # every block activation-checkpointed, as `_apply` does it
    # the device the ranks train on, where kernel workspaces are measured (None: `device`)
    trains_on: torch.device | None = None


def unavailable() -> str | None:
    """Why simulation cannot run with this torch, or None. The trackers are private torch APIs."""
    try:
        import torch.distributed._tools.fsdp2_mem_tracker  # noqa: F401
        import torch.distributed._tools.mem_tracker  # noqa: F401
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception as error:  # ImportError, or any failure inside a private module
        return f"torch {torch.__version__} lacks the memory trackers ({error})"
    return None


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int, device_type: str) -> Iterator[Any]:
    """A DeviceMesh over a fake process group of `world_size` ranks, this process being `rank`.

    Inside a job (a process group exists) the fake group is a new group over the real ranks:
    every rank must call this at the same point, as for any `new_group`. Without one, a fake
    default group is created and destroyed again.
    """
    import torch.testing._internal.distributed.fake_pg as fake_pg
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    # A DeviceMesh equals another of the same ranks, device and dimension names whatever its
    # process group, and DTensor's sharding caches key on that equality: a fake mesh equal to
    # the real one would hand the real model's DTensors the fake group (seen: the real
    # gradients ended up on the destroyed fake group). A name of its own keeps them apart.
    global _meshes_made
    _meshes_made += 1
    names = (f"autoshard_simulated_{_meshes_made}",)
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError("a fake group inside a job has the job's size")
        # use_local_synchronization: a hashed name, no global group counter moved, nothing
        # exchanged: safe where only some ranks call it (a plan() on rank 0)
        group = dist.new_group(backend="fake", use_local_synchronization=True)
        try:
            yield DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_pg.FakeStore())
    try:
        yield init_device_mesh(device_type, (world_size,), mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


_meshes_made = 0


def simulate(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    shard: Callable[..., None],
) -> Simulated:
    """Two steps of `strategy` on a fake copy of `model`, depth-reduced where the blocks allow."""
    depths = shallow_depths(model, setup.block_names)
    degree = mesh.size() if strategy.sharded else 1
    full = len(setup.block_names)
    if depths is not None:
        d1, d2, d3 = depths
        p1, p2, p3 = (_run(model, setup, strategy, mesh, shard, d) for d in depths)
        # The backward peak's moment can move with depth (early in backward with large
        # activations, at its end with large gradients): where the third depth is off the line,
        # the terms are not linear over this range, and the whole model is simulated instead.
        # The step's peak is extended from the two deeper runs only: the first run of a strategy
        # in a process has shown extra step temporaries that later runs do not (1.4 GiB on a 7B
        # model's FULL_SHARD at 3 blocks), which would tilt the line.
        line = _extend(p1[0], p2[0], d1, d2, d3)
        if abs(_total(line) - _total(p3[0])) <= _LINEARITY_TOLERANCE * _total(p3[0]):
            return Simulated(
                _extend(p2[0], p3[0], d2, d3, full), _extend(p2[1], p3[1], d2, d3, full), degree
            )
        logger.debug("%s: terms not linear in depth; simulating all %d blocks", strategy, full)
    backward, step = _run(model, setup, strategy, mesh, shard, full)
    return Simulated(backward, step, degree)


def _extend(a: Phase, b: Phase, d1: int, d2: int, depth: int) -> Phase:
    """Each term at `depth` blocks from the terms at d1 and d2 blocks (linear in depth)."""
    scale = (depth - d1) / (d2 - d1)
    return Phase(
        *(
            max(0, round(getattr(a, f.name) + scale * (getattr(b, f.name) - getattr(a, f.name))))
            for f in fields(Phase)
        )
    )


def shallow_depths(model: nn.Module, names: list[str]) -> tuple[int, int, int] | None:
    """The depths to simulate when every block is alike and they are the children of one
    ModuleList/Sequential in order, else None (simulate the whole model)."""
    if len(names) < _MIN_DEPTH_TO_EXTEND:
        return None
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1:
        return None
    parent = model.get_submodule(parents.pop())
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)) or len(parent) != len(names):
        return None
    blocks = [model.get_submodule(n) for n in names]
    if [b for b in parent] != blocks:
        return None
    signature = _signature(blocks[0])
    if any(type(b) is not type(blocks[0]) or _signature(b) != signature for b in blocks):
        return None
    return _SHALLOW


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return tuple(
        (n, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
        for n, t in [*module.named_parameters(), *module.named_buffers()]
    )


def _run(
    model: nn.Module,
    setup: Setup,
    strategy: Strategy,
    mesh: Any,
    shard: Callable[..., None],
    depth: int,
) -> tuple[Phase, Phase]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake, names = _fake_copy(model, mode, setup.device, setup.block_names, depth)
    with mode:
        batch = tree_map(lambda x: _fake_tensor(mode, x, setup.device), setup.batch)
        if setup.checkpoint_all:
            from torch.distributed._composable import checkpoint

            for name in names:
                checkpoint(fake.get_submodule(name))
        if strategy.sharded:
            shard(fake, names, mesh, strategy, setup.dtype)
        optimizer = _fake_optimizer(setup.optimizer, model, fake)
        return _two_steps(fake, optimizer, batch, setup, strategy)


def _fake_copy(
    model: nn.Module, mode: Any, device: torch.device, block_names: list[str], depth: int
) -> tuple[nn.Module, list[str]]:
    """The model's structure with fake parameters and buffers (tied ones stay tied), keeping only
    the first `depth` blocks."""
    memo: dict[int, Any] = {}
    prefixes = tuple(f"{name}." for name in block_names[depth:])
    kept = {
        id(p)
        for n, p in model.named_parameters(remove_duplicate=False)
        if not n.startswith(prefixes)
    }
    with mode:
        for param in (p for p in model.parameters() if id(p) in kept):
            memo[id(param)] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device),
                requires_grad=param.requires_grad,
            )
        for buffer in model.buffers():
            memo[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return shallow_copy(model, block_names, depth, memo)


def shallow_copy(
    model: nn.Module, block_names: list[str], depth: int, tensors: dict[int, Any] | None = None
) -> tuple[nn.Module, list[str]]:
    """The model's module tree with only its first `depth` blocks, and the blocks' names in it.

    Parameters and buffers are the model's own (not copied: the copy costs no tensor memory)
    unless `tensors` maps their ids to replacements. The blocks must be the children of one
    container, in order (`shallow_depths`)."""
    memo: dict[int, Any] = dict(tensors) if tensors is not None else {}
    prefixes = tuple(f"{name}." for name in block_names[depth:])
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:  # a tensor the kept part uses (tied ones too) is shared
        if not name.startswith(prefixes):
            memo.setdefault(id(tensor), tensor)
    for name in block_names[depth:]:  # not copied at all
        memo[id(model.get_submodule(name))] = None
    copied = copy.deepcopy(model, memo)
    if depth < len(block_names):
        parent = copied.get_submodule(block_names[0].rpartition(".")[0])
        kept = [m for m in parent._modules.values() if m is not None][:depth]
        parent._modules = {str(i): m for i, m in enumerate(kept)}
    return copied, block_names[:depth]


def _fake_tensor(mode: Any, x: Any, device: torch.device) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "meta":
        return torch.empty(x.shape, dtype=x.dtype, device=device)
    return mode.from_tensor(x).to(device)


def _fake_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, fake: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters over the fake parameters (no state yet)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    fake_params = dict(fake.named_parameters(remove_duplicate=False))
    groups = []
    for group in optimizer.param_groups:
        params = [fake_params[names[id(p)]] for p in group["params"] if names[id(p)] in fake_params]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    rebuilt: torch.optim.Optimizer = type(optimizer)([g for g in groups if g["params"]])  # type: ignore[call-arg]
    return rebuilt


# Optimizers whose step creates all of its state before any arithmetic (`_init_group`), so that
# a first step's peak is a steady step's: the measured step may be the first. Any other optimizer
# takes one unmeasured step first.
_STATE_FIRST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _two_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    setup: Setup,
    strategy: Strategy,
) -> tuple[Phase, Phase]:
    """The breakdowns at the forward/backward peak and at the optimizer step's peak of a steady
    step.

    The optimizer state is alive and unchanged through forward and backward, so it adds to
    that peak without moving it: for the optimizers in `_STATE_FIRST` the one measured step
    creates it, and it is added to the forward/backward peak afterwards. Any other optimizer first
    takes an unmeasured step from zero gradients (which allocates what a full first step would).
    With every block checkpointed (`setup.checkpoint_all`) only forward and backward run: the
    step is the unchecked simulation's, and the caller adds its state (`with_state`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoshard._apply import autocast_hooks

    if not strategy.sharded and setup.dtype is not None:
        autocast_hooks(model, setup.device.type, setup.dtype)
    in_place = strategy == Strategy.DDP  # DDP's buckets: every gradient lives from construction
    stepped = not setup.checkpoint_all and not isinstance(optimizer, _STATE_FIRST)
    if stepped:
        _first_step(model, optimizer, keep_grads=in_place)
    elif in_place:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    inputs = tensors_in(batch)
    tracker: Any
    if strategy.sharded:
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(inputs))
        tracker.track_external(optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer, *inputs)  # the batch counts as "Other": inputs
    _global_peak_only(tracker)
    # inside the tracker, which so sees the workspace blocks
    with tracker, Workspace(setup.trains_on or setup.device):
        loss = compute_loss(call_model(model, batch), batch, setup.loss_fn)
        loss.backward()
        del loss
        backward = _phase(tracker, "peak")
        if setup.checkpoint_all:
            return backward, Phase(**dict.fromkeys(_TERMS, 0))
        # The step's peak: what is alive as it starts (parameters, gradients, state), plus the
        # most its intermediates add. Taken as a difference of totals, not from the tracker's
        # breakdown at its peak, which files optimizer state under other names mid-step.
        before = _phase(tracker, "current")
        _reset_peak(tracker)
        optimizer.step()
        added = max(0, _total(tracker, "peak") - _total(before))
        created = 0 if stepped else _phase(tracker, "current").optimizer_state
        step = replace(
            before,
            optimizer_state=before.optimizer_state + created,
            temporaries=before.temporaries + added - created,
        )
        optimizer.zero_grad(set_to_none=not in_place)
    return with_state(backward, created), step


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


def _global_peak_only(tracker: Any) -> None:
    """Keep only the tracker-wide peak. After every operator torch's trackers also update each
    tracked module's peak by walking every module tracked so far, which is a fifth of a
    simulation's time on the demo model and unused here (private fields; left as they are where
    they differ)."""
    if not all(
        hasattr(tracker, name)
        for name in ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    ):
        return

    def update(peak_state: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
                tracker._peak_mem[device] = snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(snapshot)

    tracker._update_peak_stats = update


def _reset_peak(tracker: Any) -> None:
    """Start a new peak from the current bytes (private fields; without them the phases share
    the peak of the whole step, which only overestimates)."""
    if hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap"):
        tracker._peak_mem = {}
        tracker._peak_mem_snap = {}


def _total(source: Any, kind: str = "") -> int:
    if isinstance(source, Phase):
        return sum(getattr(source, f.name) for f in fields(Phase))
    return sum(s.get("Total", 0) for s in source.get_tracker_snapshot(kind).values())


def _phase(tracker: Any, kind: str) -> Phase:
    """The tracker's breakdown ("peak" or "current"), summed over devices, in autoshard's
    terms."""
    by_name: dict[str, int] = {}
    for snapshot in tracker.get_tracker_snapshot(kind).values():
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


# One simulation: a strategy, and whether every block is checkpointed (forward and backward only)
Run = tuple[Strategy, bool]


def simulate_all(
    model: nn.Module,
    setup: Setup,
    strategies: tuple[Strategy, ...],
    stats: ModelStats,
    world_size: int,
    shard: Callable[..., None],
    *,
    checkpointed: tuple[Strategy, ...] = (),
    shared: bool = False,
) -> tuple[dict[Run, Simulated], str]:
    """Simulate each strategy, and each of `checkpointed` with every block checkpointed; returns
    the simulations by run (as rank 0 sees them: its shard is the largest) and a note for the
    plan's reasons (`combine` puts a strategy's two runs together).

    Inside a job, with `shared` (`prepare`), every rank must call this at the same point: the
    runs are shared out among the ranks, each simulates its own at the real world size, and one
    `all_gather_object` gives every rank the same results. Without `shared` (`plan`, which may
    run on one rank only) nothing is exchanged: this rank simulates every run. Outside a job a
    fake default group of at most MAX_SIMULATED_DEGREE ranks is used, and the estimate rescales.
    A run whose simulation fails (an optimizer that cannot be rebuilt on fake parameters, an
    operation fake tensors do not support) is left to the analytic estimate (or, checkpointed,
    to the derivation from the unchecked one), and the note says so.
    """
    reason = unavailable()
    if reason is not None:
        return {}, f"estimates are analytic: {reason}"
    in_job = dist.is_initialized()
    rank = dist.get_rank() if in_job else 0
    size = world_size if in_job else min(world_size, MAX_SIMULATED_DEGREE)
    shared = shared and in_job
    runs = (*((s, False) for s in strategies), *((s, True) for s in checkpointed))
    mine = [run for i, run in enumerate(runs) if not shared or i % size == rank]
    results: dict[Run, Simulated] = {}
    failures: dict[Run, str] = {}
    started = time.perf_counter()
    try:
        context = fake_mesh(size, rank, setup.device.type)
        mesh = context.__enter__()
    except Exception as error:  # noqa: BLE001 - e.g. TORCH_DISTRIBUTED_DEBUG=DETAIL refuses it
        # raised alike on every rank (the same torch and environment), so all fall back together
        return {}, f"estimates are analytic: no fake process group ({error})"[:300]
    try:
        for strategy, all_blocks in mine:
            report = logger.debug if in_job else logger.info  # the planner CLI shows INFO
            how = ", every block checkpointed" if all_blocks else ""
            report(f"simulating {strategy}{how} at {size} rank(s) on fake tensors")
            run_setup = replace(setup, checkpoint_all=all_blocks)
            try:
                simulated = simulate(model, run_setup, strategy, mesh, shard)
            except Exception as error:  # noqa: BLE001 - reported in the plan; analytic instead
                logger.debug("simulating %s failed", strategy, exc_info=True)
                failures[strategy, all_blocks] = f"{type(error).__name__}: {error}"[:160]
                continue
            results[strategy, all_blocks] = _as_rank0(simulated, stats, strategy, rank)
    finally:
        context.__exit__(None, None, None)
    if shared:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (results, failures))
        for theirs, failed in gathered:
            results.update(theirs)
            failures.update(failed)
    return dict(sorted(results.items())), _note(runs, failures, size, shared, started, setup)


def _note(
    runs: tuple[Run, ...],
    failures: dict[Run, str],
    size: int,
    shared: bool,
    started: float,
    setup: Setup,
) -> str:
    seconds = time.perf_counter() - started
    shared_out = f", shared out among {size} ranks" if shared and size > 1 else ""
    checkpointed = ", ".join(str(s) for s, ck in runs if ck)
    also = f"; with every block checkpointed: {checkpointed}" if checkpointed else ""
    note = (
        f"estimates from simulated steps on fake tensors at {size} rank(s) "
        f"({len(runs)} run(s), {seconds:.1f}s{shared_out}){also}"
    )
    if failures:
        listed = "; ".join(
            f"{s}{' checkpointed' if ck else ''} ({e})" for (s, ck), e in sorted(failures.items())
        )
        note += f"; not simulated: {listed}"
    missing = unmeasured_note(setup.trains_on or setup.device)
    if missing:
        note += f"; {missing}"
    return note


def combine(runs: dict[Run, Simulated]) -> dict[Strategy, Simulated]:
    """Each strategy's unchecked simulation, with the forward/backward peak of its checkpointed
    one where that ran too (which leaves out the optimizer state: the unchecked one's is added)."""
    return {
        strategy: replace(
            plain,
            checkpointed_backward=with_state(
                runs[strategy, True].backward, plain.backward.optimizer_state
            ),
        )
        if (strategy, True) in runs
        else plain
        for (strategy, checkpointed), plain in runs.items()
        if not checkpointed
    }


def _as_rank0(simulated: Simulated, stats: ModelStats, strategy: Strategy, rank: int) -> Simulated:
    """A simulation run as `rank`, with its sharded terms as rank 0's (larger) shard has them."""
    if not strategy.sharded or rank == 0:
        return simulated
    own = shard_bytes(stats, simulated.degree, rank)
    if own == 0:
        return simulated
    ratio = shard_bytes(stats, simulated.degree, 0) / own
    return replace(
        simulated, backward=simulated.backward.scaled(ratio), step=simulated.step.scaled(ratio)
    )
