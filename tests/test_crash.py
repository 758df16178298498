"""No plan that crashes (issue 12): a candidate whose own step fails in the planning simulation
is not offered, while a failure of the memory tracker alone (the plain model's fake step fails
too) still leaves the candidate to the formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard import Strategy
from autoshard._torch_compat import fsdp_reduces_mixed_dtypes


class Block(nn.Module):
    """A residual MLP block; `refuse_fsdp` makes it fail once FSDP2 has wrapped it, and
    `changes_on_recompute` makes its recomputation save other tensors than its forward did."""

    def __init__(self, refuse_fsdp: bool = False, changes_on_recompute: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.refuse_fsdp = refuse_fsdp
        self.changes_on_recompute = changes_on_recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.fsdp import FSDPModule

        if self.refuse_fsdp and isinstance(self, FSDPModule):
            raise RuntimeError("this block cannot run sharded")
        recomputing = torch._C._current_graph_task_id() != -1  # called from within backward
        if self.changes_on_recompute and not recomputing:
            x = x * x.sigmoid()  # saves more tensors in the forward than in the recompute
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, **kwargs: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(**kwargs) for _ in range(4)])
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _plan(model: nn.Module, mixed_precision: str = "no", **kwargs: object) -> autoshard.Plan:
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(512, 64)
    return autoshard.plan(
        model,
        optimizer,
        batch,
        world_size=2,
        device_memory="1GiB",
        mixed_precision=mixed_precision,
        **kwargs,
    )


def test_a_strategy_whose_step_fails_is_not_offered() -> None:
    model = Net(refuse_fsdp=True)
    roomy = _plan(model)
    ddp_peak = next(c for c in roomy.candidates if c.strategy == Strategy.DDP).estimated_peak_bytes
    # Tight enough that DDP needs checkpointing; before issue 12, FSDP (failing its simulation)
    # was offered by formula and chosen.
    plan = _plan(model, memory_limit=ddp_peak - 1)
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}
    assert plan.strategy == Strategy.DDP and plan.activation_checkpointing > 0
    note = next(r for r in plan.reasons if r.startswith("not offered"))
    assert "SHARD_GRAD_OP (RuntimeError: this block cannot run sharded)" in note, note
    with pytest.raises(RuntimeError, match="strategy FULL_SHARD was forced, but its step with 0"):
        _plan(model, strategy="full_shard")


def test_checkpointing_whose_recompute_fails_is_not_offered() -> None:
    model = Net(changes_on_recompute=True)
    roomy = _plan(model, strategy="ddp")
    # Only checkpointing could fit this limit; before issue 12 it was offered (its simulation
    # failed and formulas stood in) and the real step raised a CheckpointError.
    plan = _plan(model, strategy="ddp", memory_limit=int(0.8 * roomy.estimated_peak_bytes))
    assert all(c.activation_checkpointing == 0 for c in plan.candidates), plan.candidates
    note = next(r for r in plan.reasons if r.startswith("not offered"))
    assert "DDP with blocks checkpointed (CheckpointError" in note, note
    assert any(r.startswith("warning: DDP is estimated at") for r in plan.reasons), plan.reasons
    with pytest.raises(autoshard.DoesNotFit):  # auto: nothing that runs fits
        _plan(model, memory_limit=int(0.8 * roomy.estimated_peak_bytes))


class KeepsKeys(nn.Module):
    """A model with a Hugging Face-style cache (`config.use_cache`, a `use_cache` argument): each
    block appends its keys to one list and reads them all back, as a decoder's key-value cache
    does, so a checkpointed block's recomputation appends again and saves other tensors (CTRL and
    RecurrentGemma under torch's checkpointing); `use_cache=False` leaves the list out."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"use_cache": True})()
        self.blocks = nn.ModuleList([CachingBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        cache: list[torch.Tensor] | None = [] if use_cache is not False else None
        for block in self.blocks:
            x = block(x, cache)
        return x.square().mean()


class CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None) -> torch.Tensor:
        keys = self.fc(x)
        if cache is None:
            return x + torch.relu(keys)
        cache.append(keys)  # every key so far, each block's and a recomputation's
        return x + torch.relu(torch.cat(cache)).view(-1, *x.shape).mean(0)


def test_a_cache_updated_again_in_recompute_says_use_cache_false_runs() -> None:
    model = KeepsKeys()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"x": torch.randn(8, 64)}
    options: dict[str, object] = dict(world_size=1, device_memory="1GiB", mixed_precision="no")
    with pytest.raises(RuntimeError, match="LOCAL with blocks checkpointed") as info:
        autoshard.plan(model, optimizer, batch, activation_checkpointing=True, **options)
    said = str(info.value)
    assert "the model keeps a cache (config.use_cache=True)" in said, said
    assert "with use_cache=False in the batch (or model.config.use_cache = False) the step" in said
    plan = autoshard.plan(
        model, optimizer, {**batch, "use_cache": False}, activation_checkpointing=True, **options
    )
    assert plan.activation_checkpointing == 2
    # a crash of another cause says nothing of a cache it does not keep
    with pytest.raises(RuntimeError, match="DDP with blocks checkpointed") as info:
        _plan(Net(changes_on_recompute=True), activation_checkpointing=True)
    assert "use_cache" not in str(info.value), info.value


