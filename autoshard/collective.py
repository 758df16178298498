"""The one cross-rank agreement of autoshard: every public call that runs collectives (`prepare`,
`save`, `load`, `shard_dataloader`) and the trial step's sync points go through `exchange`.

`agree(world, what, compute)` runs `compute` on this rank, catching every exception, and
exchanges either its value or its error with every rank before anything else happens, so no rank
is left waiting in a collective another rank never enters. If any rank failed, every rank raises:
the failing rank its own exception, the others the same type (or `PeerError` when that type
cannot be re-created from a message), naming the failing rank and its message.

The exchange goes through the process group's key-value store, not a collective, so that its
wait is bounded: each rank posts its entry under a key of its own and waits at most
`agreement_timeout()` seconds (default `DEFAULT_TIMEOUT_S`, five minutes; change it with
`autoshard.set_agreement_timeout`) for the others'. A rank that gives up marks the missing ranks'
keys as abandoned (atomically, with compare-and-set), so a late rank learns on arrival that the
others have gone, instead of entering the next collective alone; both sides raise `PeerTimeout`
naming the rank that did not answer.

The trial step's sync points (`Agreement`) sit immediately before every collective of the step:
inside FSDP2's all-gather and reduce-scatter (custom comm objects, called after FSDP2 allocated
the buffers, so an OOM while allocating them is caught before the collective), in a DDP comm hook
before each bucket's all-reduce, before DDP's forward (buffer broadcast) and before the optimizer
step. A rank whose step raised posts its code at its next sync instead; the others are at their
own next sync point, so the exchanges still pair up and every rank learns the same codes.
Composer's automatic microbatching keeps ranks in step the same way (DESIGN.md section 4).
Everything is removed after the trial: training pays nothing.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autoshard._torch_compat import (
    default_group,
    default_store,
)
from autoshard._world import World

T = TypeVar("T")
FINE, OOM, ERROR = 0, 1, 2

DEFAULT_TIMEOUT_S = 300.0
_timeout_s = DEFAULT_TIMEOUT_S
# Not agreed on: they end this process (the peers then time out, naming this rank).
_PASSING = (KeyboardInterrupt, SystemExit, GeneratorExit)


def set_agreement_timeout(seconds: float | None) -> float:
    """Set how long each rank waits for the others at an agreement point of `prepare`, `save`,
    `load`, `shard_dataloader` and the trial step, before raising `PeerTimeout` naming the rank
    that did not answer. Default 300 s (`None` restores it). Call it with the same value on every
    rank. Returns the previous value.

    Args:
        seconds: a positive number of seconds, or None for the default.
    """
    global _timeout_s
    if seconds is None:
        seconds = DEFAULT_TIMEOUT_S
    if (
        not isinstance(seconds, (int, float))
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise ValueError(
            f"the agreement timeout must be a positive number of seconds, got {seconds!r}; "
            f"pass None for the default of {DEFAULT_TIMEOUT_S:g} s"
        )
    previous, _timeout_s = _timeout_s, float(seconds)
    return previous


def agreement_timeout() -> float:
    return _timeout_s


class PeerError(RuntimeError):
    """Another rank failed with an exception whose type cannot be re-created from its message.

    Attributes:
        rank: the rank that failed.
        type_name: the name of the exception type it raised.
    """

    def __init__(self, message: str, rank: int, type_name: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name


class PeerTimeout(RuntimeError):
    """A rank did not reach an agreement point in time (it died, stalled, or is not making the
    same autoshard calls in the same order).

    Attributes:
        ranks: the ranks that did not answer (or, on a late rank, the ranks that gave up on it).
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class PeerFailed(Exception):
    """Raised at a trial sync point when another rank reported a failure; ends this rank's step."""


# ---------------------------------------------------------------------------------------------
# The exchange: every rank's entry, through the store, with a bounded wait

_ABANDONED = b"autoshard-abandoned-by:"
_round: dict[str, Any] = {"group": None, "n": 0}


def _next_round() -> tuple[Any, int]:
    """The store and this agreement's number, the same on every rank (ranks make the same calls
    in the same order); counted afresh for each process group."""
    group = default_group()
    previous = _round["group"]
    if previous is None or previous() is not group:
        _round.update(group=weakref.ref(group), n=0)
    n = int(_round["n"])
    _round["n"] = n + 1
    return default_store(), n


