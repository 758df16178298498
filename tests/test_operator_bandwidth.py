"""The model's own operators' bandwidth (`measure.rates.model_bandwidth`, issue 26): the trace
records each memory-bound call of the step, forward and backward, with the bytes it moves
(`measure.priced.MovingCalls`); the calls moving the most run again on the device at their own
shapes, alone, and the cost model prices the model's forward and backward bytes at the bandwidth
they reach, the optimizer step's at a large copy's. Timings are never asserted here: where a
figure is checked, the timer is given (tests/test_gpu.py measures them on a GPU)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from _dist import REPO
from test_model_rate import _blocks, _llama, _timed
from test_plan import AMPLE, make_inputs

from autoshard import Strategy
from autoshard._world import Memory, RankReport
from autoshard.decide.cost import compute_seconds
from autoshard.decide.hardware import Throughput, hardware_for
from autoshard.decide.profile import ActivationProfile, MovingCall
from autoshard.measure import cache, facts, priced
from autoshard.measure import rates as rates_module
from autoshard.measure.device import with_device
from autoshard.measure.fake import unavailable
from autoshard.measure.priced import arguments_json
from autoshard.measure.rates import model_bandwidth, with_model_rate
from autoshard.measure.trace import profile_scaled, profile_step

sys.path.insert(0, str(REPO / "benchmarks"))
import zoo  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

GPU = hardware_for("cuda", (9, 0), True)
CPU = torch.device("cpu")


def _gpt(depth: int = 4, rows: int = 2) -> zoo.ZooModel:
    return zoo.BUILDERS["gpt"](
        rows, d_model=64, n_layer=depth, n_head=4, seq_len=32, vocab_size=256
    )


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_trace_records_every_memory_bound_call_forward_and_backward(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None
) -> None:
    """Every byte the forward and backward move is in one recorded call; each block runs its
    norms, activations and additions alike, forward and backward; the loss's softmax and its
    backward run outside the blocks; each tensor is written as needing no gradient."""
    monkeypatch.setattr(priced, "_KEPT", 10**6)  # all of them
    built = _gpt()
    _, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, dtype)
    calls = profile.moving_calls
    assert sum(c.total_bytes for c in calls) == profile.forward_traffic + profile.backward_traffic
    by_name = {c.operator: c for c in calls}
    for name in ("aten.gelu.default", "aten.gelu_backward.default"):
        assert by_name[name].block_calls == (1, 1, 1, 1) and by_name[name].other_calls == 0
    for name in ("aten._log_softmax.default", "aten._log_softmax_backward_data.default"):
        assert sum(by_name[name].block_calls) == 0 and by_name[name].other_calls == 1
    if dtype is not None:  # autocast's casts are calls too
        assert any(c.operator == "aten._to_copy.default" for c in calls)
    for call in calls:
        if call.arguments:  # no tensor needs a gradient
            assert not any(t[3] for t in _tensors(json.loads(call.arguments))), call
    assert [c.total_bytes for c in calls] == sorted((c.total_bytes for c in calls), reverse=True)


def _tensors(written: object) -> list[list[object]]:
    if isinstance(written, dict):
        if set(written) == {"tensor"}:
            return [written["tensor"]]
        return [t for v in written.values() for t in _tensors(v)]
    if isinstance(written, list):
        return [t for v in written for t in _tensors(v)]
    return []


def test_the_calls_moving_the_most_in_the_whole_model_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trace keeps every call; the profile the calls moving the most bytes, cut once a
    shallow trace is extended: a 16-block Llama's shallow copy has its head's calls among its
    first, which the whole model's blocks outweigh."""
    built = _llama(depth=16)
    names, blocks = _blocks(built.model)
    every = profile_step(built.model, blocks, built.batch, built.loss_fn, None).moving_calls
    profile = facts._profile(built.model, blocks, built.batch, built.loss_fn, None, names)
    assert len(every) > priced._KEPT and profile.moving_calls == every[: priced._KEPT]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_a_shallow_trace_extends_each_memory_bound_call_to_every_block(
    build: Callable[..., zoo.ZooModel], dtype: torch.dtype | None
) -> None:
    """A model of 16 alike blocks is traced on 3 of them and extended: the calls kept, block by
    block, are the whole model's trace's."""
    built = build(depth=16)
    names, blocks = _blocks(built.model)
    shallow = facts._profile(built.model, blocks, built.batch, built.loss_fn, dtype, names)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(facts, "repeats", lambda *args: None)
        whole = facts._profile(built.model, blocks, built.batch, built.loss_fn, dtype, names)
    assert shallow.moving_calls and shallow.moving_calls == whole.moving_calls
    assert all(len(c.block_calls) == 16 for c in shallow.moving_calls)


