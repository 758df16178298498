"""Rank 0, which hosts the job's key-value store, is SIGKILLed in the trial step (issue 14): rank 1
must raise within the agreement timeout, naming rank 0, with its model and optimizer restored.

Started without torchrun (tests/_dist.py `run_ranks`), so that rank 1 keeps running, as under a
cluster launcher slower to react than autoshard's agreement. Rank 1 leaves with os._exit once its
result is written: tearing down a process group whose store is gone may block.

Usage (from tests/_dist.py): rank0_dies.py OUT_DIR
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import faults
from _common import _redirect_output, _write_json, build, local_batches, rank
from faults import KILLED_TIMEOUT_S, sleep_or_die, state_digest, timed

import autoshard


def killed_rank0_in_trial() -> dict[str, Any]:
    model, optimizer = build(batchnorm=True)
    die = sleep_or_die(lambda: os.kill(os.getpid(), signal.SIGKILL), on_rank=0)
    model.blocks[1].register_forward_pre_hook(die)
    before = state_digest(model, optimizer)
    autoshard.set_agreement_timeout(KILLED_TIMEOUT_S)
    result = timed(lambda: autoshard.prepare(model, optimizer, local_batches(1)[0], strategy="ddp"))
    result["restored"] = state_digest(model, optimizer) == before
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    faults.OUT = out
    _redirect_output(out / f"rank{rank()}.log")
    import torch.distributed as dist

    dist.init_process_group("gloo")
    data = killed_rank0_in_trial()
    _write_json(out / f"rank{rank()}.json", {"killed_rank0_in_trial": {"ok": True, "data": data}})
    os._exit(0)