def exchange_in_group(what: str, payload: Any) -> list[Any]:
    """`exchange` over the current default process group, for code that holds no `World`: every
    rank's `payload`, through the job's store. Not an object collective: on NCCL one queues
    behind any collective a rank left unmatched, and allocates on the device."""
    world = World(
        rank=dist.get_rank(),
        local_rank=0,
        world_size=dist.get_world_size(),
        local_world_size=1,
        backend=str(dist.get_backend()),
        device=torch.device("cpu"),
        distributed=True,
    )
    return exchange(world, what, payload)


def exchange(world: World, what: str, payload: Any) -> list[Any]:
    """Every rank's `payload`, in rank order; raises `PeerTimeout` naming the ranks that did not
    post theirs within the agreement timeout. `payload` must pickle."""
    if not world.has_peers:
        return [payload]
    return [pickle.loads(b) for b in _exchange_bytes(world, what, pickle.dumps(payload))]


def _exchange_bytes(world: World, what: str, blob: bytes) -> list[bytes]:
    store, n = _next_round()
    keys = [f"autoshard/agree/{n}/{r}" for r in range(world.world_size)]
    try:
        posted = bytes(store.compare_set(keys[world.rank], b"", blob))
        if posted != blob:  # the others gave up on this rank before it arrived
            by = sorted({int(posted[len(_ABANDONED) :])})
            raise PeerTimeout(
                f"rank(s) {by} stopped waiting for this rank (rank {world.rank}) at {what} after "
                f"{_timeout_s:g} s and raised: this rank arrived too late (it was stalled or "
                f"slow); if it is only slow, raise the limit with "
                f"autoshard.set_agreement_timeout(seconds) on every rank",
                by,
            )
        _wait(store, keys, world, what)
        values = [bytes(v) for v in store.multi_get(keys)]
    except dist.DistError as error:
        raise PeerTimeout(
            f"rank {world.rank} lost contact with the job's key-value store at {what} "
            f"({type(error).__name__}: {error}); the rank hosting it (rank 0 under torchrun) has "
            f"died, or exited after giving up on this rank: see its log",
            [0],
        ) from error
    gone = [r for r, v in enumerate(values) if v.startswith(_ABANDONED)]
    if gone:
        raise _no_answer(gone, what)
    if n > 0:  # every rank posted round n, so every rank has read round n - 1
        with contextlib.suppress(Exception):
            store.delete_key(f"autoshard/agree/{n - 1}/{world.rank}")
    return values


def _wait(store: Any, keys: list[str], world: World, what: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=_timeout_s))
        return
    except dist.DistStoreError as error:
        if "timeout" not in str(error).lower():
            raise
    # Mark each missing rank's key as abandoned; a rank that posts meanwhile keeps its entry.
    mark = _ABANDONED + str(world.rank).encode()
    gone = []
    for r, key in enumerate(keys):
        if not store.check([key]) and bytes(store.compare_set(key, b"", mark)) == mark:
            gone.append(r)
    if gone:
        raise _no_answer(gone, what)


def _no_answer(ranks: list[int], what: str) -> PeerTimeout:
    return PeerTimeout(
        f"rank(s) {ranks} did not answer within {_timeout_s:g} s at {what}: died, stalled, or "
        f"not making the same autoshard call (every rank must call it, in the same order); see "
        f"that rank's log, and if it is only slow raise the limit with "
        f"autoshard.set_agreement_timeout(seconds) on every rank",
        ranks,
    )


# ---------------------------------------------------------------------------------------------
# Agreeing on a result or an error


def agree(world: World, what: str, compute: Callable[[], T]) -> list[T]:
    """Run `compute` here and agree with every rank before anything else: every rank's value in
    rank order, or, if it raised on any rank, that exception on every rank (see the module's
    docstring). `what` names the call for the messages, e.g. "load()"."""
    return _agree(world, what, compute, share_values=True)


def agree_here(world: World, what: str, compute: Callable[[], T]) -> T:
    """`agree`, returning this rank's own value; only whether it succeeded travels (the value
    may be large: a state dict)."""
    values = _agree(world, what, compute, share_values=False)
    return values[world.rank if world.has_peers else 0]


