"""Test selection: tests marked `slow` (benchmark smoke runs and other long torchrun launches)
run only with `--full`, which CI and the README's test command pass; plain `pytest` stays quick
for the edit-test loop.

Under pytest-xdist (`-n 2`, as the README's test command runs it) each test file goes whole to
one worker: a module's launch fixture (one torchrun job whose results its tests read) then runs
once, not once per worker that draws one of its tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

# autoshard's on-disk cache of fake steps (measure/cache.py) is off for the suite and every
# process it starts: a test that plans the same model twice, changing what it measures in
# between, must simulate both times, and no test writes under the home directory.
# tests/test_cache.py turns it on, in a directory of its own, where it is what is tested.
os.environ["AUTOSHARD_CACHE"] = "0"
# Simulations shared out to worker processes (measure/pool.py) give the same results as this
# process alone; the suite, which plans hundreds of times, would start workers for each plan
# wherever a core is idle. tests/test_pool.py starts them, where they are what is tested.
os.environ["AUTOSHARD_SIMULATION_WORKERS"] = "0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (CI and the README's test command do)",
    )


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may not be installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "load":  # xdist's default for -n; another --dist is kept
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of this process alone, destroyed afterwards."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
