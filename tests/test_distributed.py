"""Multi-process tier (DESIGN.md section 5): real DDP / FSDP2 wrapping on 2 gloo ranks on CPU.

Each worker in tests/workers/ is launched once under real torchrun (see tests/_dist.py) and runs
many sub-cases; the tests below assert on what each rank recorded, one sub-case per test. The
harness's timeout turns a hang (a rank waiting in a collective its peer never entered) into a
failure that shows both ranks' output.

Loss convention: rank r trains on its half of a global batch; the loss compared with the
single-process reference (same seed, model and AdamW, the whole global batch) is the mean of the
two ranks' losses, which equals the reference's mean loss since the halves are the same size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from _dist import Launch, launch

pytestmark = pytest.mark.dist

STRATEGIES = ["ddp", "shard_grad_op", "full_shard"]
FSDP = {"shard_grad_op", "full_shard"}
LR = 1e-2  # tests/workers/_common.py LR

# fp32 parity. The distributed run and the reference compute the same losses up to the order of
# floating-point reductions: the global-batch mean is reduced over 16 rows at once in the
# reference but as two 8-row means averaged by the all-reduce / reduce-scatter, so gradients
# differ in the last bits (fp32 unit roundoff 6e-8; observed loss differences ~1e-7 relative).
# AdamW's update, about lr * sign(gradient) early on, does not amplify that over 5 steps. 1e-4
# leaves three orders of magnitude of headroom for other machines' reduction orders, while a real
# error (a rank training on the other rank's rows or on unsynchronised parameters, a step skipped
# or applied twice) moves these losses by percent. (Adam is nearly invariant to the gradient's
# scale, so summing instead of averaging would hide from a loss comparison; it is not claimed.)
RTOL_FP32 = 1e-4
# bf16 keeps an 8-bit mantissa (unit roundoff 2^-8 = 3.9e-3). Under FSDP2 the whole forward, the
# loss included, runs in bf16, so the loss itself is rounded to ~0.4%, and 10 steps of training on
# bf16 gradients drift a little further (observed at most 0.5%). 2e-2 is ~5 bf16 roundings.
RTOL_BF16 = 2e-2
# fp16 keeps a 10-bit mantissa (unit roundoff 2^-11 = 4.9e-4): observed within 0.1% of fp32 once
# steps the gradient scaler skipped are accounted for; 1e-2 is the same margin as for bf16.
RTOL_FP16 = 1e-2


def _run(worker: str, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launch(worker, Path(tmp_path_factory.mktemp(worker)))


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _run("parity", tmp_path_factory)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _run("state", tmp_path_factory)


@pytest.fixture(scope="module")
def decide(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _run("decide", tmp_path_factory)


def mean_losses(ranks: list[dict[str, Any]], key: str = "losses") -> list[float]:
    """Per step, the mean over ranks of each rank's loss."""
    per_rank = [r[key] for r in ranks]
    assert len({len(losses) for losses in per_rank}) == 1, per_rank
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


def reference(parity: Launch, key: str = "losses") -> list[float]:
    ranks = parity.case("reference")
    assert ranks[0][key] == ranks[1][key], "the reference is deterministic: same on both ranks"
    return ranks[0][key]


def assert_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected)
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))
    assert actual == pytest.approx(expected, rel=rtol, abs=0), (
        f"largest relative difference {worst:.3g} > {rtol:g}\n"
        f"actual   {actual}\nexpected {expected}"
    )


def assert_trains(losses: list[float]) -> None:
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.5 * losses[0], f"the loss did not go down: {losses}"


@pytest.mark.parametrize("worker", ["parity", "state", "decide"])
def test_worker_launch_finished_cleanly(worker: str, request: pytest.FixtureRequest) -> None:
    run: Launch = request.getfixturevalue(worker)
    if run.timed_out or run.returncode != 0:
        pytest.fail(run.report("the launch did not finish cleanly"), pytrace=False)
    run.case("__finished__")  # both ranks ran every case and destroyed the process group


# ---------------------------------------------------------------------------------------------
# 1. Forced strategies: native wrapper, same optimizer, losses equal to one process on the
#    global batch


