"""The plan as a picture (`Plan.plot`): each candidate's per-rank memory at its estimated peak,
stacked by `Footprint` term, against the usable memory, with the chosen one marked and the trial
step's measured peak on it when there is one.

matplotlib is optional (`pip install "autoshard[plot]"`) and imported only here, when a picture
is drawn. It draws on a `Figure` with the Agg canvas, never through pyplot: no window opens, and
the backend of a program that has imported pyplot is left as it was.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import TYPE_CHECKING

from autoshard._units import human, table_unit
from autoshard.decide.estimate import Footprint

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from autoshard.decide.plan import Candidate, Plan

MISSING_MATPLOTLIB = (
    'Plan.plot draws with matplotlib, which is not installed: pip install "autoshard[plot]" '
    '(or pip install "matplotlib>=3.8")'
)
DPI = 100  # pixels per inch of the PNG: the figure is width_px / DPI inches wide
# Default height: a fixed margin (title, axis, legend) plus a bar's height per candidate.
HEIGHT_MARGIN_PX = 160
HEIGHT_PER_CANDIDATE_PX = 40
MIN_HEIGHT_PX = 400

# Each Footprint term's legend text and color, its own whichever other terms a plan has: a term
# looks the same in every picture. Stacked in the order of Footprint's fields; a term added there
# needs an entry here (tests/test_plot.py checks).
TERMS: dict[str, tuple[str, str]] = {
    "params": ("params", "tab:blue"),
    "grads": ("grads", "tab:orange"),
    "optimizer_state": ("optimizer state", "tab:green"),
    "activations": ("activations", "tab:red"),
    "comm_buffers": ("comm buffers", "tab:purple"),
    "temporaries": ("temporaries", "tab:brown"),
    "overheads": ("overheads", "tab:gray"),
    "workspace": ("workspace", "tab:olive"),
}
RESERVE_LABEL = "kept free"
USABLE_LABEL = "usable memory"
MEASURED_LABEL = "measured peak"
CHOSEN_LABEL = "chosen"
BAR_HEIGHT = 0.7
LEGEND_COLUMN_PX = 200  # room for one legend entry, such as "measured peak 944.93 MiB"


def require_matplotlib() -> None:
    """Raises ImportError, saying how to install it, where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB, name="matplotlib") from exc


def default_height_px(plan: Plan) -> int:
    """`HEIGHT_MARGIN_PX` plus `HEIGHT_PER_CANDIDATE_PX` per candidate, at least
    `MIN_HEIGHT_PX`."""
    return max(MIN_HEIGHT_PX, HEIGHT_MARGIN_PX + HEIGHT_PER_CANDIDATE_PX * len(plan.candidates))


def row_label(plan: Plan, c: Candidate) -> str:
    """A candidate's name on its row, as in the table: "* FULL_SHARD 2/8" for the chosen one."""
    mark = "* " if is_chosen(plan, c) else ""
    fits = "" if c.fits else " (does not fit)"
    return f"{mark}{c.strategy} {c.activation_checkpointing}/{plan.num_blocks}{fits}"


def is_chosen(plan: Plan, c: Candidate) -> bool:
    return (c.strategy, c.activation_checkpointing) == (
        plan.strategy,
        plan.activation_checkpointing,
    )


def save(plan: Plan, path: str | os.PathLike[str], width_px: int, height_px: int) -> Figure:
    """Draw `plan` (`figure`) and write it to `path` as a PNG of width_px x height_px."""
    fig = figure(plan, width_px, height_px)
    fig.savefig(os.fspath(path), format="png", dpi=DPI)
    return fig


