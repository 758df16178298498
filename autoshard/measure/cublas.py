"""cuBLAS and cuBLASLt workspaces: memory a training step's matmuls take from the caching allocator
and keep for the life of the process.

torch gives each (cuBLAS handle, stream) pair one workspace, allocated through the caching
allocator at its first matmul, so it shows in `torch.cuda.memory_allocated` like a tensor while no
tracker sees it (fake tensors run no kernel). A training step has at least two: the forward's, on
the caller's thread, and the backward's, on autograd's device thread (another handle). On an H100
with torch 2.11 each was 32 MiB (`CUBLAS_WORKSPACE_CONFIG=:KiB:count[:KiB:count...]` changes it;
torch's default is 32 MiB from compute capability 9.0, about 8 MiB before): the demo's 35 MiB
estimate met a 98.7 MiB peak, the 64 MiB being these two.

Where this machine has the planned CUDA device, the workspaces are measured: every workspace is
freed (`_torch_compat.clear_cublas_workspaces`; torch allocates them again at the next matmul), a
small forward and backward of a linear layer runs in fp32 and in the compute dtype, and what stays
allocated once its tensors are gone is what the step will allocate (torch 2.15 keeps none by
default, and gives each operation a workspace for its duration instead: there the most the probe
held at once beyond its inputs is counted). They are freed again
afterwards, and once more by the trial before its step (`trial._workspaces_freed`: the
calibration's matmuls, or the caller's, allocate them in between), so that the trial step
measures them as training allocates them. Without a device (a what-if plan) torch's default for
a Hopper GPU is assumed, two workspaces of it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from autoshard._torch_compat import clear_cublas_workspaces, disable_current_modes
from autoshard._units import human
from autoshard._world import RankReport
from autoshard.decide.plan import PlanInputs
from autoshard.wrap.meter import caller_peak_kept

logger = logging.getLogger("autoshard")

# One workspace per handle a step uses: the forward's thread and autograd's backward thread.
HANDLES_PER_STEP = 2
# torch's default workspace from compute capability 9.0 (cuBLAS's recommendation for Hopper),
# ":4096:8" in CUBLAS_WORKSPACE_CONFIG's terms; older GPUs default to ":4096:2:16:8" (8.1 MiB).
DEFAULT_WORKSPACE_BYTES = 4096 * 8 * 1024
_PROBE_SIZE = 64  # rows and columns of the probe's matmuls: any size takes the same workspace
# Held beyond the probe's inputs during its steps, this much or more is a workspace held for an
# operation's duration (the smallest default, cuBLASLt's before Hopper, is 1 MiB); less, its
# products and gradients (some 100 KiB at 64 x 64)
EAGER_FLOOR = 2**20


@dataclass(frozen=True)
class CublasWorkspaces:
    """Bytes of cuBLAS/cuBLASLt workspace a step allocates on one rank, and how it was found."""

    nbytes: int
    note: str


def cublas_workspaces(device: torch.device, dtype: torch.dtype | None) -> CublasWorkspaces | None:
    """The workspaces a training step on `device` allocates (computing in `dtype`, or fp32), or
    None off CUDA."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return _assumed("no CUDA device here")
    try:
        nbytes = _measure(device, dtype)
    except Exception as error:  # noqa: BLE001 - an OOM or a driver error: assumed instead
        logger.debug("measuring the cuBLAS workspaces failed", exc_info=True)
        return _assumed(f"measuring them failed: {type(error).__name__}")
    if nbytes is None:
        return _assumed(f"torch {torch.__version__} cannot free them to measure them")
    name = torch.cuda.get_device_name(device)
    return CublasWorkspaces(
        nbytes,
        f"cuBLAS/cuBLASLt workspaces {human(nbytes)} per rank, measured on {device} ({name}): "
        f"a matmul's forward and backward allocated them (one per handle and stream)",
    )


