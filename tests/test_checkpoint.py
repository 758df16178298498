"""autoshard.save/load in one process, no process group: round trips, argument errors, and what a
save interrupted at each stage leaves behind. Across strategies and world sizes (FULL_SHARD and DDP
on 2 ranks): tests/test_ecosystem.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoshard
from autoshard.io.checkpoint import MARKER


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.norm = nn.BatchNorm1d(width)  # buffers: running statistics
        self.unused = nn.Linear(width, 2)  # never in forward: AdamW keeps no state for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inp(x)).square().mean()


def trained(seed: int = 0, steps: int = 2) -> tuple[Small, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(8, 3)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()},
        "groups": state["param_groups"],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["state"].keys() == b["state"].keys()
    for i, values in a["state"].items():
        assert values.keys() == b["state"][i].keys()
        assert all(torch.equal(v, b["state"][i][k]) for k, v in values.items())
    assert a["groups"] == b["groups"]


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    model, optimizer = trained()
    saved = snapshot(model, optimizer)
    assert autoshard.save(tmp_path / "ck", model, optimizer) == tmp_path / "ck"
    other, other_optimizer = trained(seed=1, steps=1)
    other_optimizer.param_groups[0]["lr"] = 0.5
    autoshard.load(str(tmp_path / "ck"), other, other_optimizer)
    assert_same(snapshot(other, other_optimizer), saved)
    assert len(other_optimizer.state) == 4  # inp and norm; `unused` has none, as saved


def test_model_only_and_an_optimizer_that_never_stepped(tmp_path: Path) -> None:
    model, optimizer = trained(steps=0)
    autoshard.save(tmp_path / "fresh", model, optimizer)
    assert not optimizer.state  # saving did not give it state
    other, other_optimizer = trained(seed=1, steps=1)
    autoshard.load(tmp_path / "fresh", other, other_optimizer)
    assert not other_optimizer.state
    assert_same(snapshot(other, other_optimizer), snapshot(model, optimizer))

    autoshard.save(tmp_path / "model", model)
    with pytest.raises(ValueError, match="holds no optimizer state .* call load\\(path, model\\)"):
        autoshard.load(tmp_path / "model", other, other_optimizer)
    other, _ = trained(seed=1)
    autoshard.load(tmp_path / "model", other)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )


def test_save_replaces_a_checkpoint_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    newer, newer_optimizer = trained(seed=2)
    autoshard.save(tmp_path / "ck", newer, newer_optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    autoshard.load(tmp_path / "ck", model, optimizer)
    assert_same(snapshot(model, optimizer), snapshot(newer, newer_optimizer))


def test_save_creates_missing_parents(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "a" / "b" / "ck", model, optimizer)
    assert (tmp_path / "a" / "b" / "ck" / MARKER).exists()


def test_crash_while_writing_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    saved = snapshot(model, optimizer)
    newer, newer_optimizer = trained(seed=2)
    original = FileSystemWriter.write_data

    def crash(self: Any, plan: Any, planner: Any) -> Any:
        original(self, plan, planner).wait()  # the data files are written...
        raise OSError("disk full")  # ...and the process dies before DCP's metadata

    monkeypatch.setattr(FileSystemWriter, "write_data", crash)
    with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[0\]: OSError: disk full"):
        autoshard.save(tmp_path / "ck", newer, newer_optimizer)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the partial one was removed
    autoshard.load(tmp_path / "ck", newer, newer_optimizer)
    assert_same(snapshot(newer, newer_optimizer), saved)
    autoshard.save(tmp_path / "ck", newer, newer_optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_crash_between_the_two_renames(tmp_path: Path) -> None:
    """Killed between renaming the old checkpoint aside and the new one in: load reads the old
    one, whole, and says so; the next save puts it back before writing (and replaces it)."""
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    saved = snapshot(model, optimizer)
    (tmp_path / "ck").rename(tmp_path / ".ck.autoshard-old")
    other, other_optimizer = trained(seed=3)
    with pytest.warns(UserWarning, match="loading the previous checkpoint it kept aside at .*old"):
        autoshard.load(tmp_path / "ck", other, other_optimizer)
    assert_same(snapshot(other, other_optimizer), saved)
    autoshard.save(tmp_path / "ck", model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_crash_before_deleting_the_replaced_checkpoint(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    autoshard.save(tmp_path / "old", model, optimizer)
    (tmp_path / "old").rename(tmp_path / ".ck.autoshard-old")
    autoshard.load(tmp_path / "ck", model, optimizer)  # the new one is complete
    autoshard.save(tmp_path / "ck", model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_load_refuses_what_is_not_a_complete_checkpoint(tmp_path: Path) -> None:
    model, optimizer = trained()
    with pytest.raises(ValueError, match="no checkpoint directory at"):
        autoshard.load(tmp_path / "missing", model, optimizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"is not a complete autoshard checkpoint \\(no {MARKER}"):
        autoshard.load(tmp_path / "empty", model, optimizer)
    autoshard.save(tmp_path / "ck", model, optimizer)
    marker = tmp_path / "ck" / MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 99}))
    with pytest.raises(ValueError, match="has format 99, this autoshard reads format 2"):
        autoshard.load(tmp_path / "ck", model, optimizer)


def test_load_refuses_another_architecture_before_changing_anything(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    wider = Small(width=5)
    wider_optimizer = torch.optim.AdamW(wider.parameters())
    before = snapshot(wider, wider_optimizer)
    with pytest.raises(ValueError, match="differ in shape, e.g. 'inp.weight' saved as \\(4, 3\\)"):
        autoshard.load(tmp_path / "ck", wider, wider_optimizer)
    assert_same(snapshot(wider, wider_optimizer), before)
    with pytest.raises(
        ValueError, match="1 tensor\\(s\\) of the model are not in it \\['extra'\\]"
    ):
        autoshard.load(tmp_path / "ck", nn.ParameterDict({"extra": nn.Parameter(torch.ones(1))}))


@pytest.mark.parametrize(
    ("path", "model", "optimizer", "error", "message"),
    [
        (42, "model", None, TypeError, "path must be a str or os.PathLike .* got int"),
        (b"ck", "model", None, TypeError, "path must be a str or os.PathLike .* got bytes"),
        ("", "model", None, ValueError, "path is empty"),
        ("ck", None, None, TypeError, "model must be a torch.nn.Module, got NoneType"),
        ("ck", "dp", None, ValueError, "torch.nn.DataParallel.* pass model.module"),
        ("ck", "model", "sgd", TypeError, "optimizer must be a torch.optim.Optimizer or None"),
        ("ck", "model", "foreign", ValueError, "holds 2 parameter\\(s\\) that model does not own"),
    ],
)
@pytest.mark.parametrize("call", ["save", "load"])
def test_argument_errors(
    tmp_path: Path, call: str, path: Any, model: Any, optimizer: Any, error: type, message: str
) -> None:
    plain, plain_optimizer = trained()
    models = {"model": plain, "dp": nn.DataParallel(plain), None: None}
    optimizers = {
        None: None,
        "sgd": "not an optimizer",
        "foreign": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
    }
    with pytest.raises(error, match=message):
        getattr(autoshard, call)(
            tmp_path / path if isinstance(path, str) and path else path,
            models[model],
            optimizers[optimizer],
        )
    assert not list(tmp_path.iterdir())  # nothing written


def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    model, optimizer = trained()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        autoshard.save(tmp_path / "file", model, optimizer)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="non-empty directory that is not an autoshard checkpoint"):
        autoshard.save(tmp_path / "data", model, optimizer)
    assert (tmp_path / "data" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    autoshard.save(tmp_path / "empty", model, optimizer)  # an empty directory is fine
    assert (tmp_path / "empty" / MARKER).exists()


def test_load_refuses_an_optimizer_of_another_kind(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    with pytest.raises(ValueError, match="holds AdamW state, the optimizer is a SGD"):
        autoshard.load(tmp_path / "ck", model, torch.optim.SGD(model.parameters(), lr=0.1))
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="the optimizer has .*'max_exp_avg_sq'.* same options"):
        autoshard.load(tmp_path / "ck", model, amsgrad)
    assert not amsgrad.state  # the state torch made to load into is gone again


def test_load_says_to_clear_gradients_when_there_is_no_state_to_load_into(tmp_path: Path) -> None:
    model, optimizer = trained()
    autoshard.save(tmp_path / "ck", model, optimizer)
    fresh, fresh_optimizer = trained(steps=0)
    fresh(torch.randn(8, 3)).backward()
    with pytest.raises(ValueError, match="call optimizer.zero_grad\\(set_to_none=True\\) first"):
        autoshard.load(tmp_path / "ck", fresh, fresh_optimizer)
    fresh_optimizer.zero_grad(set_to_none=True)
    autoshard.load(tmp_path / "ck", fresh, fresh_optimizer)
    assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))
