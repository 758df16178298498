"""The moment a step peaks at depends on how the sharded terms are scaled (`measure.step.peaks`).

A simulation on 8 ranks finds its peak where 8 ranks' shards and the activations together are
largest. A plan for more ranks (shards smaller) or under CPU offload (the state in host memory)
peaks where that degree's, or the device's, bytes are largest: often another moment, with more
activations alive and fewer gradients. The estimate takes the largest of the moments that can
peak at some degree, each at the degree planned; these tests check it against every instant of
the simulated step.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
from test_estimate import _sim_profile
from torch import nn

from autoshard.decide.estimate import (
    ModelStats,
    Phase,
    Setting,
    Simulated,
    besides_grads,
    from_simulation,
    model_stats,
    shard_ratio,
)
from autoshard.measure import simulate, step
from autoshard.measure.fake import unavailable
from autoshard.measure.simulate import Setup, combine, simulate_all
from autoshard.measure.step import peaks, sharded_bytes, total
from autoshard.strategies.strategy import Strategy


def _phase(sharded: int, other: int, *, params: int = 0) -> Phase:
    """A moment with `sharded` bytes of gradients (and `params` of parameters) and `other`
    bytes of activations."""
    return Phase(params, 0, sharded, 0, other, 0, 0)


def test_peaks_are_the_moments_largest_at_some_scale_of_the_sharded_terms() -> None:
    most_sharded = _phase(100, 10)  # the largest at the simulated degree (110)
    most_other = _phase(0, 50)  # the largest with the state on the host (50)
    between = _phase(50, 40)  # the largest at half the shards: 65 against 60 and 50
    under = _phase(50, 20)  # never the largest: `between` has as many sharded bytes, more others
    beyond = _phase(100, 5)  # never: `most_sharded` has as many, more others
    # never on the hull (under the line from most_other to between), yet the largest besides
    # its gradients: 55 against most_other's 50
    besides = _phase(0, 25, params=30)
    found = peaks([under, most_other, beyond, besides, between, most_sharded])
    assert found == (most_sharded, most_other, between, besides)
    # each is the largest at its scale of the sharded terms, and no moment left out is
    for scale in (0, 0.25, 0.5, 1, 4):

        def at(p: Phase, scale: float = scale) -> float:
            return total(p) - sharded_bytes(p) + scale * sharded_bytes(p)

        everything = [under, most_other, beyond, besides, between, most_sharded]
        assert max(map(at, found)) == max(map(at, everything))
    assert max(found, key=besides_grads) == besides
    assert peaks([]) == ()
    assert peaks([most_other, most_other]) == (most_other,)


def _stats() -> ModelStats:
    # one parameter of 64 rows x 4 fp32: 128 bytes a rank at 8 ranks, 16 at 64
    return ModelStats(1024, 1024, 256, (), 2048, "", 0, None, ((64, 4, 4),), ((64, 4, 4),))


def _setting(strategy: Strategy, world: int, checkpointed: int = 0) -> Setting:
    return Setting(strategy, checkpointed, world, 4, 4, "cpu", cuda_context_pending=False)


def test_the_estimate_peaks_at_the_moment_largest_at_the_degree_planned() -> None:
    """Simulated on 8 ranks, where backward's end (every gradient shard: 128 + 128 + 256 bytes
    of state, 50 of activations) is the peak, planned for 64 ranks (an eighth of the shards),
    where backward's beginning (100 bytes of activations) is; and under CPU offload."""
    end = Phase(128, 0, 128, 256, 50, 0, 0)
    beginning = Phase(128, 0, 0, 256, 100, 0, 0)
    assert total(end) > total(beginning)
    step_ = Phase(128, 0, 128, 256, 0, 0, 10)
    sim = Simulated(end, step_, degree=8, peaks=(end, beginning))
    at64 = from_simulation(_stats(), None, _setting(Strategy.FULL_SHARD, 64), sim)
    assert (at64.params, at64.grads, at64.optimizer_state, at64.activations) == (16, 0, 32, 100)
    # the simulation's own peak alone, scaled: the moment ending backward, short of it
    alone = Simulated(end, step_, degree=8)
    short = from_simulation(_stats(), None, _setting(Strategy.FULL_SHARD, 64), alone)
    assert (short.grads, short.activations) == (16, 50)
    assert short.peak < at64.peak
    # CPU offload: nothing sharded on the device, at any degree
    offload = from_simulation(_stats(), None, _setting(Strategy.CPU_OFFLOAD, 8), sim)
    assert (offload.params, offload.grads, offload.optimizer_state) == (0, 0, 0)
    assert offload.activations == 100
    # with every block checkpointed, the same: its moments too
    checkpointed = Simulated(
        end,
        step_,
        degree=8,
        peaks=(end, beginning),
        checkpointed_backward=end,
        checkpointed_peaks=(end, beginning),
    )
    every = from_simulation(_stats(), None, _setting(Strategy.FULL_SHARD, 64, 3), checkpointed)
    assert every.activations == 100