def test_calls_of_equal_arguments_moving_different_bytes_are_kept_apart() -> None:
    """An expanded row of a 2-row and of a 16-row tensor: the same shape and strides, but
    storages of different sizes, whose bytes the trace counts."""
    calls = priced.MovingCalls(1)
    for rows in (2, 16):
        row = torch.empty(rows, 4)[0].expand(8, 4)
        moved = sum(min(t.numel() * 4, t.untyped_storage().nbytes()) for t in (row, row + 0))
        calls.record(torch.ops.aten.mul.Tensor, (row, 2.0), {}, moved, 0, True)
    recorded = calls.result()
    assert sorted(c.moved for c in recorded) == [2 * 16 + 128, 128 + 128]  # a row read once
    assert all(c.block_calls == (1,) for c in recorded)


def test_autocast_s_casts_forward_and_backward_are_written_and_run_again() -> None:
    """Under bf16 autocast, backward casts each gradient back with `device=` its device: written
    by type, run again on the device timed; a call naming another device (a copy between
    them) is not run."""
    built = _gpt()
    _, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, torch.bfloat16)
    casts = [c for c in profile.moving_calls if c.operator == "aten._to_copy.default"]
    assert casts and all(c.arguments for c in casts)
    assert any('"device": "cpu"' in c.arguments for c in casts)
    for cast in casts:
        run, _, _ = rates_module._run_again(cast.operator, cast.arguments, CPU)
        run()
    elsewhere = casts[0].arguments.replace('"device": "cpu"', '"device": "cuda"')
    with pytest.raises(rates_module._NotRun, match="naming cuda"):
        rates_module._run_again(casts[0].operator, elsewhere, CPU)


def test_the_memory_bound_calls_survive_the_cache_and_not_the_scaling() -> None:
    built = _gpt()
    _, blocks = _blocks(built.model)
    profile = profile_step(built.model, blocks, built.batch, built.loss_fn, torch.bfloat16)
    assert profile.moving_calls
    written = json.loads(json.dumps(cache.profile_to_json(profile)))
    assert cache.profile_from_json(written) == profile
    scaled, _ = profile_scaled(built.model, blocks, _gpt(rows=4).batch, built.loss_fn, None)
    assert scaled.moving_calls == ()  # at one and two rows: not the batch's shapes


def _add(rows: int, cols: int, calls: int) -> MovingCall:
    x, y = torch.empty(rows, cols), torch.empty(rows, cols)
    return MovingCall("aten.add.Tensor", arguments_json((x, y), {}), 3 * x.nbytes, (calls,), 0)


def _profile(*calls: MovingCall, rest: int = 0) -> ActivationProfile:
    total = sum(c.total_bytes for c in calls) + rest
    return ActivationProfile(
        (0,), (0,), 0, 0, 0, (0,), 0, torch.float32,
        forward_traffic=total // 3, backward_traffic=total - total // 3, moving_calls=calls,
    )  # fmt: skip


def test_the_bandwidth_prices_each_call_as_often_as_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's forward and backward bytes over the seconds they take: each timed call as
    often as the model runs it, the bytes not timed at the large copy's bandwidth."""
    big, small = _add(64, 64, calls=3), _add(8, 64, calls=5)
    copy = 1e9
    _timed(monkeypatch, [2e-4, 5e-5])
    profile = _profile(big, small, rest=4000)
    bandwidth, where = model_bandwidth(CPU, profile, copy) or (0.0, "")
    total = big.total_bytes + small.total_bytes + 4000
    assert profile.forward_traffic + profile.backward_traffic == total
    seconds = 3 * 2e-4 + 5 * 5e-5 + 4000 / copy
    assert math.isclose(bandwidth, total / seconds, rel_tol=1e-12)
    assert where == (
        "2 of its memory-bound calls (add; 98% of its bytes) run again at its own shapes"
    )


def test_a_memory_bound_call_too_large_runs_alone_at_a_cut_batch_scaled_by_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its time at the rows `_CUT_BYTES` holds, times its bytes' ratio (a memory-bound call's
    time is its bytes'), and the sentence says so."""
    big = _add(256, 64, calls=3)
    row = 3 * 64 * 4  # the two inputs' and the output's bytes of one row
    monkeypatch.setattr(rates_module, "_BYTES", 1000)  # not one row more
    monkeypatch.setattr(rates_module, "_CUT_BYTES", 40 * row)
    got = _timed(monkeypatch, [2e-4])
    bandwidth, where = model_bandwidth(CPU, _profile(big), 1e9) or (0.0, "")
    assert got == [1]
    assert math.isclose(bandwidth, big.total_bytes / (3 * 2e-4 * 256 / 40), rel_tol=1e-12)
    assert where == (
        "1 of its memory-bound calls (add; 100% of its bytes) run again at its own shapes"
        " (1 at a smaller batch, scaled to their own)"
    )


