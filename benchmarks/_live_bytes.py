"""Live tensor bytes as the CPU allocator sees them, from torch's profiler (DESIGN.md section 3).

With `profile_memory=True` the profiler records an allocation event (size and address) for every
allocation and free that goes through c10's CPU allocator, C++-side ones included (DDP's gradient
buckets, which torch's MemTracker cannot see). Summed in time order, the sizes give the bytes live
at each moment, counted from the start of the profile. So a profile started before the model is
built counts everything the training holds; its running total, maximised over a labelled window
(a `record_function` range, in the same clock), is the peak of that window.

    with AllocatorProfile() as prof:
        ... build, wrap, warm up ...
        with prof.window("measured"):
            ... the steps to measure ...
        ... free everything ...
    live = prof.live_bytes("measured")  # live.peak, live.raw_peak, live.missed_frees, ...

One correction (measured on torch 2.13, gloo): the allocator reports a free only on a thread the
profiler watches (the state is thread-local; `profile_all_threads=True` drops memory events
altogether). A gloo collective's work object can be destroyed on gloo's worker thread, and with it
the buffer it held: the clone `c10d::_reduce_scatter_base_` makes of its input (FSDP2's gradient
reduce-scatter), the flat buffer DDP's `_broadcast_coalesced` makes of the parameters at
construction. Those frees are never reported, so the raw running total keeps growing, by a
different amount from run to run (which thread drops the last reference is a race). Such a buffer
is freed once its collective has completed, and the collectives of both are synchronous (the
calling thread waits), so an allocation made inside a `c10d::` op, or by `flatten_dense_tensors`,
that is still unfreed when the profile ends is counted as freed when that op ends. An allocation
at an address still live frees the earlier block there at the latest at that moment. Any other
allocation still live at the end counts as live to the end: `retained` when it is one of the
`known` storages the caller says outlive the profile (say, parameters a tracker keeps alive),
else `leaked`, an unexplained block (an FSDP2 all-gather buffer whose free went unreported is
one): a run with leaked bytes is an upper bound and worth measuring again.

A free of a block allocated before the profile started (a previous run's leftovers collected
late) is not counted: the running total is the bytes allocated inside the profile and still live.
Such frees are reported as `foreign_frees`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch._C._profiler import _EventType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

# Ancestors whose end bounds the life of a buffer a gloo collective held (see above).
_COLLECTIVE_PREFIX = "c10d::"
_COALESCE_OP = "aten::flatten_dense_tensors"


@dataclass(frozen=True)
class Allocation:
    """One allocator event: `nbytes` > 0 allocates at `ptr`, < 0 frees it. `freed_by` is when an
    unreported free of this block happened at the latest (None: no collective holds it)."""

    ts: int
    ptr: int
    nbytes: int
    freed_by: int | None = None


@dataclass(frozen=True)
class LiveBytes:
    """The running total of allocator bytes, counted from the start of the profile.

    Attributes:
        peak: the largest total inside the window (or at its start), missed frees corrected.
        raw_peak: the same without the correction (only the frees the profiler reported).
        at_start: the total when the window opened.
        peak_ns: when the peak was reached (the profiler's clock, ns).
        final: the total at the end of the profile.
        missed_frees: blocks whose free was not reported and was inferred (count, bytes).
        retained: blocks still live at the end that the caller knew of (count, bytes).
        leaked: other blocks still live at the end of the profile (count, bytes).
        foreign_frees: frees of blocks allocated before the profile, not counted (count, bytes).
        events: allocator events in the profile.
    """

    peak: int
    raw_peak: int
    at_start: int
    peak_ns: int
    final: int
    missed_frees: tuple[int, int]
    retained: tuple[int, int]
    leaked: tuple[int, int]
    foreign_frees: tuple[int, int]
    events: int


@dataclass(frozen=True)
class Span:
    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Corrected:
    """The allocator events as deltas of live bytes, and what was inferred, as (count, bytes)."""

    deltas: list[tuple[int, int]]  # (timestamp, signed bytes)
    missed_frees: tuple[int, int]
    retained: tuple[int, int]
    leaked: tuple[int, int]
    foreign_frees: tuple[int, int]


def corrected_deltas(
    allocations: list[Allocation], known: frozenset[int] = frozenset()
) -> Corrected:
    """The running total's deltas with the unreported frees inserted and the frees of blocks from
    before the profile left out; blocks still live at the end are `retained` when at a `known`
    address, else leaked. `allocations` must be in time order."""
    deltas: list[tuple[int, int]] = []
    live: dict[int, Allocation] = {}
    missed, foreign = [0, 0], [0, 0]
    for a in allocations:
        if a.nbytes > 0:
            earlier = live.pop(a.ptr, None)
            if earlier is not None:  # the address was free again: its free went unreported
                when = a.ts if earlier.freed_by is None else min(a.ts, earlier.freed_by)
                deltas.append((when, -earlier.nbytes))
                missed[0] += 1
                missed[1] += earlier.nbytes
            live[a.ptr] = a
        elif live.pop(a.ptr, None) is None:  # allocated before the profile
            foreign[0] += 1
            foreign[1] -= a.nbytes
            continue
        deltas.append((a.ts, a.nbytes))
    retained, leaked = [0, 0], [0, 0]
    for a in live.values():
        if a.freed_by is not None:
            deltas.append((a.freed_by, -a.nbytes))
            missed[0] += 1
            missed[1] += a.nbytes
        else:
            kept = retained if a.ptr in known else leaked
            kept[0] += 1
            kept[1] += a.nbytes
    return Corrected(deltas, _pair(missed), _pair(retained), _pair(leaked), _pair(foreign))


def _pair(counts: list[int]) -> tuple[int, int]:
    return counts[0], counts[1]


def running_peak(deltas: list[tuple[int, int]], start_ns: int, end_ns: int) -> tuple[int, int, int]:
    """(peak over [start, end], total at start, time of the peak) of a running total of deltas."""
    ordered = sorted(deltas, key=lambda e: e[0])  # stable: simultaneous events keep their order
    at_start, peak, peak_ns = 0, None, start_ns
    for (ts, _), total in zip(ordered, itertools.accumulate(d for _, d in ordered), strict=True):
        if ts < start_ns:
            at_start = total
        elif ts <= end_ns and (peak is None or total > peak):
            peak, peak_ns = total, ts
    if peak is None or peak < at_start:
        peak, peak_ns = at_start, start_ns
    return peak, at_start, peak_ns


def _freed_by(event: Any) -> int | None:
    """The end of the innermost c10d op (else the coalescing op) the allocation happened in."""
    coalesce = None
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(_COLLECTIVE_PREFIX):
            return int(parent.end_time_ns)
        if parent.name == _COALESCE_OP and coalesce is None:
            coalesce = int(parent.end_time_ns)
        parent = parent.parent
    return coalesce


class AllocatorProfile:
    """A CPU profiler recording allocator events, with named windows to take peaks over."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._allocations: list[Allocation] = []
        self._spans: list[Span] = []
        self._threads: set[int] = set()

    def __enter__(self) -> AllocatorProfile:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        if exc[0] is None:
            assert self._profile.profiler is not None
            self._read(self._profile.profiler.kineto_results)

    def _read(self, results: Any) -> None:
        """Allocator events from the event tree (it has their addresses), user spans from the
        flat event list; both in the profiler's clock."""
        stack = list(results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation:
                nbytes = event.extra_fields.alloc_size
                self._threads.add(event.start_tid)
                self._allocations.append(
                    Allocation(
                        event.start_time_ns,
                        event.extra_fields.ptr,
                        nbytes,
                        _freed_by(event) if nbytes > 0 else None,
                    )
                )
        self._allocations.sort(key=lambda a: a.ts)
        for flat in results.events():
            if flat.is_user_annotation():
                self._spans.append(Span(flat.name(), flat.start_ns(), flat.end_ns()))

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Label a span of this thread's execution (a `record_function` range)."""
        with record_function(name):
            yield

    def spans(self, name: str) -> list[Span]:
        return [s for s in self._spans if s.name == name]

    def live_bytes(self, name: str, known: frozenset[int] = frozenset()) -> LiveBytes:
        """The running total's peak over every span labelled `name`, first start to last end;
        `known`: addresses of storages expected to outlive the profile."""
        spans = self.spans(name)
        if not spans:
            raise ValueError(f"no window named {name!r} was recorded")
        start, end = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
        raw = [(a.ts, a.nbytes) for a in self._allocations]
        fixed = corrected_deltas(self._allocations, known)
        peak, at_start, peak_ns = running_peak(fixed.deltas, start, end)
        return LiveBytes(
            peak=peak,
            raw_peak=running_peak(raw, start, end)[0],
            at_start=at_start,
            peak_ns=peak_ns,
            final=sum(d for _, d in fixed.deltas),
            missed_frees=fixed.missed_frees,
            retained=fixed.retained,
            leaked=fixed.leaked,
            foreign_frees=fixed.foreign_frees,
            events=len(self._allocations),
        )

    def span_at(self, ts_ns: int, names: set[str]) -> str | None:
        """The name of the innermost recorded span among `names` that contains `ts_ns`."""
        inside = [s for s in self._spans if s.name in names and s.start_ns <= ts_ns <= s.end_ns]
        return min(inside, key=lambda s: s.end_ns - s.start_ns).name if inside else None

    def thread_count(self) -> int:
        """Distinct threads whose allocator events were recorded."""
        return len(self._threads)
