"""The trial step's pure parts, no process group: what counts as an OOM, and which rung comes next.

Candidates are built by hand with the whole estimate in one Footprint term, so every figure below
is the candidate's estimated peak.
"""

from __future__ import annotations

import pytest
import torch

from autoshard import Candidate, Strategy
from autoshard.decide.estimate import Footprint
from autoshard.wrap.trial import ABORTED_OVERSHOOT, is_oom, next_rung

DDP, ZERO2, ZERO3 = Strategy.DDP, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)

# ---------------------------------------------------------------------------------------------
# is_oom


def test_is_oom_for_torch_out_of_memory_error() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_is_oom_for_the_cpu_allocators_runtime_error() -> None:
    assert is_oom(RuntimeError(CPU_OOM))


def test_is_oom_for_a_real_cpu_allocation_failure() -> None:
    # 1 PiB: beyond any x86-64/arm64 user address space, so it fails even under overcommit.
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_oom(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`",
        "cuFFT error: CUFFT_ALLOC_FAILED",
        "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia.com",
    ],
)
def test_is_oom_for_a_cuda_library_that_could_not_allocate(message: str) -> None:
    """A step at the edge of the memory fails where a CUDA library allocates outside torch's
    allocator (a cuBLAS handle for the backward thread) as often as inside it: an error that
    fell through to the user, not a fallback."""
    assert is_oom(RuntimeError(message))
    # NCCL's is not: its communicator cannot be used after one
    assert not is_oom(torch.distributed.DistBackendError(f"NCCL error: {message}"))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x4)"),
        RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx`"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("can't allocate memory"),  # the text alone is not enough: not a RuntimeError
        ValueError("bad row in the batch"),
        TypeError("forward() missing 1 required positional argument"),
        KeyError("can't allocate memory"),
    ],
)
def test_is_oom_false_for_other_errors(error: Exception) -> None:
    assert not is_oom(error)


# ---------------------------------------------------------------------------------------------
# next_rung


def rung(strategy: Strategy, checkpointed: int, peak: int, seconds: float) -> Candidate:
    return Candidate(strategy, checkpointed, Footprint(peak, 0, 0, 0, 0, 0, 0), seconds, True)


def label(c: Candidate | None) -> tuple[str, int] | None:
    return None if c is None else (c.strategy.value, c.activation_checkpointing)


def ladder() -> list[Candidate]:
    """A typical table: more sharding and more checkpointing cost time and save memory."""
    return [
        rung(DDP, 0, 100, 1.0),
        rung(DDP, 1, 90, 1.1),
        rung(DDP, 2, 80, 1.2),
        rung(ZERO2, 0, 70, 2.0),
        rung(ZERO2, 1, 60, 2.1),
        rung(ZERO3, 0, 55, 3.0),
        rung(ZERO3, 1, 45, 3.1),
        rung(ZERO3, 2, 35, 3.2),
    ]


def pick(
    failed: tuple[Strategy, int],
    *,
    usable: int,
    peak: int | None,
    tried: tuple[tuple[Strategy, int], ...] | list[tuple[Strategy, int]] = (),
) -> Candidate | None:
    options = ladder()
    current = next(c for c in options if (c.strategy, c.activation_checkpointing) == failed)
    done = {(s.value, k) for s, k in [failed, *tried]}
    return next_rung(options, current, done, usable, peak)


def test_never_back_to_a_less_sharded_strategy() -> None:
    # ZeRO-3 AC 0 failed; DDP and ZeRO-2 rungs are faster and estimated smaller, yet unreachable.
    options = [
        rung(DDP, 1, 40, 1.0),
        rung(ZERO2, 1, 45, 2.0),
        rung(ZERO3, 0, 100, 3.0),
        rung(ZERO3, 1, 80, 3.1),
    ]
    failed = options[2]
    assert label(next_rung(options, failed, {("full_shard", 0)}, 100, 100)) == ("full_shard", 1)


def test_never_back_to_fewer_checkpointed_blocks() -> None:
    # DDP AC 2 failed; ZeRO-3 AC 0 and DDP AC 1 are estimated smaller but checkpoint fewer blocks.
    options = [
        rung(DDP, 1, 40, 1.0),
        rung(DDP, 2, 100, 1.2),
        rung(ZERO3, 0, 30, 3.0),
        rung(ZERO3, 2, 50, 3.2),
    ]
    failed = options[1]
    assert label(next_rung(options, failed, {("ddp", 2)}, 100, 100)) == ("full_shard", 2)


def test_only_escalates_over_every_failed_rung() -> None:
    order = {"ddp": 0, "shard_grad_op": 1, "full_shard": 2}
    for failed in ladder():
        for peak in (None, 50, 100, 150, 400):
            chosen = next_rung(
                ladder(),
                failed,
                {(failed.strategy.value, failed.activation_checkpointing)},
                100,
                peak,
            )
            if chosen is None:
                continue
            assert order[chosen.strategy.value] >= order[failed.strategy.value]
            assert chosen.activation_checkpointing >= failed.activation_checkpointing
            assert label(chosen) != label(failed)


def test_a_rung_further_up_is_reachable_whatever_its_estimate() -> None:
    # The estimate just proved wrong: more checkpointing that it says saves nothing is still a
    # rung up (the optimizer step can dominate the estimate while activations were the problem).
    options = [rung(ZERO3, 0, 100, 3.0), rung(ZERO3, 1, 100, 3.1), rung(ZERO3, 2, 120, 3.2)]
    assert label(next_rung(options, options[0], {("full_shard", 0)}, 100, 150)) == (
        "full_shard",
        1,
    )