def test_a_backward_is_cut_in_every_tensor_of_the_batch() -> None:
    """A normalisation's backward takes the output's gradient and the input, both of the
    batch: cut together (the gradient alone would leave the input's gradient whole, refused),
    the weight and the saved statistics of the channels whole; its factor is its bytes'
    ratio."""
    x, w = torch.empty(64, 32, 8, 8), torch.empty(32)
    name = "aten.native_batch_norm_backward.default"
    arguments = arguments_json((x, x, w, w, w, w, w, True, 1e-5, [True, True, True]), {})
    written, scale = rates_module._cut(name, arguments, 40 * 32 * 8 * 8 * 4, by_bytes=True)
    shapes = [shape for shape, *_ in rates_module._tensor_specs(json.loads(written))]
    assert shapes[0] == shapes[1] and shapes[0][0] < 64 and shapes[0][1:] == [32, 8, 8]
    assert all(shape == [32] for shape in shapes[2:])
    moved = rates_module._moved(name, arguments), rates_module._moved(name, written)
    assert scale == moved[0] / moved[1] and moved[0] > moved[1] > 0


def test_memory_bound_calls_are_timed_until_they_move_most_of_the_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = [_add(16, 16, calls=1) for _ in range(20)]
    got = _timed(monkeypatch, [1e-4] * 20)
    model_bandwidth(CPU, _profile(*calls), 1e9)
    assert got == [rates_module._MOST_MOVING]
    got.clear()
    model_bandwidth(CPU, _profile(_add(16, 16, calls=95), _add(2, 2, calls=5)), 1e9)
    assert got == [1]  # the first moves 90% and more of the bytes


