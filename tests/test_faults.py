"""Fault injection (issue 14): each numbered case of the issue reproduced and its fix asserted,
plus a randomized kill-during-save loop. Two ranks (tests/workers/faults.py, started without
torchrun so that a killed rank leaves the other running) and one process.

The guarantees the README states under "What save and load guarantee" are asserted here in its
words: `load(path)` gives the old checkpoint or the new one, whole, wherever a save is killed; a
damaged checkpoint is an error naming the file, and nothing is changed.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import signal
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import TIMEOUT_S, Launch, launch
from torch import nn

import autoshard
from autoshard.collective import Agreement, PeerError, PeerTimeout, _rebuilt
from autoshard.io.layout import MARKER

pytestmark = pytest.mark.faults

# An error agreed across ranks takes well under a second on 2 CPU cores; a rank left waiting
# would wait out the worker's 30 s agreement timeout. 15 s separates the two on a busy machine.
PROMPT_S = 15.0


# ---------------------------------------------------------------------------------------------
# Two ranks


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    out = Path(tmp_path_factory.mktemp("faults"))
    return launch("faults", out, timeout=TIMEOUT_S, launcher=None)


def case(run: Launch, name: str, ranks: tuple[int, ...] = (0, 1)) -> list[Any]:
    found = []
    for r in ranks:
        entry = run.ranks[r].get(name)
        if entry is None or not entry["ok"]:
            pytest.fail(run.report(f"rank {r}: case {name!r}: {entry}", name), pytrace=False)
        found.append(entry["data"])
    return found


@pytest.mark.dist
@pytest.mark.parametrize(
    ("name", "kind", "own"),
    [
        ("non_module_model_on_rank1", "TypeError", "model must be a torch.nn.Module, got function"),
        ("non_optimizer_on_rank1", "TypeError", "optimizer must be a torch.optim.Optimizer"),
        ("iterable_dataset_on_rank1", "ValueError", "IterableDataset"),
    ],
)
def test_bad_input_on_one_rank_raises_its_type_on_every_rank_within_seconds(
    faults: Launch, name: str, kind: str, own: str
) -> None:
    rank0, rank1 = case(faults, name)
    assert rank1["type"] == kind and own in rank1["message"], rank1
    assert rank0["type"] == kind, f"the type is kept on the other rank: {rank0}"
    assert "rank 1 failed in" in rank0["message"] and own in rank0["message"], rank0
    assert max(rank0["seconds"], rank1["seconds"]) < PROMPT_S


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_wrapping_that_fails_on_one_rank_raises_on_every_rank_within_seconds(
    faults: Launch, strategy: str
) -> None:
    rank0, rank1 = case(faults, f"wrap_fails_on_rank1_{strategy}")
    own = "injected: this rank's wrapping failed"
    assert rank1["type"] == "RuntimeError" and own in rank1["message"], rank1
    assert rank0["type"] == "RuntimeError", f"the type is kept on the other rank: {rank0}"
    assert "rank 1 failed in" in rank0["message"] and own in rank0["message"], rank0
    assert max(rank0["seconds"], rank1["seconds"]) < PROMPT_S


@pytest.mark.dist
def test_drop_last_with_too_small_a_dataset_is_an_error_naming_the_fix(faults: Launch) -> None:
    for r in case(faults, "drop_last_smaller_than_ranks_times_batch"):
        assert r["type"] == "ValueError", r
        assert "each of the 2 rank(s) gets 3, fewer than batch_size=4" in r["message"]
        assert "use drop_last=False, a batch_size of at most 3" in r["message"]


@pytest.mark.dist
def test_different_learning_rates_per_rank_are_refused_before_anything_changes(
    faults: Launch,
) -> None:
    for r in case(faults, "different_lr_on_rank1"):
        assert r["type"] == "ValueError", r
        assert "disagree with rank 0 on optimizer's hyper-parameters" in r["message"], r
        assert "param group 0 has lr=0.01 vs lr=0.02" in r["message"], r
        assert r["untouched"]


@pytest.mark.dist
def test_buffers_that_differ_between_ranks_are_warned_about_by_name(faults: Launch) -> None:
    rank0, rank1 = case(faults, "different_buffers_per_rank")
    assert len(rank0["warnings"]) == 1 and "'blocks.2.norm.running_mean'" in rank0["warnings"][0]
    assert "every rank use rank 0's" in rank0["warnings"][0]
    assert rank0["reasons"] == rank1["reasons"] and "'blocks.2.norm.running_mean'" in str(
        rank0["reasons"]
    )
    assert rank1["running_mean"] == rank0["running_mean"] == [0.0] * len(rank0["running_mean"])


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_existing_gradients_come_back_bitwise(faults: Launch, strategy: str) -> None:
    for r in case(faults, f"grads_kept_{strategy}"):
        assert r["names"] > 0 and len(r["bitwise"]) == r["names"], r


@pytest.mark.dist
@pytest.mark.parametrize(
    "name", ["resume_ddp", "resume_full_shard", "resume_full_shard_get_state_dict"]
)
def test_a_load_failing_on_one_rank_makes_every_rank_fall_back_together(
    faults: Launch, name: str
) -> None:
    """Failing while checking the files, or while taking the state dicts just before DCP's
    collective read (which would otherwise wait for the failed rank)."""
    rank0, rank1 = case(faults, name)
    assert rank1["error"].startswith("OSError: [Errno 5] Input/output error"), rank1
    assert rank0["error"].startswith("OSError: rank 1 failed in load() with OSError"), rank0
    for r in (rank0, rank1):
        assert r["loaded"] == "previous" and r["matches"] == ["previous"], r


@pytest.mark.dist
def test_a_stalled_peer_in_the_trial_step_is_named_within_the_timeout(faults: Launch) -> None:
    rank0, rank1 = case(faults, "stalled_peer_in_trial")
    assert rank0["type"] == "PeerTimeout", rank0
    assert "rank(s) [1] did not answer within 4 s at prepare()'s trial step" in rank0["message"]
    assert "autoshard.set_agreement_timeout(seconds)" in rank0["message"]
    # rank 1 slept until rank 0 had raised: rank 0 did not wait for it
    assert rank1["rank0_had_given_up"], rank1
    assert rank1["type"] == "PeerTimeout", rank1
    assert "rank(s) [0] stopped waiting for this rank (rank 1)" in rank1["message"], rank1
    assert rank0["restored"] and rank1["restored"]


@pytest.mark.dist
def test_a_peer_killed_in_the_trial_step_leaves_this_rank_restored(faults: Launch) -> None:
    (survivor,) = case(faults, "killed_peer_in_trial", ranks=(0,))
    assert survivor["type"] == "PeerTimeout", survivor
    assert "rank(s) [1] did not answer within 8 s at prepare()'s trial step" in survivor["message"]
    assert survivor["restored"], (survivor["before"], survivor["after"])
    assert "killed_peer_in_trial" not in faults.ranks[1], "rank 1 was to die in this case"


@pytest.mark.dist
def test_rank0_killed_in_the_trial_step_is_named_and_the_survivor_restored(
    tmp_path: Path,
) -> None:
    """Rank 0 hosts the key-value store the agreement runs through: its death must still end
    rank 1's wait with an error naming it, not a hang."""
    run = launch("rank0_dies", tmp_path, timeout=TIMEOUT_S, launcher=None)
    (survivor,) = case(run, "killed_rank0_in_trial", ranks=(1,))
    assert survivor["type"] == "PeerTimeout", survivor
    assert "rank 0" in survivor["message"] or "rank(s) [0]" in survivor["message"], survivor
    assert survivor["restored"], survivor
    assert survivor["seconds"] < PROMPT_S + 8, survivor  # a hang detector: the timeout is 8 s
    assert "killed_rank0_in_trial" not in run.ranks[0], "rank 0 was to die in this case"


