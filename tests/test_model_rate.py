"""The model's own FLOP/s (`measure.rates`, issue 26): the trace records each FLOP-bound call of
the forward (`measure.priced`), which is run again on the device at its own shapes, forward and
backward, and timed; the cost model prices the model's FLOPs at that rate. Timings are never
asserted here: where a figure is checked, the timer is given (tests/test_gpu.py measures them on a
GPU)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from _dist import REPO
from test_plan import AMPLE, make_inputs

import autoshard
import autoshard.pipeline as pipeline
from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.blocks import find_blocks
from autoshard.decide.cost import compute_seconds
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.decide.profile import ActivationProfile, PricedCall
from autoshard.measure import cache, facts
from autoshard.measure import rates as rates_module
from autoshard.measure.device import with_device
from autoshard.measure.fake import unavailable
from autoshard.measure.priced import PricedCalls, arguments_json, read
from autoshard.measure.rates import model_rate, with_model_rate
from autoshard.measure.trace import profile_step

sys.path.insert(0, str(REPO / "benchmarks"))
import zoo  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

GPU = hardware_for("cuda", (9, 0), True)
CPU = torch.device("cpu")


def _llama(depth: int = 4, rows: int = 2) -> zoo.ZooModel:
    return zoo.BUILDERS["llama"](
        rows, width=64, depth=depth, heads=4, kv_heads=2, seq_len=32, vocab_size=256
    )


def _blocks(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Module]]:
    found = find_blocks(model)
    return [n for n, _ in found], [m for _, m in found]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_trace_records_each_flop_bound_call_of_the_forward(dtype: torch.dtype | None) -> None:
    """Every forward FLOP is in one recorded call; each block runs its projections, attention
    and MLP alike, the head runs outside the blocks; each tensor is written with its shape,
    strides, dtype (autocast's) and whether it requires a gradient."""
    built = _llama()
    names, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, dtype)
    calls = profile.priced_calls
    assert sum(c.total_flops for c in calls) == profile.total_forward_flops > 0
    assert [c.total_flops for c in calls] == sorted((c.total_flops for c in calls), reverse=True)
    in_blocks = [c for c in calls if c.other_calls == 0]
    assert in_blocks and all(len(set(c.block_calls)) == 1 for c in in_blocks)  # alike blocks
    head = [c for c in calls if c.other_calls]
    assert len(head) == 1 and sum(head[0].block_calls) == 0  # the vocabulary's projection
    arguments = json.loads(head[0].arguments)["args"]
    x, weight = (a["tensor"] for a in arguments)
    tokens = built.batch[0].numel()
    assert x[0] == [tokens, 64] and weight[0] == [64, 256] and weight[1] == [1, 64]  # W.t()
    assert x[2] == weight[2] == ("float32" if dtype is None else "bfloat16")
    assert x[3] and weight[3]  # both need a gradient
    assert head[0].flops == 2 * tokens * 64 * 256
    attention = [c for c in calls if "attention" in c.operator]
    assert len(attention) == 1 and attention[0].block_calls == (1,) * len(blocks)


def test_a_shallow_trace_extends_each_call_to_every_block() -> None:
    """A model of 16 alike blocks is traced on 3 of them and extended: its calls, block by
    block, are the whole model's trace's."""
    built = _llama(depth=16)
    names, blocks = _blocks(built.model)
    shallow = facts._profile(built.model, blocks, built.batch, built.loss_fn, None, names)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(facts, "repeats", lambda *args: None)
        whole = facts._profile(built.model, blocks, built.batch, built.loss_fn, None, names)
    assert shallow.priced_calls == whole.priced_calls
    assert all(len(c.block_calls) == 16 for c in shallow.priced_calls)


def test_the_calls_survive_the_cache() -> None:
    built = _llama()
    _, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, torch.bfloat16)
    assert profile.priced_calls
    written = json.loads(json.dumps(cache.profile_to_json(profile)))
    assert cache.profile_from_json(written) == profile


