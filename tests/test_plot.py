"""`Plan.plot` and `autoshard plan --plot`: a PNG of the size asked, whose artists are the plan's
figures (read back from the Figure, not from the pixels), and a clear error without matplotlib."""

from __future__ import annotations

import dataclasses
import struct
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

import autoshard
from autoshard import cli
from autoshard._units import human, table_unit
from autoshard.decide import plot
from autoshard.decide.estimate import Footprint
from autoshard.decide.plan import Candidate, Plan
from autoshard.decide.precision import Precision
from autoshard.strategies.strategy import Strategy

pytest.importorskip("matplotlib")  # the test extra installs it: these run, not skip, in CI

import numpy as np  # noqa: E402  (matplotlib's own dependency)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

MiB = 2**20
TERMS = [f.name for f in fields(Footprint)]


def tiny() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A factory for `autoshard plan test_plot:tiny`."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters()), torch.randn(4, 8)


def _candidate(strategy: Strategy, ac: int, *, reserve: int = 0, fits: bool = True) -> Candidate:
    # distinct amounts per term and candidate, communication and workspace absent
    base = {Strategy.DDP: 100, Strategy.FULL_SHARD: 40}[strategy] - 10 * ac
    footprint = Footprint(
        params=base * MiB,
        grads=base * MiB,
        optimizer_state=2 * base * MiB,
        activations=(300 - 100 * ac) * MiB,
        comm_buffers=0,
        temporaries=7 * MiB,
        overheads=512 * MiB,
    )
    return Candidate(strategy, ac, footprint, 0.1, fits, reserve_bytes=reserve)


@pytest.fixture
def made() -> Plan:
    """A plan of three candidates as `decide` would give one: DDP does not fit, FULL_SHARD with
    one block checkpointed is chosen, and a trial step measured it."""
    candidates = (
        _candidate(Strategy.DDP, 0, fits=False),
        _candidate(Strategy.FULL_SHARD, 0, reserve=64 * MiB),
        _candidate(Strategy.FULL_SHARD, 1, reserve=64 * MiB),
    )
    chosen = candidates[2]
    return Plan(
        strategy=Strategy.FULL_SHARD,
        mixed_precision=Precision.BF16,
        activation_checkpointing=1,
        cpu_offload=False,
        estimated_peak_bytes=chosen.estimated_peak_bytes,
        measured_peak_bytes=chosen.estimated_peak_bytes + 50 * MiB,
        device_memory_bytes=1024 * MiB,
        world_size=8,
        num_blocks=4,
        candidates=candidates,
        reasons=(),
    )


@pytest.fixture(scope="module")
def planned() -> Plan:
    """A plan `autoshard.plan` made (no trial step: no measured peak)."""
    model, optimizer, batch = tiny()
    return autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="no"
    )


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header: the signature, then the IHDR chunk (length, type,
    width, height as big-endian 32-bit integers)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG: {head[:8]!r}"
    length, kind, width, height = struct.unpack(">I4sII", head[8:24])
    assert (length, kind) == (13, b"IHDR")
    return width, height


def _unit(plan: Plan) -> int:
    """The bytes of the axis's unit, chosen as the table chooses (`table_unit`) over what is
    drawn: the bars with what they keep free, the usable memory, the measured peak."""
    extent = [c.estimated_peak_bytes + c.reserve_bytes for c in plan.candidates]
    return table_unit(max([*extent, plan.device_memory_bytes, plan.measured_peak_bytes or 0]))[1]


def _lines(fig: Figure, label: str) -> list[Line2D]:
    return [line for line in fig.axes[0].lines if line.get_label() == label]


def _xy(line: Line2D) -> tuple[list[float], list[float]]:
    """A line's points as plain floats: its x values, its y values."""
    xy = np.asarray(line.get_xydata(), dtype=float)
    return xy[:, 0].tolist(), xy[:, 1].tolist()