# ---------------------------------------------------------------------------------------------
# One process: checkpoints


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inp(x)).square().mean()


def trained(seed: int) -> tuple[Small, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 3)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def values(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [v for s in optimizer.state.values() for v in s.values()]
    return [t.detach().clone() for t in [*model.state_dict().values(), *state]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("damage", ["three flipped bytes", "truncated shard", "truncated metadata"])
def test_a_damaged_file_is_an_error_naming_it_and_nothing_changes(
    tmp_path: Path, damage: str
) -> None:
    """Before: wrong values loaded silently (flipped bytes), or UnpicklingError / EOFError and
    torch's advice to retry with weights_only=False (truncated files)."""
    model, optimizer = trained(0)
    autoshard.save(tmp_path / "ck", model, optimizer)
    if damage == "truncated metadata":
        shard = tmp_path / "ck" / ".metadata"
    else:
        shard = next((tmp_path / "ck").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "three flipped bytes":
        for offset in (len(data) // 3, len(data) // 2, 2 * len(data) // 3):
            data[offset] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    other, other_optimizer = trained(1)
    before = values(other, other_optimizer)
    with pytest.raises(ValueError, match=f"is damaged: {shard.name} does not match the sha256"):
        autoshard.load(tmp_path / "ck", other, other_optimizer)
    assert same(values(other, other_optimizer), before)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "its autoshard.json is not valid JSON"),
        (b"[1, 2]", "is not an autoshard checkpoint marker"),
        (None, "its own digest does not match its content"),
    ],
)
def test_a_damaged_marker_is_a_clear_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    model, optimizer = trained(0)
    autoshard.save(tmp_path / "ck", model, optimizer)
    marker = tmp_path / "ck" / MARKER
    if content is None:  # a checksum edited by hand
        content = marker.read_bytes().replace(b'"files": {"', b'"files": {"x')
    marker.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        autoshard.load(tmp_path / "ck", model, optimizer)


def test_a_directory_with_a_foreign_marker_is_refused_and_kept(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / MARKER).write_text('{"title": "my thesis"}')
    (tmp_path / "thesis" / "thesis.txt").write_text("years of work")
    with pytest.raises(ValueError, match="holds a file named autoshard.json that autoshard did"):
        autoshard.save(tmp_path / "thesis", model, optimizer)
    assert (tmp_path / "thesis" / "thesis.txt").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


def test_files_a_user_keeps_inside_a_checkpoint_survive_the_next_save(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    autoshard.save(tmp_path / "ck", model, optimizer)
    (tmp_path / "ck" / "scheduler.pt").write_text("scheduler state")
    (tmp_path / "ck" / "extra").mkdir()
    (tmp_path / "ck" / "extra" / "notes.txt").write_text("notes")
    newer, newer_optimizer = trained(1)
    autoshard.save(tmp_path / "ck", newer, newer_optimizer)
    assert (tmp_path / "ck" / "scheduler.pt").read_text() == "scheduler state"
    assert (tmp_path / "ck" / "extra" / "notes.txt").read_text() == "notes"
    autoshard.load(tmp_path / "ck", model, optimizer)
    assert same(values(model, optimizer), values(newer, newer_optimizer))


def test_a_symlinked_path_is_replaced_as_a_link_and_saves_keep_working(tmp_path: Path) -> None:
    first, first_optimizer = trained(0)
    autoshard.save(tmp_path / "step1", first, first_optimizer)
    (tmp_path / "latest").symlink_to("step1")
    for seed in (1, 2):  # every later save to `latest` works too
        model, optimizer = trained(seed)
        autoshard.save(tmp_path / "latest", model, optimizer)
        other, other_optimizer = trained(5)
        autoshard.load(tmp_path / "latest", other, other_optimizer)
        assert same(values(other, other_optimizer), values(model, optimizer))
    autoshard.load(tmp_path / "step1", other, other_optimizer)  # what the link pointed to
    assert same(values(other, other_optimizer), values(first, first_optimizer))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]


@pytest.mark.parametrize("how", ["ENOSPC", "short write"])
def test_a_save_that_runs_out_of_space_says_so_and_removes_its_partial_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    import shutil

    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = trained(0)
    autoshard.save(tmp_path / "ck", model, optimizer)
    newer, newer_optimizer = trained(1)

    def full(self: Any, plan: Any, planner: Any) -> Any:
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))
    with pytest.raises(OSError, match=f"no space left on device at '{tmp_path / 'ck'}'") as info:
        autoshard.save(tmp_path / "ck", newer, newer_optimizer)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    autoshard.load(tmp_path / "ck", newer, newer_optimizer)
    assert same(values(newer, newer_optimizer), values(model, optimizer))


