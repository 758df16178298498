"""The largest batch that fits (`decide.batch.largest_batches`) against needs whose answer is
known: linear, quadratic (attention over a sequence that grows with the batch), and stepped
(padding to a multiple). The search must only ever answer a batch its probe found to fit, end
within its 2% bracket or its probe budget, and share probes between candidates."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any

import pytest
import torch
from test_plan import Tower

import autoshard
from autoshard.decide.batch import CLOSE_ENOUGH, MAX_PROBES, largest_batches
from autoshard.decide.render import WIDTH

USABLE = 10_000


def _true_largest(need: Callable[[int], int]) -> int | None:
    """By bisection: every need here grows with the rows."""
    if need(1) > USABLE:
        return None
    low, high = 1, 2**40
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle) <= USABLE else (low, middle)
    return low


NEEDS: dict[str, Callable[[int], int]] = {
    "linear": lambda n: 1_000 + 7 * n,
    "quadratic": lambda n: 500 + 3 * n + n * n // 40,
    "stepped": lambda n: 2_000 + 90 * (-(-n // 16) * 16),  # padded to 16 rows
    "fixed": lambda n: 4_000 + n // 100,  # the batch hardly matters
}


def _search(
    needs: dict[Hashable, Callable[[int], int]], rows: int
) -> tuple[dict, list[int], list[int]]:
    calls: list[int] = []

    def probe(n: int) -> dict[Hashable, tuple[int, bool]]:
        calls.append(n)
        return {k: (f(n), f(n) <= USABLE) for k, f in needs.items()}

    at_rows = {k: (f(rows), f(rows) <= USABLE) for k, f in needs.items()}
    answers, probed = largest_batches(needs, rows, at_rows, probe, USABLE)
    return answers, probed, calls


@pytest.mark.parametrize("name", list(NEEDS))
@pytest.mark.parametrize("rows", [8, 64, 4096])
def test_the_answer_fits_and_is_within_the_bracket_or_the_budget(name: str, rows: int) -> None:
    need = NEEDS[name]
    answers, probed, calls = _search({name: need}, rows)
    answer = answers[name]
    assert probed == calls and len(calls) <= MAX_PROBES
    true = _true_largest(need)
    assert answer.rows is not None and true is not None
    assert need(answer.rows) <= USABLE  # it fits: it was probed or is the example batch
    assert answer.rows in (*calls, rows)
    if answer.bound is not None:
        assert need(answer.bound) > USABLE and answer.bound in (*calls, rows)
    # never more than the truth, and within 10% of it (the batch-size issue's target), unless
    # the search stopped at its budget still open above (the answer is then a lower bound)
    assert answer.rows <= true, (answer, true, calls)
    if answer.bound is not None:
        assert answer.rows >= 0.9 * true, (answer, true, calls)
    else:
        assert len(calls) == MAX_PROBES, (answer, true, calls)
    if answer.bound is not None and len(calls) < MAX_PROBES:
        assert answer.bound - answer.rows <= max(1, int(answer.rows * CLOSE_ENOUGH))


def test_one_search_serves_every_candidate() -> None:
    answers, probed, _ = _search(dict(NEEDS), 64)
    assert len(probed) <= MAX_PROBES
    for name, need in NEEDS.items():
        true = _true_largest(need)
        assert true is not None and answers[name].rows is not None
        assert need(answers[name].rows) <= USABLE and answers[name].rows <= true


def test_not_even_one_row_fits() -> None:
    answers, probed, _ = _search({"huge": lambda n: USABLE + n}, 32)
    assert answers["huge"].rows is None and answers["huge"].bound == 1
    assert probed == [1]  # nothing to search once one row does not fit


def test_a_batch_of_one_row_that_does_not_fit_probes_nothing() -> None:
    answers, probed, _ = _search({"huge": lambda n: USABLE + n}, 1)
    assert answers["huge"].rows is None and probed == []


# ---------------------------------------------------------------------------------------------
# plan(..., max_batch=True): every candidate's figure, simulated


GPU_PLAN = dict(device="cuda", device_memory="80GiB", host_memory="64GiB", memory_limit="1GiB")


@pytest.fixture(scope="module")
def searched() -> tuple[Any, Any, Any, Any]:
    with torch.device("meta"):
        model = Tower(width=512, depth=4)
        batch = torch.randn(4096, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    plan = autoshard.plan(model, optimizer, batch, max_batch=True, **GPU_PLAN)
    return model, optimizer, batch, plan


def _fits(model: Any, optimizer: Any, rows: int, c: Any) -> bool:
    with torch.device("meta"):
        batch = torch.randn(rows, 8)
    forced = dict(strategy=c.strategy.value, activation_checkpointing=c.activation_checkpointing)
    return autoshard.plan(model, optimizer, batch, **forced, **GPU_PLAN).chosen.fits


def test_every_candidate_s_largest_batch_fits_and_a_little_more_does_not(searched: Any) -> None:
    model, optimizer, batch, plan = searched
    assert len(plan.candidates) > 1
    for c in plan.candidates:
        assert c.max_batch is not None and c.max_batch > 0, str(plan)
        assert _fits(model, optimizer, c.max_batch, c), (c.strategy, c.max_batch)
        # within the search's 2% of the first batch that does not fit (no open bracket here)
        assert not _fits(model, optimizer, c.max_batch + max(1, c.max_batch // 50), c)
    assert plan.max_batch == plan.chosen.max_batch
    reason = next(r for r in plan.reasons if r.startswith("largest per-rank batch"))
    assert "along the leading dimension its 1 tensor(s) share (4096 rows" in reason, reason
    assert "at least" not in reason  # every bracket closed


def test_the_table_and_the_dict_show_it(searched: Any) -> None:
    plan = searched[3]
    header = next(line for line in str(plan).splitlines() if line.startswith("candidate"))
    assert header.split()[-1] == "batch"
    assert all(len(line) <= WIDTH for line in str(plan).splitlines()), str(plan)
    d = plan.to_dict()
    assert d["max_batch"] == plan.max_batch
    assert [c["max_batch"] for c in d["candidates"]] == [c.max_batch for c in plan.candidates]
    # unsearched, no column
    model, optimizer, batch, _ = searched
    plain = autoshard.plan(model, optimizer, batch, **GPU_PLAN)
    assert "batch" not in str(plain).splitlines()[2].split()
    assert plain.max_batch is None


def test_a_batch_without_a_shared_leading_size_is_named_by_the_caller() -> None:
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.layer(x) * scale.mean()

    model = TwoInputs()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = (torch.randn(64, 8), torch.ones(3))  # a table of 3 beside 64 rows
    common = dict(device="cpu", device_memory="1GiB", max_batch=True)
    plan = autoshard.plan(model, optimizer, batch, **common)
    assert plan.max_batch is None
    said = next(r for r in plan.reasons if r.startswith("largest batch not searched"))
    assert "differ in their leading size ([3, 64]): name the batch size with batch_size=" in said
    named = autoshard.plan(model, optimizer, batch, batch_size=64, **common)
    assert named.max_batch is not None and named.max_batch > 64
    wrong = autoshard.plan(model, optimizer, batch, batch_size=5, **common)
    assert any("no tensor of the example batch has batch_size=5 rows" in r for r in wrong.reasons)


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        (dict(max_batch="yes"), TypeError, "max_batch must be True or False"),
        (dict(batch_size=0), ValueError, "batch_size must be a positive int"),
        (dict(batch_size=True), ValueError, "batch_size must be a positive int"),
    ],
)
def test_bad_max_batch_options_are_refused(options: dict, error: type, text: str) -> None:
    model = torch.nn.Linear(8, 1)
    with pytest.raises(error, match=text):
        autoshard.plan(model, torch.optim.AdamW(model.parameters()), torch.randn(4, 8), **options)


def test_the_command_prints_the_batch_column(capsys: pytest.CaptureFixture[str]) -> None:
    from autoshard import cli

    argv = ["plan", "test_cli:tiny", "--device", "cpu", "--device-memory", "1GiB"]
    assert cli.main([*argv, "--mixed-precision", "no", "--max-batch", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_batch"] is not None and d["max_batch"] > 4


# ---------------------------------------------------------------------------------------------
# the batch dimension (`_batch.batch_rows`) and the probes' batches (`_batch.resized`)


def test_the_batch_dimension_is_the_leading_size_the_tensors_share() -> None:
    from autoshard._batch import batch_rows

    ids = torch.zeros(8, 16, dtype=torch.long)
    assert batch_rows({"input_ids": ids, "labels": ids})[0] == 8
    assert batch_rows((torch.randn(8, 3), torch.zeros(8)))[0] == 8
    rows, why = batch_rows({"x": torch.randn(8, 3), "mask": torch.ones(1, 16)})
    assert rows is None and "differ in their leading size ([1, 8])" in why
    assert batch_rows({"x": torch.randn(8, 3), "mask": torch.ones(1, 16)}, batch_size=8)[0] == 8
    rows, why = batch_rows((torch.tensor(3.0), 5))  # a scalar and a number: nothing to cut
    assert rows is None and "no tensor with a batch dimension" in why


def test_a_probe_s_batch_is_cut_or_tiled_along_it_only() -> None:
    from autoshard._batch import resized

    batch = {"x": torch.arange(8).reshape(4, 2), "table": torch.arange(3), "n": 7}
    cut = resized(batch, 4, 3)
    assert cut["x"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert cut["table"].tolist() == [0, 1, 2] and cut["n"] == 7  # not of the batch's rows
    grown = resized(batch, 4, 10)
    assert grown["x"].shape == (10, 2) and grown["x"][4:8].equal(batch["x"])
    assert grown["table"].tolist() == [0, 1, 2]


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A batch as a frozen @dataclass nobody registered with pytree, a field the caller set
    after construction (init=False) included."""

    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"
    seen: int = dataclasses.field(default=0, init=False)


