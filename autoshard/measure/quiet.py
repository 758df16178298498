"""Silence what torch says about autoshard's own fake runs (the trace of the example batch and the
simulated steps), and only that: the user never runs those models, so a warning about them is
noise, printed once per rank. Everything else torch says still reaches the user."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator

from autoshard._torch_compat import FAKE_TENSOR_LOGGER

# FSDP2 warns when a wrapped module returns a view; the simulation wraps the user's blocks even
# when the plan is DDP, so the warning would come on every rank of a job that never runs FSDP2.
# Under a real FSDP2 wrap (prepare's) it still shows.
_FSDP_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
# MemTracker warns where a module's backward hook fires after the module is gone: a module made
# inside a forward and dropped before backward (transformers' BART, T5 and others build a
# CrossEntropyLoss there), whose parameters and buffers (none) the tracker then cannot file.
# Printed on every plan of such a model; it says nothing about the user's training.
_MODULE_GONE_WARNING = r"Module is None\. Skipping (PRE|POST)_BW hook\."
# torch.compile'd models (an OptimizedModule) warn at each call while any global module hook is
# registered, and the trackers of the trace and the simulation register theirs.
_COMPILED_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
# FakeTensorMode logs every failed meta kernel with its traceback at ERROR level before raising;
# autoshard catches the exception and says what it means, once.


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def own_runs_quiet() -> Iterator[None]:
    """Inside: FSDP2's view warning, MemTracker's warning about a module gone before its
    backward, a compiled model's warning about global hooks, and fake-tensor error logs are
    dropped, and the excepthook
    `init_process_group` installs for a fake group (it prefixes every traceback line of the rest
    of the process with `[rank0]:`) is undone afterwards."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    drop = _DropAll()
    hook = sys.excepthook
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FSDP_VIEW_WARNING, category=UserWarning)
            warnings.filterwarnings("ignore", message=_MODULE_GONE_WARNING, category=UserWarning)
            warnings.filterwarnings("ignore", message=_COMPILED_WARNING, category=UserWarning)
            yield
    finally:
        logger.removeFilter(drop)
        sys.excepthook = hook


@contextlib.contextmanager
def failed_run_unheard() -> Iterator[None]:
    """What a fake run prints is held back, and written out only if the run ends cleanly: a run
    that raises is reported in the plan, and FSDP2 prints a stack trace before each of its
    assertions (`_raise_assert_with_print`), which would reach the user's console once per rank."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