def test_a_profile_scaled_from_a_few_rows_keeps_no_call() -> None:
    """Measured on real tensors at one and two rows of four and scaled, the calls' shapes are not
    the batch's; a batch of two rows is measured as it is, and its calls are its own."""
    from autoshard.measure.trace import profile_scaled

    for rows, kept in ((4, False), (2, True)):
        built = _llama(rows=rows)
        _, blocks = _blocks(built.model)
        profile, _ = profile_scaled(built.model, blocks, built.batch, built.loss_fn, None)
        assert bool(profile.priced_calls) == kept, rows


def _mm(rows: int, inner: int, cols: int, calls: int, dtype: str = "float32") -> PricedCall:
    x = torch.empty(rows, inner, requires_grad=True)
    w = torch.empty(cols, inner, requires_grad=True).t()
    arguments = arguments_json((x.to(getattr(torch, dtype)), w.to(getattr(torch, dtype))), {})
    return PricedCall("aten.mm.default", arguments, 2 * rows * inner * cols, (calls,), 0)


def _profile(*calls: PricedCall, rest: int = 0) -> ActivationProfile:
    total = sum(c.total_flops for c in calls) + rest
    return ActivationProfile(
        (0,), (0,), 0, 0, 0, (total,), total, torch.float32, priced_calls=calls
    )


def _timed(monkeypatch: pytest.MonkeyPatch, seconds: list[float]) -> list[int]:
    """The timer gives `seconds`, one per call timed, each run once; returns how many it got."""
    got: list[int] = []

    def timer(device: torch.device, runs: list[Callable[[], object]]) -> list[float]:
        for run in runs:
            run()
        got.append(len(runs))
        return seconds[: len(runs)]

    monkeypatch.setattr(rates_module, "_fastest_each", timer)
    monkeypatch.setattr(rates_module, "_RUN_S", 0.0)  # each call in one copy
    return got


def test_the_model_s_rate_prices_each_call_as_often_as_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three times the forward's FLOPs over the seconds they take: each timed call's forward and
    backward as often as the model runs it, the calls not timed at the large matmul's rate."""
    big, small = _mm(64, 32, 48, calls=1), _mm(16, 32, 8, calls=5)  # 81%, then 98% of the FLOPs
    peak = 1e9
    _timed(monkeypatch, [2e-3, 5e-4])
    rate, where = model_rate(CPU, _profile(big, small, rest=4000), peak) or (0.0, "")
    total = big.total_flops + small.total_flops + 4000
    seconds = 2e-3 + 5 * 5e-4 + 3 * 4000 / peak
    assert math.isclose(rate, 3 * total / seconds, rel_tol=1e-12)
    assert where.startswith("2 of its FLOP-bound calls (mm; 98% of its FLOPs) run forward and")


def test_calls_are_timed_until_they_hold_most_of_the_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [_mm(64, 64, 64, calls=1) for _ in range(10)]  # 8 hold 80% of the FLOPs
    got = _timed(monkeypatch, [1e-3] * 10)
    model_rate(CPU, _profile(*calls), 1e9)
    assert got == [rates_module._MOST]
    got.clear()
    model_rate(CPU, _profile(_mm(64, 64, 64, calls=95), _mm(8, 8, 8, calls=5)), 1e9)
    assert got == [1]  # the first holds 90% and more of the FLOPs


