"""Mixed precision resolution: every automatic choice with its reason (pure, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard.decide.precision import Precision, parse_precision
from autoshard.measure import facts
from autoshard.measure.facts import resolve_mixed_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "no")])
def test_auto_on_cpu_uses_bf16_only_where_the_cpu_computes_it_natively(
    monkeypatch: pytest.MonkeyPatch, native: bool, expected: str
) -> None:
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: native)
    choice, reason = resolve_mixed_precision(None, CPU, nn.Linear(4, 4))
    assert choice == expected
    assert "(auto)" in reason
    assert ("natively" in reason) if native else ("no native bf16" in reason)


@pytest.mark.parametrize("requested", list(Precision))
def test_a_requested_precision_is_obeyed_and_says_so(requested: Precision) -> None:
    choice, reason = resolve_mixed_precision(requested, CPU, nn.Linear(4, 4))
    assert choice is requested
    assert f"mixed precision {requested.value} requested" in reason
    assert "requested by the caller" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parameters_already_in_low_precision_turn_it_off(dtype: torch.dtype) -> None:
    choice, reason = resolve_mixed_precision(Precision.BF16, CPU, nn.Linear(4, 4).to(dtype))
    assert choice is Precision.NO
    assert "already" in reason and str(dtype) in reason


def test_the_native_bf16_probe_answers_a_bool() -> None:
    assert isinstance(facts._cpu_has_native_bf16(), bool)


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
    memory = facts.with_resident(Memory(1000, 5000, "test"), model, optimizer, CPU)
    assert memory.free_bytes == 1000 + params + momentum
    assert memory.total_bytes == 5000
    assert "already hold" in memory.source
    meta = facts.with_resident(Memory(1000, 5000, "test"), model, optimizer, torch.device("meta"))
    assert meta.free_bytes == 1000  # nothing held on another device
    # the example batch there too, as the estimate counts it: its tensors' bytes, a storage at
    # most once (labels the same tensor as the inputs), a slice of a dataset as its slice (not
    # the dataset's storage), not a tensor the model holds already, inside a BatchEncoding too
    from transformers import BatchEncoding

    ids = torch.zeros(4, 100, dtype=torch.long)
    dataset = torch.ones(100_000, 100)
    batch = {"input_ids": ids, "labels": ids, "mask": dataset[:4], "w": model.weight.detach()}
    for given in (batch, BatchEncoding(batch)):
        held = facts.with_resident(Memory(1000, 5000, "test"), model, optimizer, CPU, given)
        assert held.free_bytes == 1000 + params + momentum + 4 * 100 * 8 + 4 * 100 * 4


@pytest.mark.parametrize(
    ("batch", "loss_fn", "message"),
    [
        ({"x": torch.randn(2, 4)}, None, "unexpected keyword argument"),  # wrong batch convention
        (torch.randn(2, 4), lambda out, b: "loss", "must return a scalar tensor, got str"),
        (torch.randn(2, 4), lambda out, b: out, "got shape (2, 2)"),  # not reduced
    ],
)
def test_a_batch_or_loss_fn_that_does_not_fit_the_model_is_refused_before_any_change(
    batch: object, loss_fn: object, message: str
) -> None:
    import autoshard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="could not be run through the model") as info:
        autoshard.prepare(model, optimizer, batch, loss_fn=loss_fn)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not model._forward_hooks and not model._forward_pre_hooks and not optimizer.state


def test_a_prepared_bf16_model_deep_copies_and_pickles() -> None:
    # Autocast is applied as removable hooks, not a patched `forward`: a copy (EMA, eval) runs
    # its own weights, and the module pickles.
    import copy
    import io

    import autoshard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 4)
    prepared, _, plan = autoshard.prepare(model, optimizer, x, mixed_precision="bf16")
    assert plan.mixed_precision is autoshard.Precision.BF16
    assert prepared(x).dtype == torch.float32  # outputs come back in fp32
    copied = copy.deepcopy(prepared)
    with torch.no_grad():
        for p in copied.parameters():
            p.zero_()
    assert torch.all(copied(x) == 0)
    assert not torch.all(prepared(x) == 0)
    torch.save(prepared, io.BytesIO())


def test_precision_is_its_lower_case_value_and_knows_its_dtype() -> None:
    assert [p.value for p in Precision] == ["bf16", "fp16", "no"]
    assert Precision.BF16 == "bf16" and f"{Precision.FP16}" == "fp16" and str(Precision.NO) == "no"
    assert (Precision.BF16.dtype, Precision.FP16.dtype, Precision.NO.dtype) == (
        torch.bfloat16,
        torch.float16,
        None,
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("auto", None),
        ("bf16", Precision.BF16),
        ("no", Precision.NO),
        (Precision.FP16, Precision.FP16),
    ],
)
def test_mixed_precision_accepts_its_strings_and_the_enum(
    given: str | Precision, expected: Precision | None
) -> None:
    assert parse_precision(given) is expected


@pytest.mark.parametrize("given", ["fp8", "BF16", None, torch.bfloat16])
def test_an_unknown_mixed_precision_names_the_choices(given: object) -> None:
    with pytest.raises(ValueError, match="is not one of 'auto', 'bf16', 'fp16', 'no'$"):
        parse_precision(given)


def test_prepare_takes_a_precision_and_the_plan_carries_it() -> None:
    import autoshard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    _, _, plan = autoshard.prepare(
        model, optimizer, torch.randn(2, 4), mixed_precision=autoshard.Precision.NO
    )
    assert plan.mixed_precision is autoshard.Precision.NO
    assert plan.to_dict()["mixed_precision"] == "no"
    assert "mixed precision no," in str(plan)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature:UserWarning")
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_auto_keeps_a_double_precision_model_in_its_precision(dtype: torch.dtype) -> None:
    """A held-out sweep's float64 model got bf16 under "auto": FSDP2's bf16 parameters computed
    it in bf16 (its loss 0.5% off the float64 run), while autocast left it as it was under DDP
    (a plan that said bf16 for a step that ran float64). An explicit bf16 is still obeyed."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(dtype))
    choice, reason = resolve_mixed_precision(None, CPU, model)
    assert choice is Precision.NO
    assert reason.startswith(f"mixed precision off (auto): parameters are {dtype}"), reason
    assert resolve_mixed_precision(Precision.BF16, CPU, model)[0] is Precision.BF16
