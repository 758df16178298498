"""The depth extension (`measure.simulate`): a model of 16 or more alike blocks is simulated at 3,
4 and 5 blocks and each moment of its step extended to the full depth, instant by instant. The
extended estimate must equal the simulation of the whole model: an extension that falls short is
an out-of-memory error after `prepare`.

One global peak per shallow depth, extended, fell short where the peak's moment moves with depth:
this Llama-shaped decoder under DDP with every block checkpointed peaks in the loss's temporaries
at 4 and 5 blocks and at the end of the forward at 16 (-4.7%); on an H100 the 22-block Llama of
the GPU suite under FULL_SHARD at 8 ranks, checkpointed, read -6.0% against the allocator.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _dist import REPO

import autoshard
import autoshard.measure.simulate as simulate_module
from autoshard.measure.fake import unavailable

sys.path.insert(0, str(REPO / "benchmarks"))
import zoo  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

TOLERANCE = 0.005  # of the whole model's simulated peak
DEPTH = 16  # the least that is extended


def _peak(built: zoo.ZooModel, strategy: str, checkpointed: bool, device: str) -> int:
    plan = autoshard.plan(
        built.model,
        built.optimizer,
        built.batch,
        loss_fn=built.loss_fn,
        world_size=8,
        device=device,
        device_memory="80GiB",
        strategy=strategy,
        mixed_precision="bf16",
        activation_checkpointing=checkpointed,
    )
    return plan.chosen.estimated_peak_bytes


@pytest.fixture(scope="module")
def llama() -> zoo.ZooModel:
    # a head of 8000 logits a token over 128 tokens: large beside a block of width 256
    return zoo.BUILDERS["llama"](
        1,
        device=torch.device("meta"),
        width=256,
        depth=DEPTH,
        heads=4,
        kv_heads=2,
        seq_len=128,
        vocab_size=8000,
    )


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("strategy", ["ddp", "shard_grad_op", "full_shard"])
def test_the_extended_estimate_equals_the_whole_model_s(
    llama: zoo.ZooModel,
    strategy: str,
    checkpointed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    run = simulate_module._run

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args[4])  # type: ignore[arg-type]
        return run(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(simulate_module, "_run", counted)
    # planned for GPUs (the what-if needs none): no gloo buffer on top of the simulated step
    extended = _peak(llama, strategy, checkpointed, "cuda")
    assert DEPTH not in calls, f"simulated whole, not extended: depths {calls}"
    monkeypatch.setattr(simulate_module, "_MIN_DEPTH_TO_EXTEND", DEPTH + 1)
    whole = _peak(llama, strategy, checkpointed, "cuda")
    assert abs(extended - whole) <= TOLERANCE * whole, (extended, whole)


# ---------------------------------------------------------------------------------------------
# Blocks of one shape that do not compute alike


class _Block(torch.nn.Module):
    """One shape for all; a `wide` block keeps an activation 8 times its input's for backward
    (as a global-attention layer keeps more than a sliding-window one). `layer_idx` counts the
    blocks, as transformers' layers do."""

    def __init__(self, layer_idx: int, wide: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.wide = wide
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.wide:
            y = (y.repeat(1, 8) * 2).view(x.shape[0], 8, 64).mean(1)
        return x + torch.relu(y)


class _Stack(torch.nn.Module):
    def __init__(self, wide: list[bool]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(i, w) for i, w in enumerate(wide))
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def _stack_peak(wide: list[bool]) -> tuple[int, tuple[int, int, int] | None]:
    torch.manual_seed(0)
    model = _Stack(wide)
    names = [f"blocks.{i}" for i in range(len(wide))]
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        torch.randn(512, 64),
        world_size=2,
        device_memory="80GiB",
        strategy="ddp",
        mixed_precision="no",
        activation_checkpointing=False,
    )
    return plan.chosen.estimated_peak_bytes, simulate_module.shallow_depths(model, names)


def test_blocks_of_one_shape_computing_otherwise_are_simulated_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first 5 blocks narrow, the rest wide: a copy of 3, 4 or 5 blocks never runs a wide
    one, and the extension fell short by all the wide blocks keep."""
    wide = [i >= 5 for i in range(DEPTH)]
    whole, depths = _stack_peak(wide)
    assert depths is None
    monkeypatch.setattr(simulate_module, "differing", lambda blocks: None)  # shapes alone
    extended, depths = _stack_peak(wide)
    assert depths == (3, 4, 5)
    assert extended < whole  # what the check prevents: an estimate short of the model's


def test_a_layer_index_is_no_difference() -> None:
    _, depths = _stack_peak([False] * DEPTH)
    assert depths == (3, 4, 5)


def test_transformers_sliding_and_global_layers_are_told_apart() -> None:
    transformers = pytest.importorskip("transformers")
    names = [f"model.layers.{i}" for i in range(DEPTH)]
    options = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": DEPTH,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    full = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**options))
    assert simulate_module.shallow_depths(full, names) == (3, 4, 5)
    alternating = transformers.Qwen2Config(
        **options,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (DEPTH // 2),
    )
    model = transformers.Qwen2ForCausalLM(alternating)
    assert simulate_module.shallow_depths(model, names) is None


class _Act(torch.nn.Module):
    def __init__(self, act: torch.nn.Module, fn: object = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.act = act
        self.fn = fn


def test_what_tells_blocks_apart() -> None:
    from functools import partial

    from autoshard.measure.alike import differing

    same = [_Act(torch.nn.GELU()) for _ in range(4)]
    assert differing(same) is None
    # an activation module of another class: no parameters, no shape tells it
    assert differing([*same[:3], _Act(torch.nn.ReLU())]) == "act.__class__"
    # a partial with other arguments
    slopes = [
        _Act(torch.nn.GELU(), partial(torch.nn.functional.leaky_relu, negative_slope=s))
        for s in (0.1, 0.1, 0.2)
    ]
    assert differing(slopes) == ".fn"
