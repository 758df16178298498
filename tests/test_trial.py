"""The trial step on 2 gloo ranks (DESIGN.md section 5, tier 2): OOM on one rank in forward,
backward or the optimizer step; OOM on every rung; a non-OOM error on one rank; bitwise restore;
losses unchanged by the trial; memory_limit on CPU; trial_step=False and the loss conventions.

tests/workers/trial.py runs every sub-case in one torchrun launch (see tests/_dist.py); the tests
below assert on what each rank recorded. A rank left waiting in a collective its peer never entered
would hit the worker's 60 s gloo timeout (or the harness's launch timeout): every failure case also
checks that prepare() returned well before that.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from _dist import TIMEOUT_S, Launch, launch

pytestmark = pytest.mark.dist

STRATEGIES = ["ddp", "shard_grad_op", "full_shard"]
FSDP = {"shard_grad_op", "full_shard"}
ORDER = {"ddp": 0, "shard_grad_op": 1, "full_shard": 2}  # least to most sharded
# A prepare() that ends in an OOM fallback or an error takes about 0.3-3 s on 2 CPU cores; a rank
# waiting for a peer that never comes waits out the 60 s gloo timeout. 30 s separates the two.
PROMPT_S = 30.0
# Identical batches on both ranks average identical gradients, so training matches one process
# on that batch up to the order of floating-point reductions (observed bitwise equal); 1e-4 as in
# tests/test_distributed.py.
RTOL_FP32 = 1e-4


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    # ~30 prepare() calls, each simulating its strategies: more than the default allowance
    return launch("trial", Path(tmp_path_factory.mktemp("trial")), timeout=2 * TIMEOUT_S)


def test_trial_launch_finished_cleanly(trial: Launch) -> None:
    if trial.timed_out or trial.returncode != 0:
        pytest.fail(trial.report("the launch did not finish cleanly"), pytrace=False)
    trial.case("__finished__")  # both ranks ran every case and destroyed the process group


def rungs(r: dict[str, Any]) -> list[tuple[str, int, str, list[int]]]:
    """The attempts as (strategy, checkpointed blocks, outcome, ranks out of memory)."""
    return [
        (a["strategy"], a["activation_checkpointing"], a["outcome"], a["out_of_memory_ranks"])
        for a in r["attempts"]
    ]


def assert_same_plan(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    assert (first["strategy"], first["activation_checkpointing"]) == (
        second["strategy"],
        second["activation_checkpointing"],
    ), "every rank must end with the same plan"
    assert rungs(first) == rungs(second), "every rank must record the same attempts"


def assert_trains(losses: list[float]) -> None:
    assert all(math.isfinite(v) for v in losses), losses
    falling = all(b < a for a, b in zip(losses, losses[1:], strict=False))
    assert falling, f"the loss did not go down step after step: {losses}"


# ---------------------------------------------------------------------------------------------
# 1. OOM on rank 1 only, in forward, backward or the optimizer step


WHERE = ["forward", "backward", "step"]


@pytest.mark.parametrize("strategy", ["auto", "full_shard"])
@pytest.mark.parametrize("where", WHERE)
def test_oom_on_one_rank_moves_every_rank_to_the_same_rung(
    trial: Launch, where: str, strategy: str
) -> None:
    ranks = trial.case(f"oom_rank1_{where}_{strategy}")
    assert [r["fired"] for r in ranks] == [0, 1], "the hook raised on rank 1 only, once"
    if where != "step":
        # The premise of the hooks' is_fake guard: prepare()'s FakeTensorMode trace runs them.
        assert all(r["fake_calls"] >= 1 for r in ranks)
    assert_same_plan(ranks)
    for r in ranks:
        (first, second) = rungs(r)
        # auto starts with DDP (memory is ample); forced FULL_SHARD starts without checkpointing.
        expected_first = "ddp" if strategy == "auto" else "full_shard"
        assert first == (expected_first, 0, "out_of_memory", [1]), r["attempts"]
        assert second[2] == "fit", r["attempts"]
        assert (r["strategy"], r["activation_checkpointing"]) == second[:2]
        # Only escalation: at least as sharded, at least as many checkpointed blocks, not the same.
        assert ORDER[second[0]] >= ORDER[first[0]] and second[1] >= first[1], r["attempts"]
        assert second[:2] != first[:2]
        if strategy == "full_shard":  # forced: escalation checkpoints more blocks, in place
            assert second[0] == "full_shard" and second[1] > 0, r["attempts"]
        assert r["is_fsdp"] == (r["strategy"] in FSDP) and r["is_ddp"] == (r["strategy"] == "ddp")
        assert r["measured_peak_bytes"] == r["attempts"][-1]["measured_peak_bytes"]
        assert any("fell back" in reason for reason in r["reasons"]), r["reasons"]
        assert r["prepare_seconds"] < PROMPT_S, "a rank waited for its peer"


@pytest.mark.parametrize("strategy", ["auto", "full_shard"])
@pytest.mark.parametrize("where", WHERE)
def test_training_after_an_oom_fallback(trial: Launch, where: str, strategy: str) -> None:
    ranks = trial.case(f"oom_rank1_{where}_{strategy}")
    # Both ranks feed the same batch: their losses must be the same, step by step.
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for r in ranks:
        assert_trains(r["losses"])
        assert r["losses"] == pytest.approx(r["plain_losses"], rel=RTOL_FP32, abs=0)
        assert r["all_reduces_while_training"] == 0, "a trial sync point was left behind"


def test_oom_on_rank0_while_unsharded_moves_to_fsdp_and_trains_as_forced(trial: Launch) -> None:
    ranks = trial.case("oom_unless_sharded_on_rank0")
    assert_same_plan(ranks)
    for rank, r in enumerate(ranks):
        first, *_, last = rungs(r)
        assert first == ("ddp", 0, "out_of_memory", [0]), r["attempts"]
        assert last[2] == "fit" and r["strategy"] in FSDP and r["is_fsdp"], r["attempts"]
        assert r["prepare_seconds"] < PROMPT_S, "a rank waited for its peer"
        # DDP unwrapped and the module sharded in place, after a restore: nothing of the aborted
        # attempts shows in training (dropout: the RNG state too).
        assert r["forced_attempts"] == 0
        assert r["losses"] == r["forced_losses"], f"rank {rank}"


def test_oom_that_checkpointing_cannot_cure_reaches_sharding(trial: Launch) -> None:
    # Every DDP rung runs out of memory and every FSDP rung fits. An OOM that aborts the step
    # measures less than the usable memory, so next_rung's shortfall is only a lower bound and
    # any rung estimated smaller "fits": the fastest is the next DDP checkpointing rung. The
    # attempts budget (MAX_ATTEMPTS) must not be spent on DDP's checkpointing alone with a
    # DoesNotFit claiming "every rung it could try" while no sharded rung was tried.
    ranks = trial.case("oom_unless_sharded_checkpointing_cannot_cure")
    for r in ranks:
        assert r["raised"] is None, r["raised"]
        assert r["strategy"] in FSDP, r["attempts"]
        assert r["attempts"][-1]["outcome"] == "fit", r["attempts"]
        assert r["seconds"] < PROMPT_S
    assert_same_plan(ranks)


# ---------------------------------------------------------------------------------------------
# 2. OOM on both ranks on every rung


@pytest.mark.parametrize("strategy", ["auto", "full_shard"])
def test_oom_on_every_rung_raises_does_not_fit_on_every_rank(trial: Launch, strategy: str) -> None:
    for r in trial.case(f"oom_every_rung_{strategy}"):
        assert r["is_does_not_fit"] and r["type"] == "DoesNotFit", r
        assert "ran out of memory on every rung it could try" in r["message"], r["message"]
        assert "out of memory on rank(s) [0, 1]" in r["message"], r["message"]
        assert r["missing_bytes"] is None, "the trial, not the estimate, showed nothing fits"
        assert r["fired"] >= 2, "more than one rung was tried"
        assert r["seconds"] < PROMPT_S, "a rank waited for its peer"


# ---------------------------------------------------------------------------------------------
# 3. A ValueError in forward on rank 0 only


@pytest.mark.parametrize("strategy", ["auto", "full_shard"])
def test_non_oom_error_on_one_rank_is_reraised_there_and_reported_elsewhere(
    trial: Launch, strategy: str
) -> None:
    rank0, rank1 = trial.case(f"value_error_rank0_{strategy}")
    assert rank0["type"] == "ValueError", rank0
    assert rank0["message"] == rank0["raised_message"] == "bad row in the batch on rank 0 (test)"
    assert rank0["is_the_raised_object"], "re-raised unchanged: the very exception object"
    assert rank1["type"] == "ValueError", "the type is kept on the other rank"
    assert rank1["message"] == (
        "rank 0 failed in prepare()'s trial step with ValueError: bad row in the batch on rank 0 "
        "(test)"
    ), rank1
    for r in (rank0, rank1):
        assert r["seconds"] < PROMPT_S, "a rank waited for its peer"


def test_ranks_still_in_step_after_the_failures(trial: Launch) -> None:
    ranks = trial.case("still_in_step")
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for r in ranks:
        assert r["strategy"] == "full_shard"
        assert r["all_reduce"] == 3.0
        assert_trains(r["losses"])


# ---------------------------------------------------------------------------------------------
# 4. Nothing lost, bitwise


@pytest.mark.parametrize("oom", ["fit", "oom_forward", "oom_step"])
@pytest.mark.parametrize("optimizer", ["fresh", "stateful"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trial_step_restores_everything_bitwise(
    trial: Launch, strategy: str, optimizer: str, oom: str
) -> None:
    ranks = trial.case(f"restore_{strategy}_{optimizer}_{oom}")
    assert_same_plan(ranks)
    for rank, r in enumerate(ranks):
        if oom == "fit":
            assert rungs(r) == [(strategy, 0, "fit", [])], r["attempts"]
        else:
            assert rungs(r)[0] == (strategy, 0, "out_of_memory", [1]), r["attempts"]
            assert rungs(r)[-1][2] == "fit" and len(r["attempts"]) == 2, r["attempts"]
            assert r["fired"] == rank, "the hook raised on rank 1 only"
        assert r["strategy"] == strategy
        assert r["same_param_names"]
        assert r["params_changed"] == [], "parameters (full_tensor() under FSDP) differ"
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            assert any(buffer in n for n in r["buffer_names"]), r["buffer_names"]
        assert r["buffers_changed"] == []
        assert r["grads"] == [], "no gradient left on any parameter"
        if optimizer == "fresh":
            assert r["state_names_after"] == [], "a fresh optimizer stays empty"
        else:
            assert len(r["state_names_before"]) == 28  # every parameter of Net(32, 4, batchnorm)
            assert r["state_names_after"] == r["state_names_before"]
            assert r["state_keys_are_module_params"], "state re-keyed to the module's parameters"
            assert r["state_diff"] == [], "optimizer state not restored bitwise"
        assert r["group_options_changed"] == []
        assert r["rng_equal"], "the CPU RNG state is what it was before prepare()"
        assert r["attributes_kept"], "what the forward keeps on the model is as it was"
        assert r["block_cache_kept"], "an attribute the forward set is as it was"
        # a hook the forward registered with the mark it sets: both put back, or the next forward
        # registers it again beside the one left (transformers 5: every hidden state twice)
        assert r["own_hooks_kept"], "the model's own forward hooks are as they were"
        # FSDP2 registers its state-dict hooks in its first forward, the trial's: they stay
        assert (r["state_dict_hooks"] > 0) == (strategy in FSDP), r["state_dict_hooks"]


# ---------------------------------------------------------------------------------------------
# 5. The trial step does not change training


def test_auto_with_trial_trains_bitwise_as_the_chosen_rung_forced_without_trial(
    trial: Launch,
) -> None:
    ranks = trial.case("auto_trial_matches_forced_without_trial")
    for rank, r in enumerate(ranks):
        assert len(r["auto"]["attempts"]) == 1, "auto ran its trial step"
        assert r["forced"]["attempts"] == [], "the forced run had none"
        assert (r["forced"]["strategy"], r["forced"]["activation_checkpointing"]) == (
            r["auto"]["strategy"],
            r["auto"]["activation_checkpointing"],
        )
        assert r["auto_losses"] == r["forced_losses"], f"rank {rank}"
        # Control: the losses depend on the RNG (dropout), so a leaked RNG draw would show.
        assert r["other_seed_losses"] != r["auto_losses"]


# ---------------------------------------------------------------------------------------------
# 6. memory_limit on CPU


def test_measured_peak_is_recorded(trial: Launch) -> None:
    # For the plain Net the estimate is conservative: on torch 2.13 CPU the tracked peak was
    # 2.31 MB against a DDP estimate of 2.82 MB. No memory_limit lies between a fitting estimate
    # and a larger measurement for it, hence the Workspace model of the next test.
    for r in trial.case("memory_limit_plain_model"):
        peak = r["measured_peak_bytes"]
        assert isinstance(peak, int) and peak > 0
        assert r["attempts"][-1]["measured_peak_bytes"] == peak
        assert r["attempts"][-1]["outcome"] == "fit"


def test_measured_peak_above_memory_limit_is_an_oom(trial: Launch) -> None:
    # Tested for real: the Workspace model allocates, in forward, a scratch buffer nothing saves for
    # backward, which the estimate (its trace at 1 and 2 rows) cannot see and the trial's
    # measurement does.
    # memory_limit is set to DDP's estimate exactly, so auto chooses DDP by the estimate; the
    # trial measures more than that on both ranks and must fall back to a rung that measures less.
    ranks = trial.case("memory_limit_exceeded_by_measurement")
    assert_same_plan(ranks)
    for r in ranks:
        limit = r["limit"]
        assert r["estimated_ddp"] == limit and r["candidates"]["ddp/0"] == limit, r["candidates"]
        assert r["device_memory_bytes"] == limit, "memory_limit caps the usable memory"
        first, *_, last = r["attempts"]
        assert rungs(r)[0] == ("ddp", 0, "out_of_memory", [0, 1]), r["attempts"]
        assert first["measured_peak_bytes"] > limit
        assert last["outcome"] == "fit", r["attempts"]
        assert r["measured_peak_bytes"] == last["measured_peak_bytes"] <= limit
        assert (r["strategy"], r["activation_checkpointing"]) == rungs(r)[-1][:2]
        assert r["is_fsdp"] == (r["strategy"] in FSDP)
        assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0]


# ---------------------------------------------------------------------------------------------
# 7. trial_step=False; the loss the trial step trains on


def test_the_training_s_own_bytes_are_this_rank_s_shards(trial: Launch) -> None:
    """A DTensor's `numel` is the whole tensor's: counted so, the CUDA trial held a sharded
    model's every rank's shards as its own, took the process's other tensors for the training's
    and left them out of a memory_limit's cap (`meter.held_bytes`)."""
    for r in trial.case("held_bytes_sharded"):
        assert r["sharded"], r
        # half of everything on 2 ranks (a shard of a tensor of odd rows has a row more)
        assert 0.45 * r["whole"] <= r["held"] <= 0.55 * r["whole"], r


