"""HYBRID_SHARD for real: two gloo ranks laid out as two nodes of one rank each (LOCAL_WORLD_SIZE
set to 1 before prepare() reads it), so the 2-D mesh is (replicate 2, shard 1).

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 hybrid.py OUT_DIR
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.tensor import DTensor

# Each rank its own node, as torchrun --nnodes 2 --nproc-per-node 1 would set it.
os.environ["LOCAL_WORLD_SIZE"] = "1"

from _common import (  # noqa: E402
    Cases,
    ScalarNet,
    build,
    local_batches,
    reference_losses,
    train,
)

import autoshard  # noqa: E402

STEPS = 5
cases = Cases()


@cases.case
def reference() -> dict[str, Any]:
    return {
        "losses": reference_losses(STEPS),
        "scalar_losses": reference_losses(STEPS, cls=ScalarNet),
    }


@cases.case
def hybrid_forced() -> dict[str, Any]:
    model, optimizer = build()
    batches = local_batches(STEPS)
    wrapped, returned, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy="hybrid_shard", mixed_precision="no"
    )  # compared with an fp32 reference: "auto" would pick bf16 on a CPU with native bf16
    param = next(wrapped.parameters())
    mesh = param.device_mesh if isinstance(param, DTensor) else None
    return {
        "strategy": plan.strategy.value,
        "optimizer_is_same": returned is optimizer,
        "mesh_shape": list(mesh.shape) if mesh is not None else None,
        "mesh_dims": list(mesh.mesh_dim_names or ()) if mesh is not None else None,
        "placements": [str(p) for p in param.placements] if isinstance(param, DTensor) else None,
        "losses": train(wrapped, optimizer, batches),
    }


@cases.case
def hybrid_scalars() -> dict[str, Any]:
    """Parameters of no dimension, kept whole: averaged over both dimensions of the mesh."""
    model, optimizer = build(cls=ScalarNet)
    batches = local_batches(STEPS)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy="hybrid_shard", mixed_precision="no"
    )
    losses = train(wrapped, optimizer, batches)
    scalars = [float(p.detach()) for p in model.parameters() if p.dim() == 0]
    return {"strategy": plan.strategy.value, "losses": losses, "scalars": scalars}


@cases.case
def auto_offers_hybrid() -> dict[str, Any]:
    model, optimizer = build()
    plan = autoshard.prepare(model, optimizer, local_batches(1)[0], trial_step=False).plan
    return {
        "candidates": sorted({c.strategy.value for c in plan.candidates}),
        "strategy": plan.strategy.value,
        "reasons": list(plan.reasons),
    }


if __name__ == "__main__":
    cases.main(init_process_group=False)