def test_calls_that_cannot_run_again_are_priced_at_the_large_matmul_s_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An integer tensor (indices, offsets: their values matter), arguments that could not be
    written, a call larger than the budget of one row, whose batch cannot be cut: not timed."""
    offsets = arguments_json(
        (torch.empty(8, 4), torch.empty(4, 8), torch.zeros(2, dtype=torch.int32)), {}
    )
    grouped = PricedCall("aten._grouped_mm.default", offsets, 10**6, (1,), 0)
    unwritten = PricedCall("aten.mm.default", "", 10**6, (1,), 0)
    large = _mm(1, 4096, 256, calls=100)
    small = _mm(8, 8, 8, calls=1)
    monkeypatch.setattr(rates_module, "_BYTES", 4096 * 256 * 4)  # less than the large needs
    monkeypatch.setattr(rates_module, "_CUT_BYTES", 4096 * 256 * 4)
    got = _timed(monkeypatch, [1e-3])
    profile = _profile(grouped, unwritten, large, small)
    rate, where = model_rate(CPU, profile, 1e9) or (0.0, "")
    assert got == [1] and where.startswith("1 of its FLOP-bound calls (mm; 0% of its FLOPs)")
    rest = profile.total_forward_flops - small.total_flops
    assert math.isclose(rate, 3 * profile.total_forward_flops / (1e-3 + 3 * rest / 1e9))
    _timed(monkeypatch, [])
    assert model_rate(CPU, _profile(grouped, unwritten), 1e9) is None


def test_a_call_too_large_for_the_bytes_left_runs_alone_at_a_cut_batch_scaled_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large batch's matmul that the budget cannot hold runs alone at as many rows as
    `_CUT_BYTES` holds, its time multiplied by its rows' ratio (its FLOPs'), and the sentence
    says so; a call that fits is timed with the others, whole."""
    large, small = _mm(1024, 64, 32, calls=2), _mm(8, 8, 8, calls=2000)  # 80% and 20%
    rows = 1024 * 64 * 4 * 2  # bytes one row of the large takes: its input and gradient
    fixed = 64 * 32 * 4 * 2  # the weight's and its gradient's
    output = 32 * 4 * 2  # one row's output and its gradient
    monkeypatch.setattr(rates_module, "_BYTES", 10_000)  # the small's and no more
    monkeypatch.setattr(rates_module, "_CUT_BYTES", fixed + 100 * (rows // 1024 + output))
    monkeypatch.setattr(rates_module, "_RUN_S", 0.0)  # each call in one copy
    seen = _Matmuls()
    timed: list[int] = []

    def timer(device: torch.device, runs: list[Callable[[], object]]) -> list[float]:
        timed.append(len(runs))
        with seen:
            for run in runs:
                run()
        return [1e-3] * len(runs)

    monkeypatch.setattr(rates_module, "_fastest_each", timer)
    rate, where = model_rate(CPU, _profile(large, small), 1e9) or (0.0, "")
    assert timed == [1, 1]  # the large alone, then the small
    sizes = {n for args in seen.seen for t in args for n in t.shape}
    assert 100 in sizes and 1024 not in sizes  # forward and backward at 100 rows
    seconds = 2 * 1e-3 * 1024 / 100 + 2000 * 1e-3
    total = large.total_flops + small.total_flops
    assert math.isclose(rate, 3 * total / seconds, rel_tol=1e-12)
    assert where.startswith("2 of its FLOP-bound calls (mm; 100% of its FLOPs) run forward")
    assert where.endswith(" (1 at a smaller batch, scaled to their own)"), where


def _conv(batch: int, channels: int, side: int, channels_last: bool = False) -> str:
    x = torch.empty(batch, channels, side, side, requires_grad=True)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.empty(channels, channels, 3, 3, requires_grad=True)
    return arguments_json((x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})


def test_a_convolution_is_cut_in_its_batch_alone_whatever_its_channels() -> None:
    """The batch is the output's first dimension: the input's is cut, and where the weight's
    output channels equal the batch (every tensor of that first dimension cut fails on meta),
    the first such tensor alone; a channels-last input stays channels last, the cut fits."""
    convolution = "aten.convolution.default"
    for batch, channels_last in ((32, False), (16, False), (16, True)):
        arguments = _conv(batch, 16, 8, channels_last)
        whole = rates_module._cut_bytes(
            rates_module._operator(convolution), arguments, [0], batch,
            rates_module._meta_outputs(rates_module._operator(convolution), arguments),
        )  # fmt: skip
        written, scale = rates_module._cut(convolution, arguments, whole // 2, by_bytes=False)
        x, w = rates_module._tensor_specs(json.loads(written))[:2]
        assert w[0] == [16, 16, 3, 3]  # the weight whole
        assert x[0][0] < batch and x[0][1:] == [16, 8, 8] and scale == batch / x[0][0]
        assert x[0][0] >= batch // 2 - 2  # as many rows as fit, the weight's bytes apart
        args, kwargs = rates_module._made(written, torch.device("meta"))
        assert args[0].is_contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        operator = rates_module._operator(convolution)
        assert rates_module._held(operator, args, kwargs, operator(*args, **kwargs)) <= whole // 2


def test_a_call_whose_batch_cannot_be_cut_is_not_run_at_another() -> None:
    """A reduction over the batch (its output keeps no batch), one row, a view whose
    arguments name the batch's size (the cut call fails on meta): left to the roofline."""
    cases = [
        ("aten.sum.dim_IntList", arguments_json((torch.empty(64, 32), [0]), {})),
        ("aten.mm.default", arguments_json((torch.empty(1, 64), torch.empty(64, 64)), {})),
        ("aten.view.default", arguments_json((torch.empty(64, 32), [64, 8, 4]), {})),
    ]
    for name, arguments in cases:
        with pytest.raises(rates_module._NotRun, match="batch"):
            rates_module._cut(name, arguments, 2**30, by_bytes=False)
    mm = arguments_json((torch.empty(8, 64), torch.empty(64, 64)), {})
    assert rates_module._cut("aten.mm.default", mm, 2**30, by_bytes=False) == (mm, 1.0)
    whole = (8 * 64 + 64 * 64 + 8 * 64) * 4  # its inputs and its output
    assert rates_module._cut("aten.mm.default", mm, whole - 1, by_bytes=False)[1] == 8 / 7


def _depthwise(calls: int) -> PricedCall:
    """A 7x7 depthwise convolution of 64 channels at 32x32: 12 FLOPs a byte."""
    x = torch.empty(1, 64, 32, 32, requires_grad=True)
    w = torch.empty(64, 1, 7, 7, requires_grad=True)
    arguments = arguments_json((x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 64), {})
    return PricedCall("aten.convolution.default", arguments, 2 * 49 * 64 * 32 * 32, (calls,), 0)


def test_the_calls_taking_the_most_time_by_the_roofline_are_timed_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A depthwise convolution does few FLOPs per byte: given the large copy's bandwidth, it is
    timed before a matmul of more FLOPs whose time its FLOPs bound, and the matmul not timed is
    priced by its FLOPs or its bytes, whichever take longer (here its FLOPs); without the
    bandwidth, by FLOPs alone."""
    matmul, depthwise = _mm(256, 256, 256, calls=1), _depthwise(calls=4)
    assert matmul.total_flops > depthwise.total_flops
    monkeypatch.setattr(rates_module, "_MOST", 1)
    _timed(monkeypatch, [1e-3])
    profile = _profile(matmul, depthwise)
    peak, copy = 3e11, 1e10
    rate, where = model_rate(CPU, profile, peak, copy) or (0.0, "")
    assert where.startswith("1 of its FLOP-bound calls (convolution; "), where
    moved = 3 * 256 * 256 * 4  # the matmul's two inputs and its output
    assert 3 * matmul.flops / peak > 3 * moved / copy
    seconds = 4 * 1e-3 + 3 * matmul.flops / peak
    assert math.isclose(rate, 3 * profile.total_forward_flops / seconds, rel_tol=1e-12)
    _, where = model_rate(CPU, profile, peak) or (0.0, "")
    assert where.startswith("1 of its FLOP-bound calls (mm; "), where


def test_the_roofline_counts_a_view_s_own_elements_not_its_whole_storage() -> None:
    """q, k and v cut from one fused projection each read their own columns, as the trace
    counts them."""
    fused = torch.empty(2, 4, 16, 3 * 8)
    q, k, v = (fused[..., i * 8 : (i + 1) * 8] for i in range(3))
    arguments = arguments_json((q, k, v), {})
    moved = rates_module._moved(
        "aten._scaled_dot_product_flash_attention_for_cpu.default", arguments
    )
    assert moved > 0 and moved <= 4 * 2 * 4 * 16 * 8 * 4 + 2 * 4 * 16 * 4  # q, k, v, out, lse


def test_a_call_not_timed_is_priced_by_its_bytes_where_they_take_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    matmul, depthwise = _mm(256, 256, 256, calls=10), _depthwise(calls=4)  # the matmul first
    monkeypatch.setattr(rates_module, "_MOST", 1)
    _timed(monkeypatch, [1e-3])
    profile = _profile(matmul, depthwise)
    peak, copy = 3e11, 1e10
    rate, where = model_rate(CPU, profile, peak, copy) or (0.0, "")
    assert where.startswith("1 of its FLOP-bound calls (mm; "), where
    moved = 2 * (64 * 32 * 32 * 4) + 64 * 49 * 4  # input, output, weight
    assert moved / copy > depthwise.flops / peak
    seconds = 10 * 1e-3 + 4 * 3 * moved / copy
    assert math.isclose(rate, 3 * profile.total_forward_flops / seconds, rel_tol=1e-12)


class _Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """The arguments of each matmul run meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.mm.default:
            self.seen.append(args)
        return func(*args, **(kwargs or {}))


def test_a_call_runs_at_its_own_shapes_strides_and_dtype_forward_and_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rates_module, "_RUN_S", 0.0)
    call = _mm(16, 32, 8, calls=1, dtype="bfloat16")
    run, copies, _ = rates_module._run_again(call.operator, call.arguments, CPU)
    with _Matmuls() as matmuls:
        run()
    forward = matmuls.seen[0]
    assert [tuple(t.shape) for t in forward] == [(16, 32), (32, 8)]
    assert forward[1].stride() == (1, 32) and {t.dtype for t in forward} == {torch.bfloat16}
    assert copies == 1 and len(matmuls.seen) == 3  # and the gradients of both inputs


def test_a_small_call_runs_in_copies_and_is_timed_per_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forwards of its copies one after another, then one backward of them all, so that
    the host's own work per copy (an `autograd.grad` a run) is not the call's time."""
    monkeypatch.setattr(rates_module, "_RUN_S", 1.0)  # far longer than a small matmul here
    monkeypatch.setattr(rates_module, "_COPIES", 4)
    call = _mm(16, 32, 8, calls=5)
    run, copies, held = rates_module._run_again(call.operator, call.arguments, CPU)
    with _Matmuls() as matmuls:
        run()
    assert copies == 4 and len(matmuls.seen) == 4 + 2 * 4
    inputs, output = (16 * 32 + 32 * 8) * 4, 16 * 8 * 4
    assert held == inputs + 4 * (2 * output + inputs)  # the inputs shared; each copy's own
    # the budget bounds the copies
    budget = inputs + 2 * (2 * output + inputs)
    _, fewer, _ = rates_module._run_again(call.operator, call.arguments, CPU, budget=budget)
    assert fewer == 2
    # timed per copy, each as often as the model runs it
    monkeypatch.setattr(rates_module, "_fastest_each", lambda device, runs: [4e-3] * len(runs))
    rate, _ = model_rate(CPU, _profile(call), 1e9) or (0.0, "")
    assert math.isclose(rate, 3 * call.total_flops / (5 * 1e-3), rel_tol=1e-12)


def test_the_slowest_rank_s_model_rate_replaces_the_matmul_s_and_says_so() -> None:
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    where = "measured on cuda:0 (H100): a 4096x4096 bfloat16 matmul"

    def report(rank: int, own: float | None) -> RankReport:
        figures = Throughput(8e14, 3e12, where, 4e-6, None, None, own, "5 of its calls")
        return RankReport(rank, "h", Memory(1, 1, ""), (), None, None, device_throughput=figures)

    taken = with_device(inputs, [report(0, 5e14), report(1, 4e14)])
    assert taken.hardware.flops_per_s == 4e14
    assert "FLOP/s the model's own, 5 of its calls" in taken.hardware.source
    assert compute_seconds(taken, Strategy.DDP, 0) > compute_seconds(
        with_device(inputs, [report(0, None), report(1, None)]), Strategy.DDP, 0
    )
    # a rank without it: the large matmul's, and not named
    mixed = with_device(inputs, [report(0, 5e14), report(1, None)])
    assert mixed.hardware.flops_per_s == 8e14 and "model's own" not in mixed.hardware.source
    # a report's figures read back by the GPU suite's calibration
    read = hardware_for("cuda", (9, 0), True, report(0, 3e14).device_throughput)
    assert read.flops_per_s == 3e14 and "FLOP/s the model's own" in read.source


def test_the_model_rate_must_be_a_positive_number() -> None:
    with pytest.raises(ValueError, match="model_flops_per_s"):
        Throughput(model_flops_per_s=0.0)


def test_a_plan_on_a_measured_device_prices_its_flops_at_the_model_s_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the device's figures are measured (on a GPU; given here), the model's calls are run
    again and their rate is the cost model's, named in the plan; a largest-batch probe runs
    none (its plans weigh memory alone)."""
    measured = Throughput(2e11, 1e11, "measured here", 1e-6)
    monkeypatch.setattr(pipeline, "device_throughput", lambda device, dtype: measured)
    ran: list[int] = []

    def rate(
        device: torch.device, profile: ActivationProfile, peak: float, copy: float | None
    ) -> tuple[float, str]:
        assert peak == 2e11 and copy == 1e11 and profile.priced_calls
        ran.append(len(profile.priced_calls))
        return 5e10, "its calls, timed"

    monkeypatch.setattr(rates_module, "model_rate", rate)
    built = _llama()
    plan = autoshard.plan(
        built.model, built.optimizer, built.batch, loss_fn=built.loss_fn, device_memory="1GiB"
    )
    chose = plan.reasons[-1]
    assert "FLOP/s the model's own, its calls, timed" in chose and len(ran) == 1, chose
    assert with_model_rate(None, CPU, None) is None
    assert with_model_rate(measured, CPU, None) == measured
    assert with_model_rate(measured, CPU, replace(_profile(), priced_calls=())) == measured


# ---------------------------------------------------------------------------------------------
# From a review of a9adbe9: recording never fails the trace, and records what training runs


class _Nested(torch.nn.Module):
    """A matmul of nested tensors: its arguments cannot be written (nor run on fake tensors:
    traced on real ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ragged = torch.nested.nested_tensor([x[0, :2], x[1, :3]], layout=torch.strided)
        weights = torch.nested.nested_tensor([self.w, self.w], layout=torch.strided)
        y = torch.bmm(ragged, weights)
        return x + y.to_padded_tensor(0.0, (2, 3, 4)) @ self.w


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_call_whose_arguments_cannot_be_written_keeps_the_trace() -> None:
    """It is kept under its own FLOPs, unwritten; the activations are traced as before."""
    blocks = torch.nn.ModuleList([_Nested(), _Nested()])
    model = torch.nn.Sequential(*blocks)
    batch = (torch.randn(2, 3, 4),)
    profile = profile_step(model, list(blocks), batch, lambda o, b: o.sum(), None, real=True)
    assert profile.block_saved_bytes[0] > 0
    assert sum(c.total_flops for c in profile.priced_calls) == profile.total_forward_flops
    assert any(not c.arguments for c in profile.priced_calls)


def test_calls_not_written_keep_each_its_own_flops() -> None:
    """Keyed by their FLOPs, not merged into one record of the largest."""
    calls = PricedCalls(1)
    unwritable = (torch.Generator(),)  # no priced operator takes one: JSON here has none
    for flops, block in ((100, 0), (300, 0), (100, None)):
        calls.record(torch.ops.aten.mm.default, unwritable, {}, flops, block, True)
    made = calls.result()
    assert [(c.flops, c.block_calls, c.other_calls, c.arguments) for c in made] == [
        (300, (1,), 0, ""),
        (100, (1,), 1, ""),
    ]


def test_dtypes_and_memory_formats_are_written_and_read_back() -> None:
    written = arguments_json(
        (torch.empty(2, 3),), {"out_dtype": torch.bfloat16, "memory_format": torch.channels_last}
    )
    spec = json.loads(written)

    def tensor(shape: list[int], stride: list[int], dtype: torch.dtype, grad: bool) -> str:
        return f"{shape} {stride} {dtype} {grad}"

    assert read(spec["args"], tensor) == ["[2, 3] [3, 1] torch.float32 False"]
    kwargs = {k: read(v, tensor) for k, v in spec["kwargs"].items()}
    assert kwargs == {"out_dtype": torch.bfloat16, "memory_format": torch.channels_last}


def test_the_order_of_calls_does_not_depend_on_the_order_met() -> None:
    a = ((torch.empty(4, 8), torch.empty(8, 2)), 64)
    b = ((torch.empty(4, 2), torch.empty(2, 8)), 64)  # as many FLOPs
    results = []
    for first, second in ((a, b), (b, a)):
        calls = PricedCalls(1)
        for args, flops in (first, second):
            calls.record(torch.ops.aten.mm.default, args, {}, flops, 0, True)
        results.append(calls.result())
    assert results[0] == results[1]


class _Reentrant(torch.nn.Module):
    """Checkpointed as scripts still do, `use_reentrant=True`: its forward runs without
    gradients, again in backward with them, and its backward runs. `b`'s weight frozen (a LoRA
    base's), and a float mask made inside, which needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.b.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._run, x, use_reentrant=True)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[0], 32)  # made here: needs no gradient
        return self.b(torch.relu(self.a(x)) * scale)


class _Teacher(torch.nn.Module):
    """A block whose forward runs a frozen teacher under `no_grad` (distillation, an EMA
    encoder): run once, never again, and no backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.teacher = torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.a(x) + target[:, :16]


def _needs(call: PricedCall) -> list[bool]:
    arguments = json.loads(call.arguments)["args"]
    return [a["tensor"][3] for a in arguments if isinstance(a, dict) and "tensor" in a]


def test_a_call_without_gradients_takes_them_from_its_recomputation_in_backward() -> None:
    """A block checkpointed reentrantly: its calls need what its recomputation's need (the
    activations a gradient, the frozen weight and the mask none); a teacher run under no_grad
    and never again: none, as written (a9adbe9's rule marked every float tensor)."""
    for block, expected in (
        (_Reentrant, {(16, 32): [True, True], (32, 16): [True, False]}),
        (_Teacher, {(16, 16): [True, True], (16, 64): [False, False]}),
    ):
        blocks = torch.nn.ModuleList([block(), block()])
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), *blocks)
        batch = (torch.randn(4, 8),)
        profile = profile_step(model, list(blocks), batch, lambda o, b: o.sum(), None)
        inside = [c for c in profile.priced_calls if sum(c.block_calls)]
        found = {}
        for call in inside:
            shapes = json.loads(call.arguments)["args"][-1]["tensor"][0]  # the weight.t()
            found[tuple(shapes)] = _needs(call)[-2:]
        assert found == expected, block


