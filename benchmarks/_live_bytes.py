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

Two bounds, then, on when a block whose free went unreported was freed, both reported:
- at the latest (`upper_peak`): at the reuse of its address, or at the end of the collective it
  was allocated in;
- at the earliest (`peak`, the figure compared): after its last use, where the block was used at
  all. The profile records each operator's input tensors (`record_shapes=True`) with the identity
  of the allocation behind them, so the end of the last operator that took the block as an input
  is known; a block whose address was later reused was freed somewhere between that moment and
  the reuse. The race that loses the free is of microseconds (gloo's worker thread drops the
  collective's work, and with it the last reference, just after the calling thread's `wait`),
  while the reuse of an address can come a whole step later or never. A block never freed nor
  reused is counted as `leaked` (the row is measured again): at the latest it is live to the
  end, at the earliest it was freed after its last use. On whisper under FULL_SHARD, one rank's
  all-gather output for a decoder layer (FSDP2's, 0.19 MiB), last used by its copy-out, was never
  reported freed: the upper bound held it to the end of the profile, 5% above the other rank's
  peak in that run and not in the next.
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
    unreported free of this block happened at the latest (None: no collective holds it);
    `last_use`, the end of the last operator that took the block as an input (None: none did)."""

    ts: int
    ptr: int
    nbytes: int
    freed_by: int | None = None
    last_use: int | None = None
    where: str = ""  # the operators it was allocated in, innermost first


@dataclass(frozen=True)
class LiveBytes:
    """The running total of allocator bytes, counted from the start of the profile.

    Attributes:
        peak: the largest total inside the window (or at its start), missed frees put at the
            earliest moment they can have happened.
        upper_peak: the same with missed frees at the latest moment.
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
    upper_peak: int
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
    allocations: list[Allocation], known: frozenset[int] = frozenset(), earliest: bool = False
) -> Corrected:
    """The running total's deltas with the unreported frees inserted and the frees of blocks from
    before the profile left out; blocks still live at the end are `retained` when at a `known`
    address, else leaked. An unreported free is put at the latest moment it can have happened, or
    with `earliest` at the end of the block's last use where it had one (see the module's
    docstring). `allocations` must be in time order."""
    deltas: list[tuple[int, int]] = []
    live: dict[int, Allocation] = {}
    missed, foreign = [0, 0], [0, 0]

    def missed_free(block: Allocation, latest: int) -> None:
        deltas.append((_earliest(block, latest) if earliest else latest, -block.nbytes))
        missed[0] += 1
        missed[1] += block.nbytes

    for a in allocations:
        if a.nbytes > 0:
            earlier = live.pop(a.ptr, None)
            if earlier is not None:  # the address was free again: its free went unreported
                missed_free(earlier, min(a.ts, earlier.freed_by or a.ts))
            live[a.ptr] = a
        elif live.pop(a.ptr, None) is None:  # allocated before the profile
            foreign[0] += 1
            foreign[1] -= a.nbytes
            continue
        deltas.append((a.ts, a.nbytes))
    retained, leaked = [0, 0], [0, 0]
    for a in live.values():
        if a.freed_by is not None:
            missed_free(a, a.freed_by)
        else:
            kept = retained if a.ptr in known else leaked
            kept[0] += 1
            kept[1] += a.nbytes
            if earliest and kept is leaked and a.last_use is not None:
                deltas.append((max(a.ts, a.last_use), -a.nbytes))
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


def _where(event: Any, depth: int = 8) -> str:
    names = []
    parent = event.parent
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = parent.parent
    return " < ".join(names)


