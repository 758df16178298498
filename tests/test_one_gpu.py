"""One GPU, not enough memory: the single-GPU ladder (unwrapped -> k blocks checkpointed -> CPU
offload -> CPU offload with blocks checkpointed), chosen by the cost model, for a script run with
plain `python` (prepare gives it a one-rank group of its own) or under torchrun.

The decisions are what-if plans for a GPU (`device="cuda"`), so they run on any CPU; the group of
its own is created for real on the CPU (gloo); the GPU run itself is in tests/test_gpu.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_plain_python
from test_plan import Tower

import autoshard
from autoshard import DoesNotFit, Strategy
from autoshard._units import human
from autoshard.decide.plan import Candidate, Plan

GPU = dict(device="cuda", device_memory="80GiB", host_memory="64GiB")
WIDTH, ROWS, DEPTH = 1024, 8192, 4  # activations and state both weigh: every rung matters


@pytest.fixture(scope="module")
def job() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    with torch.device("meta"):  # a what-if needs only shapes
        model = Tower(width=WIDTH, depth=DEPTH)
        batch = torch.randn(ROWS, 8)
    return model, torch.optim.AdamW(model.parameters()), batch


@pytest.fixture(scope="module")
def rungs(job: Any) -> dict[tuple[Strategy, int], Candidate]:
    """Every rung of the ladder with its estimate: each checkpointing count forced in turn."""
    found = {}
    for k in range(DEPTH + 1):
        plan = autoshard.plan(*job, activation_checkpointing=k, **GPU)
        for c in plan.candidates:
            found[(c.strategy, c.activation_checkpointing)] = c
    return found


def _need(c: Candidate) -> int:
    return c.estimated_peak_bytes + c.reserve_bytes


def _between(low: Candidate, high: Candidate) -> int:
    """A memory limit that `low` fits under and `high` does not."""
    assert _need(low) < _need(high), (low, high)
    return (_need(low) + _need(high)) // 2


def _ladder(rungs: dict[tuple[Strategy, int], Candidate]) -> dict[str, Candidate]:
    local = [rungs[(Strategy.LOCAL, k)] for k in range(DEPTH + 1)]
    offload = [rungs[(Strategy.CPU_OFFLOAD, k)] for k in range(DEPTH + 1)]
    return {
        "local": local[0],
        "local_least": min(local, key=_need),
        "offload": offload[0],
        "offload_least": min(offload, key=_need),
    }


def test_the_rungs_are_what_the_ladder_needs(rungs: dict[tuple[Strategy, int], Candidate]) -> None:
    """The fixture's model has a ladder: checkpointing saves some, offload more, both most; and
    offload costs more time than any checkpointing (PCIe both ways and an optimizer step on the
    host, against one more forward of some blocks)."""
    r = _ladder(rungs)
    assert _need(r["local_least"]) < _need(r["local"])
    assert _need(r["offload"]) < _need(r["local_least"])
    assert _need(r["offload_least"]) < _need(r["offload"])
    slowest_local = max(c.step_seconds for (s, _), c in rungs.items() if s == Strategy.LOCAL)
    fastest_offload = min(
        c.step_seconds for (s, _), c in rungs.items() if s == Strategy.CPU_OFFLOAD
    )
    assert slowest_local < fastest_offload
    offload = r["offload"]
    assert offload.footprint.params == offload.footprint.optimizer_state == 0
    assert offload.host_bytes > 0


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_one_gpu_climbs_the_ladder_as_memory_shrinks(
    launch: str, job: Any, rungs: dict[tuple[Strategy, int], Candidate]
) -> None:
    # plain python: no process group, prepare would create one; torchrun: a one-rank group
    world = {} if launch == "python" else {"world_size": 1}
    r = _ladder(rungs)

    def chosen(limit: int | None) -> Plan:
        plan = autoshard.plan(*job, memory_limit=limit, **world, **GPU)
        assert plan.world_size == 1
        return plan

    ample = chosen(None)
    assert (ample.strategy, ample.activation_checkpointing) == (Strategy.LOCAL, 0)
    assert {c.strategy for c in ample.candidates} == {Strategy.LOCAL, Strategy.CPU_OFFLOAD}

    # checkpointing fits and so does offload: checkpointing is faster
    some = chosen(_between(r["local_least"], r["local"]))
    assert some.strategy == Strategy.LOCAL and some.activation_checkpointing > 0, str(some)
    assert not some.cpu_offload

    offload = chosen(_between(r["offload"], r["local_least"]))
    assert (offload.strategy, offload.activation_checkpointing) == (Strategy.CPU_OFFLOAD, 0)
    assert offload.cpu_offload

    both = chosen(_between(r["offload_least"], r["offload"]))
    assert both.strategy == Strategy.CPU_OFFLOAD and both.activation_checkpointing > 0, str(both)

    group_note = "prepare creates a one-rank group of its own"
    for plan in (offload, both):
        said = any(group_note in reason for reason in plan.reasons)
        assert said == (launch == "python"), plan.reasons
    assert not any(group_note in reason for reason in some.reasons)


def test_one_gpu_without_enough_host_memory_does_not_offload(
    job: Any, rungs: dict[tuple[Strategy, int], Candidate]
) -> None:
    r = _ladder(rungs)
    limit = _between(r["offload"], r["local_least"])  # only offload fits the device
    host = r["offload_least"].host_bytes // 2  # and the host holds half its state
    with pytest.raises(DoesNotFit) as caught:
        autoshard.plan(*job, memory_limit=limit, **(GPU | {"host_memory": host}))
    message = str(caught.value)
    # DoesNotFit names every rung it weighed, with what each needs, and offload's host memory
    assert "Every rung weighed" in message, message
    for c in (r["local"], r["local_least"], r["offload"]):
        rung = f"{c.strategy} {c.activation_checkpointing}/{DEPTH} {human(_need(c))}"
        assert rung in message, (rung, message)
    offload = r["offload"]
    assert f"and {human(offload.host_bytes)} of host memory ({human(host)} available)" in message
    # the closest rung is the one quoted: here checkpointing's device shortfall is the smaller
    closest = min(_need(r["local_least"]) - limit, offload.host_bytes - host)
    assert caught.value.missing_bytes == closest


def test_does_not_fit_names_the_largest_batch_that_fits_found_by_simulation() -> None:
    with torch.device("meta"):
        model = Tower(width=512, depth=4)
        batch = torch.randn(16384, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    limited = GPU | {"memory_limit": "700MiB", "accumulation_steps": 2}
    with pytest.raises(DoesNotFit) as caught:
        autoshard.plan(model, optimizer, batch, **limited)
    error = caught.value
    largest = error.largest_batch
    assert largest is not None and 1 < largest < 16384, str(error)
    # simulated to fit, and the next batch past the search's 2% does not
    assert autoshard.plan(model, optimizer, batch[:largest], **limited).chosen.fits
    with pytest.raises(DoesNotFit):
        autoshard.plan(model, optimizer, batch[: largest + max(1, largest // 50)], **limited)
    message = str(error)
    assert f"The largest per-rank batch that fits: {largest} of its 16384 rows, under " in message
    keep = -(-16384 * 2 // largest)
    assert f"accumulation_steps={keep} keeps at least the 32768 rows" in message, message
    assert "simulated at 1, " in message


@pytest.mark.parametrize(
    ("rows", "limit", "why"),
    [
        (1, "300MiB", "the example batch is already one row"),
        (64, "300MiB", "not even one of its 64 rows fits under"),
    ],
)
def test_does_not_fit_says_why_no_smaller_batch_fits(rows: int, limit: str, why: str) -> None:
    with torch.device("meta"):
        model = Tower(width=512, depth=4)
        batch = torch.randn(rows, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(DoesNotFit) as caught:
        autoshard.plan(model, optimizer, batch, memory_limit=limit, **GPU)
    assert caught.value.largest_batch is None
    assert f"No smaller per-rank batch was found to fit: {why}" in str(caught.value)


def test_one_process_on_the_cpu_never_offloads(job: Any) -> None:
    model, optimizer, batch = job
    plan = autoshard.plan(model, optimizer, batch, device="cpu", device_memory="80GiB")
    assert [c.strategy for c in plan.candidates] == [Strategy.LOCAL]
    with pytest.raises(ValueError, match="CPU_OFFLOAD.*CPU"):
        autoshard.plan(model, optimizer, batch, device="cpu", strategy="cpu_offload")


OWN_GROUP_SCRIPT = """
import atexit, torch, torch.distributed as dist
from torch import nn
from autoshard import Strategy
from autoshard._world import resolve
from autoshard.decide.precision import Precision
from autoshard.wrap.apply import apply, start

