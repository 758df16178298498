"""The operator check (`measure.operators`, issue 24) runs each block on meta tensors inside a
forward on fake tensors: its only cost that grows with depth, about half of what it was. Every
verdict must be the one the check gives with every block on fake tensors, which is how it ran
before; a block that cannot run on meta gets the check on fake tensors, whole."""

from __future__ import annotations

import contextlib
import inspect
import sys

import pytest
import torch
from _dist import REPO
from test_depth_extension import (
    DEPTH,
    _ByPositionStack,
    _EverySixthDoubled,
    _FirstHalfCheckpointed,
    _MidHead,
    _Stack,
)

import autoshard.measure.layout as layout_module
from autoshard._torch_compat import grouped_mm
from autoshard.decide.blocks import find_blocks
from autoshard.measure import operators


class _NoGradByPosition(_Stack):
    """Alike blocks, of which the parent runs every fourth without gradients: the same operators,
    nothing saved for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            with torch.set_grad_enabled(i % 4 != 3):
                x = block(x)
        return self.head(x).sum()


class _Fp32ByPosition(_Stack):
    """Alike blocks, of which the parent runs every fourth outside autocast, in fp32. Autocast
    does not apply to meta tensors: only its casts, made there by `operators._Autocast`, tell."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            off = torch.autocast("cpu", enabled=False) if i % 4 == 3 else contextlib.nullcontext()
            with off:
                x = block(x)
        return self.head(x).sum()


class _UpcastByPosition(torch.nn.Module):
    """Every eighth block keeps its activation in fp32 (`y.float()`): under autocast that is a
    cast, and what relu saves is twice the others'; on meta, without autocast's casts, nothing."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.layer_idx % 8 == 7:
            y = y.float()
        return x + torch.relu(y)


class _AsksForMask(torch.nn.Module):
    """Takes a mask, which every eighth block applies: a parent that passes it only to blocks
    whose forward names it (as transformers' and diffusers' code read a signature) passes it
    to none where the forward's signature is lost."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.linear(x)
        if mask is not None and self.layer_idx % 8 == 7:
            y = y * mask
        return x + torch.relu(y)


class _Mlp(torch.nn.Module):
    """Its output is its linear layer's: bf16 under autocast."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(x))


class _ByPositionStackOf(_Stack):
    def __init__(self, block: type) -> None:
        super().__init__([False] * DEPTH)
        self.blocks = torch.nn.ModuleList(block(i) for i in range(DEPTH))


class _MaskBySignature(_ByPositionStackOf):
    def __init__(self) -> None:
        super().__init__(_AsksForMask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(x)
        for block in self.blocks:
            takes = "mask" in inspect.signature(block.forward).parameters
            x = block(x, mask=mask) if takes else block(x)
        return self.head(x).sum()


class _ParentUpcast(_ByPositionStackOf):
    """The parent makes the hidden state fp32 after every fourth block."""

    def __init__(self) -> None:
        super().__init__(_Mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i % 4 == 3:
                x = x.float()
        return self.head(x).sum()


class _Collecting(torch.nn.Module):
    """Every eighth block appends its output to a list the parent gave it, and the parent runs
    a head on what was collected: on meta the block appends to a copy."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, collected: list[torch.Tensor]) -> torch.Tensor:
        y = x + torch.relu(self.linear(x))
        if self.layer_idx % 8 == 7:
            collected.append(y)
        return y


class _CollectingStack(_ByPositionStackOf):
    def __init__(self) -> None:
        super().__init__(_Collecting)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        collected: list[torch.Tensor] = []
        for block in self.blocks:
            x = block(x, collected)
            if collected:
                x = x + self.head(collected.pop())
        return self.head(x).sum()


