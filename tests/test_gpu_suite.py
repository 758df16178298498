"""benchmarks/gpu_suite.py on the CPU: its dry run end to end (every section, small sizes, the
same code as on the GPU where there is one), its hard stop, and the measured-throughput API of
the cost model it calibrates (`hardware_for(..., measured=Throughput(...))`).

The dry run's figures are not held to the GPU targets: on the CPU the measured peak is the live
tensor bytes, which kernel scratch memory is missing from. What is checked is that every
section runs and reports what it must. The dry run is marked slow: CI runs it (`--full`), and
`compat`: CI runs it on the oldest torch too, the GPU machines'."""

from __future__ import annotations

import json
import math
import os
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import REPO, SLOW_MACHINE

from autoshard.decide.hardware import Throughput, hardware_for

sys.path.insert(0, str(REPO / "benchmarks"))
import _gpu_accuracy  # noqa: E402
import _gpu_external  # noqa: E402
import _gpu_models  # noqa: E402
import _gpu_prepare  # noqa: E402
import gpu_suite  # noqa: E402

# About 40-60 s on 2 idle cores; the limit turns a hang into a failure (see _dist.SLOW_MACHINE).
TIMEOUT_S = 90 * SLOW_MACHINE


def plain_python(where: Path) -> tuple[str, bool]:
    """A Python with this one's packages (torch, pytest) but, where autoshard is installed
    editable (CI, the venv), without autoshard: a venv whose .pth names this one's
    site-packages. A path line in a .pth adds the directory without running the .pth files in
    it, so the editable install's import hook is never set up. Also says whether autoshard is
    hidden there (a regular install in site-packages is not)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = str(where / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    probe = subprocess.run(
        [python, "-c", "import autoshard"], cwd=where, env=_clean_env(), capture_output=True
    )
    return python, probe.returncode != 0


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The dry run as a plain checkout runs it on the GPU machine: autoshard not installed, no
    PYTHONPATH, started from another directory (the first GPU run's report step could not
    import autoshard)."""
    out = tmp_path_factory.mktemp("gpu_suite")
    python, hidden = plain_python(tmp_path_factory.mktemp("plain_venv"))
    completed = subprocess.run(
        [python, str(REPO / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_clean_env(),
        cwd=out,
    )
    logs = "\n".join(
        (out / name).read_text()[-4000:]
        for name in ("worker.log", "tests.log")
        if (out / name).exists()
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr + logs
    report = json.loads((out / "report.json").read_text())
    report["autoshard_hidden"] = hidden
    return report, (out / "report.md").read_text()


def _section(report: dict, name: str) -> dict:
    entry = report["sections"][name]
    assert entry["status"] == "ok", f"{name}: {entry.get('error')}\n{entry.get('traceback')}"
    return entry["result"]


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_runs_every_section_and_writes_both_reports(dry_run: tuple[dict, str]) -> None:
    report, markdown = dry_run
    assert report["dry_run"] is True
    # where this machine's install could be hidden, the suite ran without it
    assert report["autoshard_hidden"] or "autoshard" not in _editable_finders()
    assert list(report["sections"]) == list(gpu_suite.ORDER)
    for name in gpu_suite.ORDER:
        _section(report, name)
        assert f"## {name}: ok" in markdown


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_collects_the_gpu_tests_and_they_skip_without_cuda(
    dry_run: tuple[dict, str],
) -> None:
    tests = _section(dry_run[0], "tests")
    assert tests["returncode"] == 0
    assert tests["counts"]["failed"] == 0
    assert tests["counts"]["skipped"] == len(tests["cases"]) > 0


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_measures_every_configuration_against_its_estimate(
    dry_run: tuple[dict, str],
) -> None:
    accuracy = _section(dry_run[0], "accuracy")
    rows = accuracy["rows"]
    assert [(r["model"], r["world_size"], r["strategy"], r["optimizer"]) for r in rows] == [
        (c.model, c.world, c.strategy, c.optimizer) for c in _gpu_models.DRY_CONFIGS
    ]
    for row in rows:
        assert "failed" not in row, row
        assert row["estimate_bytes"] > 0 and row["measured_bytes"] > 0
        assert (
            row["error"] == (row["estimate_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
        )
        assert row["modelled_step_s"] > 0 and row["modelled_step_s_measured_throughput"] > 0
    assert accuracy["summary"]["configurations"] == len(rows)
    assert accuracy["summary"]["targets"] == {"median": 0.02, "worst": 0.05, "under": -0.03}
    markdown = dry_run[1]
    assert "| model | world | strategy | AdamW | AC |" in markdown
    assert "| lora | 1 | full_shard | foreach | " in markdown
    assert "(target <= 2%: " in markdown and "(target <= 5%: " in markdown


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_times_prepare_by_phase_for_each_model(dry_run: tuple[dict, str]) -> None:
    prepare = _section(dry_run[0], "prepare")
    rows = prepare["rows"]
    assert [r["model"] for r in rows] == list(_gpu_prepare.DRY_ORDER)
    for row in rows:
        assert "failed" not in row, row
        # the phases nest: the trace and the simulations within the decision, which with the
        # wrapping and the trial is within the whole of prepare
        assert 0 < row["trace_s"] + row["simulations_s"] <= row["decision_s"]
        assert row["decision_s"] + row["wrap_s"] + row["trial_s"] <= row["prepare_s"]
        assert row["fake_steps"] >= 2  # the trace and at least one simulated run
        assert row["trial_steps_s"] > 0 and row["modelled_step_s"] > 0
        assert row["attempts"][-1].endswith(f"fit ({row['trial_steps_s']:.2f}s)")
        assert row["cost_model"] == "constants for the device class"  # no GPU measured here
        within = row["decision_s"] <= _gpu_prepare.DECISION_TARGET_S
        assert row["decision_within_target"] == within
    assert prepare["summary"]["models"] == len(rows)
    assert "| model | params | plan | prepare | decision | trace |" in dry_run[1]


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_prepares_each_external_family_and_measures_its_estimate(
    dry_run: tuple[dict, str],
) -> None:
    external = _section(dry_run[0], "external")
    rows = external["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == _gpu_external.order(dry_run=True)
    for row in rows:
        assert "failed" not in row, row
        footprint = row["footprint"]
        # the parameters and AdamW's state live through every measured step: a meter that
        # missed them would read below them
        assert row["measured_bytes"] >= footprint["params"] + footprint["optimizer_state"] > 0
        # the live bytes are a floor of what the allocator holds, which the estimate is of
        assert row["error"] >= _gpu_accuracy.UNDER_TARGET, row
        # no cuBLAS workspace on the CPU, estimated or held: both errors the same
        assert row["workspace_held_bytes"] == footprint["workspace"] == 0
        assert row["tensor_error"] == row["error"]
        assert 0 < row["trace_s"] + row["simulations_s"] <= row["decision_s"]
        assert row["decision_s"] + row["wrap_s"] + row["trial_s"] <= row["prepare_s"]
        assert row["fake_steps"] >= 2  # the trace and at least one simulated run
        if row["mode"] == "auto":  # the trial proved the plan
            assert row["trial_steps_s"] > 0
        else:  # forced, no trial
            options = _gpu_external.MODES[row["mode"]]
            assert row["strategy"] == options["strategy"] and row["trial_steps_s"] is None
            if options.get("activation_checkpointing") is True:
                assert row["checkpointed"] == row["num_blocks"] > 0
            else:
                assert row["checkpointed"] == 0
    s = external["summary"]
    assert s["rows"] == s["configurations"] == s["tensors"]["configurations"] == len(rows)
    assert s["failed"] == 0 and s["auto_rows"] == len(_gpu_external.DRY_ORDER)
    assert s["worst_at"] in {f"{r['model']} {r['mode']}" for r in rows}
    markdown = dry_run[1]
    assert (
        "| model | mode | plan | params | estimate | measured | error | error, workspac" in markdown
    )
    for mode in _gpu_external.MODES:
        assert f"| gpt2 | {mode} | " in markdown
    assert f"- external: {len(rows)} row(s), estimate targets " in markdown


def test_the_external_section_runs_every_family_in_every_mode_once_the_first_ones_first() -> None:
    import zoo_external

    gpu = _gpu_external.order(dry_run=False)
    assert sorted(gpu) == sorted(
        (name, mode) for name in zoo_external.ENTRIES for mode in _gpu_external.MODES
    )  # a family added to the zoo is measured too
    first = _gpu_external.FIRST
    assert set(first) <= set(zoo_external.ENTRIES)
    assert gpu[: 2 * len(first)] == [(n, m) for n in first for m in ("auto", "full_shard")]
    assert set(_gpu_external.DRY_ORDER) <= set(zoo_external.ENTRIES)


def test_the_external_report_renders_a_failed_row_and_says_when_nothing_was_measured() -> None:
    import _gpu_report

    failed = {"model": "mamba", "mode": "auto", "failed": "RuntimeError: a | b\nc"}
    result = _gpu_external._result([failed], ["clip full_shard: over budget"])
    assert result["summary"]["met"] is None and result["summary"]["tensors"]["met"] is None
    lines = _gpu_report.external_md(result)
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 2  # the header and the failed row
    header, row = table
    assert row.startswith("| mamba | auto | failed: RuntimeError: a / b c |")
    assert row.count(" |") == header.count(" |")
    assert "skipped: clip full_shard: over budget" in "\n".join(lines)
    entry = {"external": {"status": "ok", "result": result}}
    (line,) = _gpu_report.summary_lines(entry)
    assert "estimate targets not measured (not measured with the workspaces left out)" in line
    assert "1 failed, 1 skipped" in line


def test_the_cost_model_is_read_whole_from_the_plan_s_reason() -> None:
    # as `measure.device.with_device` names what it took, parentheses within
    measured = (
        "FLOP/s, memory bandwidth, operator launch time and FSDP2's host times (8 small units "
        "over a fake group) measured on cuda:0 (NVIDIA H100 80GB HBM3): a 4096x4096 bfloat16 "
        "matmul, a 256 MiB copy and 200 one-element additions, otherwise constants for the "
        "device class"
    )
    reason = (
        f"chose full_shard: the fastest candidate whose estimated peak fits (step times modelled "
        f"from {measured}) (ddp would be faster but do not fit)"
    )
    assert _gpu_prepare._cost_model(("another reason", reason)) == measured
    assert _gpu_prepare._cost_model(("no such reason",)) is None


def _editable_finders() -> str:
    """The names of this environment's editable-install import hooks."""
    return " ".join(type(f).__name__ + repr(f) for f in sys.meta_path)


def test_the_dry_run_covers_every_family_and_adamw_implementation() -> None:
    dry = _gpu_models.DRY_CONFIGS
    assert set(_gpu_models.FAMILIES) <= {c.model for c in dry}
    assert {"for-loop", "foreach", "fused"} <= {c.optimizer for c in dry}
    assert {c.world for c in dry} == {1, _gpu_models.FAKE_WORLD}
    # on the GPU: each family with every implementation under FULL_SHARD at world 1 and 8, and
    # LOCAL at world 1
    gpu = set(_gpu_models.GPU_CONFIGS)
    for name in _gpu_models.FAMILIES:
        assert _gpu_models.Config(name, 1, "local", optimizer="foreach") in gpu
        for world in (1, _gpu_models.FAKE_WORLD):
            for optimizer in ("for-loop", "foreach", "fused"):
                assert _gpu_models.Config(name, world, "full_shard", optimizer=optimizer) in gpu
    assert set(_gpu_models.GPU_MODELS) == set(_gpu_models.DRY_MODELS)
    assert sum(gpu_suite.BUDGETS[s][0] for s in gpu_suite.ORDER) <= gpu_suite.TOTAL_BUDGET_S < 600


def _row(strategy: str, error: float) -> dict:
    return {
        "model": "gpt_mid",
        "world_size": 1,
        "strategy": strategy,
        "optimizer": "default",
        "estimate_bytes": int((1 + error) * 2**30),
        "measured_bytes": 2**30,
        "error": error,
        "reserved_bytes": 2**31,
        "reserved_within_usable": True,
        "estimated_by": "estimates from simulated steps",
    }


def test_a_failing_row_s_message_leads_with_that_row_not_the_first() -> None:
    # the first GPU run: every failed row of test_gpu.py showed the first row's figures
    rows = [_row("local", -0.015), _row("ddp", 0.09), _row("full_shard", -0.04)]
    rows.append({"model": "gpt_mid", "world_size": 8, "strategy": "shard_grad_op", "failed": "X"})
    assert _gpu_accuracy.row_problems(rows[0]) == []
    assert _gpu_accuracy.row_problems(rows[1]) == ["|error| 9.0% over 5%"]
    assert _gpu_accuracy.row_problems(rows[2]) == ["error -4.0% underestimates by more than 3%"]
    assert _gpu_accuracy.row_problems(rows[3]) == ["failed: X"]
    for row, first in [
        (rows[1], "gpt_mid world 1 ddp (default AdamW): |error| 9.0% over 5%"),
        (rows[2], "gpt_mid world 1 full_shard (default AdamW): error -4.0% underestimates by"),
        (rows[3], "gpt_mid world 8 shard_grad_op (default AdamW): failed: X"),
    ]:
        message = _gpu_accuracy.failure_message(row, rows)
        assert message.splitlines()[0].startswith(first), message
        assert "world 1 ddp (default AdamW): estimate 1116.2 MiB, measured 1024.0 MiB" in message


def test_the_cpu_meter_holds_what_the_real_step_holds_where_backward_adds_into_zeros() -> None:
    """The meter's CPU side is a dispatch mode, under which `index_select`'s backward adds out of
    place, as for a tensor subclass (`wrap.branches`): it measured 40% above the real step, whose
    plain tensors add in place. The GPU test's own helper runs here, its plumbing with it."""
    import torch
    from test_gpu import branches_error

    cpu = torch.device("cpu")
    with _gpu_accuracy.one_rank_group(cpu):
        error, plan = branches_error(cpu, "index_select", rows=4096)
    assert abs(error) <= _gpu_accuracy.MEDIAN_TARGET, f"{100 * error:+.2f}%\n{plan}"


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_falls_back_after_the_trial_runs_over_the_limit(
    dry_run: tuple[dict, str],
) -> None:
    oom = _section(dry_run[0], "oom")
    assert oom["attempts"][0]["checkpointed"] == 0
    assert oom["attempts"][0]["outcome"] == "out_of_memory"
    assert oom["attempts"][-1]["outcome"] == "fit"
    assert oom["final_checkpointed"] > 0
    assert all(math.isfinite(x) for x in oom["losses"])


@pytest.mark.slow  # the dry run: about a minute on 2 cores
@pytest.mark.compat
def test_dry_run_reports_each_runtime_feature_and_the_calibration(
    dry_run: tuple[dict, str],
) -> None:
    compat = _section(dry_run[0], "compat")
    # torch 2.13 (CI) has every feature autoshard checks for: a probe reporting one absent here
    # is a broken probe
    assert [f["feature"] for f in compat["features"] if not f["present"]] == []
    calibration = _section(dry_run[0], "calibration")
    fsdp = ("fsdp_unit_s", "fsdp_gather_s")
    assert set(fsdp) <= set(calibration["figures"])
    for name, figure in calibration["figures"].items():
        if name in fsdp:
            # no constant on the CPU (gloo's measured collective cost holds them): a measured
            # figure is taken; none where the busy host's timings contradicted themselves
            assert figure["constant"] == 0 and figure["off_by"] is None
            measured = figure["measured"]
            assert measured is None or measured > 0
            assert calibration["hardware"][name] == (0 if measured is None else measured)
            continue
        assert figure["measured"] > 0 and figure["constant"] > 0
        # off by more than 20%: the cost model takes the measurement
        used = figure["measured"] if abs(figure["off_by"]) > 0.20 else figure["constant"]
        assert calibration["hardware"][name] == used


def test_a_section_past_its_budget_is_stopped_and_the_next_still_runs(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "sections"
    state.mkdir()
    monkeypatch.setitem(gpu_suite.BUDGETS, "compat", (1, 1))
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    started = time.time()
    left = gpu_suite._watch(worker, ["compat", "oom"], state, False, started)
    assert left == ["oom"]
    assert worker.poll() is not None  # killed
    entry = json.loads((state / "compat.json").read_text())
    assert entry["status"] == "timed out"
    assert "stopped at its 1s budget" in entry["error"]
    assert time.time() - started < 30


def test_a_budget_given_for_one_run_reaches_the_supervisor_and_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, budgets in gpu_suite.BUDGETS.items():
        monkeypatch.setitem(gpu_suite.BUDGETS, name, budgets)  # each put back after the test
    args = gpu_suite.parse_args(["--out", str(tmp_path), "--budget", "prepare=300"])
    assert gpu_suite.BUDGETS["prepare"][0] == 300  # the GPU's; the dry run's as it was
    args = gpu_suite.parse_args(["--out", "x", "--dry-run", "--budget", "accuracy=7"])
    assert gpu_suite.BUDGETS["accuracy"][1] == 7 and gpu_suite.BUDGETS["prepare"][0] == 300
    for wrong in ("prepare", "prepare=0", "prepare=600", "nothing=10", "prepare=soon"):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(["--out", "x", "--budget", wrong])
    # the worker is told the same budgets, as it reads them for its own deadlines
    started: list[list[str]] = []

    monkeypatch.setattr(gpu_suite, "_start", lambda command, log: started.append(command))
    monkeypatch.setattr(gpu_suite, "_watch", lambda *a: [])  # the worker's sections all done
    gpu_suite.supervise(tmp_path, True, ["accuracy"], time.time(), tuple(args.budget))
    assert started and started[0][-2:] == ["--budget", "accuracy=7"]


def test_the_supervisor_reads_a_section_start_that_is_not_written_yet_as_none(
    tmp_path: Path,
) -> None:
    """The worker's files are written whole (`_write`: a rename), and a marker from a suite
    before that, created but still empty, reads as not started: the dry run once failed with
    `could not convert string to float: ''` reading one mid-write."""
    (tmp_path / "compat.started").write_text("")
    assert gpu_suite._started_at(tmp_path, "compat") is None
    gpu_suite._write(tmp_path / "compat.started", "1234.5")
    assert gpu_suite._started_at(tmp_path, "compat") == 1234.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compat.started"]  # no part left


def test_a_worker_that_dies_in_a_section_is_recorded_and_the_next_section_still_runs(
    tmp_path,
) -> None:
    state = tmp_path / "sections"
    state.mkdir()
    (state / "compat.json").write_text(json.dumps({"status": "ok", "result": {}}))
    worker = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    worker.wait()
    left = gpu_suite._watch(worker, ["compat", "calibration", "oom"], state, True, time.time())
    assert left == ["oom"]
    entry = json.loads((state / "calibration.json").read_text())
    assert entry["status"] == "crashed"
    assert "the worker exited with 3 during this section" in entry["error"]
    assert json.loads((state / "compat.json").read_text())["status"] == "ok"  # kept as written


def test_a_group_a_section_leaves_is_destroyed_before_the_next_section_makes_its_own(
    tmp_path: Path,
) -> None:
    """On one GPU under plain python, `prepare` creates the default group where it offloads (the
    oom section's last rung), and the prepare section after it failed for every model ("trying to
    initialize the default process group twice!", on an H200). A group that existed before a
    section is the caller's, and stays."""
    import torch.distributed as dist

    def one_rank() -> None:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())

    def leaves_a_group() -> str:
        one_rank()  # as prepare() does for a one-GPU offload, and keeps for the model
        return "trained"

    def makes_its_own() -> str:
        one_rank()
        dist.destroy_process_group()
        return "prepared"

    assert not dist.is_initialized()
    try:
        gpu_suite.run_section(tmp_path, "oom", leaves_a_group)
        assert not dist.is_initialized()
        gpu_suite.run_section(tmp_path, "prepare", makes_its_own)
        for name, result in (("oom", "trained"), ("prepare", "prepared")):
            entry = json.loads((tmp_path / f"{name}.json").read_text())
            assert (entry["status"], entry["result"]) == ("ok", result), entry

        one_rank()  # the caller's own group, made before the section
        gpu_suite.run_section(tmp_path, "compat", lambda: "read")
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_pytest_run_stopped_before_its_xml_is_read_from_its_verbose_log(tmp_path) -> None:
    import _gpu_report

    log = tmp_path / "tests.log"
    log.write_text(
        "tests/test_gpu.py::test_a[1-local] PASSED    [ 10%]\n"
        "tests/test_gpu.py::test_b FAILED             [ 20%]\n"
        "noise\ntests/test_gpu.py::test_c SKIPPED (needs CUDA) [ 30%]\n"
    )
    cases = _gpu_report.log_cases(log)
    assert [(c["name"], c["outcome"]) for c in cases] == [
        ("test_a[1-local]", "passed"),
        ("test_b", "failed"),
        ("test_c", "skipped"),
    ]


def test_the_pytest_wheels_that_travel_with_the_suite_run_a_test_without_site_packages(
    tmp_path,
) -> None:
    # the GPU machine may have no pytest: the suite then unpacks benchmarks/wheels
    target = gpu_suite.unpack_wheels(tmp_path / "unpacked")
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    completed = subprocess.run(
        [sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "1 passed" in completed.stdout


# ---------------------------------------------------------------------------------------------
# The cost model's measured figures


def test_measured_throughput_replaces_the_constants_it_names_only() -> None:
    constants = hardware_for("cuda", (9, 0), True)
    measured = hardware_for(
        "cuda", (9, 0), True, Throughput(flops_per_s=6.5e14, where="measured on an H200")
    )
    assert measured.flops_per_s == 6.5e14
    assert measured.memory_bytes_per_s == constants.memory_bytes_per_s
    assert measured.intra_node_bytes_per_s == constants.intra_node_bytes_per_s
    assert measured.source == "flops measured on an H200; the rest constants"
    both = hardware_for("cpu", None, False, Throughput(1e9, 3e9, where="measured here"))
    assert (both.flops_per_s, both.memory_bytes_per_s) == (1e9, 3e9)
    assert hardware_for("cpu", None, False, Throughput()) == hardware_for("cpu", None, False)
    launch = hardware_for("cuda", (9, 0), True, Throughput(kernel_launch_s=9e-6, where="here"))
    assert launch.kernel_launch_s == 9e-6 and launch.flops_per_s == constants.flops_per_s
    assert launch.source == "operator launch time here; the rest constants"


def test_measured_throughput_refuses_what_is_not_a_positive_rate() -> None:
    with pytest.raises(ValueError, match=r"Throughput.flops_per_s must be a finite positive"):
        Throughput(flops_per_s=0.0)
    with pytest.raises(ValueError, match=r"Throughput.memory_bytes_per_s .* got nan"):
        Throughput(memory_bytes_per_s=float("nan"))
    with pytest.raises(ValueError, match=r"Throughput.kernel_launch_s must be a finite positive"):
        Throughput(kernel_launch_s=-1e-6)
    with pytest.raises(TypeError, match=r"Throughput.flops_per_s must be a number .* str '1e12'"):
        Throughput(flops_per_s="1e12")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The trial's CUDA bookkeeping, on a stand-in for torch.cuda (the real one runs in test_gpu.py)


class FakeCuda:
    """The allocator counters `caller_peak_kept` and `memory_cap` read and set."""

    def __init__(self, allocated: int, peak: int, reserved: int, fraction: float = 1.0) -> None:
        self.allocated, self.peak, self.reserved, self.fraction = (
            allocated,
            peak,
            reserved,
            fraction,
        )
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d=None: self.fraction)
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(
            cuda,
            "get_device_properties",
            lambda device=None: type("Props", (), {"total_memory": 100 * 2**30})(),
        )
        real_empty = torch.empty

        def empty(*size, dtype=None, device=None):  # type: ignore[no-untyped-def]
            if getattr(device, "type", device) != "cuda":
                return real_empty(*size, dtype=dtype, device=device)
            self.calls.append(f"allocate {size[0]}")
            self.peak = max(self.peak, self.allocated + size[0])
            self.reserved += size[0]  # a new segment
            return real_empty(0)

        monkeypatch.setattr(torch, "empty", empty)

    def set_fraction(self, fraction: float, device=None) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(f"fraction {fraction:.4g}")
        self.fraction = fraction


def test_caller_peak_kept_allocates_up_to_the_callers_peak_rounded_to_512_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from autoshard.wrap.meter import caller_peak_kept

    cuda = FakeCuda(allocated=1000, peak=10_000, reserved=2048)
    cuda.install(monkeypatch)
    with caller_peak_kept(torch.device("cuda", 0)):
        cuda.peak = 3000  # the body reset the statistics and peaked lower
    # 10,000 - 1,000 = 9,000 bytes missing, rounded up to 9,216; the new segment is given back
    assert cuda.calls == ["allocate 9216", "empty_cache"]
    assert cuda.peak >= 10_000


def test_caller_peak_kept_does_nothing_when_the_body_peaked_higher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from autoshard.wrap.meter import caller_peak_kept

    cuda = FakeCuda(allocated=1000, peak=10_000, reserved=2048)
    cuda.install(monkeypatch)
    with caller_peak_kept(torch.device("cuda", 0)):
        cuda.peak = 20_000
    assert cuda.calls == []
    with caller_peak_kept(torch.device("cpu")):  # nothing to keep on the CPU
        pass
    assert cuda.calls == []


def test_the_memory_cap_empties_the_cache_first_and_puts_the_callers_fraction_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from autoshard.wrap.meter import memory_cap

    cuda = FakeCuda(allocated=0, peak=0, reserved=0, fraction=0.9)
    cuda.install(monkeypatch)
    device = torch.device("cuda", 0)
    with memory_cap(device, 25 * 2**30, held=0):
        assert cuda.fraction == 0.25
    # cached blocks are reused beyond the cap: released before it is set
    assert cuda.calls == ["empty_cache", "fraction 0.25", "fraction 0.9"]
    with memory_cap(device, 95 * 2**30, held=0):
        assert cuda.fraction == 0.9  # the caller's own cap is the lower one
    # 5 GiB of the caller's other tensors on the device: the cap counts the whole process, the
    # limit only the training, which the plan fitted to it beside them
    cuda.allocated = 7 * 2**30
    with memory_cap(device, 25 * 2**30, held=2 * 2**30):
        assert cuda.fraction == 0.30
