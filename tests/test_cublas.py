"""cuBLAS/cuBLASLt workspaces (`measure.cublas`): a term of their own on CUDA, measured where the
device is, assumed from torch's default where it is not (a what-if plan), none on the CPU.

The GPU test measures, in a fresh process (no workspace yet), what a linear layer's first forward
and backward leave allocated, and compares it with the probe's figure."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import autoshard
from autoshard.decide.estimate import Footprint
from autoshard.measure import cublas
from autoshard.measure.cublas import (
    DEFAULT_WORKSPACE_BYTES,
    HANDLES_PER_STEP,
    configured_workspace_bytes,
    cublas_workspaces,
)

MIB = 2**20


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (":4096:8", 4096 * 8 * 1024),  # torch's default from capability 9.0: 32 MiB
        (":4096:2:16:8", (4096 * 2 + 16 * 8) * 1024),  # its default before: 8.1 MiB
        (":16:8", 16 * 8 * 1024),  # deterministic algorithms' smallest documented setting
        ("", None),
        ("4096:8", None),  # no leading colon
        (":4096", None),  # a size without a count
        (":a:b", None),
    ],
)
def test_cublas_workspace_config_is_read_as_sizes_times_counts(
    config: str, expected: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert configured_workspace_bytes() == expected


def test_none_on_the_cpu() -> None:
    assert cublas_workspaces(torch.device("cpu"), torch.bfloat16) is None


def test_assumed_without_a_device_two_handles_of_the_default_or_the_configured_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assumed = cublas_workspaces(torch.device("cuda"), torch.bfloat16)
    assert assumed is not None
    assert assumed.nbytes == HANDLES_PER_STEP * DEFAULT_WORKSPACE_BYTES == 64 * MIB
    assert "assumed" in assumed.note and "no CUDA device here" in assumed.note
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    configured = cublas_workspaces(torch.device("cuda"), torch.bfloat16)
    assert configured is not None
    assert configured.nbytes == HANDLES_PER_STEP * (4096 * 2 + 16 * 8) * 1024
    assert "CUBLAS_WORKSPACE_CONFIG" in configured.note


def test_a_measurement_that_fails_is_assumed_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fails(device: torch.device, dtype: torch.dtype | None) -> int:
        raise RuntimeError("driver")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cublas, "_measure", fails)
    assumed = cublas_workspaces(torch.device("cuda"), None)
    assert assumed is not None and assumed.nbytes == 64 * MIB
    assert "measuring them failed: RuntimeError" in assumed.note


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(8, 64)


def test_a_cuda_plan_counts_them_in_every_candidate_and_says_how(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a what-if for GPUs (assumed, not measured), on a machine with a GPU too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    model, optimizer, batch = _model()
    plan = autoshard.plan(model, optimizer, batch, world_size=2, device="cuda")
    for c in plan.candidates:
        assert c.footprint.workspace == 64 * MIB, c
        # a term of the peak like any other: the other terms plus it
        others = Footprint(**{**vars(c.footprint), "workspace": 0})
        assert c.footprint.peak == others.peak + 64 * MIB
    assert any(r.startswith("cuBLAS/cuBLASLt workspaces 64.00 MiB") for r in plan.reasons)
    assert "wksp" in str(plan).splitlines()[2].split()


def test_a_cpu_plan_has_none() -> None:
    model, optimizer, batch = _model()
    plan = autoshard.plan(model, optimizer, batch, world_size=2, device="cpu")
    assert all(c.footprint.workspace == 0 for c in plan.candidates)
    assert not any("cuBLAS" in r for r in plan.reasons)


# What a fresh process's first training matmuls leave allocated (every tensor freed), against
# the probe's figure taken in another fresh process.
_FIRST_STEP = textwrap.dedent(
    """
    import sys, torch
    device = torch.device("cuda")
    dtype = getattr(torch, sys.argv[1])
    torch.zeros(1, device=device)  # the context, before the baseline
    before = torch.cuda.memory_allocated(device)
    if sys.argv[2] == "probe":
        from autoshard.measure.cublas import cublas_workspaces
        print(cublas_workspaces(device, dtype).nbytes)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        model = model.to(device)
        x = torch.randn(32, 256, device=device)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x).float().sum()
        loss.backward()
        torch.cuda.synchronize(device)
        del loss, x
        held = sum(p.numel() * p.element_size() for p in model.parameters()) * 2  # and grads
        print(torch.cuda.memory_allocated(device) - before - held)
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_probe_measures_what_a_first_training_step_allocates(dtype: str) -> None:
    def run(kind: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_STEP, dtype, kind],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stdout.strip().splitlines()[-1])

    probe, step = run("probe"), run("step")
    assert step > 0  # the step left workspaces behind
    assert probe == step, f"probe {probe / MIB:.2f} MiB, first step {step / MIB:.2f} MiB"


