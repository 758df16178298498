"""The modelled step's compute (issue 26): FLOP-bound operators, memory-bound ones, the optimizer
step's traffic and the operators' launches (`decide.cost.compute_seconds`), and the figures the
trace counts for it (`measure.traffic.Traffic`) and the optimizer's (`decide.optimizer`)."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_plan import AMPLE, BLOCKS, STATS, make_inputs, profile
from torch import nn

from autoshard import Strategy
from autoshard.decide.cost import compute_seconds, step_seconds
from autoshard.decide.hardware import hardware_for
from autoshard.decide.optimizer import step_traffic
from autoshard.measure import trace

GPU = hardware_for("cuda", (9, 0), True)  # 4e14 FLOP/s, 2e12 B/s, 5e-6 s an operator
GB = 10**9


def _inputs(world: int, **figures: int) -> tuple[object, float]:
    """Inputs whose profile moves the given figures; and its FLOP time on GPU (3x forward)."""
    prof = replace(profile(256 * 2**20, 16 * 2**20, 64 * 2**20, 10**12), **figures)
    return make_inputs(world, AMPLE, prof, hardware=GPU), 3 * prof.total_forward_flops / 4e14


def test_memory_bound_operators_add_their_bytes_over_the_bandwidth() -> None:
    inputs, flop_time = _inputs(1, forward_traffic=GB, backward_traffic=2 * GB, forward_kernels=10)
    seconds = compute_seconds(inputs, Strategy.LOCAL, 0)  # type: ignore[arg-type]
    assert math.isclose(seconds, flop_time + 3 * GB / 2e12)
    assert step_seconds(inputs, Strategy.LOCAL, 0) == seconds  # type: ignore[arg-type]


def test_a_step_of_many_small_operators_is_bound_by_their_launches() -> None:
    inputs, flop_time = _inputs(1, forward_kernels=10**6, backward_kernels=2 * 10**6)
    assert 3 * 10**6 * 5e-6 > flop_time
    seconds = compute_seconds(inputs, Strategy.LOCAL, 0)  # type: ignore[arg-type]
    assert math.isclose(seconds, 3 * 10**6 * 5e-6)


def test_a_checkpointed_block_runs_its_forward_operators_again() -> None:
    per_block = (GB,) * BLOCKS
    inputs, _ = _inputs(1, block_forward_traffic=per_block, block_forward_kernels=(10,) * BLOCKS)
    none, three = (compute_seconds(inputs, Strategy.LOCAL, k) for k in (0, 3))  # type: ignore[arg-type]
    recompute_flops = 3 * 10**12 / 4e14
    assert math.isclose(three - none, recompute_flops + 3 * GB / 2e12)


def test_the_optimizer_step_is_the_whole_step_s_under_every_strategy() -> None:
    """Not a shard's under ZeRO: FSDP2's own per-step work, which the model does not count,
    outweighed the saving on the H100 (FULL_SHARD 1.4x to 3x LOCAL's step at world 1). Offload
    runs FSDP2 too: the same term, its host step on top (`step_seconds`)."""
    inputs, flop_time = _inputs(8)
    stats = replace(STATS, step_traffic_bytes=80 * GB, step_operators=100)
    inputs = replace(inputs, stats=stats)  # type: ignore[type-var]
    ddp = compute_seconds(inputs, Strategy.DDP, 0)  # type: ignore[arg-type]
    full = compute_seconds(inputs, Strategy.FULL_SHARD, 0)  # type: ignore[arg-type]
    offload = compute_seconds(inputs, Strategy.CPU_OFFLOAD, 0)  # type: ignore[arg-type]
    assert math.isclose(ddp, flop_time + 80 * GB / 2e12)
    assert full == ddp == offload


@pytest.mark.parametrize("world", [8, 16384])
@pytest.mark.parametrize("checkpointed", [0, BLOCKS])
def test_offload_never_models_faster_than_full_shard(world: int, checkpointed: int) -> None:
    """Offload is FULL_SHARD with the state on the host: the same device work, plus the shards'
    trips over the host link and the optimizer step on the host. With the optimizer step left
    out of its device work, a 405B-shaped model at 16,384 ranks chose CPU_OFFLOAD over a
    FULL_SHARD that fit. Here 80 GB of step traffic, 40 ms of device work that offload was
    spared, outweighed its link and host terms at 8 ranks too."""
    inputs, _ = _inputs(world)
    stats = replace(STATS, step_traffic_bytes=80 * GB, step_operators=100)
    inputs = replace(inputs, stats=stats)  # type: ignore[type-var]
    full = step_seconds(inputs, Strategy.FULL_SHARD, checkpointed)  # type: ignore[arg-type]
    offload = step_seconds(inputs, Strategy.CPU_OFFLOAD, checkpointed)  # type: ignore[arg-type]
    assert offload > full


@pytest.mark.parametrize(
    ("options", "passes", "operators"),
    [
        ({"fused": True}, 7, 1),  # read p, g, m, v; write p, m, v; one launch per list
        ({"foreach": True}, 20, 8),  # Adam's 18 passes + decoupled decay's 2; 8 lists ops
        ({"foreach": False}, 20, 8 * 3),  # the same passes, 8 operators per parameter
    ],
    ids=["fused", "foreach", "for-loop"],
)
def test_adamw_step_traffic_by_implementation(
    options: dict[str, bool], passes: int, operators: int
) -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30)]
    frozen = nn.Parameter(torch.zeros(1000), requires_grad=False)
    optimizer = torch.optim.AdamW([*params, frozen], **options)
    size = 60 * 4
    assert step_traffic(optimizer, "cuda") == (passes * size, operators)


def test_torch_s_default_implementation_is_the_device_s() -> None:
    params = [nn.Parameter(torch.zeros(8)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params)  # foreach on CUDA, the loop on CPU
    assert step_traffic(optimizer, "cuda")[1] == 8
    assert step_traffic(optimizer, "cpu")[1] == 8 * 3


def test_sgd_moves_its_momentum_once() -> None:
    param = nn.Parameter(torch.zeros(100))
    plain = torch.optim.SGD([param], lr=0.1)
    momentum = torch.optim.SGD([param], lr=0.1, momentum=0.9, foreach=False)
    assert step_traffic(plain, "cpu") == (3 * 400, 1)  # p += -lr * g: read p, g, write p
    assert step_traffic(momentum, "cpu") == (8 * 400, 3)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = x * 2  # the parent's, between blocks
        return x.sum()


def test_the_trace_counts_what_each_block_and_the_parent_between_them_move() -> None:
    model = _Net()
    x = torch.randn(8, 64)
    prof = trace.profile_step(model, list(model.blocks), x, lambda out, batch: out, None)
    activation = x.nbytes  # 8 x 64 fp32
    # addmm (priced by its FLOPs: no bytes), relu (reads and writes one activation); the
    # transpose of the weight is a view: no operator. Blocks after the first also hold the
    # parent's x * 2 before them (a read and a write; the 2 is a number, not a tensor).
    assert prof.block_forward_kernels == (2, 3, 3, 3)
    first = 2 * activation
    assert prof.block_forward_traffic[0] == first
    assert prof.block_forward_traffic[1:] == (first + 2 * activation,) * 3
    # the model's sum, after the blocks: its own
    assert prof.forward_kernels == sum(prof.block_forward_kernels) + 1
    assert prof.forward_traffic == sum(prof.block_forward_traffic) + activation + 4
    # backward: the middle blocks alike (their backward and the parent's x * 2 after them),
    # the whole more than the blocks' (the loss's)
    assert prof.block_backward_kernels[1] == prof.block_backward_kernels[2] > 0
    assert prof.block_backward_traffic[1] == prof.block_backward_traffic[2] > 0
    assert prof.backward_traffic > sum(prof.block_backward_traffic)


class _Matmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight)  # 3-D by 2-D: a view, mm, then _unsafe_view


def test_a_reshape_after_a_batched_matmul_moves_nothing() -> None:
    """A 3-D matmul's output is reshaped by `_unsafe_view`, a view torch does not mark as one:
    no bytes, no operator."""
    model = _Net()
    model.blocks = nn.ModuleList(_Matmul() for _ in range(4))
    x = torch.randn(2, 4, 64)
    prof = trace.profile_step(model, list(model.blocks), x, lambda out, batch: out, None)
    assert prof.block_forward_traffic[0] == 2 * x.nbytes  # the relu's read and write alone
    assert prof.block_forward_kernels[0] == 2  # mm and relu


def test_the_benchmark_reads_a_gpu_report(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import step_model

    report = tmp_path / "report.md"
    report.write_text(
        '`hardware_for(..., measured=Throughput(...))` gives: {"flops_per_s": 8e14, '
        '"memory_bytes_per_s": 3e12, "source": "x"}\n\n'
        "| model | world | strategy | AC | a | b | c | d | e | f | step (measured) | g | h |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| llama_1b | 1 | local | 0/22 | 1013M | 1 | 2 | 3 | 4 | 5 | 105.6 ms | 36.8 ms | 1 ms |\n"
        "| llama_1b | 8 | full_shard | 22/22 | 1B | 1 | 2 | 3 | 4 | 5 | 248.9 ms | 5 ms | 5 ms |\n"
    )
    measured, rows = step_model.read_report(report)
    assert (measured.flops_per_s, measured.memory_bytes_per_s) == (8e14, 3e12)
    assert rows == [
        {"model": "llama_1b", "strategy": "local", "checkpointed": 0, "measured_s": 0.1056}
    ]


class _SparseEmbedded(nn.Module):
    """A recommender's sparse embedding: its gradient is a sparse tensor, which has no storage."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 64, sparse=True)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("real", [False, True], ids=["fake", "real"])
def test_a_sparse_gradient_does_not_stop_the_trace(real: bool) -> None:
    model = _SparseEmbedded()
    ids = torch.randint(0, 1000, (8, 16))
    prof = trace.profile_step(model, list(model.blocks), ids, None, None, real=real)
    assert min(prof.block_saved_bytes) > 0 and prof.backward_traffic > 0


class _SelfCheckpointed(_Net):
    """Checkpoints its own blocks (transformers' gradient_checkpointing_enable): in backward each
    block's forward runs again, and its hooks with it."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x.requires_grad_()
        for i, block in enumerate(self.blocks):
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
            if i < len(self.blocks) - 1:
                x = x * 2
        return x.sum()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_block_recomputed_in_backward_keeps_its_forward_figures(reentrant: bool) -> None:
    """The recomputation ran the block's hooks again: its forward FLOPs and traffic came out
    negative or doubled, and the modelled step near 0."""
    figures = {}
    for kind in (None, reentrant):
        model = _SelfCheckpointed(kind)
        torch.manual_seed(0)
        prof = trace.profile_step(model, list(model.blocks), torch.randn(8, 64), None, None)
        figures[kind] = (prof.block_forward_flops, prof.block_forward_traffic)
    assert figures[reentrant] == figures[None]
    assert min(figures[None][0]) > 0


def test_under_accumulation_a_micro_batch_carries_its_share_of_the_optimizer_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The modelled step is one micro-batch's; the optimizer steps once per accumulation."""
    import autoshard
    from autoshard import pipeline

    seen = []
    real = pipeline.decide

    def spy(inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(inputs)
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(pipeline, "decide", spy)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    for steps in (1, 4):
        optimizer = torch.optim.AdamW(model.parameters())
        autoshard.plan(
            model, optimizer, torch.randn(8, 64), device_memory="1GiB", accumulation_steps=steps
        )
    one, four = (inputs.stats for inputs in (seen[0], seen[-1]))
    assert one.step_traffic_bytes == 20 * sum(p.nbytes for p in model.parameters())
    assert four.step_traffic_bytes == one.step_traffic_bytes // 4
    assert four.step_operators == -(-one.step_operators // 4)
