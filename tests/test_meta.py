"""What-if plans of a model on the meta device (issue 12): the example batch is moved to meta
too, where a CPU batch used to fail the trace on a device mismatch and leave the activations out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
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


class Attention(nn.Module):
    """A pre-norm attention block through `scaled_dot_product_attention`, whose kernel differs by
    device: on meta only the math path exists (it saves the B x H x S x S weights), on the CPU
    and CUDA a fused kernel saves one statistic per row."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, 3, self.heads, w // self.heads)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(attended.transpose(1, 2).reshape(b, s, w))


class Decoder(nn.Module):
    def __init__(self, scale_outside_buffers: bool = False, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Attention() for _ in range(depth))
        self.head = nn.Linear(32, 64)
        # a tensor kept as a plain attribute: built on meta, it stays there
        self.scale = torch.ones(32) if scale_outside_buffers else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.scale is not None:
            x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x).logsumexp(-1).mean()


def _decoder_plan(
    device: str, scale_outside_buffers: bool = False, depth: int = 4
) -> autoshard.Plan:
    with torch.device(device):
        model = Decoder(scale_outside_buffers, depth)
    tokens = torch.zeros(2, 128, dtype=torch.long)
    return autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        tokens,
        world_size=2,
        device_memory="1GiB",
        device="cpu",
        mixed_precision="no",
        strategy="ddp",
        activation_checkpointing=2,  # its estimate credits each block what its trace saved
    )


def _traced(plan: autoshard.Plan) -> list[str]:
    return [r for r in plan.reasons if r.startswith("activations traced")]


@pytest.mark.parametrize("depth", [4, 16])  # 16: traced on a shallow copy, operators checked
def test_a_meta_model_is_traced_as_it_is_simulated_not_on_meta_s_math_attention(
    depth: int,
) -> None:
    # Traced on meta, attention ran its math path and saved its 2 x 4 x 128 x 128 fp32 weights
    # (512 KiB a block) where the CPU's fused kernel keeps 4 KiB: at 4 blocks 2.85 MiB against
    # 889 KiB, and 2 of 4 blocks checkpointed were credited with freeing those weights, which
    # the simulated step never held: 303,112 B of activations estimated against 572,424 B.
    built = _decoder_plan("cpu", depth=depth)
    what_if = _decoder_plan("meta", depth=depth)
    assert _traced(what_if) == _traced(built)
    assert [c.footprint for c in what_if.candidates] == [c.footprint for c in built.candidates]


def test_a_meta_model_that_cannot_be_traced_off_meta_is_traced_on_meta_and_says_so() -> None:
    plan = _decoder_plan("meta", scale_outside_buffers=True)
    (traced,) = _traced(plan)
    assert "traced on the meta device, as the model was built" in traced
    assert "could not be traced on cpu tensors" in traced


class InputGradient(nn.Module):
    """Operators on the batch itself before any parameter: autograd saves their inputs only
    where the batch requires a gradient (input-gradient training, adversarial examples)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.exp().sin()).sum()


def _built_on_cpu_and_meta(
    build: Callable[[], nn.Module], batch: Callable[[str], torch.Tensor], **options: Any
) -> list[tuple[list[str], list[Any]]]:
    """The trace's reason and the candidates' footprints of a plan of the model and batch built
    on the CPU, then on meta."""
    planned = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = build()
        plan = autoshard.plan(
            model,
            torch.optim.AdamW(model.parameters()),
            batch(device),
            world_size=2,
            device_memory="1GiB",
            device="cpu",
            mixed_precision="no",
            **options,
        )
        planned.append((_traced(plan), [c.footprint for c in plan.candidates]))
    return planned


def test_a_meta_batch_that_requires_a_gradient_keeps_it_where_it_is_traced_and_simulated() -> None:
    built, what_if = _built_on_cpu_and_meta(
        InputGradient,
        lambda device: torch.empty(64, 32, device=device).requires_grad_(),
        strategy="ddp",
    )
    assert what_if == built
    # exp's output (exp saves it, sin its input) and sin's (the linear's input): 2 x 8 KiB; the
    # batch is no new memory. Without its gradient only sin's output is saved: 8 KiB.
    assert "16.00 KiB saved for backward" in built[0][0]


class ChannelsLast(nn.Module):
    """Convolutions in channels_last, as vision models train under mixed precision: the batch's
    strides decide the layout of every activation after it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(3)
        )
        self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.mean()


def test_a_meta_batch_keeps_its_strides_where_it_is_simulated() -> None:
    # Made contiguous, the meta-built model's simulation read other activations and
    # temporaries than the CPU-built one's under every strategy.
    built, what_if = _built_on_cpu_and_meta(
        ChannelsLast,
        lambda device: torch.empty(2, 8, 16, 16, device=device).to(
            memory_format=torch.channels_last
        ),
    )
    assert what_if == built