def test_prepare_initialises_the_gloo_process_group_under_torchrun(parity: Launch) -> None:
    for r in parity.case("parity_ddp"):
        assert r["pg_initialised_before"] is False
        assert r["pg_backend"] == "gloo"
        assert r["world_size"] == 2
        assert r["omp_num_threads"] == "1"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forced_strategy_returns_native_wrapper_and_same_optimizer(
    parity: Launch, strategy: str
) -> None:
    for r in parity.case(f"parity_{strategy}"):
        assert r["strategy"] == strategy
        assert r["mixed_precision"] == "no"
        assert r["activation_checkpointing"] == 0
        assert r["block_forwards_per_step"] == [1, 1, 1, 1], "no block is recomputed"
        assert r["optimizer_is_same"], "prepare must return the optimizer it was given"
        assert r["wraps_the_module"]
        if strategy == "ddp":
            assert r["is_ddp"] and not r["is_fsdp"], r["wrapped_type"]
        else:
            assert r["is_fsdp"] and not r["is_ddp"], r["wrapped_type"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forced_strategy_matches_single_process_reference(parity: Launch, strategy: str) -> None:
    ranks = parity.case(f"parity_{strategy}")
    # Each rank really trained on its own half: the halves' losses differ.
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0]
    assert_close(mean_losses(ranks), reference(parity), RTOL_FP32)


@pytest.mark.parametrize(
    "case", ["scalars_shard_grad_op", "scalars_full_shard", "scalars_full_shard_accumulating"]
)
def test_fsdp2_trains_a_model_with_parameters_of_no_dimension(parity: Launch, case: str) -> None:
    """FSDP2 refuses to shard a parameter of no dimension (CLIP's logit_scale, a ReZero gate):
    every sharding strategy was ruled out for such a model. They stay whole on every rank, their
    gradients averaged as FSDP2 averages the others': the losses and the scalars after training
    are the single process's, on both ranks alike, and with gradient sync off on a micro-batch."""
    ranks = parity.case(case)
    expected = reference(parity, "scalar_losses")
    for r in ranks:
        assert r["strategy"] == case.split("_", 1)[1].removesuffix("_accumulating")
        assert r["is_fsdp"] and r["scalar_types"] == ["Parameter"], r
        assert not any("fails in the planning simulation" in why for why in r["reasons"])
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0]
    assert_close(mean_losses(ranks), expected, RTOL_FP32)
    trained = parity.case("reference")[0]["scalars"]
    assert len(trained) == 5  # four gates and the temperature
    for r in ranks:
        assert r["scalars"].keys() == trained.keys()
        assert r["scalars"] == pytest.approx(trained, rel=RTOL_FP32, abs=0), r["scalars"]
    assert ranks[0]["scalars"] == ranks[1]["scalars"]


# ---------------------------------------------------------------------------------------------
# 2. Activation checkpointing of 2 of 4 blocks changes memory, not the losses


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_checkpointing_keeps_the_losses(parity: Launch, strategy: str) -> None:
    ranks = parity.case(f"ac_{strategy}")
    for r in ranks:
        assert r["strategy"] == strategy
        assert r["activation_checkpointing"] == 2
        # The first 2 blocks are recomputed in backward: each runs its forward twice a step.
        assert r["block_forwards_per_step"] == [2, 2, 1, 1]
    without = mean_losses(parity.case(f"parity_{strategy}"))
    assert_close(mean_losses(ranks), without, RTOL_FP32)
    assert_close(mean_losses(ranks), reference(parity), RTOL_FP32)


# ---------------------------------------------------------------------------------------------
# 3. bf16 trains and stays near fp32


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_bf16_trains_close_to_fp32(parity: Launch, strategy: str) -> None:
    ranks = parity.case(f"bf16_{strategy}")
    for r in ranks:
        assert r["mixed_precision"] == "bf16"
        assert r["strategy"] == strategy
        assert r["scaler"] is None, "bf16 needs no gradient scaler"
        assert_trains(r["losses"])
    assert_close(mean_losses(ranks), reference(parity, "fixed_batch_losses"), RTOL_BF16)


# ---------------------------------------------------------------------------------------------
# 9. fp16 on CPU: a scaler comes back, unpacking still works, training with it works


@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_fp16_returns_a_scaler_and_trains_with_it(parity: Launch, strategy: str) -> None:
    ranks = parity.case(f"fp16_{strategy}")
    for r in ranks:
        assert r["is_prepared"] and r["is_tuple_of_3"] and r["unpacked_match"]
        assert r["optimizer_is_same"]
        assert r["mixed_precision"] == "fp16"
        assert r["strategy"] == strategy
        assert r["scaler"] is not None, "fp16 must come with a gradient scaler"
        assert r["finite"]
        assert_trains(r["losses"])
    # The ranks agree on inf/NaN, so they skip the same steps and keep the same scale.
    assert ranks[0]["scale_after"] == ranks[1]["scale_after"]
    # Each step the scaler skipped (inf gradients) halved the scale and left the model as it was;
    # past those, the losses follow the fp32 run.
    skipped = round(math.log2(ranks[0]["scale_before"] / ranks[0]["scale_after"]))
    assert 0 <= skipped <= 2, ranks[0]
    fp32 = reference(parity, "fixed_batch_losses")
    assert_close(mean_losses(ranks)[skipped:], fp32[: len(fp32) - skipped], RTOL_FP16)


