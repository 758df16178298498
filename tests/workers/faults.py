"""Faults on one rank of two (issue 14): bad input on one rank only, a load that fails on one
rank, different hyper-parameters or buffers per rank, gradients kept through prepare, a stalled
peer and a killed peer in the trial step. Every case must end on every rank within seconds.

Started without torchrun (tests/_dist.py `run_ranks`), so that the rank killed in the last case
leaves the other running, as a slow cluster launcher would.

Usage (from tests/_dist.py): faults.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed.checkpoint.state_dict as state_dict_module
from _common import Cases, build, error_of, full, local_batches, rank
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import autoshard
import autoshard.io.checkpoint as checkpoint_module
import autoshard.wrap.apply as apply_module

OUT = Path(os.environ.get("FAULTS_OUT", "."))
TIMEOUT_S = 30.0  # every agreement of this worker: a hang fails in seconds, not minutes
STALL_TIMEOUT_S = 4.0
# The stalled rank sleeps until rank 0 has given up on it (or this long): rank 0 raising while its
# peer still sleeps is the proof that it did not wait, whatever the machine's speed.
STALL_MAX_S = 300.0
KILLED_TIMEOUT_S = 8.0  # the ranks' start of prepare() may differ by seconds on a busy machine

cases = Cases()
autoshard.set_agreement_timeout(TIMEOUT_S)


def timed(fn: Callable[[], Any]) -> dict[str, Any]:
    started = time.perf_counter()
    result = error_of(fn)
    result["seconds"] = time.perf_counter() - started
    return result


def digest(model: nn.Module) -> str:
    """Of the whole model (gathered: a collective under FSDP2)."""
    h = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(full(tensor.detach()).to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's parameters, buffers, optimizer state and RNG, without any collective."""
    h = hashlib.sha256()
    for tensor in [*model.parameters(), *model.buffers()]:
        h.update(tensor.detach().to(torch.float64).numpy().tobytes())
    return {
        "tensors": h.hexdigest()[:16],
        "optimizer_state": len(optimizer.state),
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
    }


# ---------------------------------------------------------------------------------------------
# 2. Bad input on one rank: every rank raises within seconds


@cases.case
def non_module_model_on_rank1() -> dict[str, Any]:
    model, optimizer = build()
    given: Any = (lambda x: x) if rank() == 1 else model
    return timed(lambda: autoshard.prepare(given, optimizer, local_batches(1)[0]))


@cases.case
def non_optimizer_on_rank1() -> dict[str, Any]:
    model, optimizer = build()
    given: Any = "adamw" if rank() == 1 else optimizer
    return timed(lambda: autoshard.prepare(model, given, local_batches(1)[0]))


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(8))


@cases.case
def iterable_dataset_on_rank1() -> dict[str, Any]:
    dataset: Any = Stream() if rank() == 1 else TensorDataset(torch.arange(8.0))
    return timed(lambda: autoshard.shard_dataloader(DataLoader(dataset, batch_size=2)))


@cases.case
def drop_last_smaller_than_ranks_times_batch() -> dict[str, Any]:
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=4, drop_last=True)
    return timed(lambda: autoshard.shard_dataloader(loader))


# ---------------------------------------------------------------------------------------------
# 8, 11. Per-rank hyper-parameters are refused, per-rank buffers warned about


@cases.case
def different_lr_on_rank1() -> dict[str, Any]:
    model, optimizer = build(lr=0.02 if rank() == 1 else 0.01)
    ids = [id(p) for p in optimizer.param_groups[0]["params"]]
    result = timed(lambda: autoshard.prepare(model, optimizer, local_batches(1)[0]))
    result["untouched"] = ids == [id(p) for p in optimizer.param_groups[0]["params"]]
    return result


@cases.case
def different_buffers_per_rank() -> dict[str, Any]:
    model, optimizer = build(batchnorm=True)
    if rank() == 1:
        model.blocks[2].norm.running_mean.fill_(1.0)  # type: ignore[union-attr]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped, _, plan = autoshard.prepare(
            model, optimizer, local_batches(1)[0], strategy="ddp", trial_step=False
        )
    return {
        "warnings": [str(w.message) for w in caught if "buffer" in str(w.message)],
        "reasons": [r for r in plan.reasons if "buffer" in r],
        "running_mean": model.blocks[2].norm.running_mean.tolist(),  # type: ignore[union-attr]
    }


# ---------------------------------------------------------------------------------------------
# 2. Wrapping that fails on one rank: every rank raises before the next collective


def wrap_fails_on_rank1(strategy: str) -> dict[str, Any]:
    """Rank 1's wrapping fails where each rank works alone: its move to the device (DDP), its
    `fully_shard` calls (after rank 0's parameters were broadcast: FULL_SHARD)."""
    model, optimizer = build()

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: this rank's wrapping failed")

    patched = mock.patch.object(apply_module, "shard_module", failing)
    if strategy == "ddp":
        patched = mock.patch.object(model, "to", failing)
    with patched if rank() == 1 else contextlib.nullcontext():
        return timed(
            lambda: autoshard.prepare(
                model, optimizer, local_batches(1)[0], strategy=strategy, mixed_precision="no"
            )
        )


@cases.case
def wrap_fails_on_rank1_ddp() -> dict[str, Any]:
    return wrap_fails_on_rank1("ddp")


@cases.case
def wrap_fails_on_rank1_full_shard() -> dict[str, Any]:
    return wrap_fails_on_rank1("full_shard")