def live_at(
    allocations: list[Allocation], ts_ns: int, known: frozenset[int] = frozenset()
) -> list[Allocation]:
    """The blocks live at `ts_ns`, unreported frees put at their earliest, as `peak` counts them
    (a block still live at the end is live, a leaked one only until its last use)."""
    live: dict[int, Allocation] = {}
    ends: dict[int, int] = {}  # id(block) -> when it was freed
    for a in allocations:
        if a.nbytes > 0:
            earlier = live.pop(a.ptr, None)
            if earlier is not None:  # unreported free, at the latest at this reuse
                ends[id(earlier)] = _earliest(earlier, a.ts)
            live[a.ptr] = a
        elif (block := live.pop(a.ptr, None)) is not None:
            ends[id(block)] = a.ts
    for a in live.values():
        if a.freed_by is not None:
            ends[id(a)] = _earliest(a, a.freed_by)
        elif a.ptr not in known and a.last_use is not None:
            ends[id(a)] = max(a.ts, a.last_use)  # leaked: its free, if any, was not reported
    return [
        a
        for a in allocations
        if a.nbytes > 0 and a.ts <= ts_ns and ends.get(id(a), ts_ns + 1) > ts_ns
    ]


def _earliest(block: Allocation, latest: int) -> int:
    """The earliest moment an unreported free can have happened, given the latest."""
    if block.freed_by is not None:
        latest = min(latest, block.freed_by)
    return latest if block.last_use is None else min(latest, max(block.ts, block.last_use))


class AllocatorProfile:
    """A CPU profiler recording allocator events, with named windows to take peaks over."""

    def __init__(self, record_uses: bool = True) -> None:
        # record_shapes: each operator's input tensors, with their allocations' identities (the
        # last uses that bound an unreported free at the earliest); without, both bounds are the
        # latest, and the profile is cheaper
        self._profile = profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=record_uses
        )
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
        flat event list; both in the profiler's clock. Each allocation's last use: the latest end
        of an operator given a tensor of that allocation (its `allocation_id`) as an input."""
        events, stack = [], list(results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            events.append(event)
        # allocation id -> (start, end) of each operator given a tensor of it as an input. The
        # profiler keeps an allocation's id for a later block at the same address when the free
        # in between went unreported: a use counts for the block live when the operator started.
        uses: dict[int, list[tuple[int, int]]] = {}
        for event in events:
            if event.tag == _EventType.TorchOp:
                for x in event.extra_fields.inputs:
                    if (key := getattr(x, "allocation_id", None)) is not None:
                        uses.setdefault(key, []).append(
                            (int(event.start_time_ns), int(event.end_time_ns))
                        )
        blocks = sorted(
            (e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns
        )
        until: dict[int, int] = {}  # id(event) -> when the next block at its address came
        latest: dict[int, Any] = {}
        for event in blocks:
            if event.extra_fields.alloc_size > 0:
                if (earlier := latest.get(event.extra_fields.ptr)) is not None:
                    until[id(earlier)] = event.start_time_ns
                latest[event.extra_fields.ptr] = event
        for event in blocks:
            nbytes = event.extra_fields.alloc_size
            self._threads.add(event.start_tid)
            last_use = None
            if nbytes > 0:
                ends = [
                    end
                    for start, end in uses.get(event.extra_fields.allocation_id, ())
                    if event.start_time_ns <= start < until.get(id(event), 1 << 62)
                ]
                last_use = max(ends, default=None)
            self._allocations.append(
                Allocation(
                    event.start_time_ns,
                    event.extra_fields.ptr,
                    nbytes,
                    _freed_by(event) if nbytes > 0 else None,
                    last_use,
                    _where(event) if nbytes > 0 else "",
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
        fixed = corrected_deltas(self._allocations, known, earliest=True)
        latest = corrected_deltas(self._allocations, known)
        peak, at_start, peak_ns = running_peak(fixed.deltas, start, end)
        return LiveBytes(
            peak=peak,
            upper_peak=running_peak(latest.deltas, start, end)[0],
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

    def live_at_peak(self, name: str, known: frozenset[int] = frozenset()) -> list[Allocation]:
        """The blocks live at the peak of the window `name` (as `live_bytes(name).peak` counts)."""
        return live_at(self._allocations, self.live_bytes(name, known).peak_ns, known)

    def span_at(self, ts_ns: int, names: set[str]) -> str | None:
        """The name of the innermost recorded span among `names` that contains `ts_ns`."""
        inside = [s for s in self._spans if s.name in names and s.start_ns <= ts_ns <= s.end_ns]
        return min(inside, key=lambda s: s.end_ns - s.start_ns).name if inside else None

    def thread_count(self) -> int:
        """Distinct threads whose allocator events were recorded."""
        return len(self._threads)
