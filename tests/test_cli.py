"""The `autoshard` command: answers rather than tracebacks, and output for machines."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from _dist import REPO, run_tree
from test_readme import _free_port, run_command
from torch import nn

import autoshard
from autoshard import cli
from autoshard.cli import demo


def test_demo_that_does_not_fit_says_so_once_and_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(demo.STATUS_FILE_ENV, raising=False)
    status = demo.main(["--memory-limit", "64KiB", "--steps", "2"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("no strategy fits") == 1, err
    assert err.startswith("autoshard demo: no strategy fits: the most frugal candidate"), err
    assert "Traceback" not in err


def test_demo_under_the_cli_hands_its_status_over_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torchrun prints a ChildFailedError for a rank that exits non-zero: under `autoshard demo`
    # the ranks exit 0 and rank 0 leaves the status for the command to exit with.
    status_file = tmp_path / "status"
    monkeypatch.setenv(demo.STATUS_FILE_ENV, str(status_file))
    assert demo.main(["--memory-limit", "64KiB", "--steps", "2"]) == 0
    assert status_file.read_text() == "2"


@pytest.mark.slow
def test_cli_demo_that_does_not_fit_prints_the_answer_once() -> None:
    returncode, output = run_command("autoshard demo --memory-limit 4MiB", REPO)
    assert returncode == 2, output
    assert output.count("no strategy fits") == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output


def test_cli_strategy_gets_the_librarys_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "autoshard.cli.demo:plan_example", "--strategy", "fsdp"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --strategy: strategy='fsdp' is not one of" in err
    assert err.rstrip().endswith("did you mean 'full_shard'?"), err


def tiny() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A factory for `autoshard plan test_cli:tiny`."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters()), torch.randn(4, 8)


PLAN_KEYS = {
    "max_batch",
    "strategy",
    "mixed_precision",
    "activation_checkpointing",
    "cpu_offload",
    "estimated_peak_bytes",
    "measured_peak_bytes",
    "device_memory_bytes",
    "world_size",
    "num_blocks",
    "chosen",
    "candidates",
    "attempts",
    "unused_parameters",
    "layer_drop",
    "autocast_raises",
    "reasons",
}
CANDIDATE_KEYS = {
    "max_batch",
    "strategy",
    "activation_checkpointing",
    "estimated_peak_bytes",
    "footprint",
    "step_seconds",
    "fits",
    "host_bytes",
    "reserve_bytes",
}
FOOTPRINT_KEYS = {
    "params",
    "grads",
    "optimizer_state",
    "activations",
    "comm_buffers",
    "temporaries",
    "overheads",
    "workspace",
}


def test_plan_to_dict_is_plain_json_with_the_chosen_candidate() -> None:
    model, optimizer, batch = tiny()
    plan = autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="no"
    )
    d = plan.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON types only
    assert set(d) == PLAN_KEYS
    assert d["strategy"] == plan.strategy.value and d["world_size"] == 2
    assert len(d["candidates"]) == len(plan.candidates) > 1
    for c in [d["chosen"], *d["candidates"]]:
        assert set(c) == CANDIDATE_KEYS and set(c["footprint"]) == FOOTPRINT_KEYS
        assert sum(c["footprint"].values()) == c["estimated_peak_bytes"]
    chosen = d["chosen"]
    assert (chosen["strategy"], chosen["activation_checkpointing"]) == (
        d["strategy"],
        d["activation_checkpointing"],
    )
    assert chosen["estimated_peak_bytes"] == d["estimated_peak_bytes"] == plan.chosen.footprint.peak
    assert chosen in d["candidates"]


def test_cli_plan_json_prints_plan_to_dict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "test_cli:tiny", "--world-size", "2", "--device-memory", "1GiB"]
    assert cli.main([*argv, "--device", "cpu", "--mixed-precision", "no", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    batch = tiny()[2]
    with torch.device("meta"):  # as the command builds it
        model = tiny()[0]
    expected = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        batch.to("meta"),
        world_size=2,
        device_memory="1GiB",
        device="cpu",
        mixed_precision="no",
    ).to_dict()
    assert set(d) == PLAN_KEYS
    for key in ("strategy", "activation_checkpointing", "estimated_peak_bytes", "chosen"):
        assert d[key] == expected[key], key


TEARDOWN_SCRIPT = """
import atexit, torch, torch.distributed as dist
from torch import nn
import autoshard

# registered before prepare's hook, so it runs after it (atexit runs last-in, first-out)
atexit.register(lambda: print("group destroyed at exit:", not dist.is_initialized()))
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer, plan = autoshard.prepare(model, optimizer, torch.randn(4, 8), strategy="ddp")
print("initialised by prepare:", dist.is_initialized())
"""


def test_prepare_destroys_the_group_it_created_at_exit(tmp_path: Path) -> None:
    # what torchrun sets, for one rank: prepare creates the gloo group, and no script ritual
    # (del model; gc.collect(); destroy_process_group()) is needed to leave cleanly
    script = tmp_path / "one_rank.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=str(REPO),
        CUDA_VISIBLE_DEVICES="",
    )
    returncode, output, _ = run_tree([sys.executable, str(script)], tmp_path, env, 120)
    assert returncode == 0, output
    assert "initialised by prepare: True" in output, output
    assert "group destroyed at exit: True" in output, output


def test_prepare_says_what_it_is_doing(caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer, batch = tiny()
    with caplog.at_level(logging.INFO, logger="autoshard"):
        autoshard.prepare(model, optimizer, batch, mixed_precision="no")
    said = [r.getMessage() for r in caplog.records if r.name == "autoshard"]
    assert said[0] == "tracing one step of the example batch for its activations", said
    assert said[1] == "simulating LOCAL at 1 rank(s) on fake tensors", said
    assert said[2] == (
        "chose LOCAL with 0/0 blocks checkpointed; wrapping the model; running the trial step"
    )
    assert said[-1].startswith("prepared:\nautoshard plan: LOCAL"), said


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_a_trial_above_the_estimate_is_said_once(
    level: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo on a GPU printed the trial's warning twice: in the plan logged at INFO, and by
    the logger again. Shown at INFO the plan carries it; at WARNING the warning alone does."""
    from autoshard import api

    real = api.prove

    def over(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(result, measured_peak=10 * result.chosen.estimated_peak_bytes)

    monkeypatch.setattr(api, "prove", over)
    model, optimizer, batch = tiny()
    with caplog.at_level(level, logger="autoshard"):
        autoshard.prepare(model, optimizer, batch, mixed_precision="no")
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "autoshard")
    assert said.count("warning: the trial step measured") == 1, said
