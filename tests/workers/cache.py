"""autoshard's cache in a job: what one rank kept serves every rank (tests/test_cache.py).

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 cache.py OUT_DIR

Each rank has a cache directory of its own under OUT_DIR. "first" prepares with rank 0's cache
on and empty, rank 1's off; "again" prepares a fresh copy of the same model with rank 0's cache
as "first" left it and rank 1's on but empty.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from _common import Cases, build, local_batches, rank

import autoshard

OUT = Path(sys.argv[1])
cases = Cases()


def _prepare(cache_on: bool) -> dict[str, Any]:
    os.environ["AUTOSHARD_CACHE"] = "1" if cache_on else "0"
    os.environ["AUTOSHARD_CACHE_DIR"] = str(OUT / f"cache{rank()}")
    model, optimizer = build()
    # forced, with checkpointing: two runs to share out, whatever the memory here
    _, _, plan = autoshard.prepare(
        model,
        optimizer,
        local_batches(1)[0],
        strategy="full_shard",
        activation_checkpointing=True,
        mixed_precision="no",
    )
    simulated = next(r for r in plan.reasons if "simulated steps" in r)
    trace = next(r for r in plan.reasons if r.startswith("activations traced"))
    plan_dict = plan.to_dict()
    # what is decided from the simulations (the trial's measured peak and the memory free vary)
    figures = {k: plan_dict[k] for k in ("strategy", "activation_checkpointing")}
    figures["estimates"] = [
        (c["strategy"], c["activation_checkpointing"], c["estimated_peak_bytes"], c["footprint"])
        for c in plan_dict["candidates"]
    ]
    return {"figures": figures, "simulated": simulated, "trace_kept": "cache" in trace}


@cases.case
def first() -> dict[str, Any]:
    return _prepare(cache_on=rank() == 0)


@cases.case
def again() -> dict[str, Any]:
    return _prepare(cache_on=True)


if __name__ == "__main__":
    cases.main()
