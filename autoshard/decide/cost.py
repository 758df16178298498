"""The cost model: a candidate's modelled step time, and the memory it keeps free beside its
estimate. Generic over strategies: every strategy-specific term is read from its recipe
(`strategies.recipes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.strategies.recipes import Engine, recipe
from autoshard.strategies.strategy import Strategy

if TYPE_CHECKING:
    from autoshard.decide.plan import PlanInputs

# DDP's default bucket_cap_mb=25: one all-reduce launch per bucket
DDP_BUCKET_BYTES = 25 * 2**20


def step_seconds(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> float:
    """Modelled step time: compute (`compute_seconds`), overlapped with gradient/parameter
    traffic, plus collective launches and FSDP2's copies and host work.

    Traffic per rank for a ring over N ranks moves (N-1)/N of the payload per pass: DDP
    all-reduces gradients (2 passes), ZeRO-2 all-gathers parameters once and reduce-scatters
    gradients (2 passes), ZeRO-3 all-gathers again in backward (3 passes).
    """
    r = recipe(strategy)
    hw, stats, s = inputs.hardware, inputs.stats, inputs.setting
    compute = compute_seconds(inputs, strategy, checkpointed)
    n = inputs.world_size
    ring = (n - 1) / n if n > 1 else 0.0
    bandwidth = hw.intra_node_bytes_per_s if inputs.num_nodes <= 1 else hw.inter_node_bytes_per_s
    gathered = stats.floating_numel * s.compute_bytes
    reduced = stats.trainable_bytes
    units = len(stats.block_numel) + 1
    if r.engine is Engine.NONE:
        return compute
    if r.engine is Engine.DDP:
        buckets = max(1, -(-reduced // DDP_BUCKET_BYTES))
        return max(compute, 2 * reduced * ring / bandwidth) + buckets * hw.collective_latency_s
    passes = r.gathers
    copies = 2 * passes * gathered / hw.memory_bytes_per_s
    # each unit's all-gathers and reduce-scatter launched; FSDP2's own host work for every unit
    # and each all-gather: every block's `passes`, the root's one (it stays gathered after
    # forward, torch's default for the root); and DTensor's for every operator of the optimizer
    # step, whose tensors are all DTensor shards: the host's alone, the device idle meanwhile
    # (on an H200 AdamW's loop over the parameters stepped 17 to 116 ms slower than foreach
    # under FULL_SHARD, where it was modelled 2 to 4 ms slower)
    host = units * hw.fsdp_unit_s + ((units - 1) * passes + 1) * hw.fsdp_gather_s
    host += stats.step_operators * hw.dtensor_op_s
    launches = (passes + 1) * units * hw.collective_latency_s + host
    if r.hybrid:
        # all-gathers and reduce-scatters within a node; then each rank all-reduces its gradient
        # shard (1/ranks_per_node of them) with its peers on the other nodes
        local = inputs.ranks_per_node
        local_ring = (local - 1) / local
        nodes_ring = (inputs.num_nodes - 1) / inputs.num_nodes
        traffic = (passes * gathered + reduced) * local_ring / hw.intra_node_bytes_per_s
        traffic += 2 * (reduced / local) * nodes_ring / hw.inter_node_bytes_per_s
        return max(compute, traffic) + copies + launches + units * hw.collective_latency_s
    traffic = (passes * gathered + reduced) * ring / bandwidth
    seconds = max(compute, traffic) + copies + launches
    if r.offload:
        # each unit's shard goes to the device twice (forward, backward), its gradient comes
        # back, and the optimizer reads and writes parameters, gradients and state on the CPU
        shard = stats.param_bytes / n
        seconds += (2 * shard + stats.trainable_bytes / n) / hw.host_link_bytes_per_s
        state = stats.param_bytes + stats.trainable_bytes + stats.optimizer_bytes
        seconds += 2 * state / n / hw.host_memory_bytes_per_s
    return seconds


def compute_seconds(inputs: PlanInputs, strategy: Strategy, checkpointed: int) -> float:
    """The step's own work on one rank, without communication: the forward, the backward (twice
    the forward's FLOPs), one forward more of each checkpointed block and the optimizer step,
    each operator either FLOP-bound (matmuls, convolutions, attention: the traced FLOPs over the
    FLOP/s) or memory-bound (the bytes the others read and write over the bandwidth); and no
    faster than the operators can be launched one after the other
    (`Hardware.kernel_launch_s`), which bounds a step of many small operators. A roofline
    (Williams, Waterman and Patterson 2009) summed over operators, with eager launch costs."""
    hw, stats, profile = inputs.hardware, inputs.stats, inputs.profile
    flops = traffic = operators = 0
    if profile is not None:
        flops = 3 * profile.total_forward_flops + profile.recompute_flops(checkpointed)
        traffic = (
            profile.forward_traffic
            + profile.backward_traffic
            + profile.recompute_traffic(checkpointed)
        )
        operators = (
            profile.forward_kernels
            + profile.backward_kernels
            + profile.recompute_kernels(checkpointed)
        )
    # The whole optimizer step's, sharded or not: a sharded step moves a shard's bytes, but FSDP2
    # has per-step work beyond its units' host time (`step_seconds`), its optimizer step's over
    # DTensors above all, that the model counts only in part (per operator, `dtensor_op_s`; on
    # one H100 its step measured 1.4x to 3x the unwrapped one, benchmarks/RESULTS.md);
    # crediting the shard alone would choose ZeRO over DDP for small models by the optimizer's
    # saving. Offload is FSDP2 too, with that work and more, so it carries the same term (its own
    # step on the host is added in `step_seconds`): left out, offload at 16,384 ranks modelled
    # 16 s faster than FULL_SHARD for a 405B-shaped model, the whole step's 32 TB, and was chosen
    # over it where both fit.
    operators += stats.step_operators
    device = (
        flops / hw.flops_per_s
        + traffic / hw.traffic_bytes_per_s  # at the model's own operators' bandwidth, if measured
        + stats.step_traffic_bytes / hw.memory_bytes_per_s
    )
    return max(device, operators * hw.kernel_launch_s)


def reserve_bytes(inputs: PlanInputs, strategy: Strategy) -> int:
    """Memory kept free under FSDP2 beside the estimated peak: one FSDP unit's sharded gradient.

    The simulation's collectives complete at once; real ones complete when they do, and a unit's
    reduce-scatter output can then be allocated while the gradients it reduces still count. On 2
    gloo ranks, ZeRO-3 over a 6-block MLP peaked at one of two values from step to step, the
    higher one by exactly one block's sharded gradient more (compare.py, mlp `ac_only`:
    64,968,336 or 66,746,768 bytes). Reserving the largest unit's keeps such a step within the
    limit; DDP reduces in place and needs none."""
    r = recipe(strategy)
    if not r.sharded:
        return 0
    stats = inputs.stats
    degree = r.shard_degree(inputs.world_size, inputs.ranks_per_node)
    largest = max((*stats.block_numel, stats.root_numel), default=0)
    element = stats.param_bytes / max(stats.floating_numel, 1)  # gradients in the stored dtype
    return round(-(-largest // max(degree, 1)) * element)