# registered before prepare's hook, so it runs after it (atexit runs last-in, first-out)
atexit.register(lambda: print("group destroyed at exit:", not dist.is_initialized()))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters())
world = resolve(init=True)  # plain python: nothing to initialise
print("group before:", dist.is_initialized(), world.distributed)
wrapping = start(model, ["0", "1"], world, Precision.BF16, False)
apply(wrapping, optimizer, Strategy.LOCAL, 1)  # the first rung: unwrapped, autocast hooks
print("local:", dist.is_initialized(), len(wrapping.autocast) > 0)
# the trial's fallback on one GPU, in place (there: CPU_OFFLOAD; on the CPU its engine, FSDP2)
apply(wrapping, optimizer, Strategy.FULL_SHARD, 2)
print("group after:", dist.is_initialized(), dist.get_world_size(), dist.get_backend())
print("world:", wrapping.world.distributed, wrapping.world.backend, wrapping.world.world_size)
print("autocast hooks left:", len(wrapping.autocast), "checkpointed:", wrapping.checkpointed)
print("notes:", wrapping.notes)
loss = wrapping.model(torch.randn(4, 8)).float().sum()
loss.backward()
optimizer.step()
print("trained:", bool(torch.isfinite(loss)))
"""


def test_plain_python_gets_a_one_rank_group_of_its_own_destroyed_at_exit(tmp_path: Path) -> None:
    returncode, output, _ = run_plain_python(OWN_GROUP_SCRIPT, tmp_path, 120)
    assert returncode == 0, output
    assert "group before: False False" in output, output
    assert "local: False True" in output, output  # no group for the unwrapped rung
    assert "group after: True 1 gloo" in output, output
    assert "world: True gloo 1" in output, output
    assert "autocast hooks left: 0 checkpointed: 2" in output, output  # FSDP2's policy instead
    assert "prepare created a one-rank group of its own (gloo, in-process store)" in output
    assert "trained: True" in output, output
    assert "group destroyed at exit: True" in output, output
