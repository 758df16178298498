"""benchmarks/zoo_random.py: random hand-written models for the estimator's harness."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo_random  # noqa: E402


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_an_entry_trains_and_is_the_same_every_time(seed: int) -> None:
    name = f"r{seed}"
    built = zoo_random.build(name)
    loss = built.loss_fn(built.model(*built.batch), built.batch)  # as the harness calls it
    loss.backward()
    built.optimizer.step()
    assert torch.isfinite(loss)
    again = zoo_random.build(name)
    assert again.model.spec == built.model.spec
    first, second = zoo_random.build(name).model.state_dict(), again.model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(again.batch[0], zoo_random.build(name).batch[0])
    # another rank's data, the same model
    other = zoo_random.build(name, rank=1)
    assert not torch.equal(other.batch[0], again.batch[0])
    assert zoo_random.describe(seed).startswith(f"{name}: width=")


def test_the_draws_cover_what_the_docstring_promises() -> None:
    """Over the entries, every choice the module lists is drawn at least once."""
    specs = [zoo_random.draw(seed) for seed in range(zoo_random.SEEDS)]
    for key in (
        "tokens",
        "language_model",
        "pyramid",
        "pool",
        "tied",
        "alternate",
        "gated",
        "two_groups",
        "frozen_first",
        "written_out",
        "pre_norm",
        "causal",
        "inplace",
    ):
        assert {s[key] for s in specs} == {False, True}, key
    assert {s["optimizer"] for s in specs} == {"adamw", "adam_amsgrad", "sgd", "rmsprop", "adagrad"}
    assert {s["norm"] for s in specs} == {"layer", "rms", "none"}
    assert {s["positions"] for s in specs} == {"persistent", "buffer", "none"}
    assert max(s["depth"] for s in specs) >= 16  # deep enough to be extended


def test_two_groups_put_the_embedding_after_the_decayed_weights() -> None:
    draws = {s: zoo_random.draw(s) for s in range(zoo_random.SEEDS)}
    seed = next(
        s for s, d in draws.items() if d["two_groups"] and d["tokens"] and not d["frozen_first"]
    )
    built = zoo_random.build(f"r{seed}")
    decayed, rest = built.optimizer.param_groups
    assert decayed["weight_decay"] > 0 == rest["weight_decay"]
    assert any(p is built.model.embed.weight for p in rest["params"])
    assert all(p.ndim == 2 for p in decayed["params"])


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="entries are r0, r1"):
        zoo_random.build("f3")
