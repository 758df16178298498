"""A prepared model compiled afterwards (`torch.compile(model)`, as torch's DDP documents) on 2
gloo ranks: DDP and FSDP2, bf16, every block checkpointed. Each case trains the same model
three steps eagerly and three compiled (AOTAutograd's `aot_eager`: no C++ compiler needed) and
returns both losses; tests/test_compiled_training.py compares them.

Usage (from tests/_dist.py, under torchrun): compiled.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _common import Cases

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_compiled_training import built, prepared_and_trained  # noqa: E402

cases = Cases()


def _losses(strategy: str, compiled: bool) -> list[float]:
    model, optimizer, batch = built()
    losses = prepared_and_trained(
        model, optimizer, batch, compiled, strategy=strategy, mixed_precision="bf16",
        activation_checkpointing=True,
    )  # fmt: skip
    torch.compiler.reset()
    return losses


def _case(strategy: str) -> dict[str, list[float]]:
    return {"eager": _losses(strategy, False), "compiled": _losses(strategy, True)}


cases.case(lambda: _case("ddp"), "ddp")
cases.case(lambda: _case("full_shard"), "full_shard")

if __name__ == "__main__":
    cases.main()
