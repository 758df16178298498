"""What-if plans of a model on the meta device (issue 12): the example batch is moved to meta
too, where a CPU batch used to fail the trace on a device mismatch and leave the activations out."""

from __future__ import annotations

import torch
from torch import nn

import autoshard


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _layers()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.net(input)


def _layers() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)]),
        nn.Linear(256, 1),
    )


def _plan(model: nn.Module, batch: object) -> autoshard.Plan:
    optimizer = torch.optim.AdamW(model.parameters())
    return autoshard.plan(
        model,
        optimizer,
        batch,
        world_size=4,
        device_memory="1GiB",
        mixed_precision="no",
        strategy="full_shard",  # one simulation is enough here
    )


def test_a_meta_model_takes_a_cpu_batch() -> None:
    with torch.device("meta"):
        model = Model()
    cpu = {"input": torch.randn(32, 64)}  # a Mapping: keyword arguments
    plan = _plan(model, cpu)
    assert any(r.startswith("activations traced") for r in plan.reasons), plan.reasons
    assert any(r.startswith("the model is on the meta device") for r in plan.reasons)
    assert cpu["input"].device.type == "cpu"  # the caller's batch is left as it was
    on_meta = _plan(model, {"input": torch.empty(32, 64, device="meta")})
    assert [c.footprint for c in plan.candidates] == [c.footprint for c in on_meta.candidates]


def test_a_real_model_keeps_its_batch_where_it_is() -> None:
    plan = _plan(Model(), torch.randn(32, 64))
    assert not any(r.startswith("the model is on the meta device") for r in plan.reasons)
