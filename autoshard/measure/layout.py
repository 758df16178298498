"""How a model's blocks repeat, for simulating it shallow and extending (`measure.simulate`).

The blocks sit in lists (the children of a ModuleList or Sequential, in order): one for a
decoder, an encoder's and a decoder's for an encoder-decoder. Within a list, a `Stretch` is a
lead of blocks unlike the rest (DeepSeek's first dense layers before the mixture-of-experts
ones), then whole periods of blocks alike position by position (one block; two where a
mixture-of-experts layer comes every second one, or sliding and global attention alternate;
six for Gemma 3's five sliding to one global), then a tail that begins one more period. Blocks
are alike when they are of one class, parameter and buffer shapes and attributes
(`alike.alike`).

A copy of the model keeping every list's lead, k periods and tail runs what the whole model
runs, k periods' worth: every moment of its step is then a line in k (`simulate`), simulated at
k = 3, 4 and 5 (`SHALLOW`) and extended to the model's own number of periods. Every list has
that number: a list with more periods than another has them grouped into longer ones (24 and
12 blocks: periods of 2 and 1 blocks, 12 of each), and what does not divide goes into its lead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autoshard.measure.alike import alike, counting, describe

# Periods simulated: the first two give each moment's line, the third checks it. Deeper than
# FSDP2's window (the block in backward, the one prefetched and one reduce-scattering), so that
# every term grows by whole periods.
SHALLOW = (3, 4, 5)
# For one list of alike blocks, the least depth extended: the three shallow runs then hold 12 of
# its 16 blocks. Other layouts are extended where their three runs hold as few in proportion.
MIN_DEPTH_TO_EXTEND = 16
# Labels of a block whose moments are not extended: interior to its list's periods, its moments
# are lines in its position, whose largest sits at an end (`Stretch.label`)
INTERIOR = "interior block"


@dataclass(frozen=True)
class Stretch:
    """One list of blocks: `lead` blocks, then `periods` periods of `period` blocks alike position
    by position, then `tail` blocks (fewer than a period) alike to a period's first ones."""

    names: tuple[str, ...]
    lead: int
    period: int
    periods: int

    @property
    def tail(self) -> int:
        return len(self.names) - self.lead - self.periods * self.period

    def kept(self, k: int) -> tuple[str, ...]:
        """The list's blocks a copy with k periods keeps: the first ones, the tail's included
        (the blocks after k periods begin another period, as the tail does)."""
        return self.names[: self.lead + k * self.period + self.tail]

    def label(self, index: int, k: int) -> str:
        """The label of the kept block at `index` in the copy with k periods: the same block of
        the model at every k. A block of the periods counts from the nearer end (the first two
        periods and the last two); the others are interior."""
        parent = self.names[0].rpartition(".")[0]
        if index < self.lead:
            return f"{parent} lead {index}"
        j, position = divmod(index - self.lead, self.period)
        if j >= k:
            return f"{parent} tail {position}"
        if j < 2:
            return f"{parent} {position} of period {j}"
        if j >= k - 2:
            return f"{parent} {position} of period {j - k}"  # -1: the last, -2: the one before
        return INTERIOR


@dataclass(frozen=True)
class Layout:
    """Every list of blocks, each with the same number of periods."""

    stretches: tuple[Stretch, ...]

    @property
    def periods(self) -> int:
        """The number of periods of every list that repeats (a list that does not is all lead,
        kept whole at every depth)."""
        return max(s.periods for s in self.stretches)

    def kept(self, k: int) -> list[str]:
        """The blocks a copy with k periods of every list keeps, in the model's order."""
        return [name for stretch in self.stretches for name in stretch.kept(k)]

    def labels(self, k: int) -> list[str]:
        """Each kept block's label (`Stretch.label`), in the order of `kept`."""
        return [
            stretch.label(i, k) for stretch in self.stretches for i in range(len(stretch.kept(k)))
        ]

    def source(self, k: int, backward: bool = False) -> dict[str, str]:
        """For each block of the model, the block of the copy with k periods that stands for it:
        itself where kept, else the same position of the copy's last period.

        With `backward`, for what a block's backward holds, which depends on what runs after
        it (the gradient of a tensor every block takes, summed over the blocks after it: an
        encoder's output in each decoder block): the model's last period and tail stand for
        themselves in the copy's, and every period between its first k-1 and its last by the
        same position of the copy's second-last period, which blocks follow there too (k >= 2).
        """
        found: dict[str, str] = {}
        for stretch in self.stretches:
            kept = stretch.kept(k)
            last = stretch.lead + (k - 1) * stretch.period
            model_last = stretch.lead + (stretch.periods - 1) * stretch.period
            moved = backward and stretch.periods > k  # else the copy keeps the whole list
            for i, name in enumerate(stretch.names):
                position = (i - stretch.lead) % stretch.period
                if i >= len(stretch.names) - stretch.tail:  # the tail: kept at the copy's end
                    found[name] = kept[i - len(stretch.names) + len(kept)]
                elif moved and i >= model_last:
                    found[name] = kept[last + position]
                elif moved and i >= last:
                    found[name] = kept[last - stretch.period + position]
                elif i < stretch.lead + k * stretch.period:
                    found[name] = name
                else:
                    found[name] = kept[last + position]
        return found


