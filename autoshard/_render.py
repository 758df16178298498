"""The plan as text: the candidate table, the trial's attempts and the reasons."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard._units import human, table_unit

if TYPE_CHECKING:
    from autoshard._plan import Plan


_HEADER = (
    "candidate",
    "AC",
    "params",
    "grads",
    "optim",
    "activ",
    "comm",
    "temp",
    "other",
    "peak",
    "step",
    "fits",
)


def render(plan: Plan) -> str:
    """The plan as a table: one row per candidate, bytes per rank, the chosen one marked."""
    unit, size = table_unit(max((c.estimated_peak_bytes for c in plan.candidates), default=0))
    rows: list[tuple[str, ...]] = [_HEADER]
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
            f.overheads,
            f.peak,
        )
        rows.append(
            (
                ("* " if chosen else "  ") + str(c.strategy),
                f"{c.activation_checkpointing}/{plan.num_blocks}",
                *(f"{x / size:.2f}" for x in terms),
                f"{c.step_seconds * 1e3:.1f}ms",
                "yes" if c.fits else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(
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
        line(rows[0]) + f"   ({unit} per rank; step time modelled, for ranking only)",
        *(line(row) for row in rows[1:]),
    ]
    for attempt in plan.attempts:
        peak = attempt.measured_peak_bytes
        lines.append(
            f"trial: {attempt.strategy} AC {attempt.activation_checkpointing}: {attempt.outcome}"
            + (f", measured peak {human(peak)}" if peak is not None else "")
        )
    lines.extend(f"- {reason}" for reason in plan.reasons)
    return "\n".join(lines)