# ---------------------------------------------------------------------------------------------
# 4. strategy="auto" under memory_limit


def test_auto_picks_fsdp_when_the_limit_excludes_ddp(decide: Launch) -> None:
    estimates = decide.case("what_if_estimates")[0]
    ranks = decide.case("auto_limit_between_ddp_and_fsdp")
    limit = ranks[0]["limit"]
    # The premise: DDP does not fit even with activation checkpointing; some FSDP candidate does.
    fsdp_min = min(estimates["peaks"]["shard_grad_op"], estimates["peaks"]["full_shard"])
    assert fsdp_min < min(estimates["ddp_by_ac"]), f"FSDP should save memory here: {estimates}"
    assert fsdp_min <= limit < min(estimates["ddp_by_ac"]), estimates
    for r in ranks:
        assert r["device_memory_bytes"] == limit, "memory_limit caps the usable memory"
        assert r["strategy"] in FSDP, r["reasons"]
        assert r["is_fsdp"]
        assert r["estimated_peak_bytes"] <= limit
    assert ranks[0]["strategy"] == ranks[1]["strategy"], "every rank decides the same"
    assert_close(mean_losses(ranks), ranks[0]["reference_losses"], RTOL_FP32)


def test_auto_picks_ddp_when_the_limit_is_generous(decide: Launch) -> None:
    ranks = decide.case("auto_generous_limit")
    for r in ranks:
        assert r["strategy"] == "ddp", r["reasons"]
        assert r["activation_checkpointing"] == 0
        assert r["is_ddp"]
    assert_close(mean_losses(ranks), ranks[0]["reference_losses"], RTOL_FP32)


def test_max_batch_is_the_same_on_every_rank(decide: Launch) -> None:
    ranks = decide.case("auto_max_batch")
    assert ranks[0]["max_batch"] is not None and ranks[0]["max_batch"] > 0, ranks[0]["reasons"]
    assert all(r["max_batch"] == ranks[0]["max_batch"] for r in ranks)
    assert all(r["candidates"] == ranks[0]["candidates"] for r in ranks)
    reason = next(x for x in ranks[0]["reasons"] if x.startswith("largest per-rank batch"))
    assert "the least of the 2 ranks' figures" in reason, reason


def test_does_not_fit_names_the_same_largest_batch_on_every_rank(decide: Launch) -> None:
    ranks = decide.case("does_not_fit_names_the_largest_batch_on_every_rank")
    assert all(r["raised"] and r["type"] == "DoesNotFit" for r in ranks), ranks
    assert ranks[0]["message"] == ranks[1]["message"]
    # half the least peak, which parameters and optimizer state dominate: no batch helps
    message = ranks[0]["message"]
    assert "No smaller per-rank batch was found to fit: not even one of its 8 rows" in message


# ---------------------------------------------------------------------------------------------
# 5. An LR scheduler built before prepare() drives the re-bound optimizer


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lr_scheduler_built_before_prepare_still_steps(state: Launch, strategy: str) -> None:
    for r in state.case(f"scheduler_{strategy}"):
        assert r["optimizer_is_same"] and r["scheduler_optimizer_is_same"]
        assert r["group_params_are_module_params"], "the group holds the module's own parameters"
        expected_dtensor = [strategy in FSDP] * r["num_params"]
        assert r["group_params_dtensor"] == expected_dtensor
        # LambdaLR factors 1, 0.5, 0: the trial step left lr as it was; each scheduler.step()
        # then moved the lr of the group the optimizer uses.
        assert r["lrs"] == [LR, LR * 0.5, 0.0]
        assert r["last_lr"] == [0.0]
        # The updates reach the wrapped parameters, and at lr 0 they stop.
        assert r["changed_per_step"] == [r["num_params"], r["num_params"], 0]