def test_a_dataclass_batch_is_looked_into() -> None:
    """pytree takes an unregistered dataclass for a leaf: a held-out sweep's image batch as a
    @dataclass had its 24 MiB left out of the estimate (304 MiB against 328 MiB as a tuple),
    and its rows were not found ("no tensor with a batch dimension")."""
    from autoshard._batch import batch_bytes, batch_rows, resized, tensors_in

    batch = _Batch(torch.randn(8, 3), torch.zeros(8))
    object.__setattr__(batch, "seen", 3)
    assert [t.shape for t in tensors_in(batch)] == [(8, 3), (8,)]
    assert batch_bytes(batch) == batch_bytes((batch.x, batch.y))
    assert batch_rows(batch)[0] == 8
    cut = resized({"batch": batch}, 8, 3)["batch"]
    assert isinstance(cut, _Batch) and cut.x.shape == (3, 3) and cut.y.shape == (3,)
    assert (cut.note, cut.seen) == ("kept", 3)
    assert batch.x.shape == (8, 3)  # the caller's batch as it was


class Tokens(torch.nn.Module):
    """A tokenizer's batch to a scalar loss: an embedding and a head over the vocabulary."""

    def __init__(self, vocabulary: int = 100, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary, width)
        self.head = torch.nn.Linear(width, vocabulary)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids) * attention_mask[..., None]
        logits = self.head(hidden).flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, input_ids.flatten())


