"""GPU tier: real CUDA memory. Skipped where there is no CUDA (CI has none); run on a GPU machine.

One process on one GPU (LOCAL): sharding needs two GPUs, but the trial step's real-OOM path, the
memory cap and the measured peak are the same code on every strategy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard import _inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]

# Activations (~290 MiB per block per 4096 rows, fp32) dominate: about 12 GiB unchecked against
# about 5 GiB with every block checkpointed, so a limit between them separates the two.
WIDTH, BLOCKS, BATCH = 2048, 8, 16384


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.randn(BATCH, WIDTH).cuda()


def test_chosen_plan_fits_for_real_and_reports_the_measured_peak() -> None:
    model, optimizer, batch = _setup()
    model, optimizer, plan = autoshard.prepare(model, optimizer, batch, mixed_precision="bf16")
    assert plan.measured_peak_bytes is not None  # torch.cuda.max_memory_allocated of the trial
    assert plan.measured_peak_bytes <= plan.device_memory_bytes
    print(
        f"\nestimated {plan.estimated_peak_bytes} B, measured {plan.measured_peak_bytes} B\n{plan}"
    )


def test_a_real_oom_under_memory_limit_falls_back_to_more_checkpointing_then_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, optimizer, batch = _setup()
    # The estimator is conservative, so on its own it never picks a rung that really OOMs. Stand
    # in an estimate that misses the activations: the plan then keeps every block unchecked,
    # and the real cap below makes that trial run out of CUDA memory.
    real_measure = _inputs.measure

    def missing_activations(*args, **kwargs):  # type: ignore[no-untyped-def]
        measured = real_measure(*args, **kwargs)
        profile = measured.profile
        shrunk = type(profile)(
            block_saved_bytes=tuple(b // 100 for b in profile.block_saved_bytes),
            block_input_bytes=tuple(b // 100 for b in profile.block_input_bytes),
            before_saved_bytes=0,
            after_saved_bytes=0,
            largest_saved_bytes=profile.largest_saved_bytes // 100,
            block_forward_flops=profile.block_forward_flops,
            total_forward_flops=profile.total_forward_flops,
            compute_dtype=profile.compute_dtype,
        )
        return type(measured)(shrunk, measured.trace_note)

    def estimate(checkpointed: int) -> int:
        return autoshard.plan(
            model,
            optimizer,
            batch,
            device_memory="1TiB",
            mixed_precision="no",
            activation_checkpointing=checkpointed,
        ).estimated_peak_bytes

    # Between what full and no checkpointing need (true estimates, taken before the stand-in).
    limit = (estimate(0) + estimate(BLOCKS)) // 2
    monkeypatch.setattr("autoshard._prepare.measure", missing_activations)
    # ... and no simulation, which would trace the activations again on its own
    monkeypatch.setattr(
        "autoshard._inputs.simulate_all", lambda *args, **kwargs: ({}, "not simulated (test)")
    )
    model, optimizer, plan = autoshard.prepare(
        model, optimizer, batch, mixed_precision="no", memory_limit=limit
    )
    assert plan.attempts[0].activation_checkpointing == 0
    assert plan.attempts[0].outcome.startswith("out of memory")
    assert plan.attempts[-1].outcome.startswith("fit")
    assert plan.activation_checkpointing > 0
    losses = []
    for _ in range(3):
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.fixture
def one_rank_group():  # type: ignore[no-untyped-def]
    """A one-rank NCCL process group, so the FSDP2 strategies can run on one GPU."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl", rank=0, world_size=1, store=store)
    try:
        yield
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "shard_grad_op", "full_shard", "cpu_offload"])
def test_each_strategy_trains_and_its_estimate_is_reported_beside_the_measured_peak(
    strategy: str, one_rank_group: None
) -> None:
    model, optimizer, batch = _setup()
    model, optimizer, plan = autoshard.prepare(
        model, optimizer, batch, strategy=strategy, mixed_precision="bf16"
    )
    assert plan.strategy.value == strategy
    assert plan.cpu_offload == (strategy == "cpu_offload")
    if strategy == "cpu_offload":  # the sharded state lives in host memory
        param = next(model.parameters())
        assert param.to_local().device.type == "cpu"  # type: ignore[attr-defined]
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(batch).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    chosen = next(
        c
        for c in plan.candidates
        if c.strategy == plan.strategy
        and c.activation_checkpointing == plan.activation_checkpointing
    )
    tensors = chosen.estimated_peak_bytes - chosen.footprint.overheads
    print(
        f"\n{strategy}: estimated tensors {tensors / 2**20:.1f} MiB, measured allocated "
        f"{measured / 2**20:.1f} MiB, reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB, "
        f"error {(tensors - measured) / measured:+.1%}"
    )
