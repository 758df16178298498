"""A model whose forward raises under autocast and runs without it, where its parameters cast to
the compute dtype (FSDP2's mixed precision) make its dtypes agree: X-MOD's language adapters write
a linear's bf16 output into `torch.zeros_like` of an fp32 input. Mixed precision trains it through
FSDP2, on one rank too; LOCAL and DDP, which compute under autocast, are refused for it with what
to do instead. Where FSDP2 cannot help (the job cannot use it, or the cast step fails too), "auto"
turns mixed precision off and an explicit request is refused, as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_plain_python
from torch import nn

import autoshard
from autoshard.measure import facts
from autoshard.measure.facts import measure
from autoshard.strategies.recipes import Job, available
from autoshard.strategies.strategy import Strategy

PLAN = {"world_size": 2, "device_memory": "1GiB"}
RAISED = "the model's forward raises under autocast to bfloat16 (RuntimeError: index_add_()"


class SumsIntoItsInputsDtype(nn.Module):
    """Each block's output summed in place into a buffer made like the block's input: under
    autocast the input is fp32 (the batch) and the linear's output bf16, which `index_add_`
    refuses; with the parameters and the input cast to bf16, as FSDP2 computes, both are bf16."""

    def __init__(self, width: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0], device=x.device)
        for block in self.blocks:
            x = torch.zeros_like(x).index_add_(0, rows, torch.tanh(block(x)))
        return x.square().mean()


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = SumsIntoItsInputsDtype()
    return model, torch.optim.AdamW(model.parameters()), torch.randn(4, 8)


def test_it_raises_under_autocast_and_runs_with_cast_parameters() -> None:
    """The premise, on real tensors: autocast raises, the FSDP2-like cast runs."""
    model, _, batch = _model()
    with pytest.raises(RuntimeError, match="index_add_"), torch.autocast("cpu", torch.bfloat16):
        model(batch)
    cast = SumsIntoItsInputsDtype().to(torch.bfloat16)
    assert torch.isfinite(cast(batch.to(torch.bfloat16)))


@pytest.mark.parametrize("asked", ["bf16", "auto"])
def test_mixed_precision_trains_it_sharded(asked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)  # auto: bf16 on any CPU
    model, optimizer, batch = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = autoshard.plan(model, optimizer, batch, mixed_precision=asked, **PLAN)
    assert plan.mixed_precision.value == "bf16"
    assert plan.strategy in (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD), plan
    weighed = {c.strategy for c in plan.candidates}
    assert not weighed & {Strategy.LOCAL, Strategy.DDP}, plan
    assert plan.autocast_raises is not None and plan.autocast_raises.startswith(RAISED)
    assert plan.to_dict()["autocast_raises"] == plan.autocast_raises
    said = next(r for r in plan.reasons if r.startswith(RAISED))
    assert "LOCAL and DDP, which compute mixed precision under autocast, are not weighed" in said
    assert "FSDP2 casts the parameters to the compute dtype instead" in said
    assert any("example batch with the parameters cast to bfloat16:" in r for r in plan.reasons)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched


def test_the_trace_with_cast_parameters_saves_in_the_compute_dtype() -> None:
    """Traced as FSDP2 computes it, not in fp32: each linear block saves its input in bf16,
    half the fp32 trace's bytes, the first its bf16 copy of the batch (new memory, as FSDP2's
    cast of the root's input is; the fp32 batch is not), and the trace says its dtype."""
    model, _, batch = _model()
    fp32 = measure(model, list(model.blocks), batch, None, None)
    cast = measure(model, list(model.blocks), batch, None, torch.bfloat16, cast=True)
    assert fp32.profile is not None and cast.profile is not None, cast.trace_note
    assert cast.profile.compute_dtype == torch.bfloat16
    assert cast.profile.activation_bytes(0) < fp32.profile.activation_bytes(0)
    assert fp32.profile.block_saved_bytes[1] == 4 * 8 * 4
    assert cast.profile.block_saved_bytes[1] == 4 * 8 * 2
    assert (fp32.profile.block_saved_bytes[0], cast.profile.block_saved_bytes[0]) == (0, 4 * 8 * 2)


def test_a_strategy_that_computes_under_autocast_is_refused_with_what_to_do() -> None:
    model, optimizer, batch = _model()
    with pytest.raises(ValueError, match="strategy DDP computes mixed precision under") as e:
        autoshard.plan(model, optimizer, batch, mixed_precision="bf16", strategy="ddp", **PLAN)
    message = str(e.value)
    assert RAISED in message and "'shard_grad_op' or 'full_shard'" in message, message
    assert "mixed_precision='no'" in message, message
    # asked for nothing, the forced DDP trains in fp32, as written
    plan = autoshard.plan(model, optimizer, batch, strategy="ddp", **PLAN)
    assert plan.strategy == Strategy.DDP and plan.mixed_precision.value == "no"