def test_a_load_failing_part_way_leaves_the_model_and_optimizer_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint.state_dict as state_dict

    model, optimizer = trained(0)
    autoshard.save(tmp_path / "ck", model, optimizer)
    other, other_optimizer = trained(1)
    before = values(other, other_optimizer)
    lr = other_optimizer.param_groups[0]["lr"] = 0.5

    def fails(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "Input/output error (injected after the model was loaded)")

    monkeypatch.setattr(state_dict, "set_optimizer_state_dict", fails)
    with pytest.raises(OSError, match="injected after the model was loaded"):
        autoshard.load(tmp_path / "ck", other, other_optimizer)
    assert same(values(other, other_optimizer), before)
    assert other_optimizer.param_groups[0]["lr"] == lr


# ---------------------------------------------------------------------------------------------
# Killed during a save, at random points: load(path) gives the old or the new checkpoint, whole

KILL_POINTS = 24
LATE_POINTS = 10


def _save_and_die_at(path: Path, model: Any, optimizer: Any, kill_at: int | None) -> None:
    """In a forked child (which computes nothing: torch's thread pool does not survive a fork):
    save, SIGKILLing itself at file-system operation `kill_at` (None:
    count them and exit). The operations are every call that creates, renames, links, syncs or
    deletes, and every write."""
    import builtins
    import io
    import shutil

    count = [0]

    def step() -> None:
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            step()
            result = original(*args, **kwargs)
            step()
            return result

        setattr(owner, name, wrapped)

    for owner, name in [
        (os, "rename"),
        (os, "replace"),
        (os, "link"),
        (os, "fsync"),
        (os, "unlink"),
        (os, "rmdir"),
        (os, "mkdir"),
        (shutil, "rmtree"),
        (builtins, "open"),
        (io, "open"),
    ]:
        wrap(owner, name)
    autoshard.save(path, model, optimizer)
    os.write(3, str(count[0]).encode())


