"""The estimator (`estimate`: one candidate's per-rank footprint, term by term) and the trace it
reads activations from (`profile_step`). Every expected value is a formula with a comment per
term, as PyTorch's test_fully_shard_memory.py writes its expected peaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoshard.decide.estimate import (
    ALLOCATOR_MARGIN,
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFER_BYTES,
    Footprint,
    ModelStats,
    Setting,
    estimate,
    model_stats,
)
from autoshard.decide.optimizer import optimizer_state_bytes
from autoshard.decide.profile import ActivationProfile
from autoshard.measure.trace import profile_step
from autoshard.strategies.strategy import Strategy

FP32 = 4
BF16 = 2
BATCH = 8


class MLPBlock(nn.Module):
    """x + fc2(dropout(gelu(fc1(x)))): a transformer MLP sub-block."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


class Net(nn.Module):
    """A learned offset (so every block's input requires grad), MLP blocks, a linear head."""

    def __init__(self, width: int, hiddens: list[int], out: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(width))
        self.blocks = nn.ModuleList([MLPBlock(width, h) for h in hiddens])
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.offset  # add saves nothing for backward
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_numel(width: int, hidden: int) -> int:
    return (
        width * hidden + hidden  # fc1 weight + bias
        + hidden * width + width  # fc2 weight + bias
    )  # fmt: skip


def uniform_net() -> Net:
    torch.manual_seed(0)
    return Net(16, [64, 64, 64, 64], 8)


def uneven_net() -> Net:
    """Blocks of different widths (the middle one is the largest), a frozen offset and a
    non-floating parameter."""
    torch.manual_seed(0)
    net = Net(32, [32, 128, 64], 4)
    net.offset.requires_grad_(False)
    net.register_parameter("ids", nn.Parameter(torch.arange(10), requires_grad=False))
    return net


# Hand-written sizes of the two models: (param_bytes, trainable_bytes, floating_numel, blocks).
HAND = {
    "uniform": (
        (16 + 4 * block_numel(16, 64) + 16 * 8 + 8) * FP32,  # offset + 4 blocks + head, fp32
        (16 + 4 * block_numel(16, 64) + 16 * 8 + 8) * FP32,  # everything trains
        16 + 4 * block_numel(16, 64) + 16 * 8 + 8,
        (block_numel(16, 64),) * 4,
    ),
    "uneven": (
        (32 + sum(block_numel(32, h) for h in (32, 128, 64)) + 32 * 4 + 4) * FP32  # floats
        + 10 * 8,  # the int64 `ids` parameter
        (sum(block_numel(32, h) for h in (32, 128, 64)) + 32 * 4 + 4) * FP32,  # no offset/ids
        32 + sum(block_numel(32, h) for h in (32, 128, 64)) + 32 * 4 + 4,  # floats only
        tuple(block_numel(32, h) for h in (32, 128, 64)),
    ),
}
FACTORIES = {"uniform": uniform_net, "uneven": uneven_net}
# The head's outputs: the loss sums them (saving nothing), and the caller's loop holds them
OUTPUTS = {"uniform": 8, "uneven": 4}


def measure(name: str) -> tuple[ModelStats, ActivationProfile]:
    model = FACTORIES[name]()
    blocks = list(model.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_bytes, reason = optimizer_state_bytes(optimizer)
    batch = torch.randn(BATCH, model.offset.numel())
    stats = model_stats(model, blocks, opt_bytes, reason, batch.numel() * batch.element_size())
    return stats, profile_step(model, blocks, batch, None, None)


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[ModelStats, ActivationProfile]]:
    return {name: measure(name) for name in FACTORIES}