def test_where_fsdp2_cannot_train_it_auto_is_off_and_bf16_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An optimizer leaving a trainable parameter out: FSDP2 cannot shard the job."""
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)
    model, _, batch = _model()
    optimizer = torch.optim.AdamW(model.blocks[0].parameters())
    plan = autoshard.plan(model, optimizer, batch, **PLAN)
    assert plan.mixed_precision.value == "no" and plan.strategy == Strategy.DDP, plan
    assert any(r.startswith("mixed precision off (auto chose bf16)") for r in plan.reasons)
    with pytest.raises(ValueError, match="strategy DDP computes mixed precision under") as e:
        autoshard.plan(model, optimizer, batch, mixed_precision="bf16", **PLAN)
    assert "FSDP2, which casts the parameters instead, cannot be used here" in str(e.value)


def test_jobs_it_leaves_without_autocast() -> None:
    raised = "the model's forward raises under autocast to bfloat16 (RuntimeError: x)"
    sharded = (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
    assert available(Job(2, True, 1, "cpu", autocast_raises=raised)) == sharded
    # one process: sharded over a one-rank group of its own, as offload is on a GPU
    assert available(Job(1, False, 1, "cpu", own_group=True, autocast_raises=raised)) == sharded
    assert available(Job(1, False, 1, "cpu", own_group=True)) == (Strategy.LOCAL,)
    assert available(Job(1, False, 1, "cpu", autocast_raises=raised)) == ()
    assert available(Job(2, True, 1, "cpu", cannot_shard="x", autocast_raises=raised)) == ()


def test_a_plan_for_accelerate_turns_its_autocast_off() -> None:
    """accelerate autocasts every forward under mixed precision, FSDP's too."""
    from accelerate.utils import AutocastKwargs

    model, optimizer, batch = _model()
    plan = autoshard.plan(model, optimizer, batch, mixed_precision="bf16", **PLAN)
    with pytest.warns(UserWarning):  # a sharded plan on the CPU, where accelerate runs DDP
        kwargs: dict[str, Any] = autoshard.accelerate_kwargs(plan, model)
    off = [h for h in kwargs["kwargs_handlers"] if isinstance(h, AutocastKwargs)]
    assert len(off) == 1 and off[0].enabled is False, kwargs
    assert kwargs["mixed_precision"] == "bf16"
    plain = autoshard.plan(model, optimizer, batch, mixed_precision="no", **PLAN)
    assert not any(
        isinstance(h, AutocastKwargs)
        for h in autoshard.accelerate_kwargs(plain, model).get("kwargs_handlers", [])
    )


PLAIN_PYTHON = """
import torch, torch.distributed as dist
from torch import nn
import autoshard
from test_autocast_raises import SumsIntoItsInputsDtype

torch.manual_seed(0)
model = SumsIntoItsInputsDtype()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batch = torch.randn(4, 8)
prepared = autoshard.prepare(model, optimizer, batch, mixed_precision="bf16")
plan = prepared.plan
print("plan:", plan.strategy.value, plan.mixed_precision.value, plan.world_size)
print("trial:", [a.outcome.value for a in plan.attempts], plan.measured_peak_bytes is not None)
print("group:", dist.is_initialized(), dist.get_world_size())
losses = []
for _ in range(3):
    loss = prepared.model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss))
print("finite:", all(torch.isfinite(torch.tensor(losses))))
print("dtypes:", sorted({str(p.dtype) for p in model.parameters()}))
"""


def test_one_process_trains_it_sharded_over_a_group_of_its_own(tmp_path: Path) -> None:
    """Plain `python`, bf16 asked for: unwrapped it cannot run, so prepare shards it over a
    one-rank group of its own, its trial step runs, and it trains; the user's parameters stay
    fp32 (FSDP2's shards), only the gathered copies are bf16."""
    script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n{PLAIN_PYTHON}"
    returncode, output, _ = run_plain_python(script, tmp_path, 180)
    assert returncode == 0, output
    assert "plan: shard_grad_op bf16 1" in output, output
    assert "trial: ['fit'] True" in output, output
    assert "group: True 1" in output, output
    assert "finite: True" in output, output
    assert "dtypes: ['torch.float32']" in output, output