@pytest.mark.parametrize("width, height", [(640, 360), (1001, 333), (1600, 900)])
def test_the_file_is_a_png_of_the_size_asked(
    made: Plan, tmp_path: Path, width: int, height: int
) -> None:
    path = tmp_path / "plan.png"
    fig = made.plot(path, width_px=width, height_px=height)
    assert isinstance(fig, Figure)
    assert png_size(path) == (width, height)


def test_the_default_size_grows_with_the_candidates(made: Plan, tmp_path: Path) -> None:
    made.plot(tmp_path / "three.png")
    # 160 px + 40 px per candidate, at least 400
    assert png_size(tmp_path / "three.png") == (1000, 400)
    many = dataclasses.replace(made, candidates=made.candidates * 4)  # 12 rows
    many.plot(tmp_path / "twelve.png")
    assert png_size(tmp_path / "twelve.png") == (1000, 160 + 40 * 12)


@pytest.mark.parametrize("which", ["made", "planned"])
def test_each_bar_is_its_candidates_terms_stacked_in_the_tables_unit(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    plan: Plan = request.getfixturevalue(which)
    ax = plan.plot(tmp_path / "plan.png").axes[0]
    size = _unit(plan)
    bars = {c.get_label(): c for c in ax.containers}
    assert [label for label in bars if label in TERMS] == TERMS  # every term, in field order
    for row, c in enumerate(plan.candidates):
        left = 0.0
        for term in TERMS:
            patch = bars[term].patches[row]  # type: ignore[attr-defined]
            assert patch.get_width() == pytest.approx(getattr(c.footprint, term) / size)
            assert patch.get_x() == pytest.approx(left)  # on top of the terms before it
            assert patch.get_y() + patch.get_height() / 2 == pytest.approx(row)
            left += patch.get_width()
        assert left == pytest.approx(c.estimated_peak_bytes / size)
        if c.reserve_bytes:  # what is kept free beside the peak, hollow, after it
            reserve = bars[plot.RESERVE_LABEL].patches[row]  # type: ignore[attr-defined]
            assert not reserve.get_fill()
            assert (reserve.get_x(), reserve.get_width()) == pytest.approx(
                (left, c.reserve_bytes / size)
            )
    unit = table_unit(size)[0]  # the size is the largest thing drawn's unit: its own unit
    assert ax.get_xlabel() == f"{unit} per rank at each candidate's estimated peak"


def test_the_legend_names_the_terms_drawn_and_each_term_keeps_its_color(
    made: Plan, tmp_path: Path
) -> None:
    fig = made.plot(tmp_path / "plan.png")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    drawn = [t for t in TERMS if any(getattr(c.footprint, t) for c in made.candidates)]
    assert "comm_buffers" not in drawn and "workspace" not in drawn  # 0 in every candidate
    assert legend == [
        *(plot.TERMS[t][0] for t in drawn),
        plot.RESERVE_LABEL,
        "usable memory 1.00 GiB",
        f"measured peak {human(made.measured_peak_bytes or 0)}",
    ]
    bars = {c.get_label(): c for c in fig.axes[0].containers}
    for term in TERMS:  # the same color whichever terms this plan has
        expected = Rectangle((0, 0), 1, 1, color=plot.TERMS[term][1]).get_facecolor()
        assert bars[term].patches[0].get_facecolor() == expected  # type: ignore[attr-defined]


def test_every_footprint_term_has_a_legend_text_and_a_color_of_its_own() -> None:
    assert set(plot.TERMS) == set(TERMS)
    colors = [color for _, color in plot.TERMS.values()]
    assert len(set(colors)) == len(colors)


def test_the_usable_memory_is_a_line_across_every_bar(made: Plan, tmp_path: Path) -> None:
    fig = made.plot(tmp_path / "plan.png")
    (usable,) = _lines(fig, plot.USABLE_LABEL)
    x = made.device_memory_bytes / _unit(made)
    assert _xy(usable) == (pytest.approx([x, x]), [0, 1])  # y in axes coordinates: top to bottom
    assert fig.axes[0].get_xlim()[1] > x


def test_the_chosen_candidate_is_marked(made: Plan, tmp_path: Path) -> None:
    ax = made.plot(tmp_path / "plan.png").axes[0]
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == [
        "DDP 0/4 (does not fit)",
        "FULL_SHARD 0/4",
        "* FULL_SHARD 1/4",
    ]
    assert [t.get_fontweight() for t in labels] == ["normal", "normal", "bold"]
    assert labels[0].get_color() != labels[1].get_color()  # what does not fit stands out
    (outline,) = [p for p in ax.patches if p.get_label() == plot.CHOSEN_LABEL]
    assert isinstance(outline, Rectangle) and not outline.get_fill()
    assert outline.get_x() == 0
    assert outline.get_width() == pytest.approx(made.estimated_peak_bytes / _unit(made))
    assert outline.get_y() + outline.get_height() / 2 == pytest.approx(2)  # its row


def test_the_measured_peak_is_drawn_on_the_chosen_bar_when_there_is_one(
    made: Plan, planned: Plan, tmp_path: Path
) -> None:
    fig = made.plot(tmp_path / "measured.png")
    (line,) = _lines(fig, plot.MEASURED_LABEL)
    x = (made.measured_peak_bytes or 0) / _unit(made)
    xs, (low, high) = _xy(line)
    assert xs == pytest.approx([x, x])
    assert low < 2 < high  # across the chosen row
    assert planned.measured_peak_bytes is None  # autoshard.plan runs no trial step
    unmeasured = planned.plot(tmp_path / "unmeasured.png")
    assert _lines(unmeasured, plot.MEASURED_LABEL) == []
    legend = [t.get_text() for t in unmeasured.legends[0].get_texts()]
    assert not any(t.startswith(plot.MEASURED_LABEL) for t in legend)


def test_it_draws_with_agg_and_without_pyplot(
    made: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    backend = dict.__getitem__(matplotlib.rcParams, "backend")
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing it would fail
    fig = made.plot(tmp_path / "plan.png")
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert dict.__getitem__(matplotlib.rcParams, "backend") == backend  # a user's, untouched


def test_without_matplotlib_the_error_says_how_to_install_it(
    made: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(ImportError) as info:
        made.plot(tmp_path / "plan.png")
    assert str(info.value) == (
        'Plan.plot draws with matplotlib, which is not installed: pip install "autoshard[plot]" '
        '(or pip install "matplotlib>=3.8")'
    )
    assert not (tmp_path / "plan.png").exists()


@pytest.mark.parametrize("size", [0, -5, 2.5, True])
def test_a_size_that_is_not_pixels_is_refused(made: Plan, tmp_path: Path, size: object) -> None:
    with pytest.raises(
        ValueError, match=f"width_px must be a positive number of pixels, got {size!r}"
    ):
        made.plot(tmp_path / "plan.png", width_px=size)  # type: ignore[arg-type]


PLAN_ARGV = [
    "plan",
    "test_plot:tiny",
    "--world-size",
    "2",
    "--device-memory",
    "1GiB",
    "--device",
    "cpu",
    "--mixed-precision",
    "no",
]


def test_cli_plan_plot_writes_the_picture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "plan.png"
    assert cli.main([*PLAN_ARGV, "--plot", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("autoshard plan: ")  # the table, as without --plot
    assert f"autoshard plan: drew the plan in {path}" in err
    assert png_size(path) == (1000, 400)  # the default size for its 3 candidates


def test_cli_plot_problems_are_said_before_planning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def plan(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before --plot was checked")

    monkeypatch.setattr(autoshard, "plan", plan)
    missing = tmp_path / "no-such-folder" / "plan.png"
    with pytest.raises(SystemExit) as info:
        cli.main([*PLAN_ARGV, "--plot", str(missing)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--plot {missing}: the folder {missing.parent} does not exist" in err

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as info:
        cli.main([*PLAN_ARGV, "--plot", str(tmp_path / "plan.png")])
    assert info.value.code == 2
    assert 'pip install "autoshard[plot]"' in capsys.readouterr().err