def _measure(device: torch.device, dtype: torch.dtype | None) -> int | None:
    """Bytes of workspace a forward and backward of a linear layer take, starting from none:
    what they leave allocated once their tensors are gone (torch 2.11 to 2.13 keep one per
    handle and stream), and what the same steps, run again, hold at once beyond their inputs
    where that is a workspace's size (`EAGER_FLOOR`): torch 2.15 keeps cuBLASLt's but, unless
    `TORCH_CUBLAS_WORKSPACE_CACHE=1`, gives each cuBLAS operation a workspace of its own for its
    duration (`CUDAContextLight.h`, `getCurrentCUDABlasHandleWithWorkspace`). None where this
    torch cannot free the workspaces."""
    dtypes = dict.fromkeys((torch.float32, dtype or torch.float32))
    with disable_current_modes(), caller_peak_kept(device):
        torch.cuda.synchronize(device)
        if not clear_cublas_workspaces():
            return None
        before = torch.cuda.memory_allocated(device)
        for each in dtypes:
            _linear_step(device, each)
        torch.cuda.synchronize(device)
        kept = max(0, torch.cuda.memory_allocated(device) - before)
        # again, with what is kept allocated already: the peak beyond it and the inputs (alive
        # throughout; the least of the steps', whichever the peak is in) is the products and
        # gradients at the peak (KiB), and a workspace held for an operation's duration
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # the caller's peak: `caller_peak_kept`
        inputs = min(_linear_step(device, each) for each in dtypes)
        torch.cuda.synchronize(device)
        during = torch.cuda.max_memory_allocated(device) - base - inputs
        clear_cublas_workspaces()  # the trial step allocates them again, as training does
    return kept + (during if during >= EAGER_FLOOR else 0)


def _linear_step(device: torch.device, dtype: torch.dtype) -> int:
    """A linear layer's forward (addmm: cuBLASLt with its bias) and backward (mm on autograd's
    thread), and a plain matmul's (cuBLAS). Returns the bytes of its inputs."""
    shape = (_PROBE_SIZE, _PROBE_SIZE)
    x = torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
    w = torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(_PROBE_SIZE, device=device, dtype=dtype, requires_grad=True)
    out = torch.nn.functional.linear(x, w, b) + x @ w
    out.sum().backward()
    return sum(t.untyped_storage().nbytes() for t in (x, w, b))


def _assumed(why: str) -> CublasWorkspaces:
    per_handle = configured_workspace_bytes() or DEFAULT_WORKSPACE_BYTES
    source = "CUBLAS_WORKSPACE_CONFIG" if configured_workspace_bytes() else "torch's default"
    nbytes = HANDLES_PER_STEP * per_handle
    return CublasWorkspaces(
        nbytes,
        f"cuBLAS/cuBLASLt workspaces {human(nbytes)} per rank assumed ({HANDLES_PER_STEP} "
        f"handles, forward and backward, x {human(per_handle)}: {source} on compute "
        f"capability 9.0+); not measured: {why}",
    )


def configured_workspace_bytes() -> int | None:
    """One workspace's bytes as CUBLAS_WORKSPACE_CONFIG sets it (":SIZE_KiB:COUNT" pairs, the
    sizes times the counts summed), or None where it is unset or not of that form."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    parts = config.split(":")
    if len(parts) < 3 or parts[0] != "" or len(parts) % 2 == 0:
        return None
    try:
        numbers = [int(p) for p in parts[1:]]
    except ValueError:
        return None
    return sum(size * count for size, count in zip(numbers[::2], numbers[1::2], strict=True)) * 1024


def with_cublas(inputs: PlanInputs, reports: list[RankReport]) -> PlanInputs:
    """`inputs` with the most cuBLAS workspace any rank's step allocates, and its note."""
    known: list[CublasWorkspaces] = [r.cublas for r in reports if r.cublas is not None]
    if not known:
        return inputs
    most = max(known, key=lambda w: w.nbytes)
    setting = replace(inputs.setting, library_workspace_bytes=most.nbytes)
    return replace(inputs, setting=setting, reasons=(*inputs.reasons, most.note))
