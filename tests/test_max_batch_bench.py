"""benchmarks/max_batch.py (issue 25): the search for the true largest batch and the verdict, on
made-up peaks; then, marked slow, one tiny family end to end under real torchrun (2 gloo ranks).

Nothing here depends on timing or on figures that could drift: the end-to-end run checks the
report's structure and what the search guarantees by construction (every measured batch is
within the limit exactly when every rank's peak is, the true largest was measured within it and
the next batch over it), not whether the estimate met the issue's targets."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from _dist import REPO, SLOW_MACHINE, run_torchrun

sys.path.insert(0, str(REPO / "benchmarks"))
import max_batch  # noqa: E402

SCRIPT = REPO / "benchmarks" / "max_batch.py"
FAMILY = "external/mixtral"  # the smallest search of the default set: about 45 s on 2 cores
# the limit turns a hang into a failure (see _dist.SLOW_MACHINE)
TIMEOUT_S = 90 * SLOW_MACHINE


# ---------------------------------------------------------------------------------------------
# The search, on a made-up peak


def search(true: int, start: int) -> tuple[tuple[int, int | None], list[int]]:
    """true_largest on a step whose peak grows with the rows, `true` the last within."""
    asked: list[int] = []

    def within(rows: int) -> bool:
        asked.append(rows)
        return rows <= true

    return max_batch.true_largest(within, start), asked


@pytest.mark.parametrize("true", [1, 7, 31, 32, 33, 40, 64, 100, 1000])
@pytest.mark.parametrize("start", [1, 8, 32])
def test_the_search_finds_the_true_largest_from_any_start(true: int, start: int) -> None:
    (found, over), asked = search(true, start)
    assert (found, over) == (true, true + 1)
    assert asked[0] == start  # the reported batch is measured first
    assert true in asked and true + 1 in asked


def test_the_search_from_the_right_answer_measures_it_and_the_next_batch_only() -> None:
    # R + R/8 over, then the bisection closes the bracket down to R + 1
    _, asked = search(32, 32)
    assert asked == [32, 36, 34, 33]


def test_the_search_reports_zero_when_not_even_one_row_is_within() -> None:
    assert search(0, 16)[0] == (0, 1)


def test_the_search_stops_at_max_rows_and_leaves_the_bound_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(max_batch, "MAX_ROWS", 100)
    (found, over), asked = search(10_000, 8)
    assert over is None and found <= 100 and max(asked) <= 100


# ---------------------------------------------------------------------------------------------
# The verdict and the report


def row(r: int | None, t: int | None, within: bool | None, **extra: Any) -> dict[str, Any]:
    base = {
        "zoo": "own",
        "family": "gpt",
        "R": r,
        "T": t,
        "T_bound": None if t is None else t + 1,
        "R_within": within,
        "params": 867_072,
        "example_rows": 8,
        "limit_bytes": 60 * 2**20,
        "strategy": "ddp",
        "checkpointed": 0,
        "num_blocks": 4,
        "mixed_precision": "bf16",
        "need_at_R_bytes": 59 * 2**20,
        "probes": [] if r is None else [{"rows": r, "within": within, "peaks": [1, 2]}],
        "seconds": 1.0,
    }
    base.update(extra)
    return {**base, **max_batch.verdict(base)}


@pytest.mark.parametrize(
    "r, t, within, met, under",
    [
        (32, 32, True, True, False),
        (29, 32, True, True, False),  # 0.906 T
        (28, 32, True, False, False),  # 0.875 T: too cautious
        (33, 32, False, False, True),  # over the true largest: an underestimate
    ],
)
def test_the_target_is_r_within_the_limit_and_between_nine_tenths_of_t_and_t(
    r: int, t: int, within: bool, met: bool, under: bool
) -> None:
    verdict = max_batch.verdict(row(r, t, within))
    assert verdict["target_met"] is met
    assert verdict["underestimate"] is under
    assert verdict["ratio"] == pytest.approx(r / t)


def test_the_summary_names_each_case_that_misses_a_target() -> None:
    rows = [row(32, 32, True), row(65, 64, False, family="resnet"), row(28, 32, True)]
    s = max_batch.summary(rows)
    assert not s["R_within_limit"] and not s["target_met"]
    assert [c.split()[0] for c in s["underestimates"]] == ["own/resnet"]
    assert len(s["below_target"]) == 1
    text = max_batch.summary_lines(s)
    assert "R > T" in text and "R < 0.9 T" in text
    table = max_batch.table([*rows, {"zoo": "external", "family": "t5", "error": "boom"}])
    lines = table.splitlines()
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "failed: boom" in lines[-1]


def test_families_take_plain_and_zoo_qualified_names() -> None:
    def pairs(zoo: str, names: str | None) -> list[tuple[str, str]]:
        chosen = ["--families", names] if names else []
        args = max_batch.parse_args(["--out", "x", "--zoo", zoo, *chosen])
        return max_batch.families(args)

    assert pairs("both", "llama") == [("own", "llama"), ("external", "llama")]
    assert pairs("both", "external/t5,gpt") == [("external", "t5"), ("own", "gpt")]
    assert pairs("own", None) == [("own", f) for f in max_batch.OWN]
    with pytest.raises(SystemExit):
        pairs("own", "t5")


# ---------------------------------------------------------------------------------------------
# End to end, one tiny family


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("max_batch")
    code, output, timed_out = run_torchrun(
        SCRIPT, "--out", str(out), "--families", FAMILY, timeout=TIMEOUT_S
    )
    assert not timed_out and code == 0, output[-4000:]
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


@pytest.mark.slow  # one family's search and bisection: about 45 s on 2 cores
def test_one_family_end_to_end_reports_r_t_and_every_measured_batch(
    report: tuple[dict[str, Any], str],
) -> None:
    result, markdown = report
    assert result["machine"]["world_size"] == 2
    [family] = result["rows"]
    assert "error" not in family, family.get("error")
    assert f"{family['zoo']}/{family['family']}" == FAMILY
    limit, r, t = family["limit_bytes"], family["R"], family["T"]
    assert isinstance(r, int) and r >= 1 and isinstance(t, int)
    measured = {p["rows"]: p for p in family["probes"]}
    for p in measured.values():
        assert len(p["peaks"]) == 2 and all(isinstance(x, int) for x in p["peaks"])
        assert p["within"] is (max(p["peaks"]) <= limit)
    assert family["R_within"] is measured[r]["within"]
    if t:
        assert measured[t]["within"]
    assert family["T_bound"] == t + 1 and not measured[t + 1]["within"]
    assert family["target_met"] == (family["R_within"] and 0.9 * t <= r <= t)
    assert "| external/mixtral |" in markdown and "R/T" in markdown