# ---------------------------------------------------------------------------------------------
# 6. Optimizer state held before prepare() is re-keyed (and sharded under FSDP)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_is_rekeyed_to_the_new_parameters(state: Launch, strategy: str) -> None:
    for r in state.case(f"rekey_{strategy}"):
        assert sorted(r["state_keys"]) == sorted(r["param_names"])
        assert len(r["state_keys"]) == len(r["param_names"])
        for name, entry in r["per_param"].items():
            assert entry["has_state"], name
            assert entry["step"] == 3.0, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert entry[f"{key}_equal"], (name, key, entry[f"{key}_max_abs_diff"])
                if strategy in FSDP:
                    assert r["param_dtensor"][name]
                    assert entry[f"{key}_dtensor"], (name, key)
                    assert entry[f"{key}_placements_match"], (name, key)
                else:
                    assert not entry[f"{key}_dtensor"], (name, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_resumes_from_rekeyed_state(state: Launch, strategy: str) -> None:
    ranks = state.case(f"rekey_{strategy}")
    expected = ranks[0]["reference_losses"]
    pre = len(ranks[0]["pre_losses"])
    assert ranks[0]["pre_losses"] == expected[:pre]
    assert_close(mean_losses(ranks, "post_losses"), expected[pre:], RTOL_FP32)


# ---------------------------------------------------------------------------------------------
# 7. The trial step leaves nothing behind


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trial_step_restores_everything(state: Launch, strategy: str) -> None:
    for r in state.case(f"trial_{strategy}_on"):
        assert len(r["attempts"]) == 1, "the trial step ran"
        assert r["same_param_names"]
        assert r["params_changed"] == []
        assert any("running_mean" in n for n in r["buffer_names"])
        assert r["buffers_changed"] == []
        assert r["grads"] == [], "no gradient left on any parameter"
        assert r["optimizer_state_len"] == 0, "a fresh optimizer stays empty"
        assert r["group_options_changed"] == []
        assert r["rng_equal"], "the CPU RNG state is what it was before prepare()"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trial_step_does_not_change_training(state: Launch, strategy: str) -> None:
    on = state.case(f"trial_{strategy}_on")
    off = state.case(f"trial_{strategy}_off")
    for r in off:
        assert r["attempts"] == [], "trial_step=False runs no trial step"
        assert r["rng_equal"]
    for rank, (a, b) in enumerate(zip(on, off, strict=True)):
        # Dropout draws from the RNG: any state the trial left behind would change these.
        assert a["losses"] == b["losses"], f"rank {rank}"


# ---------------------------------------------------------------------------------------------
# 8. Bad input on one rank: every rank raises, none hangs (the launch's timeout proves it)


def test_invalid_argument_on_one_rank_raises_on_every_rank(decide: Launch) -> None:
    rank0, rank1 = decide.case("bad_strategy_on_rank1")
    assert rank1["type"] == "ValueError" and "zero4" in rank1["message"], rank1
    assert rank0["type"] == "ValueError" and "rank 1" in rank0["message"], rank0
    assert "zero4" in rank0["message"], "rank 0 should say what rank 1 got wrong"
    assert rank0["untouched"] and rank1["untouched"]


def test_invalid_type_on_one_rank_raises_on_every_rank(decide: Launch) -> None:
    rank0, rank1 = decide.case("bad_type_on_rank1")
    assert rank1["type"] == "TypeError" and "trial_step" in rank1["message"], rank1
    assert rank0["type"] == "TypeError", "the type is kept on every rank"
    assert "rank 1 failed in prepare() with TypeError: trial_step" in rank0["message"], rank0
    assert rank0["untouched"] and rank1["untouched"]


def test_different_models_across_ranks_raise_on_every_rank(decide: Launch) -> None:
    for r in decide.case("different_model_on_rank1"):
        assert r["type"] == "ValueError", r
        assert "disagree" in r["message"] and "model" in r["message"], r
        assert r["untouched"]


def test_different_arguments_across_ranks_raise_on_every_rank(decide: Launch) -> None:
    for r in decide.case("different_strategy_on_rank1"):
        assert r["type"] == "ValueError", r
        assert "ranks disagree with rank 0 on strategy (ranks [1])" in r["message"], r
        assert r["untouched"]


def test_local_strategy_on_two_ranks_is_a_value_error(decide: Launch) -> None:
    for r in decide.case("local_strategy_on_two_ranks"):
        assert r["type"] == "ValueError", r
        assert "local" in r["message"].lower(), r


def test_each_rank_s_worker_simulates_as_that_rank(decide: Launch) -> None:
    """measure.sharing inside a job: of each rank's 9 steps (3 runs of 3 kinds at 3 depths) its
    worker made 6 (the first of each kind is the rank's, which the worker checks itself
    against), gathered the same on both ranks, equal to the simulations without workers."""
    for r in decide.case("simulations_shared_out_to_workers"):
        assert r["equal"], r
        assert r["runs"] == 6, r
        assert "shared out among 2 ranks, 6 of the fake steps made by 1 worker" in r["note"], r


def test_ranks_stay_in_step_after_errors(decide: Launch) -> None:
    ranks = decide.case("still_in_step_after_errors")
    for r in ranks:
        assert r["strategy"] == "full_shard"
        assert r["all_reduce"] == 3.0
    assert_close(mean_losses(ranks), ranks[0]["reference_losses"], RTOL_FP32)


def test_ddp_finds_parameters_that_get_no_gradient(decide: Launch) -> None:
    for r in decide.case("ddp_with_parameters_that_get_no_gradient"):
        assert r["find_unused_parameters"] is True, r
        assert len(r["reasons"]) == 1 and "'unused." in r["reasons"][0], r
        assert r["losses"][-1] < r["losses"][0], r  # trains past the second step


def test_ddp_looks_for_unused_parameters_where_the_model_drops_layers(decide: Launch) -> None:
    for r in decide.case("ddp_with_layer_drop"):
        assert r["unused_parameters"] == [], r  # the traced step used every layer
        assert r["layer_drop"] == "'layerdrop' is 0.1", r
        assert r["find_unused_parameters"] is True, r
        assert len(r["reasons"]) == 1 and "find_unused_parameters=True" in r["reasons"][0], r
        assert len(r["losses"]) == 3, r  # trained past the steps that skip a layer


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("optimizer_state_on_rank0_only", "optimizer state"),
        ("example_batch_on_rank0_only", "example_batch"),
    ],
)
def test_ranks_that_would_run_different_collectives_are_refused_together(
    decide: Launch, case: str, field: str
) -> None:
    for r in decide.case(case):
        assert r["raised"] and r["type"] == "ValueError", r
        assert "disagree" in r["message"] and field in r["message"], r