def test_recording_that_fails_keeps_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoshard.measure import priced

    def fails(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a writer's own failure")

    monkeypatch.setattr(priced, "arguments_json", fails)
    built = _llama()
    _, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, None)
    assert profile.block_saved_bytes[0] > 0
    assert {c.arguments for c in profile.priced_calls} == {""}
    assert sum(c.total_flops for c in profile.priced_calls) == profile.total_forward_flops


def test_symbolic_sizes_are_not_written() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(5, 3), symbolic_context=context)
    assert arguments_json((x,), {}) == ""


def test_a_call_takes_half_the_device_s_free_memory_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rates_module, "_RUN_S", 1.0)
    monkeypatch.setattr(rates_module, "_COPIES", 8)
    call = _mm(16, 32, 8, calls=1)
    inputs, output = (16 * 32 + 32 * 8) * 4, 16 * 8 * 4
    each = 2 * output + inputs
    monkeypatch.setattr(rates_module, "_free", lambda device: 2 * (inputs + 3 * each))
    _, copies, _ = rates_module._run_again(call.operator, call.arguments, CPU)
    assert copies == 3
    monkeypatch.setattr(rates_module, "_free", lambda device: inputs + each)  # half: too little
    with pytest.raises(rates_module._NotRun):
        rates_module._run_again(call.operator, call.arguments, CPU)


def test_calls_holding_more_than_the_forward_s_flops_give_a_finite_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The records hold a call the forward's total misses (a block run twice, traced once): the
    rest is no negative time."""
    call = _mm(16, 16, 16, calls=4)
    profile = replace(_profile(call), total_forward_flops=call.total_flops // 2)
    _timed(monkeypatch, [1e-3])
    rate, where = model_rate(CPU, profile, 1e9) or (0.0, "")
    assert math.isclose(rate, 3 * profile.total_forward_flops / (4 * 1e-3), rel_tol=1e-12)
    assert "100% of its FLOPs" in where