# ---------------------------------------------------------------------------------------------
# 10. Existing gradients come back bitwise


def grads_kept(strategy: str) -> dict[str, Any]:
    model, optimizer = build()
    batch = local_batches(1)[0 if rank() == 0 else 0]
    same = {k: v[:8] for k, v in local_batches(1)[0].items()} if rank() == 0 else None
    box = [same]
    torch.distributed.broadcast_object_list(box, src=0)  # the same batch on both ranks
    batch = box[0]
    model(**batch)["loss"].backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    autoshard.prepare(model, optimizer, batch, strategy=strategy, mixed_precision="no")
    after = {n: full(p.grad) if p.grad is not None else None for n, p in model.named_parameters()}
    return {
        "names": len(before),
        "bitwise": [
            n for n, g in before.items() if after.get(n) is not None and torch.equal(after[n], g)
        ],
    }


@cases.case
def grads_kept_ddp() -> dict[str, Any]:
    return grads_kept("ddp")


@cases.case
def grads_kept_full_shard() -> dict[str, Any]:
    return grads_kept("full_shard")


# ---------------------------------------------------------------------------------------------
# 1. A load that fails on rank 1 only: every rank falls back to the same checkpoint


def resume_after_one_rank_failed(strategy: str, failing: str = "verify") -> dict[str, Any]:
    """`failing`: where rank 1's load fails: checking the files ("verify"), or taking the state
    dicts to load into just before DCP's collective read ("get_state_dict")."""
    where = OUT / f"resume_{strategy}_{failing}"
    model, optimizer = build()
    model, optimizer, _ = autoshard.prepare(
        model, optimizer, strategy=strategy, mixed_precision="no", trial_step=False
    )
    batches = local_batches(2)
    digests = {}
    for name, batch in zip(("previous", "latest"), batches, strict=True):
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        autoshard.save(where / name, model, optimizer)
        digests[name] = digest(model)
    fresh, fresh_optimizer = build()
    fresh, fresh_optimizer, _ = autoshard.prepare(
        fresh, fresh_optimizer, strategy=strategy, mixed_precision="no", trial_step=False
    )
    owner = checkpoint_module if failing == "verify" else state_dict_module
    original = getattr(owner, failing)

    def flaky(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error (injected, transient)")

    if rank() == 1:
        setattr(owner, failing, flaky)
    error = None
    try:
        autoshard.load(where / "latest", fresh, fresh_optimizer)
        loaded = "latest"
    except Exception as caught:  # the usual resume script
        error = f"{type(caught).__name__}: {caught}"
        setattr(owner, failing, original)
        autoshard.load(where / "previous", fresh, fresh_optimizer)
        loaded = "previous"
    setattr(owner, failing, original)
    now = digest(fresh)
    matches = [k for k, v in digests.items() if v == now]
    return {"loaded": loaded, "error": error, "matches": matches}


@cases.case
def resume_ddp() -> dict[str, Any]:
    return resume_after_one_rank_failed("ddp")


@cases.case
def resume_full_shard() -> dict[str, Any]:
    return resume_after_one_rank_failed("full_shard")


@cases.case
def resume_full_shard_get_state_dict() -> dict[str, Any]:
    return resume_after_one_rank_failed("full_shard", "get_state_dict")


# ---------------------------------------------------------------------------------------------
# 2, 9. A stalled peer, then a killed peer, in the trial step


def sleep_or_die(action: Callable[[], None], on_rank: int = 1) -> Callable[..., None]:
    """A forward pre-hook that runs `action` once, on `on_rank`, in the real (not fake) step."""
    fired = []

    def hook(module: nn.Module, args: Any) -> None:
        if rank() == on_rank and not fired and not any(is_fake(a) for a in args):
            fired.append(True)
            action()

    return hook


@cases.case
def stalled_peer_in_trial() -> dict[str, Any]:
    model, optimizer = build(batchnorm=True)
    gave_up = OUT / "stalled_peer_rank0_gave_up"
    woke: dict[str, bool] = {}

    def stall() -> None:
        deadline = time.monotonic() + STALL_MAX_S
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        woke["rank0_had_given_up"] = gave_up.exists()

    model.blocks[1].register_forward_pre_hook(sleep_or_die(stall))
    before = state_digest(model, optimizer)
    autoshard.set_agreement_timeout(STALL_TIMEOUT_S)
    try:
        result = timed(
            lambda: autoshard.prepare(model, optimizer, local_batches(1)[0], strategy="ddp")
        )
    finally:
        autoshard.set_agreement_timeout(TIMEOUT_S)
        if rank() == 0:
            gave_up.touch()
    result.update(woke)
    result["restored"] = state_digest(model, optimizer) == before
    torch.distributed.barrier()  # rank 1 woke late: start the next case together
    return result


@cases.case
def killed_peer_in_trial() -> dict[str, Any]:
    """Last: rank 1 dies here."""
    model, optimizer = build(batchnorm=True)
    die = sleep_or_die(lambda: os.kill(os.getpid(), signal.SIGKILL))
    model.blocks[1].register_forward_pre_hook(die)
    before = state_digest(model, optimizer)
    autoshard.set_agreement_timeout(KILLED_TIMEOUT_S)
    result = timed(lambda: autoshard.prepare(model, optimizer, local_batches(1)[0], strategy="ddp"))
    result["restored"] = state_digest(model, optimizer) == before
    result["before"], result["after"] = before, state_digest(model, optimizer)
    return result


if __name__ == "__main__":
    import sys

    OUT = Path(sys.argv[1])
    cases.main()