@pytest.mark.parametrize("strategy", [Strategy.LOCAL, Strategy.DDP, Strategy.FULL_SHARD], ids=str)
def test_the_peaks_give_what_every_moment_gives_with_blocks_checkpointed(
    strategy: Strategy,
) -> None:
    """Checkpointing k blocks lets go of activations and temporaries, never of the buffers and
    gathered parameters (`estimate._less`): a moment with few activations and many gathered
    parameters can be the largest after it, though not on the hull of totals. Unwrapped and
    under DDP the peaks give exactly what all the moments give, for every k; under FSDP2 with
    none checkpointed, and in a reviewer's case, two of three blocks."""
    rng = random.Random(0)
    moments = [
        Phase(512, 0, rng.randrange(513), 1024, rng.randrange(200), rng.randrange(200), 0)
        for _ in range(60)
    ]
    # backward's beginning, and a moment later in it with many gathered parameters: the
    # largest once a block's 45 bytes are let go
    moments += [Phase(512, 0, 512, 1024, 400, 0, 0), Phase(512, 0, 500, 1024, 20, 380, 0)]
    step_ = Phase(512, 0, 512, 1024, 0, 0, 10)
    largest = max(moments, key=total)
    kept = peaks(moments)
    assert len(kept) < len(moments) // 4
    world = {Strategy.LOCAL: 1, Strategy.DDP: 2, Strategy.FULL_SHARD: 8}[strategy]
    for k in range(4) if strategy != Strategy.FULL_SHARD else (0, 2):
        s = _setting(strategy, world, k)
        from_all = Simulated(largest, step_, 8, peaks=tuple(moments))
        from_peaks = Simulated(largest, step_, 8, peaks=kept)
        found = from_simulation(_stats(), _sim_profile(), s, from_peaks)
        assert found == from_simulation(_stats(), _sim_profile(), s, from_all), k


class _Wide(nn.Module):
    """Blocks of one wide linear layer: 1 MiB of parameters each against 64 KiB of activations
    for a batch of 32, so that on 8 ranks the end of backward (every gradient shard) is the
    peak, and on 64 its beginning."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
@pytest.mark.parametrize("extended", [False, True], ids=["whole", "extended"])
def test_a_plan_for_64_ranks_simulated_on_8_peaks_at_the_instant_largest_at_64(
    extended: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against every instant of the simulated step: the estimate at 64 ranks, and under CPU
    offload, is the largest instant there. Before, the moment largest at 8 ranks was scaled:
    4.5% under at 64 ranks, 6.5% under offloaded, for 8 blocks simulated whole. Sixteen blocks
    (`layout.MIN_DEPTH_TO_EXTEND`) are simulated at 3, 4 and 5 and extended."""
    depth = 16 if extended else 8
    torch.manual_seed(0)
    model = _Wide(depth=depth)
    optimizer = torch.optim.Adam(model.parameters())
    names = [f"blocks.{i}" for i in range(depth)]
    stats = model_stats(model, [model.get_submodule(n) for n in names], 0, "", 0)
    batch = torch.randn(32, 512)
    # each block an FSDP2 unit; simulated whole (as where blocks run different operators), or
    # extended
    cpu = torch.device("cpu")
    setup = Setup(names, batch, None, optimizer, None, cpu, unlike_blocks=not extended)
    found = []
    original = simulate._extended

    def extended_here(*args: Any, **kwargs: Any) -> Any:
        found.append(original(*args, **kwargs))
        return found[-1]

    with monkeypatch.context() as patch:
        patch.setattr(simulate, "_extended", extended_here)
        runs, note = simulate_all(model, setup, (Strategy.FULL_SHARD,), stats, 64)
    assert bool(found) == extended and None not in found
    sim = combine(runs)[Strategy.FULL_SHARD]
    assert sim.degree == 8, note
    # every instant of the whole model's step: each moment keeps all of its instants
    instants: list[Phase] = []
    run = simulate._run

    def recorded(*args: object, **kwargs: object) -> simulate.Steps:
        moments, step_peak, starts = run(*args, **kwargs)  # type: ignore[arg-type]
        instants.extend(p for phases in moments.values() for p in phases)
        return moments, step_peak, starts

    monkeypatch.setattr(simulate, "_run", recorded)
    monkeypatch.setattr(step, "peaks", tuple)
    monkeypatch.setattr(step, "_UNALIGNED", sys.maxsize)
    simulate_all(model, replace(setup, unlike_blocks=True), (Strategy.FULL_SHARD,), stats, 64)
    assert len(instants) > 100
    ratio = shard_ratio(stats, 8, 64)
    assert ratio == 1 / 8  # every parameter's rows divide by 64
    stepped = sim.scaled(ratio, ratio).step
    expected = max(max(total(p.scaled(ratio)) for p in instants), total(stepped))
    at64 = from_simulation(stats, None, _setting(Strategy.FULL_SHARD, 64), sim)
    assert at64.peak == expected
    # the moment largest at 8 ranks is another: scaled alone, it falls short
    assert total(sim.backward.scaled(ratio)) < expected
    # CPU offload: the largest instant of what stays on the device
    on_device = max(total(p) - sharded_bytes(p) for p in instants)
    s = Setting(Strategy.CPU_OFFLOAD, 0, 64, 4, 4, "cuda", cuda_context_pending=False)
    offload = from_simulation(stats, None, s, sim)
    assert offload.peak - offload.overheads == max(
        on_device, sim.step.buffers + sim.step.activations
    )
    assert total(sim.backward) - sharded_bytes(sim.backward) < on_device
