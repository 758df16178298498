"""What `prepare` spends deciding, before its trial step (issue 24: "on a GPU `prepare()` of each
external family within 5 s plus its trial step"), measured here on the CPU.

    python benchmarks/prepare_cost.py                  # the GPU suite's models, GPU-sized
    python benchmarks/prepare_cost.py --models llama_1b,enc_dec --worlds 8
    python benchmarks/prepare_cost.py --dry-run        # the same models, tiny (seconds)

Each model of the GPU suite (`_gpu_models.GPU_MODELS`: the first GPU run's four, and the five
families that broke its estimate) is built on the meta device at its GPU size and planned for
ranks of 80 GiB CUDA devices, bf16, the way `prepare` decides: the fastest strategies simulated
first, and no slower one once one fits (`with_simulation(..., every=False)`; a what-if `plan`
simulates every candidate). The trace and the simulations run on fake tensors, on the CPU, in a
GPU host's `prepare` as here: this is the part of its time that does not depend on the GPU.
The cache is off and no simulation worker runs, so every fake step is made and counted here.

Per model and world size: the fake steps (the trace's and each simulated run's at each depth),
the fake operators (calls into `FakeTensorMode.dispatch`) and those other than `prim.device`
(autograd reading a tensor's device, a few microseconds each), the CPU seconds and the wall
seconds of the decision, and the plan. At world 8 the figures are every rank's simulations
together: in a job they are shared out among the ranks. Not counted here, and owed on a GPU:
the device's calibration, the cuBLAS workspace probe, NCCL's start and the trial step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ["AUTOSHARD_CACHE"] = "0"
os.environ["AUTOSHARD_SIMULATION_WORKERS"] = "0"  # every fake step made here, where it is counted

import _gpu_families  # noqa: E402
import _gpu_models  # noqa: E402
import zoo  # noqa: E402

import autoshard  # noqa: E402
from autoshard import pipeline  # noqa: E402
from autoshard.measure import facts, simulate, simulated  # noqa: E402

META = torch.device("meta")


@contextlib.contextmanager
def _as_prepare_decides() -> Iterator[dict[str, int]]:
    """While it lasts: plans simulate as `prepare` does (the fastest first), and fake steps and
    operators are counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counts = {"steps": 0, "operators": 0, "device": 0}
    trace, dispatch, run, with_simulation = (
        facts._measure,
        FakeTensorMode.dispatch,
        simulate._run,
        simulated.with_simulation,
    )
    device_op = torch.ops.prim.device.default

    def counted_dispatch(self: Any, func: Any, *a: Any, **k: Any) -> Any:
        counts["operators"] += 1
        counts["device"] += func is device_op
        return dispatch(self, func, *a, **k)

    def counted_trace(*a: Any, **k: Any) -> Any:
        counts["steps"] += 1
        return trace(*a, **k)

    def counted_run(*a: Any, **k: Any) -> Any:
        counts["steps"] += 1
        return run(*a, **k)

    def fastest_first(
        inputs: Any, work: Any, names: Any, device: Any, strategies: Any, *_: Any
    ) -> Any:
        # `shared` stays False: this process makes every rank's simulations
        return with_simulation(inputs, work, names, device, strategies, False, False)

    patches = [
        (FakeTensorMode, "dispatch", counted_dispatch),
        (facts, "_measure", counted_trace),
        (simulate, "_run", counted_run),
        (pipeline, "with_simulation", fastest_first),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield counts
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def build(name: str, models: dict[str, Any]) -> Any:
    """Model `name` of `models` on meta, with its AdamW (foreach, CUDA's default), batch, loss."""
    kind, batch, sizes = models[name]
    builder = _gpu_families.BUILDERS.get(kind) or zoo.BUILDERS[kind]
    # built under the meta device: a model built on the CPU and moved with `.to("meta")` loses
    # its ties (`Module._apply` makes a new Parameter for each module holding the tied one)
    with META:
        built = builder(batch, device=META, **sizes)
    trainable = [p for p in built.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, foreach=True)
    return zoo.ZooModel(built.model, optimizer, built.batch, built.loss_fn)


def measure(name: str, models: dict[str, Any], world: int) -> dict[str, Any]:
    built = build(name, models)
    with _as_prepare_decides() as counts:
        cpu, wall = time.process_time(), time.perf_counter()
        plan = autoshard.plan(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            world_size=world,
            device="cuda",
            device_memory="80GiB",
            mixed_precision="bf16",
        )
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "model": name,
        "world": world,
        **counts,
        "cpu_s": cpu,
        "wall_s": wall,
        "plan": f"{plan.strategy.value}, AC {plan.activation_checkpointing}/{plan.num_blocks}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: every one)")
    parser.add_argument("--worlds", default="1,8", help="world sizes, comma-separated")
    parser.add_argument("--dry-run", action="store_true", help="the tiny sizes (seconds)")
    args = parser.parse_args(argv)
    models = _gpu_models.models_for(args.dry_run)
    names = args.models.split(",") if args.models else list(models)
    unknown = [n for n in names if n not in models]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(models)}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s)")
    print(
        "| model | world | fake steps | fake operators | not `prim.device` | CPU s | wall s "
        "| plan |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        for name in names:
            row = measure(name, models, world)
            print(
                f"| {name} | {world} | {row['steps']} | {row['operators']:,} | "
                f"{row['operators'] - row['device']:,} | {row['cpu_s']:.1f} | "
                f"{row['wall_s']:.1f} | {row['plan']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