def test_only_operators_that_take_any_values_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointwise operators, reductions and the named norms, softmaxes and copies run on random
    tensors, a boolean mask among them; an operator whose GPU kernel checks its values (binary
    cross-entropy asserts its inputs are in [0, 1], ending the CUDA context) or an integer
    tensor (indices: their values matter) does not."""
    assert rates_module._runs_on_any_values("aten.add.Tensor")
    assert rates_module._runs_on_any_values("aten.sum.dim_IntList")
    assert rates_module._runs_on_any_values("aten.native_layer_norm_backward.default")
    assert rates_module._runs_on_any_values("aten._to_copy.default")
    assert not rates_module._runs_on_any_values("aten.binary_cross_entropy.default")
    assert not rates_module._runs_on_any_values("aten.nll_loss_forward.default")
    assert not rates_module._runs_on_any_values("aten.embedding_dense_backward.default")
    assert not rates_module._runs_on_any_values("aten.bernoulli.p")  # p in [0, 1] on CUDA
    x = torch.empty(8, 8)
    mask = torch.empty(8, 8, dtype=torch.bool)
    bce = MovingCall(
        "aten.binary_cross_entropy.default", arguments_json((x, x), {}), 10**6, (1,), 0
    )
    where = MovingCall("aten.where.self", arguments_json((mask, x, x), {}), 10**5, (1,), 0)
    index = torch.zeros(8, dtype=torch.long)
    gather = MovingCall(
        "aten.index_select.default", arguments_json((x, 0, index), {}), 10**5, (1,), 0
    )
    got = _timed(monkeypatch, [1e-4])
    profile = _profile(bce, where, gather)
    bandwidth, said = model_bandwidth(CPU, profile, 1e9) or (0.0, "")
    assert got == [1] and said.startswith("1 of its memory-bound calls (where; ")
    rest = profile.forward_traffic + profile.backward_traffic - where.total_bytes
    assert math.isclose(bandwidth, (rest + where.total_bytes) / (1e-4 + rest / 1e9))
    _timed(monkeypatch, [])
    assert model_bandwidth(CPU, _profile(bce, gather), 1e9) is None


def test_a_memory_bound_call_runs_alone_in_copies_its_outputs_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its copies' forwards one after another, no backward (a backward's calls are recorded as
    their own), each copy's output alive to the run's end as a step's are; the bytes held are
    the shared inputs and each copy's output; each call's copies take their share of the
    budget, the first always runs."""
    monkeypatch.setattr(rates_module, "_RUN_S", 1.0)  # far longer than a small addition here
    monkeypatch.setattr(rates_module, "_COPIES", 4)
    call = _add(16, 32, calls=1)
    run, copies, held = rates_module._run_again(call.operator, call.arguments, CPU)
    seen: list[int] = []

    class _Adds(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(0 if func is torch.ops.aten.add.Tensor else 1)
            return func(*args, **(kwargs or {}))

    with _Adds():
        run()
    assert copies == 4 and seen == [0, 0, 0, 0]
    inputs = output = 16 * 32 * 4
    assert held == 2 * inputs + 4 * output
    _, fewer, _ = rates_module._run_again(
        call.operator, call.arguments, CPU, share=2 * inputs + 2 * output
    )
    assert fewer == 2
    _, one, _ = rates_module._run_again(call.operator, call.arguments, CPU, share=0)
    assert one == 1


def _report(rank: int, own: float | None) -> RankReport:
    figures = Throughput(
        8e14, 3e12, "measured on cuda:0 (H100)", 4e-6, model_memory_bytes_per_s=own,
        model_memory_where="9 of its calls",
    )  # fmt: skip
    return RankReport(rank, "h", Memory(1, 1, ""), (), None, None, device_throughput=figures)


def test_the_slowest_rank_s_bandwidth_prices_the_model_s_bytes_and_says_so() -> None:
    """The model's forward and backward bytes at the slowest rank's own bandwidth, where every
    rank measured one; the optimizer step's at the large copy's."""
    inputs = make_inputs(2, AMPLE, hardware=GPU)
    assert inputs.profile is not None
    inputs = replace(
        inputs,
        profile=replace(inputs.profile, forward_traffic=3 * 2**30, backward_traffic=5 * 2**30),
        stats=replace(inputs.stats, step_traffic_bytes=7 * 2**30, step_operators=40),
    )
    taken = with_device(inputs, [_report(0, 2e12), _report(1, 1e12)])
    hardware = taken.hardware
    assert hardware.operator_bytes_per_s == 1e12 and hardware.memory_bytes_per_s == 3e12
    assert "; operator bandwidth the model's own, 9 of its calls" in hardware.source
    assert "FLOP/s the model's own" not in hardware.source
    profile, stats = taken.profile, taken.stats
    assert profile is not None
    traffic = profile.forward_traffic + profile.backward_traffic
    device = (
        3 * profile.total_forward_flops / hardware.flops_per_s
        + traffic / 1e12
        + stats.step_traffic_bytes / 3e12
    )
    launches = (profile.forward_kernels + profile.backward_kernels + stats.step_operators) * 4e-6
    assert math.isclose(compute_seconds(taken, Strategy.DDP, 0), max(device, launches))
    # a rank without it: the large copy's, and not named
    mixed = with_device(inputs, [_report(0, 2e12), _report(1, None)])
    assert mixed.hardware.operator_bytes_per_s is None
    assert mixed.hardware.traffic_bytes_per_s == 3e12
    assert "model's own" not in mixed.hardware.source
    # a report's figures read back by the GPU suite's calibration
    read = hardware_for("cuda", (9, 0), True, _report(0, 5e11).device_throughput)
    assert read.traffic_bytes_per_s == 5e11 and read.memory_bytes_per_s == 3e12
    assert "operator bandwidth the model's own, 9 of its calls" in read.source


def test_the_model_s_bandwidth_must_be_a_positive_number() -> None:
    with pytest.raises(ValueError, match="model_memory_bytes_per_s"):
        Throughput(model_memory_bytes_per_s=-1.0)


def test_each_of_the_model_s_figures_is_taken_where_it_was_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FLOP/s and the bandwidth are measured apart: one failing leaves the other."""
    measured = Throughput(2e11, 1e11, "measured here", 1e-6)
    profile = _profile(_add(16, 16, calls=1))

    def failed(*args: object) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(rates_module, "model_rate", failed)
    monkeypatch.setattr(rates_module, "model_bandwidth", lambda *args: (5e10, "timed"))
    found = with_model_rate(measured, CPU, profile)
    assert found is not None and found.model_flops_per_s is None
    assert found.model_memory_bytes_per_s == 5e10 and found.model_memory_where == "timed"
    monkeypatch.setattr(rates_module, "model_bandwidth", failed)
    assert with_model_rate(measured, CPU, profile) == measured
    # without a measured bandwidth, none of the model's own
    monkeypatch.setattr(rates_module, "model_bandwidth", lambda *args: (5e10, "timed"))
    unmeasured = replace(measured, memory_bytes_per_s=None)
    assert with_model_rate(unmeasured, CPU, profile) == unmeasured
