"""The generator states a checkpointed step keeps, counted where they are device memory: the CPU.

torch's activation checkpoint (`torch.utils.checkpoint`, re-entrant or not, and the composable
`checkpoint`) keeps the CPU generator's state, `torch.get_rng_state()` (5,056 bytes), from each
checkpointed block's forward until that block's backward, whose recomputation takes one more
(`torch.random.fork_rng`) while it runs. Those are real CPU tensors even under a fake mode, so
a simulated step never saw them: a model trained on the CPU with every block checkpointed was
estimated 5,056 bytes short per block (a 2-block Qwen3 under FULL_SHARD: -10,116 bytes, -0.3%).
On a GPU they are host memory (as is the GPU generator's own state), and nothing is counted.

`states_counted(device)`: while it lasts, in this thread, where `device` is the CPU,
`torch.get_rng_state()` gives an empty fake block of the real state's size (allocated through
the modes in force, so the memory tracker sees it live for as long as the checkpoint holds it)
and `torch.set_rng_state` ignores such a block (a fake step draws nothing from the generator).
Where the modes are set aside inside the step (a kernel run for real), in other threads and
elsewhere, both are torch's own.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autoshard._torch_compat import resolve

_local = threading.local()  # .depth: this thread's counted steps in progress
_lock = threading.Lock()
_own: tuple[Any, Any] | None = None  # torch's own (get, set) while ours are in place
_users = 0  # counted steps in progress, every thread


@functools.cache
def state_bytes() -> int:
    """The size of the CPU generator's state (MT19937 and its extras)."""
    return int((_own[0] if _own else torch.get_rng_state)().nbytes)


def _get_state() -> torch.Tensor:
    if getattr(_local, "depth", 0) > 0:
        block = torch.empty(state_bytes(), dtype=torch.uint8, device="cpu")
        if isinstance(block, resolve("FakeTensor")):
            return block
        # the fake mode set aside (a kernel run for real inside the step, a workspace probe):
        # the real state, which that caller will set back
    # torch's own (the default generator's, where a caller kept ours past the step)
    return (_own[0] if _own else torch.default_generator.get_state)()  # type: ignore[no-any-return]


def _set_state(new_state: torch.Tensor) -> None:
    if not isinstance(new_state, resolve("FakeTensor")):
        (_own[1] if _own else torch.default_generator.set_state)(new_state)


@contextmanager
def states_counted(device: torch.device) -> Iterator[None]:
    """The generator states a step keeps, as fake blocks where `device` is the CPU (see the
    module's docstring); nothing changes elsewhere."""
    if device.type != "cpu":
        yield
        return
    global _users, _own
    with _lock:
        if _users == 0:
            _own = (torch.get_rng_state, torch.set_rng_state)
            state_bytes()  # measured on torch's own
            torch.get_rng_state = _get_state
            torch.set_rng_state = _set_state
        _users += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _users -= 1
            if _users == 0 and _own is not None:
                get, set_ = _own
                _own = None
                # put back only what is still ours (not what something else has put there since)
                if torch.get_rng_state is _get_state:
                    torch.get_rng_state = get
                if torch.set_rng_state is _set_state:
                    torch.set_rng_state = set_