def test_a_tracker_failure_alone_still_offers_the_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the plain model's fake step fails as well, the failure is not the candidate's: it
    is left to the formulas, as before."""
    import autoshard.measure.simulate

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the tracker cannot follow this")

    monkeypatch.setattr(autoshard.measure.simulate, "simulate", broken)
    monkeypatch.setattr("autoshard.measure.crash.fake_step", lambda *a, **k: "RuntimeError: fake")
    plan = _plan(Net(refuse_fsdp=False))
    assert {c.strategy for c in plan.candidates} >= {Strategy.DDP, Strategy.FULL_SHARD}
    assert not any(r.startswith("not offered") for r in plan.reasons), plan.reasons
    assert any("not simulated: DDP (RuntimeError: the tracker" in r for r in plan.reasons)


class UpcastsForItsHead(Net):
    """Its head takes the blocks' output in fp32 (`x.float()`): under autocast the linear casts
    both to bf16, but FSDP2's bf16 parameters leave an fp32 input against a bf16 weight, which the
    real matmul refuses and its fake kernel took."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.linear(x.float(), self.head.weight, self.head.bias).square().mean()


def test_a_strategy_whose_parameters_dtype_meets_another_in_a_matmul_is_not_offered() -> None:
    """Before, FSDP2 was simulated and offered (and chosen where DDP did not fit): its trial
    step raised the real kernel's error."""
    model = UpcastsForItsHead()
    plan = _plan(model, mixed_precision="bf16")
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}
    note = next(r for r in plan.reasons if r.startswith("not offered"))
    assert "FULL_SHARD (MixedDtypes: addmm(): mat1 (float32) and mat2 (bfloat16)" in note, note
    forced = "strategy FULL_SHARD was forced.*activation_checkpointing, mixed_precision='no', or"
    with pytest.raises(RuntimeError, match=forced):
        _plan(model, mixed_precision="bf16", strategy="full_shard")


class RoutedBlock(Block):
    """A block with a router kept in fp32 as Switch Transformers keeps it: `converts` converts
    the router module in the forward (`Module.to`); otherwise the router's weight is cast in the
    forward's arithmetic, or (`moves`) the router is only moved to the input's device."""

    def __init__(self, converts: bool = True, moves: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(64, 4, bias=False)
        self.converts = converts
        self.moves = moves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.moves:
            self.router.to(x.device)
        if self.converts:
            self.router.to(torch.float32)
            weight = self.router.weight
        else:
            weight = self.router.weight.float()
        gate = nn.functional.linear(x.float(), weight).softmax(-1)[..., :1]
        return x + torch.relu(self.fc(x)) * gate.to(x.dtype)


class Routed(Net):
    def __init__(self, **kwargs: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RoutedBlock(**kwargs) for _ in range(4)])