def test_trial_step_false_skips_it(trial: Launch) -> None:
    for r in trial.case("trial_step_off"):
        assert r["attempts"] == []
        assert r["measured_peak_bytes"] is None
        assert "trial step off (trial_step=False)" in r["reasons"], r["reasons"]
        assert r["real_calls"] == 0, "no real forward ran inside prepare()"
        assert r["strategy"] == "ddp"


def test_loss_fn_is_called_with_the_output_and_the_batch(trial: Launch) -> None:
    for r in trial.case("loss_fn_is_used"):
        real = [c for c in r["loss_fn_calls"] if not c["fake"]]
        assert len(real) == 2, "one call per trial step (two for a fresh optimizer)"
        for call in real:
            assert call["output_type"] == "dict" and call["output_keys"] == ["logits"], call
            assert call["logits_shape"] == [8, 4], call  # the model's output for this batch
            assert call["batch_keys"] == ["x", "y"] and call["batch_equal"], call
        # The loss came from loss_fn (cross-entropy), not from summing the logits.
        assert not any(g["all_ones"] for g in r["grads"]["logits"]), r["grads"]


def test_output_loss_is_used_without_loss_fn(trial: Launch) -> None:
    for r in trial.case("output_loss_is_used"):
        assert r["loss_fn_calls"] == []
        losses = r["grads"]["loss"]
        assert len(losses) == 2 and all(g["shape"] == [] and g["all_ones"] for g in losses)
        # output.loss, not output.logits summed: the logits got cross-entropy's gradient.
        assert r["grads"]["logits"] and not any(g["all_ones"] for g in r["grads"]["logits"])


def test_output_is_summed_in_fp32_without_a_loss(trial: Launch) -> None:
    for r in trial.case("output_summed"):
        grads = r["grads"]["logits"]
        assert len(grads) == 2
        for g in grads:  # d(sum)/d(output) = 1 everywhere
            assert g["all_ones"] and g["dtype"] == "torch.float32" and g["shape"] == [8, 4], g