def _agree(world: World, what: str, compute: Callable[[], T], share_values: bool) -> list[T]:
    own: BaseException | None = None
    try:
        value = compute()
        entry = pickle.dumps(("ok", value if share_values else None)) if world.has_peers else b""
    except _PASSING:
        raise
    except BaseException as error:
        own, entry = error, pickle.dumps(_describe(error))
    if not world.has_peers:
        if own is not None:
            raise own
        return [value]
    replies = [pickle.loads(b) for b in _exchange_bytes(world, what, entry)]
    if own is not None:
        raise own
    for rank, reply in enumerate(replies):
        if reply[0] == "error":
            raise _rebuilt(rank, what, *reply[1:])
    if not share_values:
        return [value if r == world.rank else None for r in range(len(replies))]  # type: ignore[misc]
    return [reply[1] for reply in replies]


def settle(world: World, what: str, error: BaseException | None) -> None:
    """Agree on an error already caught (or on none): raise on every rank if any rank has one."""

    def compute() -> None:
        if error is not None:
            raise error

    agree(world, what, compute)


def _describe(error: BaseException) -> tuple[str, bytes | None, str, str]:
    try:
        kind: bytes | None = pickle.dumps(type(error))
    except Exception:  # a class defined inside a function: only its name travels
        kind = None
    try:
        message = str(error)
    except Exception:
        message = repr(error)
    return ("error", kind, type(error).__name__, message)


def _rebuilt(rank: int, what: str, kind: bytes | None, name: str, message: str) -> BaseException:
    """The failing rank's exception, re-created on this rank: the same type when it takes a
    message; else a PeerError that is also a subclass of that type (where Python allows it), so
    `except ThatType` still catches it; either way naming the rank and the original message."""
    text = f"rank {rank} failed in {what} with {name}: {message}"
    cls: Any = None
    with contextlib.suppress(Exception):
        cls = pickle.loads(kind) if kind is not None else None
    error: Any = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        with contextlib.suppress(Exception):
            error = cls(text)
        if error is None or text not in _text(error):
            error = _subclass_of(cls, f"{text}; see rank {rank}'s traceback", rank, name)
    if error is None:
        error = PeerError(f"{text}; see rank {rank}'s traceback", rank, name)
    with contextlib.suppress(Exception):
        error.rank = rank
    return error  # type: ignore[no-any-return]


def _subclass_of(cls: type, text: str, rank: int, name: str) -> BaseException | None:
    """A PeerError that is also a `cls`, for a `cls` whose constructor takes other arguments."""

    def init(self: BaseException, message: str) -> None:
        BaseException.__init__(self, message)
        self.rank, self.type_name = rank, name  # type: ignore[attr-defined]

    for bases in ((PeerError, cls), (cls,)):
        with contextlib.suppress(Exception):
            sub = type(f"{cls.__name__}OnAnotherRank", bases, {"__init__": init})
            sub.__str__ = BaseException.__str__  # type: ignore[method-assign,assignment]
            error = sub(text)
            if _text(error) == text:
                return error  # type: ignore[no-any-return]
    return None


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:
        return ""


# ---------------------------------------------------------------------------------------------
# The trial step's sync points


class Agreement:
    """The sync points of one trial step."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rows: list[tuple[int, int]] | None = None  # set once any rank reported a failure
        self.broken: PeerTimeout | None = None  # a rank did not answer: no later sync can pair

    def sync(self, code: int = FINE, peak: int = 0) -> list[tuple[int, int]]:
        """One exchange unless a failure is already known; returns (code, peak bytes) of every
        rank."""
        if self.broken is not None:
            raise self.broken
        if self.rows is not None:
            return self.rows
        try:
            replies = exchange(self.world, "prepare()'s trial step", (code, peak))
        except PeerTimeout as error:
            self.broken = error
            raise
        rows = [tuple(r) for r in replies]
        if any(c for c, _ in rows):
            self.rows = rows  # type: ignore[assignment]
        return rows  # type: ignore[return-value]

    def check(self) -> None:
        if any(c for c, _ in self.sync()):
            raise PeerFailed
