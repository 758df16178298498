"""The cost model's step time against steps measured on a GPU (issue 26: "modelled step within
+-35% of the measured step for LOCAL, DDP and FULL_SHARD at world 1 on the suite's models").

Reads a GPU suite report (`benchmarks/gpu_suite.py --out DIR` writes DIR/report.md): its
calibration (the FLOP/s and memory bandwidth measured on that GPU) and its accuracy rows (model,
world, strategy, checkpointed blocks, the measured median step). Each world-1 row's model is
built on the meta device at the suite's size and planned here, on the CPU, as the GPU's plan was
(`device="cuda"`, its strategy and checkpointing forced, AdamW as the suite made it); the
modelled step is then computed with the report's measured figures and with the constants, and
set beside the step the GPU measured.

    python benchmarks/step_model.py --report ../shared/gpu/h100-2026-11-24.md

The report's figures are measurements of autoshard at the commit it names; the modelled steps
are this checkout's. Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("AUTOSHARD_CACHE", "0")
os.environ.setdefault("AUTOSHARD_SIMULATION_WORKERS", "0")

import _gpu_families  # noqa: E402
import _gpu_models  # noqa: E402
import zoo  # noqa: E402
from _gpu_accuracy import captured_inputs  # noqa: E402

import autoshard  # noqa: E402
from autoshard.decide.cost import step_seconds  # noqa: E402
from autoshard.decide.hardware import Throughput, hardware_for  # noqa: E402
from autoshard.strategies.strategy import Strategy  # noqa: E402

_ROW = re.compile(
    r"^\| (?P<model>\w+) \| (?P<world>\d+) \| (?P<strategy>\w+) \| (?P<ac>\d+)/\d+ \|"
    r".*\| (?P<step>[\d.]+) ms \| [^|]* \| [^|]* \|$"
)


def read_report(path: Path) -> tuple[Throughput, list[dict[str, Any]]]:
    """The report's measured throughput and its world-1 accuracy rows."""
    text = path.read_text()
    given = re.search(r"measured=Throughput\(\.\.\.\)\)` gives: (\{.*\})", text)
    if given is None:
        raise SystemExit(f"{path}: no calibration figures (the calibration section)")
    figures = json.loads(given.group(1))
    measured = Throughput(
        figures["flops_per_s"], figures["memory_bytes_per_s"], f"measured ({path.name})"
    )
    rows = []
    for line in text.splitlines():
        match = _ROW.match(line)
        if match and match["world"] == "1":
            rows.append(
                {
                    "model": match["model"],
                    "strategy": match["strategy"],
                    "checkpointed": int(match["ac"]),
                    "measured_s": float(match["step"]) / 1e3,
                }
            )
    if not rows:
        raise SystemExit(f"{path}: no world-1 rows in its accuracy table")
    return measured, rows


def modelled(row: dict[str, Any], measured: Throughput) -> tuple[float, float]:
    """The row's modelled step with the constants and with the measured figures, in seconds."""
    kind, batch, sizes = _gpu_models.GPU_MODELS[row["model"]]
    builder = _gpu_families.BUILDERS.get(kind) or zoo.BUILDERS[kind]
    built = builder(batch, device=torch.device("meta"), **sizes)
    trainable = [p for p in built.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)  # the suite's "default": foreach on CUDA
    with captured_inputs() as seen:
        plan = autoshard.plan(
            built.model,
            optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            world_size=1,
            device="cuda",
            device_memory="80GiB",
            mixed_precision="bf16",
            strategy=row["strategy"],
            activation_checkpointing=row["checkpointed"],
        )
    inputs = seen[-1]
    strategy = Strategy(plan.strategy)
    constants = step_seconds(inputs, strategy, plan.activation_checkpointing)
    hardware = hardware_for("cuda", (9, 0), True, measured)
    calibrated = step_seconds(
        replace(inputs, hardware=hardware), strategy, plan.activation_checkpointing
    )
    return constants, calibrated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True, help="a GPU suite report.md")
    args = parser.parse_args()
    measured, rows = read_report(args.report)
    print(
        f"report {args.report}: {measured.flops_per_s:.3g} FLOP/s, "
        f"{measured.memory_bytes_per_s:.3g} B/s measured; operator launch: the constant"
    )
    print(
        "| model | strategy | AC | measured | modelled (constants) | modelled (measured) | error |"
    )
    print("|---|---|---|---|---|---|---|")
    errors = []
    for row in rows:
        constants, calibrated = modelled(row, measured)
        error = (calibrated - row["measured_s"]) / row["measured_s"]
        errors.append(error)
        print(
            f"| {row['model']} | {row['strategy']} | {row['checkpointed']} | "
            f"{row['measured_s'] * 1e3:.1f} ms | {constants * 1e3:.1f} ms | "
            f"{calibrated * 1e3:.1f} ms | {error:+.0%} |"
        )
    within = sum(abs(e) <= 0.35 for e in errors)
    print(f"\n{within} of {len(errors)} rows within +-35% (issue 26's target)")


if __name__ == "__main__":
    main()