def test_a_forward_that_converts_a_module_is_not_sharded_under_mixed_precision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Switch Transformers and NLLB-MoE convert their routers to fp32 in the forward, which no
    fake step can follow: their FSDP2 candidates were offered by formula under bf16 and the
    trial step raised FSDP2's "reduce-scatter expects uniform gradient dtype" (torch 2.13).
    FSDP2 of torch 2.15 reduces such gradients: there they are offered, and train
    (test_real_fsdp2_and_a_module_the_forward_converts)."""
    model = Routed()
    plan = _plan(model, mixed_precision="bf16")
    if fsdp_reduces_mixed_dtypes():
        assert Strategy.FULL_SHARD in {c.strategy for c in plan.candidates}
        assert not any(r.startswith("not offered") for r in plan.reasons), plan.reasons
        return
    assert {c.strategy for c in plan.candidates} == {Strategy.DDP}
    note = next(r for r in plan.reasons if r.startswith("not offered"))
    assert "FULL_SHARD (ConvertedInForward: the forward converts a module's parameters to " in note
    assert "torch.float32 (Module.to or .float() in forward), which FSDP2's torch.bfloat16" in note
    forced = "strategy FULL_SHARD was forced.*ConvertedInForward.*mixed_precision='no', or"
    with pytest.raises(RuntimeError, match=forced):
        _plan(model, mixed_precision="bf16", strategy="full_shard")
    # where DDP does not fit, the refusal says what would shard it; FSDP2's own failure in the
    # simulation (it prints a stack trace before raising) does not reach the console
    capsys.readouterr()
    needed = plan.chosen.estimated_peak_bytes
    with pytest.raises(autoshard.DoesNotFit, match="would run with mixed_precision='no'"):
        _plan(model, mixed_precision="bf16", memory_limit=needed // 2)
    printed = capsys.readouterr()
    assert "uniform gradient dtype" not in printed.out + printed.err, printed
    # without mixed precision FSDP2 trains it (the conversion changes nothing): still offered
    plain = _plan(model)
    assert {Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP} <= {c.strategy for c in plain.candidates}
    assert not any(r.startswith("not offered") for r in plain.reasons), plain.reasons


@pytest.mark.parametrize("kwargs", [{"converts": False}, {"converts": False, "moves": True}])
def test_a_cast_in_the_arithmetic_or_a_move_is_no_conversion(kwargs: dict[str, bool]) -> None:
    """A weight cast with autograd (FSDP2's gradient comes back in its own dtype) and a module
    moved to the device it is on convert nothing: FSDP2 stays offered under bf16."""
    plan = _plan(Routed(**kwargs), mixed_precision="bf16")
    assert Strategy.FULL_SHARD in {c.strategy for c in plan.candidates}
    assert not any("ConvertedInForward" in r for r in plan.reasons), plan.reasons


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_real_fsdp2_and_a_module_the_forward_converts(
    one_rank_group: None, mixed_precision: bool
) -> None:
    """What the rule above stands on: real FSDP2 trains the converting model without mixed
    precision, and with bf16 parameters only where it reduces gradients of two dtypes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Routed()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed_precision else None
    for block in model.blocks:
        fully_shard(block, **({"mp_policy": policy} if policy else {}))
    fully_shard(model, **({"mp_policy": policy} if policy else {}))
    loss = model(torch.randn(8, 64))
    if not mixed_precision or fsdp_reduces_mixed_dtypes():
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        return
    with pytest.raises(AssertionError, match="uniform gradient dtype"):
        loss.backward()


class SpectralMixing(Net):
    """FNet-style mixing through torch.fft, which computes no bf16 on CPU: under autocast it
    runs in fp32, under FSDP2's bf16 parameters its input is bf16 and it raises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + torch.fft.rfft(x, dim=-1).real.repeat(1, 2)[:, :64]
        return self.head(x).square().mean()


def test_a_kernel_that_refuses_the_low_precision_dtype_names_mixed_precision_off() -> None:
    """A held-out sweep (FNet, an FFT-based S4): FSDP2 under bf16 rightly not offered, but the
    advice left out the one setting that would shard the model."""
    model = SpectralMixing()
    plan = _plan(model, mixed_precision="bf16")
    note = next(r for r in plan.reasons if r.startswith("not offered"))
    assert "Unsupported dtype BFloat16" in note and "with mixed_precision='no'" in note, note
    forced = "strategy FULL_SHARD was forced.*activation_checkpointing, mixed_precision='no', or"
    with pytest.raises(RuntimeError, match=forced):
        _plan(model, mixed_precision="bf16", strategy="full_shard")
    assert Strategy.FULL_SHARD in {c.strategy for c in _plan(model).candidates}


class WideUpcasts(nn.Module):
    """UpcastsForItsHead's fp32 head behind wide blocks and a small batch: parameters and
    optimizer state, which FSDP2 shards, dominate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.head = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return nn.functional.linear(x.float(), self.head.weight, self.head.bias).square().mean()


def test_auto_turns_mixed_precision_off_where_only_a_candidate_it_fails_would_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A held-out sweep's diffusion UNet (a timestep embedding made in fp32 in the forward):
    under "auto" bf16 its FSDP2 candidates fail, DDP needed more than the limit, and the plan
    was refused, though FULL_SHARD without mixed precision fit. Now decided again in fp32."""
    from autoshard.measure import facts

    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)  # auto: bf16, on any CPU
    model = WideUpcasts()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(8, 256)

    def plan(mixed_precision: str, **kwargs: object) -> autoshard.Plan:
        return autoshard.plan(
            model, optimizer, batch, world_size=4, mixed_precision=mixed_precision, **kwargs
        )

    full_shard = next(c for c in plan("no").candidates if c.strategy == Strategy.FULL_SHARD)
    ddp = next(c for c in plan("bf16").candidates if c.strategy == Strategy.DDP)
    limit = full_shard.estimated_peak_bytes + full_shard.reserve_bytes + 4096
    assert limit < ddp.estimated_peak_bytes  # only FULL_SHARD, in fp32, fits
    chosen = plan("auto", memory_limit=limit)
    assert chosen.strategy == Strategy.FULL_SHARD and chosen.mixed_precision == "no", chosen
    why = next(r for r in chosen.reasons if r.startswith("mixed precision off (auto chose bf16)"))
    assert "FULL_SHARD, SHARD_GRAD_OP failed" in why and "FULL_SHARD fits" in why, why
    with pytest.raises(autoshard.DoesNotFit, match="would run with mixed_precision='no'"):
        plan("bf16", memory_limit=limit)  # asked for: obeyed, and refused
