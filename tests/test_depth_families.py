"""The depth extension (`measure.simulate`) across model layouts: the extended estimate must equal
the simulation of the whole model, for one family of each layout of blocks
(`benchmarks/deep_families.py`; `benchmarks/depth_extension.py` runs every family, strategy and
setting). An extension that falls short is an out-of-memory error after `prepare`.

One strategy a family, the three spread over the layouts; each must be extended (simulated
shallow only), or the comparison proves nothing. Checkpointing on is asked of every layout but
MoE every second layer, whose periods of two are checkpointed in `mixed_blocks`; off, of one
layout of each kind (one list, periods of two, two block classes). tests/test_depth_extension.py
holds each layout to the same, both ways, on torch-only models.
"""

from __future__ import annotations

import sys

import pytest
from _dist import REPO

from autoshard.measure.fake import unavailable

pytest.importorskip("transformers")
sys.path.insert(0, str(REPO / "benchmarks"))
import depth_extension  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # two plans a case, one of every block: about 7 minutes on 2 busy cores
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    # torch's module tracker, on a block freed before its backward hook ran
    pytest.mark.filterwarnings("ignore:Module is None"),
]

TOLERANCE = depth_extension.TOLERANCE  # of the whole model's estimated peak

# family, strategy (one of each layout), checkpointed
CASES = [
    ("llama", "ddp", False),  # one list of alike blocks
    ("llama", "full_shard", True),
    # encoder and decoder lists, of two classes. Not sharded: on torch 2.13 a foreach optimizer
    # step over DTensors costs time quadratic in the parameters (DTensor's sharding propagation
    # walks every tensor's spec for each): this whole model's FULL_SHARD plan took 150 s under
    # a profiler, 73 s of it there; DDP's 29 s
    ("bart", "ddp", True),
    ("qwen_moe_prefix", "shard_grad_op", True),  # the first two layers dense, the rest MoE
    ("qwen_moe_step2", "full_shard", False),  # MoE every second layer
    ("qwen2_alternating", "ddp", True),  # sliding and full attention alternating, one shape
    ("mixed_blocks", "shard_grad_op", False),  # two block classes alternating in one list
    ("mixed_blocks", "shard_grad_op", True),
]


@pytest.mark.parametrize(
    ("family", "strategy", "checkpointed"),
    CASES,
    ids=[f"{f}-{'checkpointed' if c else 'plain'}" for f, _, c in CASES],
)
def test_the_extended_estimate_equals_the_whole_model_s(
    family: str, strategy: str, checkpointed: bool
) -> None:
    extended = depth_extension.plan_peak(family, strategy, checkpointed, whole=False)
    whole = depth_extension.plan_peak(family, strategy, checkpointed, whole=True)
    assert whole["kind"] == "whole", whole  # the reference simulated every block
    assert extended["kind"] == "ext", extended  # and the estimate never did
    error = extended["peak"] - whole["peak"]
    assert abs(error) <= TOLERANCE * whole["peak"], (
        f"{family} {strategy} checkpointed={checkpointed}: extended {extended['peak']} against "
        f"whole {whole['peak']} ({100 * error / whole['peak']:+.3f}%); simulated "
        f"{extended['kind']} at depths {extended['depths']} of {whole['blocks']} blocks"
    )
