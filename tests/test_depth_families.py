"""The depth extension (`measure.simulate`) across model layouts: the extended estimate must equal
the simulation of the whole model, for one family of each layout of blocks
(`benchmarks/deep_families.py`; `benchmarks/depth_extension.py` runs every family, strategy and
setting). An extension that falls short is an out-of-memory error after `prepare`.

One strategy a family, the three spread over the layouts; each must be extended (simulated
shallow only), or the comparison proves nothing. Every layout with every block checkpointed and
then none (the second plan reads back the unchecked runs the first simulated), but MoE every
second layer, unchecked only: its periods of two are checkpointed in `mixed_blocks`.
tests/test_depth_extension.py holds each layout to the same, both ways, on torch-only models.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _dist import REPO, plans_kept

from autoshard.measure.fake import unavailable

pytest.importorskip("transformers")
sys.path.insert(0, str(REPO / "benchmarks"))
import depth_extension  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # 2 to 4 plans a case, half of every block: about 5 minutes on 2 busy cores
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    # torch's module tracker, on a block freed before its backward hook ran
    pytest.mark.filterwarnings("ignore:Module is None"),
]

TOLERANCE = depth_extension.TOLERANCE  # of the whole model's estimated peak

# family, strategy (one of each layout), checkpointed: every block, none, or each in turn (the
# unchecked plan then reads back the runs the checkpointed one simulated: `_plan_peaks`)
CASES = [
    # one list of alike blocks (under DDP and SHARD_GRAD_OP: tests/test_depth_extension.py's
    # Llama-shaped decoder)
    ("llama", "full_shard", (True, False)),
    # encoder and decoder lists, of two classes. Not sharded: on torch 2.13 a foreach optimizer
    # step over DTensors costs time quadratic in the parameters (DTensor's sharding propagation
    # walks every tensor's spec for each): this whole model's FULL_SHARD plan took 150 s under
    # a profiler, 73 s of it there; DDP's 29 s
    ("bart", "ddp", (True, False)),
    # the first two layers dense, the rest MoE
    ("qwen_moe_prefix", "shard_grad_op", (True, False)),
    ("qwen_moe_step2", "full_shard", (False,)),  # MoE every second layer
    # sliding and full attention alternating, one shape
    ("qwen2_alternating", "ddp", (True, False)),
    ("mixed_blocks", "shard_grad_op", (True, False)),  # two block classes alternating in a list
]
_SHOWN = {(False,): "plain", (True, False): "checkpointed-plain"}


def _plan_peaks(
    family: str,
    strategy: str,
    settings: tuple[bool, ...],
    whole: bool,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> list[dict[str, Any]]:
    """`depth_extension.plan_peak` for each of `settings` in turn, autoshard's cache on in
    `cache` (the suite turns it off): a plan after the first reads back the runs it shares with
    an earlier one. One directory for the extended plans, another for the whole model's."""
    for name, value in plans_kept(cache).items():
        monkeypatch.setenv(name, value)
    return [depth_extension.plan_peak(family, strategy, c, whole=whole) for c in settings]


@pytest.mark.parametrize(
    ("family", "strategy", "settings"),
    CASES,
    ids=[f"{f}-{_SHOWN[c]}" for f, _, c in CASES],
)
def test_the_extended_estimate_equals_the_whole_model_s(
    family: str,
    strategy: str,
    settings: tuple[bool, ...],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    extended = _plan_peaks(family, strategy, settings, False, tmp_path / "extended", monkeypatch)
    whole = _plan_peaks(family, strategy, settings, True, tmp_path / "whole", monkeypatch)
    # what was simulated ("none": every run read back), of every block for the reference and of
    # none for the estimate
    assert {plan["kind"] for plan in whole} - {"none"} == {"whole"}, whole
    assert {plan["kind"] for plan in extended} - {"none"} == {"ext"}, extended
    for checkpointed, ext, ref in zip(settings, extended, whole, strict=True):
        error = ext["peak"] - ref["peak"]
        assert abs(error) <= TOLERANCE * ref["peak"], (
            f"{family} {strategy} checkpointed={checkpointed}: extended {ext['peak']} against "
            f"whole {ref['peak']} ({100 * error / ref['peak']:+.3f}%); simulated "
            f"{extended[0]['kind']} at depths {extended[0]['depths']} of {ref['blocks']} blocks"
        )
