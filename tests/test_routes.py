"""Every route to a strategy builds the same model (issue 13): wrapped fresh by `prepare`, or
reached in place by the trial step's fallbacks. tests/workers/routes.py wraps each route on 2 gloo
ranks; the tests compare what it recorded."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from _dist import Launch, launch

pytestmark = pytest.mark.dist

FRESH = {
    "shard_grad_op": "shard_grad_op_fresh",
    "full_shard": "full_shard_fresh",
    "hybrid_shard": "hybrid_shard_fresh",
}
FALLBACKS = [
    ("shard_grad_op", "shard_grad_op_via_ddp"),
    ("full_shard", "full_shard_via_ddp"),
    ("full_shard", "full_shard_via_shard_grad_op"),
    ("full_shard", "full_shard_via_ddp_and_shard_grad_op"),
    ("hybrid_shard", "hybrid_shard_via_ddp"),
]
ROOT_PARAMS = ("inp.weight", "inp.bias", "head.weight", "head.bias")


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launch("routes", Path(tmp_path_factory.mktemp("routes")))


def test_routes_launch_finished_cleanly(routes: Launch) -> None:
    if routes.timed_out or routes.returncode != 0:
        pytest.fail(routes.report("the launch did not finish cleanly"), pytrace=False)
    routes.case("__finished__")


@pytest.mark.parametrize(("strategy", "route"), FALLBACKS)
def test_a_fallback_builds_the_model_a_fresh_wrap_builds(
    routes: Launch, strategy: str, route: str
) -> None:
    for fresh, other in zip(routes.case(FRESH[strategy]), routes.case(route), strict=True):
        for key in fresh:
            assert other[key] == fresh[key], (key, route)


@pytest.mark.parametrize("strategy", list(FRESH))
def test_resharding_after_forward_follows_the_strategy_and_leaves_the_root_to_torch(
    routes: Launch, strategy: str
) -> None:
    """Blocks (and their batch norms, units of their own under bf16) reshard after forward under
    ZeRO-3 and HSDP, not under ZeRO-2; the root keeps torch's default, which for the root is to
    stay gathered (`fully_shard(reshard_after_forward=None)`), as torchtitan leaves it."""
    for r in routes.case(FRESH[strategy]):
        after = r["after_forward"]
        blocks = {n: v for n, v in after.items() if n.startswith("blocks.")}
        assert blocks and set(blocks.values()) == {strategy != "shard_grad_op"}, blocks
        assert not any(after[n] for n in ROOT_PARAMS), after


def test_torch_leaves_the_root_gathered_by_default() -> None:
    """What the root's resharding relies on: `fully_shard`'s default is None (root: False)."""
    from torch.distributed.fsdp import fully_shard

    default = inspect.signature(fully_shard).parameters["reshard_after_forward"].default
    assert default is None, f"this torch's fully_shard defaults reshard_after_forward={default!r}"
