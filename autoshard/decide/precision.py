"""The mixed precisions a plan can train in, and the compute dtype of each."""

from __future__ import annotations

import enum

import torch


class Precision(str, enum.Enum):
    """The mixed precision a plan trains in; str-valued, so `plan.mixed_precision == "bf16"`.

    BF16: bf16 compute (FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`, autocast otherwise);
        parameters, gradients and optimizer state stay fp32.
    FP16: the same in fp16, with a gradient scaler (`prepared.scaler`).
    NO: the parameters' own dtype throughout.

    "auto" is a request (`prepare(mixed_precision="auto")`), not a Precision: it resolves to one.
    """

    BF16 = "bf16"
    FP16 = "fp16"
    NO = "no"

    @property
    def dtype(self) -> torch.dtype | None:
        """The compute dtype; None: no mixed precision (the parameters' own dtype)."""
        return _DTYPES[self]

    def __str__(self) -> str:
        return self.value


_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.NO: None}

AUTO = "auto"
# what `mixed_precision=` accepts: "auto", or a Precision (or its value)
REQUESTS = (AUTO, *(p.value for p in Precision))


def parse_precision(value: object) -> Precision | None:
    """The caller's `mixed_precision`: None for "auto", else its Precision.

    Raises:
        ValueError: `value` is none of "auto", "bf16", "fp16", "no" (or a Precision).
    """
    if isinstance(value, Precision):
        return value
    if value == AUTO:
        return None
    if isinstance(value, str) and value in REQUESTS:
        return Precision(value)
    raise ValueError(f"mixed_precision={value!r} is not one of {', '.join(map(repr, REQUESTS))}")