# ---------------------------------------------------------------------------------------------
# 9. HYBRID_SHARD: a 2-D mesh (replicate across "nodes", shard within one), trained for real


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return _run("hybrid", tmp_path_factory)


def test_hybrid_launch_finished_cleanly(hybrid: Launch) -> None:
    if hybrid.timed_out or hybrid.returncode != 0:
        pytest.fail(hybrid.report("the launch did not finish cleanly"), pytrace=False)
    hybrid.case("__finished__")


def test_hybrid_shard_trains_on_a_2d_mesh_like_one_process(hybrid: Launch) -> None:
    ranks = hybrid.case("hybrid_forced")
    for r in ranks:
        assert r["strategy"] == "hybrid_shard"
        assert r["optimizer_is_same"]
        assert r["mesh_shape"] == [2, 1]  # 2 nodes of 1 rank: replicate 2, shard 1
        assert r["mesh_dims"] == ["replicate", "shard"]
        assert r["placements"] == ["R", "S(0)"]  # replicated across nodes, dim 0 sharded within
    assert_close(mean_losses(ranks), hybrid.case("reference")[0]["losses"], RTOL_FP32)


def test_hybrid_shard_averages_parameters_of_no_dimension_over_the_2d_mesh(
    hybrid: Launch,
) -> None:
    ranks = hybrid.case("hybrid_scalars")
    assert {r["strategy"] for r in ranks} == {"hybrid_shard"}
    assert_close(mean_losses(ranks), hybrid.case("reference")[0]["scalar_losses"], RTOL_FP32)
    assert len(ranks[0]["scalars"]) == 5 and ranks[0]["scalars"] == ranks[1]["scalars"]


def test_ranks_on_two_nodes_make_hybrid_a_candidate(hybrid: Launch) -> None:
    for r in hybrid.case("auto_offers_hybrid"):
        # weighed: shown, or left unsimulated as slower than a candidate that fits
        outweighed = [x for x in r["reasons"] if "not simulated nor shown" in x]
        assert "hybrid_shard" in r["candidates"] or "HYBRID_SHARD" in "".join(outweighed), r


# ---------------------------------------------------------------------------------------------
# 10. Batch norm under FSDP2 bf16: the norms run in fp32 as under autocast (else the step fails)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_batchnorm_trains_under_fsdp2_bf16(decide: Launch, strategy: str) -> None:
    for r in decide.case(f"batchnorm_bf16_{strategy}"):
        assert r["strategy"] == strategy
        assert r["norm_stats_dtype"] == "torch.float32"
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