class _Allocator:
    """The caching allocator's counters as `cublas._measure` reads them, and linear steps that
    allocate through it: workspaces kept per handle (torch 2.11 to 2.13), or, as torch 2.15 by
    default, cuBLASLt's kept and cuBLAS's held for each operation's duration."""

    INPUTS, PRODUCTS = 3 * 16 * 1024, 100 * 1024  # x, w, b; products and gradients at the peak

    def __init__(self, kept: int, per_operation: int) -> None:
        self.allocated = self.peak = 5 * MIB  # the caller's
        self.kept, self.per_operation, self.workspaces = kept, per_operation, 0

    def linear_step(self, device: torch.device, dtype: torch.dtype) -> int:
        if not self.workspaces:
            self.workspaces = self.kept
            self.allocated += self.kept
        held = self.INPUTS + self.PRODUCTS + self.per_operation
        self.peak = max(self.peak, self.allocated + held)
        return self.INPUTS

    def clear(self) -> bool:
        self.allocated -= self.workspaces
        self.workspaces = 0
        return True


@pytest.mark.parametrize(
    ("kept", "per_operation"),
    [(64 * MIB, 0), (MIB, 32 * MIB), (0, 32 * MIB)],
    ids=["kept (2.11 to 2.13)", "cuBLASLt's kept, cuBLAS's per operation (2.15)", "none kept"],
)
def test_the_probe_counts_workspaces_kept_and_those_held_for_an_operation(
    kept: int, per_operation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept workspaces exactly, as a first training step leaves them (the GPU test below); and a
    workspace held only while an operation runs, which torch 2.15 gives each cuBLAS call, with
    the probe's own products at its peak (a few KiB over): counting only what was kept read
    about 0 there."""
    import contextlib

    allocator = _Allocator(kept, per_operation)
    monkeypatch.setattr(cublas, "caller_peak_kept", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cublas, "clear_cublas_workspaces", allocator.clear)
    monkeypatch.setattr(cublas, "_linear_step", allocator.linear_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocator.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator.peak)

    def reset(device: object = None) -> None:
        allocator.peak = allocator.allocated

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    measured = cublas._measure(torch.device("cuda", 0), torch.bfloat16)
    if per_operation:
        assert kept + per_operation <= measured <= kept + per_operation + _Allocator.PRODUCTS
    else:
        assert measured == kept
    assert allocator.workspaces == 0  # freed again: the trial's step allocates them as training


def test_a_cuda_trial_frees_the_workspaces_before_it_so_that_it_counts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workspaces a matmul left before the trial (the calibration's, or the caller's) would read as
    memory unrelated to the training: the trial frees them first, after the device is idle, and
    its step allocates them again (tests/test_gpu.py measures that on a GPU)."""
    from autoshard.wrap import trial

    calls: list[str] = []
    monkeypatch.setattr(trial, "clear_cublas_workspaces", lambda: calls.append("clear") or True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    trial._workspaces_freed(torch.device("cpu"))
    assert calls == []
    trial._workspaces_freed(torch.device("cuda", 0))
    assert calls == ["sync", "clear"]
