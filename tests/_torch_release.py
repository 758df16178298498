"""torch's own behaviour that changed between the releases the package supports (2.11 to 2.15),
each with the release it changed in, measured in a venv of each (2.11.0, 2.13.0, 2.14.1, 2.15.0;
DESIGN.md section 3b). Tests that assert torch's behaviour expect the installed release's, not
the loosest of them."""

from __future__ import annotations

import torch

RELEASE = torch.torch_version.TorchVersion(torch.__version__)

# What torch's fake (meta) kernel of `_grouped_mm` says to fp32 inputs: refused up to 2.14 (its
# message changed in 2.14, which admits fp16), accepted from 2.15 (None).
FAKE_GROUPED_MM_FP32_REFUSED: str | None = (
    "Expected inputs of BF16 type"
    if RELEASE < (2, 14)
    else "Expected mat_a to be BFloat16 or supported Float16 matrix"
    if RELEASE < (2, 15)
    else None
)

# The shape error of a matrix product names the operator from 2.15 ("addmm: mat1 and mat2 shapes
# cannot be multiplied"), not before.
SHAPE_ERROR_PREFIX = "addmm: " if RELEASE >= (2, 15) else ""

# FSDP2's ZeRO-2 (reshard_after_forward=False) peak holds one unit's unsharded bytes more than
# every unit gathered up to 2.14, and not from 2.15. Seen on the MLP of tests/test_simulate.py at
# 2 ranks: torch's FSDPMemTracker shows two units' all-gather outputs alive at the end of forward
# on 2.13 and one on 2.15 (the same real FSDP2 code runs under fake tensors), and on 2 real gloo
# ranks the live tensor bytes of a ZeRO-2 step fell from 1,364,900 B on 2.13 to 1,309,524 B on
# 2.15, below ZeRO-3's (measured 2026-11-24 with wrap.meter.LiveBytes).
ZERO2_PEAK_HOLDS_AN_EXTRA_UNIT = RELEASE < (2, 15)