class _Noisy(torch.nn.Module):
    """Adds noise made without a device (on the CPU, or where a device context says)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x)) + torch.randn(x.shape) * 0.01


class _HoldingATensor(torch.nn.Module):
    """A block that keeps a tensor outside its parameters and buffers (cannot meet a meta
    tensor) and, where `by_position`, computes by its position as `_ByPosition` does."""

    def __init__(self, layer_idx: int, by_position: bool) -> None:
        super().__init__()
        self.layer_idx, self.by_position = layer_idx, by_position
        self.linear = torch.nn.Linear(64, 64)
        self.scale = torch.ones(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale
        if self.by_position and self.layer_idx % 8 == 7:
            y = (y.repeat(1, 8) * 2).view(x.shape[0], 8, 64).mean(1)
        return x + torch.relu(y)


def _holding(by_position: bool) -> _Stack:
    model = _Stack([False] * DEPTH)
    model.blocks = torch.nn.ModuleList(_HoldingATensor(i, by_position) for i in range(DEPTH))
    return model


def _verdict(
    model: torch.nn.Module,
    batch: object,
    dtype: torch.dtype | None,
    meta: bool | None,
    device: torch.device | None = None,
) -> str | None:
    """`operators.first_unlike` on the model's blocks: with every block on meta tensors (raises
    where one cannot run there), on fake tensors, or (None) as the check chooses. Which blocks
    differ, and how (what they run differs or what follows them); the first operator that
    differs, named after it, is not always the same on meta (autocast's casts made where a torch
    function is called, attention without a fused kernel). `device`: where a model built on meta
    is checked, as a plan does."""
    found = find_blocks(model)
    names, blocks = [n for n, _ in found], [b for _, b in found]
    layout = layout_module.repeats(model, names)
    assert layout is not None  # alike by all they hold
    with pytest.MonkeyPatch.context() as patch:
        if meta is not None:
            patch.setattr(
                operators, "operators_by_block", lambda *a: operators._recorded(*a, meta=meta)
            )
        verdict = operators.first_unlike(model, blocks, names, layout, batch, dtype, device)
    return None if verdict is None else verdict.split(" (")[0]


@pytest.mark.parametrize(
    ("build", "dtype", "expected"),
    [
        (lambda: _Stack([False] * DEPTH), None, None),
        (lambda: _Stack([False] * DEPTH), torch.bfloat16, None),
        (lambda: _ByPositionStack(DEPTH), None, "blocks blocks.6 and blocks.7 hold the same"),
        (lambda: _EverySixthDoubled([False] * DEPTH), None, "after blocks blocks.3 and blocks.4"),
        (lambda: _FirstHalfCheckpointed([False] * DEPTH), None, "after blocks blocks.6 and"),
        (lambda: _MidHead(DEPTH), None, "after blocks blocks.6 and blocks.7"),
        (lambda: _NoGradByPosition([False] * DEPTH), None, "blocks blocks.2 and blocks.3"),
        (lambda: _Fp32ByPosition([False] * DEPTH), torch.bfloat16, "blocks blocks.2 and"),
        (lambda: _ByPositionStackOf(_UpcastByPosition), torch.bfloat16, "blocks.6 and blocks.7"),
        (_ParentUpcast, torch.bfloat16, "after blocks blocks.2 and"),
        (_MaskBySignature, None, "blocks blocks.6 and blocks.7"),
    ],
    ids=[
        "alike",
        "alike-bf16",
        "own",
        "parent",
        "checkpointed",
        "mid_head",
        "no_grad",
        "fp32_under_autocast",
        "upcast_under_autocast",
        "parent_upcast_under_autocast",
        "signature_read",
    ],
)
def test_blocks_on_meta_get_the_verdict_of_fake_tensors(
    build: object, dtype: torch.dtype | None, expected: str | None
) -> None:
    torch.manual_seed(0)
    model = build()  # type: ignore[operator]
    batch = torch.randn(8, 64)
    on_meta = _verdict(model, batch, dtype, meta=True)
    assert on_meta == _verdict(model, batch, dtype, meta=False)
    if expected is None:
        assert on_meta is None
    else:
        assert on_meta is not None and expected in on_meta, on_meta


@pytest.mark.parametrize(
    ("build", "raised"),
    [
        (lambda: _holding(False), "meta"),
        (lambda: _holding(True), "meta"),
        (_CollectingStack, "changed the containers it was given"),
    ],
    ids=["held_tensor", "held_tensor_by_position", "collecting_by_position"],
)
def test_a_block_that_cannot_run_on_meta_is_checked_on_fake_tensors(
    build: object, raised: str
) -> None:
    model, batch = build(), torch.randn(8, 64)  # type: ignore[operator]
    by_position = not isinstance(model.blocks[0], _HoldingATensor) or model.blocks[0].by_position
    with pytest.raises(RuntimeError, match=raised):
        _verdict(model, batch, None, meta=True)
    verdict = _verdict(model, batch, None, meta=None)
    assert verdict == _verdict(model, batch, None, meta=False)
    if by_position:
        assert verdict is not None and "blocks.6 and blocks.7" in verdict, verdict
    else:
        assert verdict is None


def test_blocks_on_meta_make_no_real_tensor() -> None:
    """A tensor a block makes without a device is made on meta: no memory, and the user's
    random generator does not move (on fake tensors neither happens)."""
    torch.manual_seed(0)
    model, batch = _ByPositionStackOf(_Noisy), torch.randn(8, 64)
    state = torch.get_rng_state()
    assert _verdict(model, batch, None, meta=True) is None
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    "family",
    [
        "llama",  # a mask made by the model from values: on fake tensors, outside the blocks
        "gemma2",  # sliding and global attention alternating
        "t5",  # an encoder and a decoder, relative position bias
        "qwen3_moe",  # experts through torch._grouped_mm, whose meta kernel takes bf16 only
    ],
)
def test_transformers_layers_run_on_meta(family: str) -> None:
    """The families users bring run their blocks on meta (the check gains for them too), under
    bf16 autocast as a mixed-precision plan checks them, with the verdict of fake tensors."""
    pytest.importorskip("transformers")
    if family == "qwen3_moe" and grouped_mm() is None:
        pytest.skip("this torch has no _grouped_mm")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import deep_families

    built, cpu = deep_families.build(family), torch.device("cpu")  # built on meta
    on_meta = _verdict(built.model, built.batch, torch.bfloat16, meta=True, device=cpu)
    assert on_meta == _verdict(built.model, built.batch, torch.bfloat16, meta=False, device=cpu)
    assert on_meta is None, on_meta  # their blocks compute alike


def test_the_benchmark_compares_both_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """`benchmarks/operator_check.py` on two families: both verdicts, the blocks run on meta."""
    pytest.importorskip("transformers")  # deep_families builds transformers models too
    sys.path.insert(0, str(REPO / "benchmarks"))
    import operator_check

    assert operator_check.main(["--families", "zoo_mlp,mixed_blocks"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("| zoo_mlp |", "| mixed_blocks |"))]
    assert len(rows) == 2, out
    assert all(row.split(" | ")[2:5] == ["None", "None", "yes"] for row in rows), rows