def setting(
    strategy: Strategy,
    world_size: int,
    checkpointed: int = 0,
    *,
    compute_bytes: int = BF16,
    device_type: str = "cpu",
    cuda_context_pending: bool = False,
) -> Setting:
    return Setting(
        strategy=strategy,
        checkpointed=checkpointed,
        world_size=world_size,
        compute_bytes=compute_bytes,
        param_element_bytes=FP32,
        device_type=device_type,
        cuda_context_pending=cuda_context_pending,
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


CASES = [
    (name, world_size, strategy)
    for name in FACTORIES
    for world_size in (2, 8)
    for strategy in (Strategy.DDP, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
] + [(name, 1, Strategy.LOCAL) for name in FACTORIES]


# --- model_stats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FACTORIES))
def test_model_stats_against_hand_sizes(
    name: str, measured: dict[str, tuple[ModelStats, ActivationProfile]]
) -> None:
    stats, _ = measured[name]
    param_bytes, trainable_bytes, floating_numel, blocks = HAND[name]
    assert stats.param_bytes == param_bytes
    assert stats.trainable_bytes == trainable_bytes
    assert stats.floating_numel == floating_numel
    assert stats.block_numel == blocks
    assert stats.root_numel == floating_numel - sum(blocks)  # offset + head
    assert stats.input_bytes == BATCH * (16 if name == "uniform" else 32) * FP32
    # AdamW: exp_avg + exp_avg_sq (fp32) per trainable element, plus a 4-byte step per param.
    n_trainable = sum(1 for p in FACTORIES[name]().parameters() if p.requires_grad)
    assert stats.optimizer_bytes == 2 * trainable_bytes + 4 * n_trainable


# --- estimate: one term at a time ----------------------------------------------------------------

SHARDED = (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
Terms = tuple[int, int, int, int, int, int]  # params, grads, optim, activations, comm, temporaries


def hand_comm(name: str, strategy: Strategy, compute_bytes: int = BF16) -> int:
    """FSDP2's unsharded buffers, from the hand sizes of the model."""
    _, _, floating_numel, blocks = HAND[name]
    two_largest = sum(sorted(blocks, reverse=True)[:2])  # the two largest FSDP units (blocks)
    root = floating_numel - sum(blocks)  # offset + head: the root unit
    # fp32 unsharded grads: the unit reduce-scattering + the next, or the root's at the end
    reduce_scatter = max(two_largest, root) * FP32
    if strategy == Strategy.SHARD_GRAD_OP:
        # every parameter all-gathered in the compute dtype, kept from forward to backward
        return floating_numel * compute_bytes + reduce_scatter
    if strategy == Strategy.FULL_SHARD:
        # the root (never resharded after forward) + the current and the prefetched block
        return min(root + two_largest, floating_numel) * compute_bytes + reduce_scatter
    return 0  # DDP/LOCAL gather nothing; DDP's buckets are the grads themselves


def hand_phases(
    name: str,
    world_size: int,
    strategy: Strategy,
    stats: ModelStats,
    profile: ActivationProfile,
    checkpointed: int = 0,
) -> tuple[Terms, Terms]:
    """The two candidate peaks of a step, (backward, optimizer step), term by term."""
    param_bytes, trainable_bytes, floating_numel, blocks = HAND[name]
    # ZeRO-2 and ZeRO-3 (FSDP2) keep one 1/N shard of the stored parameters, gradients and
    # optimizer state per rank; DDP and a single process keep all of it.
    shards = world_size if strategy in SHARDED else 1
    params = ceil_div(param_bytes, shards)  # stored params (fp32 + the int64 ids)
    grads_all = ceil_div(trainable_bytes, shards)  # fp32 grads of trainable params only
    # AdamW's state (checked by hand in test_model_stats_against_hand_sizes), sharded alike
    optimizer_state = ceil_div(stats.optimizer_bytes, shards)
    # the batch, and the output the caller's loop holds through backward and the step
    held = stats.input_bytes + BATCH * OUTPUTS[name] * FP32
    if strategy == Strategy.DDP:
        grads_in_backward = grads_all  # bucket views: all of them exist from construction
    elif strategy in SHARDED:
        # the sharded grads accumulate next to the reduce-scatter buffers in comm: all counted
        grads_in_backward = grads_all
    else:
        # LOCAL: grads appear unit by unit; the largest unit's worth (fp32) sits next to all the
        # activations, never more than all the grads
        root = floating_numel - sum(blocks)
        grads_in_backward = min(grads_all, max(max(blocks), root) * FP32)
    backward = (
        params,
        grads_in_backward,
        optimizer_state,
        held + profile.activation_bytes(checkpointed),  # the batch, the output, saved tensors
        hand_comm(name, strategy),  # gathered params + grads waiting for reduce-scatter
        2 * profile.largest_saved_bytes,  # the largest saved tensor's gradient next to it
    )
    step = (
        params,
        grads_all,  # every gradient is alive at the step
        optimizer_state,
        held,  # activations are freed by then; the caller's loop holds the batch and output
        0,  # and so are the gathered parameters
        grads_all,  # AdamW (foreach): one grad-sized list of intermediates
    )
    return backward, step


def larger(backward: Terms, step: Terms) -> Terms:
    return backward if sum(backward) >= sum(step) else step  # a tie is reported as backward


def terms_of(fp: Footprint) -> Terms:
    return (
        fp.params,
        fp.grads,
        fp.optimizer_state,
        fp.activations,
        fp.comm_buffers,
        fp.temporaries,
    )


@pytest.mark.parametrize(("name", "world_size", "strategy"), CASES)
def test_model_states_are_divided_by_world_size_only_when_sharded(
    name: str,
    world_size: int,
    strategy: Strategy,
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    stats, profile = measured[name]
    param_bytes, trainable_bytes, _, _ = HAND[name]
    fp = estimate(stats, profile, setting(strategy, world_size))
    shards = world_size if strategy in SHARDED else 1
    assert fp.params == ceil_div(param_bytes, shards)  # the same in both phases
    assert fp.optimizer_state == ceil_div(stats.optimizer_bytes, shards)
    backward, step = hand_phases(name, world_size, strategy, stats, profile)
    # The gradients are those alive at the peak: all of them (1/N shard) at the optimizer step,
    # fewer in backward except under DDP.
    assert fp.grads == larger(backward, step)[1]
    assert step[1] == ceil_div(trainable_bytes, shards)


# Which phase peaks for these two small models (batch of 8 rows), worked out by hand in units of
# bytes for the uniform model (params P = grads G = 34_656, AdamW state 69_388, batch 512,
# saved activations 27_136, largest saved tensor 2_048):
# - DDP: backward = P + G + optim + (512 + 27_136) + 0 + 2 * 2_048 = 170_444, step = P + G + optim
#   + G = 173_356: one grad-sized list of AdamW intermediates outweighs the activations.
# - LOCAL: backward has only the largest unit's grads (2_128 elements * 4 = 8_512): 144_300 <
#   173_356, the step again.
# - FSDP at N = 2: step = 17_328 + 17_328 + 34_694 + 17_328 = 86_678, while backward holds the
#   activations (27_648) and the gathered bf16 params (8_664 * 2) alone: backward peaks; at
#   N = 8 the shards are smaller still. The uneven model follows the same pattern.
PEAK_PHASE = {
    Strategy.DDP: "step",
    Strategy.LOCAL: "step",
    Strategy.SHARD_GRAD_OP: "backward",
    Strategy.FULL_SHARD: "backward",
}


@pytest.mark.parametrize(("name", "world_size", "strategy"), CASES)
def test_the_phase_that_peaks(
    name: str,
    world_size: int,
    strategy: Strategy,
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    stats, profile = measured[name]
    backward, step = hand_phases(name, world_size, strategy, stats, profile)
    fp = estimate(stats, profile, setting(strategy, world_size))
    if PEAK_PHASE[strategy] == "step":
        assert sum(step) > sum(backward)
        assert terms_of(fp) == step
        # the activations freed before the step, the batch and the output still held
        assert fp.activations == step[3] and fp.comm_buffers == 0
    else:
        assert sum(backward) > sum(step)
        assert terms_of(fp) == backward
        # FSDP: the sharded grads, accumulating next to the reduce-scatter buffers in comm
        assert fp.grads == ceil_div(stats.trainable_bytes, world_size)


@pytest.mark.parametrize(("name", "world_size", "strategy"), CASES)
def test_comm_buffers(
    name: str,
    world_size: int,
    strategy: Strategy,
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    stats, profile = measured[name]
    _, _, floating_numel, blocks = HAND[name]
    first, second = sorted(blocks, reverse=True)[:2]
    root = floating_numel - sum(blocks)
    fp = estimate(stats, profile, setting(strategy, world_size))
    if strategy == Strategy.SHARD_GRAD_OP:
        expected = (
            floating_numel * BF16  # every param all-gathered in bf16, kept forward -> backward
            # fp32 unsharded grads of the two largest units, or of the root at the end
            + max(first + second, root) * FP32
        )
    elif strategy == Strategy.FULL_SHARD:
        expected = (
            root * BF16  # the root unit is not resharded after forward
            + (first + second) * BF16  # the current block gathered + the prefetched one
            + max(first + second, root) * FP32  # reduce-scatter, as above
        )
        assert root + first + second < floating_numel  # more than 2 blocks: the cap is not hit
    else:
        expected = 0  # DDP/LOCAL gather nothing; DDP's buckets are the grads themselves
    # Under FSDP backward peaks for these models (test_the_phase_that_peaks): comm is in it.
    assert fp.comm_buffers == expected
    assert expected == hand_comm(name, strategy)


@pytest.mark.parametrize("n_blocks", [0, 1, 2])
def test_full_shard_with_two_blocks_or_fewer_gathers_everything(n_blocks: int) -> None:
    block = 10 * 2**20  # elements per block
    root = 3 * 2**20  # elements outside the blocks
    floating = root + n_blocks * block
    stats = ModelStats(
        param_bytes=floating * FP32,
        trainable_bytes=floating * FP32,
        floating_numel=floating,
        block_numel=(block,) * n_blocks,
        optimizer_bytes=0,  # plain SGD: the step phase is the params and grads only
        optimizer_reason="SGD: no state",
        input_bytes=2**20,
    )
    zero2 = estimate(stats, None, setting(Strategy.SHARD_GRAD_OP, 4))
    zero3 = estimate(stats, None, setting(Strategy.FULL_SHARD, 4))
    two_largest = n_blocks * block  # the two largest blocks are all of them (or none)
    # root + the two largest = every parameter: ZeRO-3 gathers as much as ZeRO-2.
    expected = (
        floating * BF16  # all parameters gathered in bf16
        # fp32 grads reduce-scattering: the (at most two) blocks', or the root's at the end of
        # backward (without blocks, the whole model's)
        + max(two_largest, root) * FP32
    )
    assert zero3.comm_buffers == zero2.comm_buffers == expected


@pytest.mark.parametrize("name", list(FACTORIES))
def test_full_shard_gathers_less_than_shard_grad_op(
    name: str, measured: dict[str, tuple[ModelStats, ActivationProfile]]
) -> None:
    stats, profile = measured[name]
    zero2 = estimate(stats, profile, setting(Strategy.SHARD_GRAD_OP, 8))
    zero3 = estimate(stats, profile, setting(Strategy.FULL_SHARD, 8))
    assert zero3.comm_buffers < zero2.comm_buffers
    assert zero3.peak < zero2.peak


@pytest.mark.parametrize(("name", "world_size", "strategy"), CASES)
def test_the_peak_is_the_larger_phase_with_no_overheads_on_cpu(
    name: str,
    world_size: int,
    strategy: Strategy,
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    stats, profile = measured[name]
    fp = estimate(stats, profile, setting(strategy, world_size))
    terms = larger(*hand_phases(name, world_size, strategy, stats, profile))
    assert terms_of(fp) == terms
    assert fp.overheads == 0  # on CPU: no caching allocator, no context, no NCCL
    assert fp.peak == sum(terms)


MiB = 2**20


def _adam_stats() -> ModelStats:
    """400 MiB of fp32 parameters in four blocks, all trainable, with Adam's state."""
    return ModelStats(
        param_bytes=400 * MiB,
        trainable_bytes=400 * MiB,
        floating_numel=100 * MiB,
        block_numel=(25 * MiB,) * 4,
        optimizer_bytes=800 * MiB,
        optimizer_reason="Adam: 2 state(s) per parameter",
        input_bytes=MiB,
    )


def test_the_step_peaks_when_activations_are_small() -> None:
    stats = _adam_stats()
    fp = estimate(stats, None, setting(Strategy.DDP, 2))
    # backward: params 400 + grads 400 (DDP buckets) + Adam 800 + the batch 1 (no trace) + no
    # comm + no backward temporary (no trace) = 1601 MiB;
    # step: params 400 + grads 400 + Adam 800 + the batch 1 (the caller's loop holds it) +
    # foreach intermediates 400 = 2001 MiB: the step.
    assert terms_of(fp) == (400 * MiB, 400 * MiB, 800 * MiB, MiB, 0, 400 * MiB)
    assert fp.overheads == 0  # on CPU
    # Without optimizer state (plain SGD) there is no step temporary: step = 400 + 400 + 1 (the
    # batch) = 801 MiB, as backward = 400 + 400 + 1 (the batch) = 801 MiB.
    no_state = ModelStats(**{**stats.__dict__, "optimizer_bytes": 0})
    fp = estimate(no_state, None, setting(Strategy.DDP, 2))
    assert terms_of(fp) == (400 * MiB, 400 * MiB, 0, MiB, 0, 0)


@pytest.mark.parametrize(
    ("strategy", "world_size"),
    [(Strategy.LOCAL, 1), (Strategy.DDP, 2), (Strategy.FULL_SHARD, 4), (Strategy.CPU_OFFLOAD, 4)],
)
def test_the_formulas_hold_the_buffers_whole_on_every_rank(
    strategy: Strategy, world_size: int
) -> None:
    """FSDP2 shards parameters, never buffers (a rotary table, a mask, batch norms' statistics),
    and offload leaves them on the device: GPT-J's sine table was missing from the formulas'
    estimate, 0.3% under the simulated one."""
    stats = _adam_stats()
    buffered = dataclasses.replace(stats, buffer_bytes=8 * MiB)
    plain, held = (estimate(s, None, setting(strategy, world_size)) for s in (stats, buffered))
    assert held.params - plain.params == 8 * MiB
    assert held.peak - plain.peak == 8 * MiB


def test_model_stats_count_the_buffers_once() -> None:
    norm = nn.BatchNorm1d(8)  # running mean and variance (fp32), the batches seen (int64)
    model = nn.Sequential(norm, nn.Linear(8, 8), norm)
    stats = model_stats(model, [], 0, "", 0)
    assert stats.buffer_bytes == 8 * 4 + 8 * 4 + 8


def test_local_backward_holds_the_largest_units_grads() -> None:
    # Blocks of 40 and 30 elements and a 50-element root: the root is the largest unit.
    stats = ModelStats(
        param_bytes=120 * FP32,
        trainable_bytes=120 * FP32,
        floating_numel=120,
        block_numel=(40, 30),
        optimizer_bytes=0,  # no step temporary: step = params + all grads + the batch
        optimizer_reason="SGD: no state",
        input_bytes=290,
    )

    def saving(nbytes: int) -> ActivationProfile:  # the head saves `nbytes`, the blocks nothing
        return ActivationProfile((0, 0), (0, 0), 0, nbytes, 0, (0, 0), 0, torch.float32)

    local = setting(Strategy.LOCAL, 1)
    # backward: params 480 + the root's grads 50 * 4 = 200 + the batch 290 + saved 300 = 1270
    # bytes; step: params 480 + all grads 480 + the batch 290 = 1250 bytes: backward peaks.
    assert terms_of(estimate(stats, saving(300), local)) == (480, 200, 0, 590, 0, 0)
    # 280 bytes saved: both phases come to 1250 bytes, and the tie reads as backward.
    assert terms_of(estimate(stats, saving(280), local)) == (480, 200, 0, 570, 0, 0)
    # Most parameters frozen: the largest unit (200 bytes of grads) is capped at all the
    # trainable grads (40 * 4 = 160). backward: 480 + 160 + 290 + 300 = 1230; step: 480 + 160
    # + 290 = 930.
    frozen = ModelStats(**{**stats.__dict__, "trainable_bytes": 40 * FP32})
    assert terms_of(estimate(frozen, saving(300), local)) == (480, 160, 0, 590, 0, 0)


@pytest.mark.parametrize(
    ("device_type", "world_size", "pending", "extra"),
    [
        ("cpu", 8, True, None),  # no overheads on CPU, whatever the flag says
        ("cuda", 8, True, CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES),  # context + NCCL buffers
        ("cuda", 8, False, NCCL_BUFFER_BYTES),  # context already created: NCCL only
        ("cuda", 1, True, CUDA_CONTEXT_BYTES),  # one rank: no communicator
        ("cuda", 1, False, 0),
    ],
)
@pytest.mark.parametrize("simulated", [False, True], ids=["analytic", "simulated"])
def test_cuda_overheads_only_on_cuda_from_formulas_and_from_a_simulation(
    device_type: str,
    world_size: int,
    pending: bool,
    extra: int | None,
    simulated: bool,
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    # Both ways to the peak add the same overheads to their tensor bytes (they once disagreed on
    # CPU: the formulas added a 5% allocator margin there, the simulation none).
    from autoshard.decide.estimate import Phase, Simulated

    stats, profile = measured["uniform"]
    strategy = Strategy.FULL_SHARD if world_size > 1 else Strategy.LOCAL
    s = setting(strategy, world_size, device_type=device_type, cuda_context_pending=pending)
    sim = Simulated(Phase(100, 1, 50, 200, 300, 40, 5), Phase(100, 1, 50, 200, 0, 0, 80), 8)
    fp = estimate(stats, profile, s, sim if simulated else None)
    tensors = fp.peak - fp.overheads
    # on CUDA: a 5% allocator margin of the tensors, plus the context and NCCL's buffers
    assert fp.overheads == (0 if extra is None else int(0.05 * tensors) + extra)
    assert ALLOCATOR_MARGIN == 0.05
    assert CUDA_CONTEXT_BYTES == 512 * 2**20 and NCCL_BUFFER_BYTES == 256 * 2**20


def test_activations_fall_as_blocks_are_checkpointed_down_to_the_recompute_floor(
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    stats, profile = measured["uniform"]
    n = len(profile.block_saved_bytes)
    saved, kept = profile.block_saved_bytes[0], profile.block_input_bytes[0]
    assert n == 4
    assert set(profile.block_saved_bytes) == {saved}  # identical blocks
    assert set(profile.block_input_bytes) == {kept}
    # what a checkpointed block holds when it runs again: its saved tensors and more
    recomputed = profile.block_checkpointed_bytes[0]
    assert set(profile.block_checkpointed_bytes) == {recomputed} and recomputed > saved
    other = profile.other_saved_bytes
    before = profile.before_saved_bytes  # still alive when the blocks run backward
    held = stats.input_bytes + profile.output_bytes  # the batch and the output, the loop's
    temporary = max(2 * profile.largest_saved_bytes, profile.backward_rise_bytes)
    values = []
    for k in range(n + 1):
        fp = estimate(stats, profile, setting(Strategy.FULL_SHARD, 2, k))
        forward_end = (
            other  # saved outside the blocks (the head's input)
            + (n - k) * saved  # blocks not checkpointed keep everything they saved
            + k * kept  # checkpointed blocks keep only their input
        )
        # the head's and the unchecked blocks' backward: all forward kept, and backward's rise
        unchecked = forward_end + temporary
        # checkpointed block j running again (after the head and blocks > j freed theirs):
        # what was saved before the blocks, the inputs of blocks 0..j-1 and what block j holds;
        # the worst j is the last, k - 1
        again = before + (k - 1) * kept + recomputed if k else 0
        assert fp.activations + fp.temporaries == held + max(unchecked, again), k
        values.append(fp.activations + fp.temporaries)
    # Strictly falling all the way: each checkpointed block drops (saved - kept) at the end of
    # forward, and running block j again no longer holds the head's input (saved after the
    # blocks, freed by then), only what was saved before them (nothing here: `+ offset` saves
    # nothing).
    assert all(a > b for a, b in zip(values, values[1:], strict=False)), values
    # At k = n the floor is the last block running again: what it holds next to the inputs of
    # the n - 1 blocks before it, more than the end of forward keeps (the head's input and n
    # inputs) with backward's rise.
    assert before + (n - 1) * kept + recomputed > other + n * kept + temporary
    assert values[n] == held + before + (n - 1) * kept + recomputed
    # These are the activations and temporaries at the peak for every k: FULL_SHARD at N = 2
    # peaks in backward, whose fixed terms (params 17_328 + optim 34_694 + comm 25_840 = 77_862)
    # plus the floor's 11_520 bytes exceed the step (17_328 + 2 * 17_328 grads/foreach +
    # 34_694).


# --- the trace -----------------------------------------------------------------------------------


def test_profile_step_per_block_saved_bytes_match_the_hand_formula() -> None:
    width, hidden = 16, 64
    model = uniform_net()
    batch = torch.randn(BATCH, width)
    profile = profile_step(model, list(model.blocks), batch, None, None)
    x = BATCH * width * FP32  # one (BATCH, width) fp32 activation
    h = BATCH * hidden * FP32  # one (BATCH, hidden) fp32 activation
    per_block = (
        x  # fc1 saves its input (for fc1.weight's gradient)
        + h  # GELU saves its input, fc1's output
        + h  # CPU dropout is `input * noise`: it saves the fp32 noise (the scaled mask)
        + h  # fc2 saves its input, dropout's output
        # fc1/fc2 also hand their weights to autograd, but those are the parameters'
        # own storages: no new memory, already counted in the params (or comm) term.
        # The residual add saves nothing.
    )
    # Forward FLOPs count matmuls: 2 * M * K * N each.
    assert profile.block_forward_flops == (2 * BATCH * width * hidden * 2,) * 4  # fc1 + fc2
    assert profile.total_forward_flops == (
        4 * 2 * BATCH * width * hidden * 2  # the blocks
        + 2 * BATCH * width * 8  # the head
    )
    assert profile.compute_dtype == torch.float32
    assert profile.block_input_bytes == (x,) * 4  # what a checkpointed block keeps
    assert profile.block_saved_bytes == (per_block,) * 4
    assert profile.before_saved_bytes == 0  # `+ offset` saves nothing
    assert profile.after_saved_bytes == x  # the head saves its input; the default sum nothing
    assert profile.other_saved_bytes == x  # before + after
    assert profile.largest_saved_bytes == h  # the largest activation storage


def test_profile_step_leaves_the_model_and_the_rng_untouched() -> None:
    model = uniform_net()  # has dropout in every block
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = {name: p for name, p in model.named_parameters()}
    batch = torch.randn(BATCH, 16)
    rng = torch.get_rng_state()
    profile_step(model, list(model.blocks), batch, None, None)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, param in model.named_parameters():
        assert param is objects[name]
        assert torch.equal(param, before[name])
        assert param.grad is None
    assert not model.blocks[0]._forward_pre_hooks  # the attribution hooks are removed
    assert not model.blocks[0]._forward_hooks


def test_a_plan_leaves_python_s_random_number_generator_as_it_was() -> None:
    """torch's fake collectives, in the simulation, draw their work ids from Python's `random`:
    every plan moved the user's stream (data shuffling, augmentation seeded through it)."""
    import random

    import autoshard

    model = uniform_net()
    random.seed(0)
    state = random.getstate()
    autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        torch.randn(BATCH, 16),
        world_size=2,
        device_memory="1GiB",
        strategy="full_shard",
    )
    assert random.getstate() == state


def test_profile_step_leaves_buffers_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.train()
    running_mean = model[1].running_mean.clone()
    profile_step(model, [], torch.randn(6, 4), None, None)
    assert torch.equal(model[1].running_mean, running_mean)
    assert int(model[1].num_batches_tracked) == 0


def test_profile_step_with_a_loss_fn_and_autocast() -> None:
    width, hidden, out = 16, 64, 8
    model = uniform_net()
    batch = (torch.randn(BATCH, width),)
    calls = []

    def loss_fn(output: torch.Tensor, seen: object) -> torch.Tensor:
        calls.append(seen)
        return output.float().pow(2).mean()

    profile = profile_step(model, list(model.blocks), batch, loss_fn, torch.bfloat16)
    assert profile.compute_dtype == torch.bfloat16
    assert len(calls) == 1
    x = BATCH * width * BF16  # one (BATCH, width) bf16 activation
    h = BATCH * hidden * BF16  # one (BATCH, hidden) bf16 activation
    w = hidden * width * BF16  # autocast's bf16 copy of a block weight: new memory, counted
    per_block = (
        x  # fc1 saves its input cast to bf16 (the fp32 residual stream is not what it saves)
        + w  # ... and the bf16 copy of fc1.weight
        + h  # GELU saves fc1's bf16 output
        + h  # CPU dropout saves its bf16 noise
        + h  # fc2 saves dropout's bf16 output
        + w  # ... and the bf16 copy of fc2.weight
        # the residual add (fp32 + bf16 -> fp32) saves nothing
    )
    assert profile.block_saved_bytes == (per_block,) * 4
    # The residual stream stays fp32: each block's input is (BATCH, width) fp32.
    assert profile.block_input_bytes == (BATCH * width * FP32,) * 4
    assert profile.before_saved_bytes == 0  # `+ offset` saves nothing
    assert profile.after_saved_bytes == (
        x  # the head saves its input cast to bf16
        + width * out * BF16  # ... and the bf16 copy of head.weight
        + BATCH * out * FP32  # pow saves its input, the output cast to fp32 by loss_fn
    )
    assert profile.largest_saved_bytes == w  # a weight copy outweighs these small activations
    # Without the weight copies the activations are exactly half the fp32 ones (2 vs 4 bytes).
    fp32 = profile_step(model, list(model.blocks), batch, loss_fn, None)
    assert all(
        bf16 - 2 * w == full // 2
        for bf16, full in zip(profile.block_saved_bytes, fp32.block_saved_bytes, strict=True)
    )


def test_profile_step_does_not_count_the_batch_as_saved() -> None:
    width, hidden = 16, 64
    torch.manual_seed(0)
    blocks = nn.Sequential(*(MLPBlock(width, hidden) for _ in range(3)))
    batch = torch.randn(BATCH, width)
    profile = profile_step(blocks, list(blocks), batch, None, None)
    x = BATCH * width * FP32
    h = BATCH * hidden * FP32
    per_block = x + 3 * h  # fc1's input, GELU's input, dropout's noise, fc2's input
    # Block 0's fc1 saves the batch itself: the caller's tensor, not new memory.
    assert profile.block_saved_bytes == (per_block - x, per_block, per_block)
    assert profile.before_saved_bytes == 0
    assert profile.after_saved_bytes == 0  # the default loss (a sum) saves nothing


def test_activation_bytes_by_hand() -> None:
    prof = ActivationProfile(
        block_saved_bytes=(50, 90, 70),
        block_input_bytes=(5, 6, 7),
        before_saved_bytes=100,  # e.g. an embedding's
        after_saved_bytes=1000,  # e.g. the head's and the loss's
        largest_saved_bytes=40,
        block_forward_flops=(1, 1, 1),
        total_forward_flops=4,
        compute_dtype=torch.float32,
    )
    assert prof.other_saved_bytes == 100 + 1000  # before + after the blocks
    saved = 1100 + 50 + 90 + 70  # = 1310: everything at the end of forward
    assert prof.activation_bytes(0) == saved
    assert prof.activation_bytes(-2) == saved  # clamped to 0
    # k = 1: the end of forward drops block 0's saved tensors but keeps its input: 1310 - 45;
    # recomputing block 0 holds the before-blocks tensors and block 0's own: 100 + 50.
    assert prof.activation_bytes(1) == max(saved - (50 - 5), 100 + 50)
    # k = 2: 1310 - 45 - 84 = 1181; recompute of block 1 (the worse): 100 + 5 + 90 = 195.
    assert prof.activation_bytes(2) == max(saved - 45 - 84, 100 + 0 + 50, 100 + 5 + 90)
    # k = 3: 1310 - 45 - 84 - 63 = 1118 (the head's 1000 bytes keep the end of forward ahead).
    k3 = max(saved - 45 - 84 - 63, 100 + 50, 100 + 5 + 90, 100 + 5 + 6 + 70)
    assert k3 == 1118
    assert prof.activation_bytes(3) == k3
    assert prof.activation_bytes(7) == k3  # clamped to the number of blocks
    # With the head's tensors small, a recompute peak decides at k = 3. End of forward:
    # 1 (after) + 100 (before) + the three inputs 5 + 6 + 7 = 119; recomputing block j holds
    # before + inputs of blocks < j + block j's saved: 150, 195, 181. The worst is block 1, the
    # one that saves most, not the last (the after-blocks tensors are freed by then).
    small_head = ActivationProfile(**{**prof.__dict__, "after_saved_bytes": 1})
    expected = max(1 + 100 + 5 + 6 + 7, 100 + 50, 100 + 5 + 90, 100 + 5 + 6 + 70)
    assert expected == 195
    assert small_head.activation_bytes(3) == expected


def test_uneven_profile_by_hand(
    measured: dict[str, tuple[ModelStats, ActivationProfile]],
) -> None:
    _, profile = measured["uneven"]
    width = 32
    x = BATCH * width * FP32
    # Each block saves fc1's input, GELU's input, dropout's noise and fc2's input; the frozen
    # offset makes block 0's input a new tensor (batch + offset), so it counts.
    assert profile.block_saved_bytes == tuple(x + 3 * BATCH * h * FP32 for h in (32, 128, 64))
    assert profile.block_input_bytes == (x,) * 3
    assert profile.before_saved_bytes == 0
    assert profile.after_saved_bytes == x  # the head's input
    assert profile.largest_saved_bytes == BATCH * 128 * FP32  # the middle block's hidden


def test_step_temporaries_follow_the_optimizer_implementation() -> None:
    # SGD's update is in place; a foreach Adam (the default on CUDA) holds one intermediate per
    # parameter at once; a single-tensor Adam (the default on CPU) two of one parameter (sqrt,
    # then its division) while `denom` still holds the previous parameter's.
    from autoshard.decide.optimizer import step_temporary_bytes

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    sizes = [p.numel() * 4 for p in model.parameters()]  # 4096, 64, 2048, 32 fp32 elements
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert step_temporary_bytes(sgd, "cuda") == 0
    adam = torch.optim.Adam(model.parameters())
    assert step_temporary_bytes(adam, "cuda") == sum(sizes)  # foreach by default
    # single-tensor by default: the first weight's two, then the second weight's two beside
    # the first bias's one
    assert step_temporary_bytes(adam, "cpu") == max(2 * sizes[0], 2 * sizes[2] + sizes[1])
    assert step_temporary_bytes(torch.optim.Adam(model.parameters(), foreach=True), "cpu") == sum(
        sizes
    )
    assert step_temporary_bytes(torch.optim.Adam(model.parameters(), fused=True), "cpu") == 0

    mib = 2**20
    base = dict(
        param_bytes=100 * mib,
        trainable_bytes=100 * mib,
        floating_numel=25 * mib,
        block_numel=(),
        optimizer_bytes=200 * mib,
        optimizer_reason="Adam: 2 state(s) per parameter",
        input_bytes=0,
    )
    s = setting(Strategy.LOCAL, 1)
    assert estimate(ModelStats(**base, step_temporary_bytes=0), None, s).temporaries == 0
    assert (
        estimate(ModelStats(**base, step_temporary_bytes=5 * mib), None, s).temporaries == 5 * mib
    )
    # unknown: one gradient-sized list, as a foreach step holds
    assert estimate(ModelStats(**base), None, s).temporaries == 100 * mib


# ---------------------------------------------------------------------------------------------
# From a simulation: the simulated phases moved to the candidate (by hand)


def _sim_profile() -> ActivationProfile:
    return ActivationProfile(
        block_saved_bytes=(50, 90, 70),
        block_input_bytes=(5, 6, 7),
        before_saved_bytes=100,
        after_saved_bytes=1000,
        largest_saved_bytes=40,
        block_forward_flops=(1, 1, 1),
        total_forward_flops=4,
        compute_dtype=torch.float32,
    )


def _sim_stats() -> ModelStats:
    # two parameters of 8 rows x 4 fp32 and 3 rows x 4 fp32: 176 bytes
    return ModelStats(176, 176, 44, (), 352, "", 0, None, ((8, 4, 4), (3, 4, 4)))


def test_from_simulation_takes_the_larger_phase_and_frees_checkpointed_activations() -> None:
    from autoshard.decide.estimate import Phase, Simulated, from_simulation

    backward = Phase(10, 1, 0, 20, activations=1310, comm_buffers=30, temporaries=5)
    step = Phase(10, 1, 10, 20, activations=0, comm_buffers=0, temporaries=40)
    sim = Simulated(backward, step, degree=1)
    prof = _sim_profile()
    fp = from_simulation(_sim_stats(), prof, setting(Strategy.DDP, 2), sim)
    assert (fp.params, fp.grads, fp.optimizer_state) == (11, 0, 20)  # params + buffers
    assert (fp.activations, fp.comm_buffers, fp.temporaries, fp.overheads) == (1310, 30, 5, 0)
    # one checkpointed block frees what the profile says it saves beyond its input
    fp1 = from_simulation(_sim_stats(), prof, setting(Strategy.DDP, 2, checkpointed=1), sim)
    assert fp1.activations == 1310 - (prof.activation_bytes(0) - prof.activation_bytes(1))
    # checkpointing everything cannot take the peak below the optimizer step's
    small = Simulated(Phase(10, 1, 0, 20, 200, 0, 0), step, degree=1)
    fp_all = from_simulation(_sim_stats(), prof, setting(Strategy.DDP, 2, checkpointed=3), small)
    assert fp_all.peak == 10 + 1 + 10 + 20 + 40


def test_k_of_n_checkpointed_blocks_are_derived_at_the_forward_s_and_backward_s_peaks() -> None:
    """Checkpointing the first block frees, as backward begins, what it saved beyond its input
    (45 B) and what the output held through backward had of it (a transformers layer
    checkpointed leaves the cache out: 8 B); in the forward, what it saved but autocast's copies
    of its parameters (20 B; kept to the model's return where autocast computes) and what the
    previous output, carried through the forward, had of it (12 B). Each moment so derived, the
    larger counts. The output was left in (GPT-NeoX with 1 to 3 of 4 blocks checkpointed:
    +4.0% to +17.5%), the copies taken for freed (MRA: -0.4% to -1.6%)."""
    from autoshard.decide.estimate import Phase, Simulated, from_simulation

    prof = dataclasses.replace(
        _sim_profile(),
        block_cast_bytes=(20, 0, 0),
        output_bytes=8,
        block_output_bytes=(8, 0, 0),
        block_output_left_bytes=(8, 0, 0),
        carried_bytes=12,
        block_carried_bytes=(12, 0, 0),
        block_carried_left_bytes=(12, 0, 0),
    )
    step = Phase(10, 1, 10, 20, activations=0, comm_buffers=0, temporaries=40)

    def derived(strategy: Strategy, backward: int, forward: int | None, state: int = 0) -> int:
        sim = Simulated(
            Phase(10, 1, 0, 20, activations=backward, comm_buffers=30, temporaries=5),
            step,
            degree=1,
            forward=None if forward is None else Phase(10, 1, 0, 20, forward, 30, 5),
        )
        s = setting(strategy, 1, checkpointed=1)
        s = dataclasses.replace(s, checkpoint_state_bytes=state)
        return from_simulation(_sim_stats(), prof, s, sim).activations

    assert prof.activation_bytes(0) - prof.activation_bytes(1) == 45
    # the peak in backward, the forward's below it
    assert derived(Strategy.LOCAL, 1310, 1300) == max(1310 - (45 + 8), 1300 - (45 - 20 + 12))
    assert derived(Strategy.LOCAL, 1310, 1250) == 1310 - (45 + 8)
    # the peak in the forward: autocast's copies stay
    assert derived(Strategy.DDP, 1310, 1310) == 1310 - (45 - 20 + 12)
    # not told apart: the peak is taken for either
    assert derived(Strategy.DDP, 1310, None) == 1310 - (45 - 20 + 12)
    # FSDP2 casts the parameters itself: autocast's copies are nothing checkpointing frees
    assert derived(Strategy.SHARD_GRAD_OP, 1310, 1310) == 1310 - (45 - 20 + 8)
    # each checkpointed block keeps the generator's state (on the CPU)
    assert derived(Strategy.LOCAL, 1310, 1250, state=100) == 1310 - (45 + 8) + 100


def test_from_simulation_rescales_the_shards_to_the_planned_degree() -> None:
    from autoshard.decide.estimate import Phase, Simulated, from_simulation, shard_bytes

    stats = _sim_stats()
    at2 = shard_bytes(stats, 2)  # rank 0: 4 of 8 rows and 2 of 3 rows, x 16 bytes
    assert at2 == (4 + 2) * 16
    at8 = shard_bytes(stats, 8)  # 1 of 8 rows and 1 of 3 rows
    assert at8 == (1 + 1) * 16
    assert shard_bytes(stats, 2, rank=1) == (4 + 1) * 16
    sim = Simulated(
        Phase(at2, 0, at2, 2 * at2, 100, 50, 0), Phase(at2, 0, at2, 2 * at2, 0, 0, 7), degree=2
    )
    fp = from_simulation(stats, None, setting(Strategy.FULL_SHARD, 8), sim)
    assert (fp.params, fp.grads, fp.optimizer_state) == (at8, at8, 2 * at8)
    assert (fp.activations, fp.comm_buffers) == (100, 50)  # not sharded: unchanged


def test_from_simulation_under_cpu_offload_keeps_state_off_the_device() -> None:
    from autoshard.decide.estimate import Phase, Simulated, from_simulation, host_bytes

    stats = _sim_stats()
    sim = Simulated(Phase(96, 0, 96, 192, 100, 50, 3), Phase(96, 0, 96, 192, 0, 0, 7), degree=2)
    s = setting(Strategy.CPU_OFFLOAD, 2, device_type="cuda")
    fp = from_simulation(stats, None, s, sim)
    assert (fp.params, fp.grads, fp.optimizer_state) == (0, 0, 0)
    assert (fp.activations, fp.comm_buffers, fp.temporaries) == (100, 50, 3)
    # The host holds this rank's shard of parameters and gradients, pinned, and its share of the
    # optimizer state. Rank 0's shards are 4 of 8 rows and 2 of 3 rows (16 bytes each): 64 and
    # 32 bytes, powers of two already.
    trainable = dataclasses.replace(stats, grad_rows=stats.param_rows)  # both are trainable
    assert host_bytes(trainable, s) == (64 + 32) + (64 + 32) + 352 // 2
    assert host_bytes(trainable, setting(Strategy.FULL_SHARD, 2)) == 0
    # Each pinned allocation is rounded up to a power of two: one rank's 3 rows of 16 bytes, 48
    # bytes, take 64; 8 rows take 128.
    whole = setting(Strategy.CPU_OFFLOAD, 1, device_type="cuda")
    assert host_bytes(trainable, whole) == 2 * (128 + 64) + 352
    # shapes unknown: the shares of the bytes, unrounded
    unknown = dataclasses.replace(trainable, param_rows=(), grad_rows=())
    assert host_bytes(unknown, s) == (176 + 176 + 352) // 2


def test_cpu_offload_s_formulas_peak_where_the_device_s_bytes_do() -> None:
    """Under CPU offload the state is in host memory: the formulas' peak is the moment with the
    most bytes on the device, the forward's end with its transients (300 bytes), not the
    beginning of backward, which is the largest only with the gradients beside it (offload was
    3.3% under)."""
    from autoshard.decide.estimate import analytic

    profile = dataclasses.replace(
        _sim_profile(), block_checkpointed_bytes=(50, 90, 70), forward_rise_bytes=300
    )
    rows = ((64, 16, 4),)  # 4,096 bytes of parameters, as many of gradients
    stats = ModelStats(4096, 4096, 1024, (256, 256, 256), 8192, "", 0, None, rows, rows)
    full = analytic(stats, profile, setting(Strategy.FULL_SHARD, 1, checkpointed=2))
    offload = analytic(stats, profile, setting(Strategy.CPU_OFFLOAD, 1, checkpointed=2))
    # FULL_SHARD: backward's beginning, its temporaries the largest saved activation and its
    # gradient, every gradient alive
    assert (full.grads, full.temporaries) == (4096, 2 * profile.largest_saved_bytes)
    assert (offload.params, offload.grads, offload.optimizer_state) == (0, 0, 0)
    assert offload.activations == full.activations
    assert offload.temporaries == profile.forward_rise_bytes
    # under gradient accumulation the earlier micro-batches' gradients stay on the device,
    # unsharded, until the last one's are reduced (FSDP2's `unsharded_accumulated_grad`), as
    # the simulation's estimate counts them (they were dropped with the state)
    accumulating = dataclasses.replace(
        setting(Strategy.CPU_OFFLOAD, 1, checkpointed=2), accumulation_steps=4
    )
    assert analytic(stats, profile, accumulating).grads == stats.trainable_bytes


def test_cpu_offload_s_step_runs_the_host_s_implementation() -> None:
    """Under CPU offload the optimizer steps CPU tensors, where torch's default is the loop:
    `AdamW()` planned for CUDA holds foreach's copy of every parameter on the device's step,
    one or two parameters' worth on the host's (it counted the whole copy there too)."""
    import torch
    from torch import nn

    from autoshard.decide.estimate import host_bytes, model_stats
    from autoshard.decide.optimizer import optimizer_state_bytes, step_temporary_bytes

    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    adamw = torch.optim.AdamW(model.parameters())
    state, reason = optimizer_state_bytes(adamw)
    device, host = step_temporary_bytes(adamw, "cuda"), step_temporary_bytes(adamw, "cpu")
    assert host < device
    stats = model_stats(model, [], state, reason, 0, device, host)
    s = setting(Strategy.CPU_OFFLOAD, 2, device_type="cuda")
    without = dataclasses.replace(stats, host_step_temporary_bytes=None)
    assert host_bytes(without, s) - host_bytes(stats, s) == -(-(state + device) // 2) - -(
        -(state + host) // 2
    )


def test_gradient_rows_are_those_of_trainable_parameters() -> None:
    from autoshard.decide.estimate import model_stats

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    model[0].requires_grad_(False)  # frozen: pinned as a parameter, no gradient
    stats = model_stats(model, [], 0, "", 0)
    assert stats.param_rows == ((3, 4, 4), (3, 1, 4), (5, 3, 4), (5, 1, 4))
    assert stats.grad_rows == ((5, 3, 4), (5, 1, 4))


@pytest.mark.parametrize("strategy", [Strategy.LOCAL, Strategy.DDP, Strategy.FULL_SHARD])
def test_ddp_s_first_buckets_are_counted_on_cuda_where_nccl_holds_them_into_the_second_step(
    strategy: Strategy, measured: dict[str, tuple[ModelStats, ActivationProfile]]
) -> None:
    """The buckets DDP drops when it rebuilds them at the second step stay allocated on CUDA
    until NCCL's watchdog lets go of the first step's all-reduces: a 200M-parameter GPT at world 1
    measured its estimate plus its fp32 parameters on an H100 and an H200. gloo frees them at
    once; FSDP2 and the unwrapped model have no buckets."""
    from autoshard.decide.estimate import Phase, Simulated, from_simulation

    stats, profile = measured["uniform"]
    ddp = strategy is Strategy.DDP
    sim = Simulated(
        Phase(10, 1, 0, 20, activations=1310, comm_buffers=30, temporaries=5),
        Phase(10, 1, 10, 20, activations=0, comm_buffers=0, temporaries=40),
        degree=1,
    )
    for world in (1, 4):
        on_cpu, on_cuda = (
            setting(strategy, world, device_type=device) for device in ("cpu", "cuda")
        )
        # by formula and from a simulation; in whichever phase peaks (comm counts in both)
        for of, cpu, cuda in (
            (stats, estimate(stats, profile, on_cpu), estimate(stats, profile, on_cuda)),
            (
                _sim_stats(),
                from_simulation(_sim_stats(), None, on_cpu, sim),
                from_simulation(_sim_stats(), None, on_cuda, sim),
            ),
        ):
            held = of.trainable_bytes if ddp else 0
            assert cuda.comm_buffers - cpu.comm_buffers == held, (strategy, world)
            assert terms_of(cuda)[:4] == terms_of(cpu)[:4]
            # looking for unused parameters, DDP never rebuilds its buckets: none retired
            unused = dataclasses.replace(on_cuda, find_unused=True)
            looking = (
                estimate(stats, profile, unused)
                if of is stats
                else from_simulation(_sim_stats(), None, unused, sim)
            )
            assert terms_of(looking) == terms_of(cpu), (strategy, world)


def test_a_checkpointed_block_s_backward_counts_the_gradients_of_the_blocks_after_it() -> None:
    """Unwrapped, backward's early peak holds the largest unit's gradients; a checkpointed
    block runs again later, when every block after it and the head have theirs (T5 with every
    block checkpointed read 5.2% under the allocator's peak before; -0.2% now)."""
    stats = dataclasses.replace(_adam_stats(), optimizer_bytes=0)
    block = 16 * MiB
    profile = ActivationProfile(
        block_saved_bytes=(8 * block,) * 4,
        block_input_bytes=(block,) * 4,
        before_saved_bytes=0,
        after_saved_bytes=0,
        largest_saved_bytes=block,
        block_forward_flops=(0,) * 4,
        total_forward_flops=0,
        compute_dtype=torch.float32,
        block_checkpointed_bytes=(10 * block,) * 4,
        block_checkpointed_into_buffers_bytes=(10 * block,) * 4,
    )
    fp = estimate(stats, profile, setting(Strategy.LOCAL, 1, checkpointed=4))
    # the last block's moment is the earliest (no block's gradients yet but its own, at most
    # the largest unit's); the first block's the latest: the three after it and its own, all
    # 400 MiB, beside its recomputation (10 blocks) and the batch
    first = 400 * MiB + 10 * block + MiB
    last = 100 * MiB + 3 * block + 10 * block + MiB
    assert fp.grads + fp.activations + fp.temporaries == max(first, last)
    assert fp.grads == 400 * MiB