def _fork_save(path: Path, model: Any, optimizer: Any, kill_at: int | None) -> tuple[int, int]:
    """(exit signal or code, operations counted) of a forked save."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.dup2(write_end, 3)
            _save_and_die_at(path, model, optimizer, kill_at)
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    counted = os.read(read_end, 64)
    os.close(read_end)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, int(counted or 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_save_killed_at_random_points_leaves_the_old_or_the_new_checkpoint_whole(
    tmp_path: Path,
) -> None:
    old, old_optimizer = trained(0)
    new, new_optimizer = trained(1)
    path = tmp_path / "ck"
    # Warm up (imports load lazily, and a child inherits what the parent loaded), then count the
    # operations of a save over an existing checkpoint.
    autoshard.save(path, old, old_optimizer)
    autoshard.load(path, *trained(7))
    code, operations = _fork_save(path, new, new_optimizer, None)
    assert code == 0 and operations > 10, (code, operations)
    # The renames and deletions come last: every one of the last operations, and a random
    # sample of the earlier ones (writing the data and the marker).
    late = list(range(max(operations - LATE_POINTS, 1), operations + 1))
    early = range(1, late[0])
    points = late + random.Random(14).sample(early, min(KILL_POINTS - len(late), len(early)))
    outcomes = {"old": 0, "new": 0}
    for kill_at in sorted(points):
        autoshard.save(path, old, old_optimizer)  # the checkpoint already there
        code, _ = _fork_save(path, new, new_optimizer, kill_at)
        assert code == -signal.SIGKILL, f"the save finished before operation {kill_at}"
        model, optimizer = trained(7)
        with _quiet():
            autoshard.load(path, model, optimizer)
        got = values(model, optimizer)
        if same(got, values(old, old_optimizer)):
            outcomes["old"] += 1
        else:
            assert same(got, values(new, new_optimizer)), f"killed at {kill_at}: neither, whole"
            outcomes["new"] += 1
    assert outcomes["old"] and outcomes["new"], (outcomes, operations)  # both sides were hit
    autoshard.save(path, new, new_optimizer)  # and a later save cleans up after them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert len(points) >= 20


def _quiet() -> Any:
    import warnings

    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("ignore")

    class Exit:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *args: Any) -> None:
            context.__exit__(*args)

    return Exit()


# ---------------------------------------------------------------------------------------------
# One process: the errors the issue found unclear, and agreement pieces


class Doubler(nn.Module):
    def __init__(self, fill: float = 0.5) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        nn.init.constant_(self.linear.weight, fill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_function_passed_as_model_names_the_problem() -> None:
    model = Doubler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        autoshard.prepare(lambda x: x, optimizer, torch.ones(2, 4))  # type: ignore[arg-type]


def test_a_meta_batch_for_the_trial_step_names_the_fix() -> None:
    model = Doubler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on the meta device .* pass a real batch, or trial_step"):
        autoshard.prepare(model, optimizer, torch.ones(2, 4, device="meta"))


def test_a_detached_loss_names_loss_fn() -> None:
    model = Doubler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="loss_fn\\(output, batch\\) returned a loss that does"):
        autoshard.prepare(
            model, optimizer, torch.ones(2, 4), loss_fn=lambda out, batch: out.sum().detach()
        )


def test_a_non_finite_trial_loss_is_in_the_reasons_and_warned_about() -> None:
    model = Doubler(fill=float("nan"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="loss was not finite \\(nan or inf\\) on rank\\(s\\)"):
        _, _, plan = autoshard.prepare(model, optimizer, torch.ones(2, 4))
    assert any("loss was not finite" in r for r in plan.reasons), plan.reasons


def test_existing_gradients_come_back_bitwise_in_one_process() -> None:
    model = Doubler()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    autoshard.prepare(model, optimizer, torch.ones(2, 4))
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError):  # and when prepare raises in the trial step
        autoshard.prepare(model, optimizer, torch.ones(2, 4), loss_fn=lambda out, b: out)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())


def test_a_peer_timeout_after_an_oom_keeps_nothing_of_the_step_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the trial's last sync raises (a peer that never came) after this rank ran out of
    memory, the OOM's traceback, and with it the step's activations, stayed alive through the
    restore and in the error the caller got."""
    alive: list[weakref.ref[torch.Tensor]] = []

    class RunsOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.layer(x)
            if type(y).__name__ != "FakeTensor":  # the trial step, not prepare's fake trace
                activations = torch.ones(1000)
                alive.append(weakref.ref(activations))
                raise torch.OutOfMemoryError("CUDA out of memory (the test's)")
            return y.sum()

    seen: list[list[bool]] = []

    def sync(self: Agreement, code: int = 0, peak: int = 0) -> list[tuple[int, int]]:
        gc.collect()
        seen.append([ref() is not None for ref in alive])
        raise PeerTimeout("rank 1 did not reach the trial's last sync point", [1])

    monkeypatch.setattr(Agreement, "sync", sync)
    model = RunsOut()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PeerTimeout) as caught:
        autoshard.prepare(model, optimizer, torch.randn(4, 8), strategy="local")
    assert seen == [[False]]  # the step's activations gone before the sync
    del caught
    gc.collect()
    assert alive[0]() is None