def figure(plan: Plan, width_px: int, height_px: int) -> Figure:
    """The picture of `plan` on a new Figure with the Agg canvas (see the module's docstring)."""
    for name, value in (("width_px", width_px), ("height_px", height_px)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"Plan.plot: {name} must be a positive number of pixels, got {value!r}"
            )
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    measured = plan.measured_peak_bytes
    extent = [c.estimated_peak_bytes + c.reserve_bytes for c in plan.candidates]
    largest = max([*extent, plan.device_memory_bytes, measured or 0])
    unit, size = table_unit(largest)
    handles = _stack(plan, ax, size)
    for row, (c, end) in enumerate(zip(plan.candidates, extent, strict=True)):
        if is_chosen(plan, c) and measured is not None:
            end = max(end, measured)  # clear of the measured peak's mark
        ax.text(end / size, row, f" {human(c.estimated_peak_bytes)}", va="center")
    usable = ax.axvline(
        plan.device_memory_bytes / size, color="crimson", linestyle="--", label=USABLE_LABEL
    )
    handles.append((usable, f"{USABLE_LABEL} {human(plan.device_memory_bytes)}"))
    row = _mark_chosen(plan, ax, size)
    if measured is not None:
        (line,) = ax.plot([measured / size] * 2, [row - 0.45, row + 0.45], color="black", lw=3)
        line.set_label(MEASURED_LABEL)
        handles.append((line, f"{MEASURED_LABEL} {human(measured)}"))
    ax.set_xlim(0, largest / size * 1.15)  # room for the numbers at the bars' ends
    ax.set_xlabel(f"{unit} per rank at each candidate's estimated peak")
    ax.set_title(
        f"autoshard plan: {plan.strategy}, mixed precision {plan.mixed_precision}, "
        f"world size {plan.world_size}"
    )
    columns = max(1, min(len(handles), width_px // LEGEND_COLUMN_PX))
    fig.legend(*zip(*handles, strict=True), loc="outside lower center", ncols=columns)
    return fig


def _stack(plan: Plan, ax: Axes, size: int) -> list[tuple[Artist, str]]:
    """One bar per candidate (a row each, in the table's order), one segment per term (a
    container per term, labelled with the term's name, zero-width where it is 0), then what is
    kept free beside the peak, hollow; returns the legend's entries: the terms some candidate
    has, and the reserve where there is one."""
    rows = range(len(plan.candidates))
    handles: list[tuple[Artist, str]] = []
    left = [0.0] * len(plan.candidates)
    for term in (f.name for f in fields(Footprint)):
        text, color = TERMS[term]
        widths = [getattr(c.footprint, term) / size for c in plan.candidates]
        bars = ax.barh(rows, widths, BAR_HEIGHT, left, color=color, label=term)
        if any(widths):  # a term no candidate has stays out of the legend
            handles.append((bars.patches[0], text))
        left = [x + w for x, w in zip(left, widths, strict=True)]
    if any(c.reserve_bytes for c in plan.candidates):
        widths = [c.reserve_bytes / size for c in plan.candidates]
        reserve = ax.barh(rows, widths, BAR_HEIGHT, left, fill=False, hatch="//", edgecolor="0.5")
        reserve.set_label(RESERVE_LABEL)
        handles.append((reserve.patches[0], RESERVE_LABEL))
    return handles


def _mark_chosen(plan: Plan, ax: Axes, size: int) -> int:
    """Label each row, the chosen one's in bold and its bar outlined, those that do not fit in
    red; returns the chosen one's row."""
    from matplotlib.patches import Rectangle

    ax.set_yticks(range(len(plan.candidates)), [row_label(plan, c) for c in plan.candidates])
    ax.invert_yaxis()  # the table's order, top to bottom
    for label, c in zip(ax.get_yticklabels(), plan.candidates, strict=True):
        if is_chosen(plan, c):
            label.set_fontweight("bold")
        if not c.fits:
            label.set_color("crimson")
    row = next(i for i, c in enumerate(plan.candidates) if is_chosen(plan, c))
    peak = plan.chosen.estimated_peak_bytes / size
    half = BAR_HEIGHT / 2 + 0.05
    outline = Rectangle((0, row - half), peak, 2 * half, fill=False, edgecolor="black", lw=2)
    outline.set_label(CHOSEN_LABEL)
    ax.add_patch(outline)
    return row