def test_equally_frugal_rungs_prefer_the_one_further_up() -> None:
    # Nothing fits after scaling (x4); the two most frugal rungs tie: the more sharded one, then
    # the one with more blocks checkpointed, is taken.
    options = [
        rung(DDP, 0, 100, 1.0),
        rung(DDP, 3, 40, 1.3),
        rung(ZERO2, 1, 40, 2.1),
        rung(ZERO2, 2, 40, 2.2),
    ]
    assert label(next_rung(options, options[0], {("ddp", 0)}, 100, 400)) == ("shard_grad_op", 2)


def test_a_rung_that_would_only_just_fit_does_not() -> None:
    # Scaled by 1.25, DDP AC 1 (80 -> 100) would fill the usable memory exactly: no room to spare,
    # so ZeRO-3 AC 0 (60 -> 75) is next although it is slower.
    options = [rung(DDP, 0, 100, 1.0), rung(DDP, 1, 80, 1.1), rung(ZERO3, 0, 60, 3.0)]
    assert label(next_rung(options, options[0], {("ddp", 0)}, 100, 125)) == ("full_shard", 0)


def test_skips_rungs_already_tried() -> None:
    # Usable 1000, estimated 100, yet the step died of OOM: it is assumed to have needed
    # 1.25 x 1000, so every estimate is scaled by 12.5 and a rung must be estimated under 80.
    # ZeRO-2 AC 0 (70) is the fastest such rung; with it tried, ZeRO-2 AC 1 (60) is next.
    assert ABORTED_OVERSHOOT == 1.25
    chosen = pick((DDP, 0), usable=1000, peak=None, tried=[(DDP, 1), (DDP, 2)])
    assert label(chosen) == ("shard_grad_op", 0)
    chosen = pick((DDP, 0), usable=1000, peak=None, tried=[(ZERO2, 0)])
    assert label(chosen) == ("shard_grad_op", 1)


def test_prefers_the_fastest_rung_that_fits_after_scaling_by_the_shortfall() -> None:
    # DDP AC 0 estimated 100 measured 150 against 100 usable: every estimate is scaled by 1.5.
    # DDP AC 1/2 (135, 120) and ZeRO-2 AC 0 (105) no longer fit; ZeRO-2 AC 1 (90) is the fastest
    # that does, ahead of the more frugal ZeRO-3 rungs.
    assert label(pick((DDP, 0), usable=100, peak=150)) == ("shard_grad_op", 1)
    # An OOM aborted the step (peak no more than usable, or unknown): it is assumed to have
    # needed 1.25 x usable = 125, so estimates scale by 1.25 and must stay under 80. DDP AC 1
    # (90 -> 112.5) and AC 2 (80 -> 100, no room to spare) are out: checkpointing one more block
    # at a time would spend every attempt on DDP. ZeRO-2 AC 0 (70 -> 87.5) is next.
    assert label(pick((DDP, 0), usable=100, peak=90)) == ("shard_grad_op", 0)
    assert label(pick((DDP, 0), usable=100, peak=None)) == ("shard_grad_op", 0)


def test_the_most_frugal_rung_left_when_none_fits() -> None:
    # Measured at 4x the estimate: even ZeRO-3 AC 2 (35 -> 140) does not fit; it is still the
    # best hope, being the most frugal rung left.
    assert label(pick((DDP, 0), usable=100, peak=400)) == ("full_shard", 2)
    # ... and with ZeRO-3 AC 2 tried, the most frugal of the rest.
    assert label(pick((DDP, 0), usable=100, peak=400, tried=[(ZERO3, 2)])) == ("full_shard", 1)


def test_none_when_nothing_is_left() -> None:
    options = ladder()
    everything = {(c.strategy.value, c.activation_checkpointing) for c in options}
    assert next_rung(options, options[0], everything, 100, 150) is None
    # The top of the ladder failed: nothing is further up.
    assert next_rung(options, options[-1], {("full_shard", 2)}, 100, 150) is None
    # Only the failed rung was on offer (strategy and checkpointing both forced).
    assert next_rung([options[3]], options[3], {("shard_grad_op", 0)}, 100, 150) is None


def test_one_gpu_falls_back_from_unwrapped_to_offload_where_no_checkpointing_fits() -> None:
    """One GPU's ladder (LOCAL, then CPU_OFFLOAD, each with blocks checkpointed): an unwrapped
    rung that ran out of memory moves to the fastest rung that fits once its estimate is scaled
    by the shortfall: more checkpointing while that fits, offload beyond."""
    offload = Strategy.CPU_OFFLOAD
    options = [
        rung(Strategy.LOCAL, 0, 100, 1.0),
        rung(Strategy.LOCAL, 2, 90, 1.1),
        rung(Strategy.LOCAL, 4, 85, 1.2),
        rung(offload, 0, 60, 6.0),
        rung(offload, 4, 50, 6.2),
    ]
    # the step needed 110 against an estimate of 100: LOCAL 2/4 scaled is 99, within 100
    assert next_rung(options, options[0], {("local", 0)}, 100, 110) == options[1]
    # needed 130: 2/4 and 4/4 scaled are 117 and 110.5: only offload fits (78), and the faster
    assert next_rung(options, options[0], {("local", 0)}, 100, 130) == options[3]