def test_drop_last_with_too_small_a_dataset_in_one_process() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(3.0)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="every rank would get zero batches; use drop_last=False"):
        autoshard.shard_dataloader(loader)


def test_the_agreement_timeout_is_validated_and_restorable() -> None:
    previous = autoshard.set_agreement_timeout(12)
    try:
        assert autoshard.set_agreement_timeout(None) == 12
        with pytest.raises(ValueError, match="must be a positive number of seconds, got 0"):
            autoshard.set_agreement_timeout(0)
    finally:
        autoshard.set_agreement_timeout(previous)


class NeedsTwo(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


def test_a_peer_error_keeps_its_type_or_says_which_it_was() -> None:
    import pickle

    error = _rebuilt(1, "load()", pickle.dumps(OSError), "OSError", "disk gone")
    assert type(error) is OSError
    assert str(error) == "rank 1 failed in load() with OSError: disk gone"
    error = _rebuilt(1, "load()", pickle.dumps(NeedsTwo), "NeedsTwo", "x")
    assert isinstance(error, NeedsTwo), "except NeedsTwo still catches it"
    assert isinstance(error, PeerError) and error.rank == 1 and error.type_name == "NeedsTwo"
    assert "rank 1 failed in load() with NeedsTwo: x; see rank 1's traceback" in str(error)
    error = _rebuilt(1, "load()", None, "Local", "y")  # a class that did not pickle
    assert type(error) is PeerError and "with Local: y" in str(error)


# The README's words for what the tests above check; each phrase must stay in its section.
GUARANTEES = [
    "`load(path)` gives the old checkpoint or the new one, whole",  # the kill loop
    "A damaged checkpoint is an error naming the file, and nothing is changed",  # damaged shard
    "Nothing is deleted that autoshard did not write",  # foreign marker, user files, symlink
    'saying "no space left on device at <path>"',  # the ENOSPC test
    "`load` never leaves a model half-loaded",  # a load failing part way
    "Ranks never resume from different checkpoints",  # resume_ddp / resume_full_shard
]


def test_the_readme_states_the_guarantees_these_tests_check() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("#### What save and load guarantee") :]
    section = " ".join(section[: section.index("#### When one rank fails")].split())
    for phrase in GUARANTEES:
        assert phrase in section.replace("**", ""), phrase


