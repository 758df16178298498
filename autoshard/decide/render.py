"""The plan as text (the candidate table, the trial's attempts and the reasons) and as a dict of
plain JSON types."""

from __future__ import annotations

import textwrap
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from autoshard._units import human, table_unit

if TYPE_CHECKING:
    from autoshard.decide.plan import Candidate, Plan


_HEADER = (
    "candidate",
    "AC",
    "params",
    "grads",
    "optim",
    "activ",
    "comm",
    "temp",
    "wksp",
    "other",
    "peak",
    "step",
    "fits",
)


WIDTH = 100  # the table, its legend and the lines above it fit a terminal of this width
_ACTIVATIONS = _HEADER.index("activ") - 2  # its index among the byte terms


def _cell(value: int, size: int, term: int) -> str:
    # No activation alive at the peak: it is the optimizer step's, after backward freed them.
    if term == _ACTIVATIONS and value == 0:
        return "-"
    return f"{value / size:.2f}"


def _legend(unit: str, batches: bool = False) -> list[str]:
    """What the columns mean, under the table, so that it reads without the README."""
    text = (
        f"{unit} per rank at each candidate's estimated peak; * = chosen; AC = blocks "
        f"checkpointed. params, grads, optim: the parameters, gradients and optimizer state this "
        f"rank holds. activ: activations saved for backward, and the batch, still alive at the "
        f"peak moment ('-': the peak is the optimizer step, after backward freed them). comm: "
        f"FSDP2's gathered parameters and gradients awaiting reduce-scatter; on CUDA, DDP's "
        f"first buckets, which NCCL holds into the second step. temp: temporaries "
        f"(the optimizer step's, the gradient of a saved activation in backward). wksp: cuBLAS's "
        f"workspaces, which the step's matmuls allocate and keep. other: what no "
        f"tensor shows (CUDA context, NCCL buffers, allocator margin). peak: their sum; fits: "
        f"peak plus what is kept free beside it (below) within the usable memory. step: modelled "
        f"step time, for ranking only."
    )
    if batches:
        text += " batch: the largest per-rank batch each fits, simulated ('-': not even one row)."
    return textwrap.wrap(text, width=WIDTH, break_on_hyphens=False)


def render(plan: Plan) -> str:
    """The plan as a table: one row per candidate, bytes per rank, the chosen one marked; with
    a `batch` column (each one's largest per-rank batch) where that was searched."""
    unit, size = table_unit(max((c.estimated_peak_bytes for c in plan.candidates), default=0))
    batches = any(c.max_batch is not None for c in plan.candidates)
    header = (*_HEADER, "batch") if batches else _HEADER
    rows: list[tuple[str, ...]] = [header]
    for c in plan.candidates:
        f = c.footprint
        chosen = (
            c.strategy == plan.strategy
            and c.activation_checkpointing == plan.activation_checkpointing
        )
        terms = (
            f.params,
            f.grads,
            f.optimizer_state,
            f.activations,
            f.comm_buffers,
            f.temporaries,
            f.workspace,
            f.overheads,
            f.peak,
        )
        rows.append(
            (
                ("* " if chosen else "  ") + str(c.strategy),
                f"{c.activation_checkpointing}/{plan.num_blocks}",
                *(_cell(x, size, i) for i, x in enumerate(terms)),
                f"{c.step_seconds * 1e3:.1f}ms",
                "yes" if c.fits else "no",
                *((str(c.max_batch) if c.max_batch is not None else "-",) if batches else ()),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    # two spaces between columns, one where two would not fit the terminal's width
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= WIDTH else " "

    def line(row: tuple[str, ...]) -> str:
        return gap.join(
            x.ljust(w) if i == 0 else x.rjust(w)
            for i, (x, w) in enumerate(zip(row, widths, strict=True))
        )

    measured = plan.measured_peak_bytes
    lines = [
        f"autoshard plan: {plan.strategy}, mixed precision {plan.mixed_precision}, "
        f"activation checkpointing {plan.activation_checkpointing}/{plan.num_blocks} blocks, "
        f"world size {plan.world_size}",
        f"usable memory per rank {human(plan.device_memory_bytes)}; estimated peak "
        f"{human(plan.estimated_peak_bytes)}"
        + (f"; measured {human(measured)}" if measured is not None else ""),
        line(rows[0]),
        *(line(row) for row in rows[1:]),
        *_legend(unit, batches),
    ]
    for attempt in plan.attempts:
        peak = attempt.measured_peak_bytes
        lines.append(
            f"trial: {attempt}" + (f", measured peak {human(peak)}" if peak is not None else "")
        )
    for reason in plan.reasons:
        lines += textwrap.wrap(f"- {reason}", WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)


def candidate_dict(c: Candidate) -> dict[str, Any]:
    return {
        "strategy": c.strategy.value,
        "activation_checkpointing": c.activation_checkpointing,
        "estimated_peak_bytes": c.estimated_peak_bytes,
        "footprint": {f.name: getattr(c.footprint, f.name) for f in fields(c.footprint)},
        "step_seconds": c.step_seconds,
        "fits": c.fits,
        "host_bytes": c.host_bytes,
        "reserve_bytes": c.reserve_bytes,
        "max_batch": c.max_batch,
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    """`Plan.to_dict`: every field, in plain JSON types."""
    return {
        "strategy": plan.strategy.value,
        "mixed_precision": plan.mixed_precision.value,
        "activation_checkpointing": plan.activation_checkpointing,
        "cpu_offload": plan.cpu_offload,
        "estimated_peak_bytes": plan.estimated_peak_bytes,
        "measured_peak_bytes": plan.measured_peak_bytes,
        "device_memory_bytes": plan.device_memory_bytes,
        "world_size": plan.world_size,
        "num_blocks": plan.num_blocks,
        "max_batch": plan.max_batch,
        "chosen": candidate_dict(plan.chosen),
        "candidates": [candidate_dict(c) for c in plan.candidates],
        "attempts": [
            {
                "strategy": a.strategy.value,
                "activation_checkpointing": a.activation_checkpointing,
                "outcome": a.outcome.value,
                "measured_peak_bytes": a.measured_peak_bytes,
                "seconds": a.seconds,
                "out_of_memory_ranks": list(a.out_of_memory_ranks),
            }
            for a in plan.attempts
        ],
        "unused_parameters": list(plan.unused_parameters),
        "layer_drop": plan.layer_drop,
        "autocast_raises": plan.autocast_raises,
        "reasons": list(plan.reasons),
    }
