"""benchmarks/estimate_accuracy.py: the allocator measurement it rests on, then the harness itself
under real torchrun (2 gloo ranks) on gpt, mlp and resnet with every strategy, checkpointing off and
on every block, held to the accuracy target: every configuration's predicted peak within 8% of the
allocator's measured peak. resnet's convolutions hold scratch memory only the allocator sees
(checkpointed, 8.8% of its peak on 2 ranks): without `measure.workspace` it misses the target."""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from _dist import REPO, SLOW_MACHINE, plans_kept, run_torchrun

sys.path.insert(0, str(REPO / "benchmarks"))
import zoo_external  # noqa: E402
from _live_bytes import (  # noqa: E402
    Allocation,
    AllocatorProfile,
    corrected_deltas,
    live_at,
    running_peak,
)

WORST_TARGET = 0.08  # the target for every configuration
# About 90 s on 2 idle cores (18 configurations); the limit turns a hang into a failure (see
# _dist.SLOW_MACHINE).
TIMEOUT_S = 120 * SLOW_MACHINE
STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
MODELS = ("gpt", "mlp", "resnet")

ROW_FIELDS = {
    "model",
    "optimizer_class",
    "world_size",
    "strategy",
    "mixed_precision",
    "checkpointed",
    "num_blocks",
    "predicted_bytes",
    "allocator_peak_bytes",
    "allocator_upper_peak_bytes",
    "allocator_raw_peak_bytes",
    "tracker_peak_bytes",
    "errors",
    "error",
    "worst_rank",
    "breakdown",
    "window",
    "clean",
    "attempts",
}
BREAKDOWN = {"params", "grads", "optimizer_state", "activations", "comm_buffers", "temporaries"}


# ---------------------------------------------------------------------------------------------
# The measurement, without a process group


def test_running_peak_is_taken_inside_the_window_only() -> None:
    deltas = [(0, 100), (10, 50), (20, -120), (30, 400), (40, -400), (50, 900)]
    # totals: 100, 150, 30, 430, 30, 930; the window [15, 45] sees 30 at its start, then 430
    assert running_peak(deltas, 15, 45) == (430, 150, 30)
    assert running_peak(deltas, 41, 45) == (30, 30, 41)  # no event inside: the total at start


def test_unreported_frees_are_inferred_and_older_blocks_ignored() -> None:
    allocations = [
        Allocation(0, ptr=1, nbytes=100),  # the model: retained by whoever holds it
        Allocation(10, ptr=2, nbytes=40, freed_by=15),  # a collective's buffer, free unreported
        Allocation(20, ptr=3, nbytes=30),  # freed unreported, then its address is reused
        Allocation(30, ptr=3, nbytes=30),
        Allocation(35, ptr=9, nbytes=-70),  # a block from before the profile
        Allocation(40, ptr=3, nbytes=-30),
        Allocation(50, ptr=4, nbytes=5),  # never freed: leaked
    ]
    fixed = corrected_deltas(allocations, known=frozenset({1}))
    assert fixed.missed_frees == (2, 70)
    assert fixed.retained == (1, 100)
    assert fixed.leaked == (1, 5)
    assert fixed.foreign_frees == (1, 70)
    # live: 100; +40 = 140 at 10; -40 at 15; +30 at 20; reuse at 30: -30 then +30; -30 at 40
    assert running_peak(fixed.deltas, 0, 100)[0] == 140
    assert sum(d for _, d in fixed.deltas) == 105


def test_allocator_peak_matches_memtracker_on_a_plain_module() -> None:
    """DESIGN.md section 3: on one process, with no C++-side buffers, the profiler's running
    total (started before the model exists) and MemTracker agree to the byte."""
    import zoo
    from torch.distributed._tools.mem_tracker import MemTracker

    def step(built: zoo.ZooModel) -> None:
        loss = built.loss_fn(built.model(*built.batch), built.batch)
        loss.backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)

    gc.collect()
    with AllocatorProfile() as prof:
        built = zoo.build("gpt", 4, n_layer=2)
        step(built)  # the optimizer state exists from here on
        tracker = MemTracker()
        tracker.track_external(built.model, built.optimizer, *built.batch)
        with prof.window("measured"), tracker:
            step(built)
        tracked = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        del built, tracker
        gc.collect()
    live = prof.live_bytes("measured")
    assert tracked > 0
    assert live.peak == tracked
    assert live.missed_frees == (0, 0)  # one thread: every free is reported