def layout(model: nn.Module, names: list[str]) -> Layout | None:
    """How the blocks `names` repeat, where simulating copies of SHALLOW periods costs less than
    the whole model (`repeats`: their three runs hold at most as many blocks in proportion as
    they do of a list of MIN_DEPTH_TO_EXTEND alike blocks); else None."""
    best = repeats(model, names)
    if best is None:
        return None
    shallow = sum(len(best.kept(k)) for k in SHALLOW)
    if shallow * MIN_DEPTH_TO_EXTEND > sum(SHALLOW) * len(names):
        return None
    return best


def repeats(model: nn.Module, names: list[str]) -> Layout | None:
    """How the blocks `names` repeat (every list with more than SHALLOW[-1] periods, the others
    as leads), whatever a shallow copy saves; None where no list repeats so. Each list must hold
    blocks only (a copy drops its last ones)."""
    lists = _lists(model, names)
    if lists is None:
        return None
    found = [_stretch(model, list_names) for list_names in lists]
    repeating = [s for s in found if s.periods > SHALLOW[-1]]
    if not repeating:
        return None
    best: Layout | None = None
    for periods in range(SHALLOW[-1] + 1, min(s.periods for s in repeating) + 1):
        candidate = Layout(tuple(_regrouped(s, periods) for s in found))
        if best is None or len(candidate.kept(4)) < len(best.kept(4)):
            best = candidate
    assert best is not None
    return best


def _lists(model: nn.Module, names: list[str]) -> list[list[str]] | None:
    """The block names by list, each list's in order, or None where a block is not the child of
    a ModuleList/Sequential holding blocks only."""
    by_parent: dict[str, list[str]] = {}
    for name in names:
        by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    for parent_name, list_names in by_parent.items():
        parent = model.get_submodule(parent_name)
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return None
        if [b for b in parent] != [model.get_submodule(n) for n in list_names]:
            return None
    return list(by_parent.values())


def _stretch(model: nn.Module, names: list[str]) -> Stretch:
    """The list's layout with the fewest blocks kept at 4 periods; a list with no repeat is all
    lead."""
    blocks = [model.get_submodule(n) for n in names]
    described = [describe(b) for b in blocks]
    counted = counting(described)
    n = len(blocks)
    best = Stretch(tuple(names), n, 1, 0)
    for period in range(1, n // (SHALLOW[-1] + 1) + 1):
        unlike = [
            i for i in range(n - period) if not alike(described[i], described[i + period], counted)
        ]
        lead = unlike[-1] + 1 if unlike else 0
        periods = (n - lead) // period
        if periods <= SHALLOW[-1]:
            continue
        stretch = Stretch(tuple(names), lead, period, periods)
        if best.periods == 0 or len(stretch.kept(4)) < len(best.kept(4)):
            best = stretch
    return best


def _regrouped(stretch: Stretch, periods: int) -> Stretch:
    """`stretch` with `periods` periods: its own grouped, those left over moved into its lead. A
    list without periods (all lead) stays as it is."""
    if stretch.periods == 0:
        return stretch
    group = stretch.periods // periods
    left = stretch.periods - group * periods
    return Stretch(
        stretch.names, stretch.lead + left * stretch.period, group * stretch.period, periods
    )