# ---------------------------------------------------------------------------------------------
# The agreement on four ranks (tests/workers/agree4.py)


@pytest.fixture(scope="module")
def agree4(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launch("agree4", tmp_path_factory.mktemp("agree4"), launcher=None, nproc=4)


def _four(run: Launch, name: str) -> list[Any]:
    return case(run, name, ranks=(0, 1, 2, 3))


@pytest.mark.dist
def test_four_ranks_agree_on_every_value_in_rank_order(agree4: Launch) -> None:
    for values in _four(agree4, "values_in_rank_order"):
        assert values == [0, 10, 20, 30]
    assert all(_four(agree4, "many_rounds"))


@pytest.mark.dist
def test_one_rank_of_four_failing_raises_its_type_on_every_rank(agree4: Launch) -> None:
    for r, result in enumerate(_four(agree4, "error_on_rank2")):
        assert result["type"] == "KeyError", result
        assert "injected on rank 2" in result["message"], result
        if r != 2:
            assert "rank 2 failed in a test" in result["message"], result


@pytest.mark.dist
def test_several_failing_ranks_each_keep_their_own_and_the_others_hear_the_lowest(
    agree4: Launch,
) -> None:
    results = _four(agree4, "errors_on_ranks_1_and_3")
    for r, result in enumerate(results):
        assert result["type"] == "KeyError", result
        expected = f"injected on rank {r}" if r in (1, 3) else "rank 1 failed in a test"
        assert expected in result["message"], (r, result)


@pytest.mark.dist
def test_a_stalled_rank_of_four_is_named_by_the_others_and_told_it_came_late(
    agree4: Launch,
) -> None:
    results = _four(agree4, "rank3_stalls")
    for result in results[:3]:
        assert result["type"] == "PeerTimeout", result
        assert "rank(s) [3] did not answer within 3 s" in result["message"], result
    late = results[3]
    assert late["type"] == "PeerTimeout" and "arrived too late" in late["message"], late
