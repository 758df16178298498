"""Mixed precision resolution: every automatic choice with its reason (pure, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard import _inputs
from autoshard._inputs import resolve_mixed_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "no")])
def test_auto_on_cpu_uses_bf16_only_where_the_cpu_computes_it_natively(
    monkeypatch: pytest.MonkeyPatch, native: bool, expected: str
) -> None:
    monkeypatch.setattr(_inputs, "_cpu_has_native_bf16", lambda: native)
    choice, reason = resolve_mixed_precision("auto", CPU, nn.Linear(4, 4))
    assert choice == expected
    assert "(auto)" in reason
    assert ("natively" in reason) if native else ("no native bf16" in reason)


@pytest.mark.parametrize("requested", ["bf16", "fp16", "no"])
def test_a_requested_precision_is_obeyed_and_says_so(requested: str) -> None:
    choice, reason = resolve_mixed_precision(requested, CPU, nn.Linear(4, 4))
    assert choice == requested
    assert "requested by the caller" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parameters_already_in_low_precision_turn_it_off(dtype: torch.dtype) -> None:
    choice, reason = resolve_mixed_precision("bf16", CPU, nn.Linear(4, 4).to(dtype))
    assert choice == "no"
    assert "already" in reason and str(dtype) in reason


def test_the_native_bf16_probe_answers_a_bool() -> None:
    assert isinstance(_inputs._cpu_has_native_bf16(), bool)


def test_memory_the_model_already_holds_counts_as_usable() -> None:
    # The estimate counts the parameters and optimizer state; free memory measured with them
    # already allocated must not count them a second time.
    from autoshard._world import Memory

    model = nn.Linear(100, 100)  # 100*100 + 100 fp32 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 100)).sum().backward()
    optimizer.step()  # one momentum buffer per parameter
    params = (100 * 100 + 100) * 4
    momentum = params
    memory = _inputs.with_resident(Memory(1000, 5000, "test"), model, optimizer, CPU)
    assert memory.free_bytes == 1000 + params + momentum
    assert memory.total_bytes == 5000
    assert "already hold" in memory.source
    meta = _inputs.with_resident(Memory(1000, 5000, "test"), model, optimizer, torch.device("meta"))
    assert meta.free_bytes == 1000  # nothing held on another device