def test_a_tokenizer_s_batch_encoding_is_looked_into() -> None:
    """transformers' `BatchEncoding` (what a tokenizer and its data collators return: a
    `UserDict`, which pytree takes for a leaf) was not looked into: its bytes were left out of
    the estimate, its rows not found ("largest batch not searched: the example batch has no
    tensor with a batch dimension"), and it was not moved to the training device for the trial
    step. Now as the same batch given as a dict."""
    from transformers import BatchEncoding

    from autoshard._batch import batch_bytes, batch_rows, batch_to, resized, tensors_in

    ids = torch.randint(0, 100, (8, 16))
    given = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch = BatchEncoding(given)
    assert [t.shape for t in tensors_in(batch)] == [(8, 16), (8, 16)]
    assert batch_bytes(batch) == batch_bytes(given)
    assert batch_rows(batch)[0] == 8
    cut = resized(batch, 8, 3)
    assert isinstance(cut, BatchEncoding) and cut["input_ids"].shape == (3, 16)
    moved = batch_to(batch, torch.device("meta"))
    assert isinstance(moved, BatchEncoding)
    assert all(t.device.type == "meta" for t in moved.values())
    assert all(t.device.type == "cpu" for t in batch.values())  # the caller's as it was

    # a mapping of its own kind stays whole: its copy could share what it holds with the caller's
    class Store(MutableMapping[str, torch.Tensor]):
        def __init__(self, **items: torch.Tensor) -> None:
            self.items = items

        def __getitem__(self, key: str) -> torch.Tensor:
            return self.items[key]

        def __setitem__(self, key: str, value: torch.Tensor) -> None:
            self.items[key] = value

        def __delitem__(self, key: str) -> None:
            del self.items[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self.items)

        def __len__(self) -> int:
            return len(self.items)

    store = Store(input_ids=ids)
    batch_to(store, torch.device("meta"))
    assert store["input_ids"].device.type == "cpu"

    model = Tokens()
    plans = [
        autoshard.plan(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            b,
            mixed_precision="no",
            max_batch=True,
            device_memory="1GiB",
        )  # fmt: skip
        for b in (given, batch)
    ]
    assert plans[1].estimated_peak_bytes == plans[0].estimated_peak_bytes
    assert plans[1].max_batch == plans[0].max_batch is not None