def test_checkpointing_takes_a_number_of_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    """`--ac off,on,2`: none, every block, or the first k blocks checkpointed, as `prepare`'s
    `activation_checkpointing` takes them; anything else is refused."""
    import estimate_accuracy

    args = estimate_accuracy.parse_args(["--ac", "off,on,2"])
    assert [estimate_accuracy._checkpointing(a) for a in args.ac.split(",")] == [False, True, 2]
    for bad in ("0", "all", "-1", "on,1.5"):
        with pytest.raises(SystemExit):
            estimate_accuracy.parse_args(["--ac", bad])
        assert "--ac takes" in capsys.readouterr().err, bad


class _Windows:
    """AllocatorProfile's `window` alone, for a step taken outside a profile."""

    @staticmethod
    def window(name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


@pytest.mark.parametrize("wrapper", ["none", "ddp", "fsdp2"])
def test_accumulating_steps_run_every_micro_batch_with_sync_off_but_the_last(
    one_rank_group: None, wrapper: str
) -> None:
    """`--accumulation M`: each measured step is M forwards and backwards of the batch, gradient
    sync off for all but the last (DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync`),
    then one optimizer step on the sum of the micro-batches' gradients, each loss divided by M:
    here the single batch's gradient."""
    import estimate_accuracy
    import zoo
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import autoshard

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    batch = (torch.randn(4, 8),)
    reference = torch.autograd.grad(inner(*batch).square().mean(), list(inner.parameters()))
    if wrapper == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(inner)
    elif wrapper == "fsdp2":
        model = fully_shard(inner)
    else:
        model = inner
    synced: list[bool] = []  # per forward and per backward: whether gradient sync was on
    sync = [True]  # FSDP2's, as last set (it has no public getter)
    if wrapper == "fsdp2":
        setter = model.set_requires_gradient_sync

        def recording(on: bool, **kwargs: object) -> None:
            sync[0] = on
            setter(on, **kwargs)

        model.set_requires_gradient_sync = recording  # type: ignore[method-assign]
    on = (lambda: model.require_backward_grad_sync) if wrapper == "ddp" else (lambda: sync[0])
    # DDP decides in its forward whether the backward syncs, FSDP2 in its backward
    inner.register_forward_pre_hook(lambda *_: synced.append(on()))
    inner[2].register_full_backward_hook(lambda *_: synced.append(on()))
    stepped: list[list[torch.Tensor]] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(
        lambda *_: stepped.append([_local(p.grad).clone() for p in model.parameters()])
    )
    built = zoo.ZooModel(model, optimizer, batch, lambda out, b: out.square().mean())
    prepared = autoshard.Prepared(model, optimizer, None)  # type: ignore[arg-type]
    estimate_accuracy.train_step(prepared, built, _Windows(), [None], micro_batches=3)
    assert len(synced) == 6 and len(stepped) == 1  # three forwards and backwards, one step
    for got, want in zip(stepped[0], reference, strict=True):
        torch.testing.assert_close(got, want)
    off = [False] * 4 + [True] * 2
    assert synced == ([True] * 6 if wrapper == "none" else off)
    assert sync == [True]  # FSDP2's sync back on after the step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_accumulation_is_a_number_of_micro_batches(capsys: pytest.CaptureFixture[str]) -> None:
    import estimate_accuracy

    assert estimate_accuracy.parse_args([]).accumulation == 1
    assert estimate_accuracy.parse_args(["--accumulation", "4"]).accumulation == 4
    with pytest.raises(SystemExit):
        estimate_accuracy.parse_args(["--accumulation", "0"])
    assert "--accumulation >= 1" in capsys.readouterr().err


def test_a_zoo_file_of_the_users_own_is_run_as_the_external_zoo_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--zoo FILE.py`: any file defining ENTRIES and build() as zoo_external.py does."""
    import estimate_accuracy

    good = tmp_path / "my_zoo.py"
    good.write_text(
        "import torch\n"
        "import zoo\n"
        "ENTRIES = {'tiny': None, 'other': None}\n"
        "def build(name, per_rank_batch=None, *, rank=0, seed=0, device='cpu'):\n"
        "    model = torch.nn.Linear(4, 2)\n"
        "    batch = (torch.randn(per_rank_batch or 3, 4),)\n"
        "    return zoo.ZooModel(model, torch.optim.AdamW(model.parameters()), batch,\n"
        "                        lambda out, b: out.sum())\n"
    )
    args = estimate_accuracy.parse_args(["--zoo", str(good)])
    assert args.models == "tiny,other"  # every entry unless --models names some
    assert estimate_accuracy.registry(str(good)) is estimate_accuracy.registry(str(good))
    built = estimate_accuracy.registry(str(good)).build("tiny", 5, rank=0, seed=0, device="cpu")
    assert built.batch[0].shape == (5, 4)

    no_build = tmp_path / "no_build.py"
    no_build.write_text("ENTRIES = {'tiny': None}\n")
    for argv, said in (
        (["--zoo", str(no_build)], "defines no build"),
        (["--zoo", str(tmp_path / "absent.py")], "an existing .py file"),
        (["--zoo", "internal"], "an existing .py file"),
        (["--zoo", str(good), "--models", "tiny,huge"], "unknown"),
    ):
        with pytest.raises(SystemExit):
            estimate_accuracy.parse_args(argv)
        assert said in capsys.readouterr().err, argv


# ---------------------------------------------------------------------------------------------
# The harness under torchrun


def _plans_kept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The harness's environment: autoshard's cache on, in a directory of its own. Each row
    plans twice, `plan()` before the allocator profile and `prepare()` inside it, with the same
    model, batch and settings: the second reads the first's fake steps back, as a user's
    `prepare` after a `plan` does. Its figures are the same (tests/test_cache.py); its time is
    not spent twice."""
    return plans_kept(tmp_path_factory.mktemp("plans_kept"))


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    returncode, output, timed_out = run_torchrun(
        REPO / "benchmarks" / "estimate_accuracy.py",
        "--models",
        ",".join(MODELS),
        "--strategies",
        ",".join(STRATEGIES),
        "--mixed-precision",
        "no",
        "--ac",
        "off,on",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--retries",
        "1",
        "--no-trial",  # as before the trial column existed: its CI time unchanged
        "--no-last-use",  # frees bounded at the latest only, as before: its CI time unchanged
        "--json",
        str(out),
        timeout=TIMEOUT_S,
        environment=_plans_kept(tmp_path_factory),
    )
    if timed_out:
        pytest.fail(f"estimate_accuracy.py timed out after {TIMEOUT_S}s:\n{output[-4000:]}")
    if returncode != 0:
        pytest.fail(f"estimate_accuracy.py exited with {returncode}:\n{output[-4000:]}")
    data = json.loads(out.read_text())
    data["stdout"] = output
    return data


@pytest.mark.dist
@pytest.mark.slow
def test_a_row_per_model_and_strategy(result: dict) -> None:
    seen = sorted((r["model"], r["strategy"], r["checkpointed"] > 0) for r in result["rows"])
    assert seen == sorted((m, s, ac) for m in MODELS for s in STRATEGIES for ac in (False, True))
    assert result["machine"]["world_size"] == 2


@pytest.mark.dist
@pytest.mark.slow
def test_every_row_has_every_figure(result: dict) -> None:
    for row in result["rows"]:
        assert row["error_message"] is None, row["error_message"]
        assert ROW_FIELDS <= row.keys(), ROW_FIELDS - row.keys()
        assert BREAKDOWN <= row["breakdown"].keys()
        assert row["mixed_precision"] == "no"
        for key in ("predicted_bytes", "allocator_peak_bytes", "tracker_peak_bytes", "errors"):
            assert len(row[key]) == 2, key
        # The allocator sees every tensor the tracker sees, and more (kernels' scratch memory).
        # Compared on the raw peak, which drops only the frees the profiler reported: the
        # corrected peak takes a gloo buffer whose free went unreported as freed when its
        # collective ended, the earliest it can have been, and so may fall below the tracker in
        # a step where a collective completed late (seen once on a busy machine, by 2.5%).
        for raw, tracker in zip(
            row["allocator_raw_peak_bytes"], row["tracker_peak_bytes"], strict=True
        ):
            assert raw >= 0.99 * tracker > 0
        assert row["error"] == row["errors"][row["worst_rank"]]


@pytest.mark.dist
@pytest.mark.slow
def test_stdout_has_the_table_and_the_summary(result: dict) -> None:
    assert "| model | world | strategy | optimizer | mp | AC | predicted MiB |" in result["stdout"]
    assert "median |error|" in result["stdout"] and "worst |error|" in result["stdout"]
    assert {"median_abs_error", "worst_abs_error"} <= result["summary"].keys()
    worst = max(result["rows"], key=lambda r: abs(r["error"]))
    assert (
        f"{worst['model']} world 2 {worst['strategy']} {worst['optimizer_class']} "
        in (result["summary"]["worst"])
    )


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["ac_off", "ac_all"])
def test_estimate_within_target(
    result: dict, model: str, strategy: str, checkpointed: bool
) -> None:
    row = next(
        r
        for r in result["rows"]
        if r["model"] == model
        and r["strategy"] == strategy
        and (r["checkpointed"] > 0) == checkpointed
    )
    predicted = row["predicted_bytes"][row["worst_rank"]] / 2**20
    measured = row["allocator_peak_bytes"][row["worst_rank"]] / 2**20
    assert abs(row["error"]) <= WORST_TARGET, (
        f"{model} {strategy}: predicted {predicted:.1f} MiB, allocator peak {measured:.1f} MiB "
        f"({100 * row['error']:+.1f}%, target within {100 * WORST_TARGET:g}%); "
        f"breakdown {row['breakdown']}"
    )


# ---------------------------------------------------------------------------------------------
# The external zoo (benchmarks/zoo_external.py): models nobody here wrote, held to the issue's
# targets. Its fast subset (`zoo_external.FAST`): a mixture of experts run through
# torch._grouped_mm (Mixtral), tied embeddings (GPT-2), an encoder-decoder (T5), PEFT LoRA on a
# GQA decoder (frozen base) and a plain-torch encoder returning a dict, under every strategy at
# 2 ranks, fp32, checkpointing off, the first two steps after prepare (with its trial step, as
# a user calls it) measured, no tracker (the allocator's figures only). 6-7 minutes on 2 cores
# shared with other test runs. Without the trial step, FSDP2's first step holds one-off
# allocations the estimate does not count (T5 FULL_SHARD -3.5%): see benchmarks/RESULTS.md.

MEDIAN_TARGET = 0.03
UNDER_TARGET = -0.03
EXTERNAL_TIMEOUT_S = 120 * SLOW_MACHINE  # a hang detector (see _dist.SLOW_MACHINE)


def _external_models() -> tuple[str, ...]:
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")
    pytest.importorskip("peft", reason="peft is not installed (the test extra)")
    return zoo_external.FAST


def test_unreported_frees_have_two_bounds_the_last_use_and_the_reuse() -> None:
    allocations = [
        Allocation(0, ptr=1, nbytes=100, last_use=5),  # last used at 5, its free unreported
        Allocation(10, ptr=2, nbytes=50),
        Allocation(20, ptr=2, nbytes=-50),
        Allocation(30, ptr=1, nbytes=100),  # its address reused: freed at the latest here
        Allocation(40, ptr=1, nbytes=-100),
        Allocation(50, ptr=3, nbytes=20, last_use=55),  # never freed nor reused
        Allocation(60, ptr=4, nbytes=30),  # never used, never freed
    ]
    latest = corrected_deltas(allocations)
    earliest = corrected_deltas(allocations, earliest=True)
    # latest: 100, 150 at 10, 100 at 20, 100 at 30 (-100 + 100), 0 at 40, then 20 and 50
    assert running_peak(latest.deltas, 0, 45)[0] == 150
    assert sum(d for _, d in latest.deltas) == 50
    # earliest: 100 until 5, 50 at 10, 0 at 20, 100 at 30; the leaked block freed after its use
    assert running_peak(earliest.deltas, 0, 45)[0] == 100
    assert sum(d for _, d in earliest.deltas) == 30
    # both count the same frees as missed, and both blocks as leaked (the row is measured again)
    assert latest.missed_frees == earliest.missed_frees == (1, 100)
    assert latest.leaked == earliest.leaked == (2, 50)
    # what is live at a moment, as the earliest bound counts it
    assert [a.ptr for a in live_at(allocations, 12)] == [2]
    assert [a.ptr for a in live_at(allocations, 52)] == [3]
    assert [a.ptr for a in live_at(allocations, 65)] == [4]


@pytest.fixture(scope="module")
def external(tmp_path_factory: pytest.TempPathFactory) -> dict:
    models = _external_models()
    out = tmp_path_factory.mktemp("accuracy_external") / "accuracy.json"
    returncode, output, timed_out = run_torchrun(
        REPO / "benchmarks" / "estimate_accuracy.py",
        "--zoo",
        "external",
        "--models",
        ",".join(models),
        "--strategies",
        ",".join(STRATEGIES),
        "--mixed-precision",
        "no",
        "--ac",
        "off",
        "--steps",
        "2",  # the first step has no optimizer state in backward: the second is the steady one
        "--retries",
        "1",
        "--no-tracker",
        "--json",
        str(out),
        timeout=EXTERNAL_TIMEOUT_S,
        environment=_plans_kept(tmp_path_factory),
    )
    if timed_out:
        pytest.fail(
            f"estimate_accuracy.py timed out after {EXTERNAL_TIMEOUT_S}s:\n{output[-4000:]}"
        )
    if returncode != 0:
        pytest.fail(f"estimate_accuracy.py exited with {returncode}:\n{output[-4000:]}")
    return json.loads(out.read_text())


def _external_row(result: dict, model: str, strategy: str) -> dict:
    row = next(r for r in result["rows"] if r["model"] == model and r["strategy"] == strategy)
    assert row["error_message"] is None, f"{model} {strategy}: {row['error_message']}"
    return row


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model", zoo_external.FAST)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_external_estimate_within_target(external: dict, model: str, strategy: str) -> None:
    row = _external_row(external, model, strategy)
    w = row["worst_rank"]
    detail = (
        f"{model} {strategy}: predicted {row['predicted_bytes'][w] / 2**20:.2f} MiB, allocator "
        f"peak {row['allocator_peak_bytes'][w] / 2**20:.2f} MiB ({100 * row['error']:+.1f}%); "
        f"breakdown {row['breakdown']}; reasons {row['reasons']}"
    )
    assert abs(row["error"]) <= WORST_TARGET, detail
    # every term measured: the plan traced the batch and simulated the strategy
    assert row["breakdown"]["activations"] > 0, detail
    assert not any("not simulated" in r for r in row["reasons"]), detail


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model", zoo_external.FAST)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_external_no_underestimate_beyond_target(external: dict, model: str, strategy: str) -> None:
    row = _external_row(external, model, strategy)
    w = row["worst_rank"]
    assert row["error"] >= UNDER_TARGET, (
        f"{model} {strategy}: predicted {row['predicted_bytes'][w] / 2**20:.2f} MiB, allocator "
        f"peak {row['allocator_peak_bytes'][w] / 2**20:.2f} MiB ({100 * row['error']:+.1f}%)"
    )


@pytest.mark.dist
@pytest.mark.slow
def test_external_median_error_within_target(external: dict) -> None:
    models = _external_models()
    assert sorted((r["model"], r["strategy"]) for r in external["rows"]) == sorted(
        (m, s) for m in models for s in STRATEGIES
    )
    done = external["rows"]
    assert all(r["error_message"] is None for r in done)
    median = statistics.median(abs(r["error"]) for r in done)
    assert median <= MEDIAN_TARGET, f"median |error| {100 * median:.1f}%"
