"""What each strategy is, in one place: one `Recipe` per `Strategy`, in the `RECIPES` registry.

Everything else reads a strategy's facts from its recipe, never by comparing strategies:
the planner its availability, memory and cost terms and what it is simulated as; `wrap.apply`
its engine, mesh and wrapping; the trial its in-place fallbacks, sync points and tie-breaking
order; `io.accelerate` its accelerate mapping. Adding a strategy (ZeRO-1, tensor parallelism, a
new offload) is adding a recipe here; docs/architecture.md lists what a recipe must provide.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from autoshard.strategies.strategy import Strategy


class Engine(enum.Enum):
    """The torch engine a strategy wraps with; it fixes the sync points the trial step uses."""

    NONE = "none"  # the module itself, in one process
    DDP = "ddp"  # torch.nn.parallel.DistributedDataParallel: gradients all-reduced in buckets
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard per block, then the root


@dataclass(frozen=True)
class Job:
    """What decides which strategies a job can use."""

    world_size: int
    distributed: bool  # a process group exists or is planned for (what-if)
    num_nodes: int
    device_type: str
    # One process without a process group (plain `python`), which `prepare` can give a one-rank
    # group of its own (`_world.own_group`) for a strategy that helps alone (`Recipe.helps_alone`).
    own_group: bool = False
    # Where the model skips whole layers at random in training (`engines.layer_drop`), or None
    skips_layers: str | None = None
    # Why FSDP2 cannot train this model and optimizer at all (`engines.cannot_shard`), or None
    cannot_shard: str | None = None
    # Where mixed precision is on and the model's forward raises under autocast, though it runs
    # without it: what it raised, as "the model's forward raises under autocast to bfloat16
    # (RuntimeError: ...)". LOCAL and DDP compute under autocast; FSDP2 casts the parameters.
    autocast_raises: str | None = None


@dataclass(frozen=True)
class Recipe:
    """One strategy, whole. Fields are facts the generic code reads; none is a per-strategy branch.

    Memory terms (`decide.estimate`): `engine` FSDP2 shards parameters, gradients and optimizer
    state over `shard_degree` ranks; DDP holds every gradient in its buckets from construction;
    `reshard_after_forward` frees each block's gathered parameters after its forward (ZeRO-3);
    `offload` keeps the sharded state in host memory. Cost terms (`decide.cost`): parameter
    all-gathers per step (`gathers`), and `hybrid` traffic split between intra- and inter-node.
    """

    strategy: Strategy
    engine: Engine
    # Why it cannot be used by a job, or None where it can; the text is the error a forced
    # choice gets, so it says what to use instead.
    unavailable: Callable[[Job], str | None]
    reshard_after_forward: bool = False
    offload: bool = False  # FSDP2 CPUOffloadPolicy
    hybrid: bool = False  # 2-D mesh (replicate across nodes, shard within each)
    # Estimated from another strategy's simulation (the same FSDP2 step at another sharding
    # degree, or with the state moved to the host); None: simulated as itself.
    simulated_as: Strategy | None = None
    # How frugal it is, for breaking ties between equally large estimates on the trial's ladder.
    frugality: int = 0
    # The strategies the trial can move to in place after this one ran out of memory; None: any
    # (unwrapping DDP leaves the module as it was). An FSDP2 module cannot be re-sharded over
    # another mesh or offloaded afterwards.
    falls_back_to: frozenset[Strategy] | None = frozenset()
    # accelerate's FullyShardedDataParallelPlugin(reshard_after_forward=...) for this strategy;
    # None where accelerate's plugin does not express it (`io.accelerate`): HYBRID_SHARD needs
    # accelerate's ParallelismConfig over nodes, which the Plan does not carry.
    accelerate_reshard_after_forward: bool | None = None

    @property
    def sharded(self) -> bool:
        return self.engine is Engine.FSDP2

    @property
    def helps_alone(self) -> bool:
        """Whether it buys anything with one rank: sharding over one rank shards nothing and DDP
        reduces nothing, but offload moves the state to host memory (and LOCAL is the baseline).
        With one rank `auto` weighs only these; a forced wrapper is still obeyed."""
        return self.engine is Engine.NONE or self.offload

    @property
    def gathers(self) -> int:
        """Parameter all-gathers per step: ZeRO-2 once (forward), ZeRO-3 again in backward."""
        if not self.sharded:
            return 0
        return 2 if self.reshard_after_forward else 1

    @property
    def simulation(self) -> Strategy:
        """The strategy whose simulated step estimates this one."""
        return self.simulated_as or self.strategy

    def shard_degree(self, world_size: int, ranks_per_node: int) -> int:
        """Ranks the state is sharded over (1: replicated)."""
        if not self.sharded:
            return 1
        return ranks_per_node if self.hybrid else world_size

    def can_fall_back_to(self, other: Strategy) -> bool:
        """Whether the trial can move from this strategy to `other` in place (`wrap.apply`)."""
        if other == self.strategy or self.falls_back_to is None:
            return True
        return other in self.falls_back_to


def _under_autocast(
    check: Callable[[Job], str | None], strategy: Strategy
) -> Callable[[Job], str | None]:
    """`check`, and not for a model whose forward raises under autocast (`Job.autocast_raises`),
    which an unsharded strategy computes mixed precision under; FSDP2 casts the parameters to the
    compute dtype instead and runs it, where it can train the job at all."""

    def unsharded(job: Job) -> str | None:
        if job.autocast_raises is None:
            return check(job)
        sharded = RECIPES[Strategy.FULL_SHARD].unavailable(job)
        instead = (
            "FSDP2 casts the parameters to that dtype instead, without autocast: use "
            "'shard_grad_op' or 'full_shard' (one rank too), or 'auto'"
            if sharded is None
            else f"and FSDP2, which casts the parameters instead, cannot be used here ({sharded})"
        )
        return (
            f"strategy {strategy} computes mixed precision under autocast, and "
            f"{job.autocast_raises}, though it runs without it (an operator of the model mixes "
            f"dtypes autocast leaves apart); {instead}; or pass mixed_precision='no', or cast "
            f"where the model mixes them"
        )

    return unsharded


def _local(job: Job) -> str | None:
    if job.world_size == 1:
        return None
    return (
        f"strategy LOCAL trains one process unwrapped, but this job has {job.world_size} ranks; "
        f"choose 'ddp', 'shard_grad_op', 'full_shard' or 'auto'"
    )


def _needs_group(strategy: Strategy) -> Callable[[Job], str | None]:
    def check(job: Job) -> str | None:
        # a process alone may shard over a one-rank group of its own where it cannot train
        # unsharded (`Job.autocast_raises`)
        if job.distributed or (job.own_group and job.autocast_raises is not None):
            return None
        return (
            f"strategy {strategy} needs a process group; launch with torchrun or accelerate "
            f"launch (or use strategy='auto', which decides for one process: unwrapped, or its "
            f"state offloaded to host memory on a GPU)"
        )

    return check


def _sharded(check: Callable[[Job], str | None], strategy: Strategy) -> Callable[[Job], str | None]:
    """`check`, and no FSDP2 for a model or optimizer it cannot train (`Job.cannot_shard`: sparse
    gradients, an optimizer whose step fails on sharded parameters), nor over several ranks for
    a model that skips layers at random: a rank that skips a block neither gathers its
    parameters with the others in backward nor reduce-scatters its gradients, so the ranks'
    collectives differ (an error on gloo, a hang on NCCL, at the first step that skips one)."""

    def sharded(job: Job) -> str | None:
        if job.cannot_shard is not None:
            return f"strategy {strategy} cannot train this job: {job.cannot_shard}; use 'ddp'"
        if job.skips_layers is None or job.world_size == 1:
            return check(job)
        return (
            f"strategy {strategy} shards each block with collectives every rank must join, but "
            f"the model skips layers at random in training ({job.skips_layers}), each rank its "
            f"own: at the first step that skips one the ranks' collectives would differ (an "
            f"error, or a hang). Use 'ddp' (it then looks for unused parameters every step), "
            f"or set that probability to 0 to shard the model"
        )

    return sharded


def never_sharded(job: Job) -> str | None:
    """Why FSDP2 cannot shard this job over several ranks, however many (so more ranks shrink
    nothing per rank), or None: what FSDP2 cannot train at all, or layers skipped at random."""
    if job.cannot_shard is not None:
        return job.cannot_shard
    if job.skips_layers is not None:
        return f"the model skips layers at random in training ({job.skips_layers})"
    return None


def _hybrid(job: Job) -> str | None:
    if 1 < job.num_nodes <= job.world_size and job.world_size % job.num_nodes == 0:
        return _needs_group(Strategy.HYBRID_SHARD)(job)
    return (
        f"strategy HYBRID_SHARD shards within a node and replicates across nodes, but the "
        f"{job.world_size} rank(s) are on {job.num_nodes} node(s) (it needs more than one, each "
        f"with the same number of ranks); use 'full_shard'"
    )


def _offload(job: Job) -> str | None:
    if job.device_type == "cuda":
        # it helps one process alone: prepare gives a plain-python process a group of its own
        return None if job.own_group else _needs_group(Strategy.CPU_OFFLOAD)(job)
    return (
        "strategy CPU_OFFLOAD moves state from GPU memory to host memory, but this job trains "
        "on the CPU already; use 'full_shard'"
    )


# In the order the planner lists candidates, least to most memory-frugal.
RECIPES: dict[Strategy, Recipe] = {
    r.strategy: r
    for r in (
        Recipe(
            Strategy.LOCAL,
            Engine.NONE,
            _under_autocast(_local, Strategy.LOCAL),
            falls_back_to=None,
        ),
        Recipe(
            Strategy.DDP,
            Engine.DDP,
            _under_autocast(_needs_group(Strategy.DDP), Strategy.DDP),
            falls_back_to=None,
        ),
        Recipe(
            Strategy.SHARD_GRAD_OP,
            Engine.FSDP2,
            _sharded(_needs_group(Strategy.SHARD_GRAD_OP), Strategy.SHARD_GRAD_OP),
            frugality=1,
            falls_back_to=frozenset({Strategy.FULL_SHARD}),
            accelerate_reshard_after_forward=False,
        ),
        Recipe(
            Strategy.FULL_SHARD,
            Engine.FSDP2,
            _sharded(_needs_group(Strategy.FULL_SHARD), Strategy.FULL_SHARD),
            reshard_after_forward=True,
            frugality=3,
            accelerate_reshard_after_forward=True,
        ),
        Recipe(
            Strategy.HYBRID_SHARD,
            Engine.FSDP2,
            _sharded(_hybrid, Strategy.HYBRID_SHARD),
            reshard_after_forward=True,
            hybrid=True,
            simulated_as=Strategy.FULL_SHARD,
            frugality=2,
        ),
        Recipe(
            Strategy.CPU_OFFLOAD,
            Engine.FSDP2,
            _sharded(_offload, Strategy.CPU_OFFLOAD),
            reshard_after_forward=True,
            offload=True,
            simulated_as=Strategy.FULL_SHARD,
            frugality=4,
            accelerate_reshard_after_forward=True,
        ),
    )
}


def recipe(strategy: Strategy) -> Recipe:
    return RECIPES[strategy]


def available(job: Job) -> tuple[Strategy, ...]:
    """The strategies this job can use, in registry order: without a process group LOCAL, and
    those a group of its own would serve (`Job.own_group`); with one, every recipe that accepts
    the job (with one rank `auto` weighs only those that help alone, `Recipe.helps_alone`).
    None, where the model's forward raises under autocast (`Job.autocast_raises`) and FSDP2
    cannot be used either."""
    if not job.distributed and not job.own_group:
        return () if job.autocast_raises is not None else (Strategy.LOCAL,)
    return tuple(s for s, r in RECIPES.items() if r.unavailable(job) is None)
