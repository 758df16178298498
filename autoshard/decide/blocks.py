"""Which submodules are the repeated blocks: the units of sharding and of checkpointing.

A block is an instance of a class the model repeats. Hugging Face models name their block classes
in `_no_split_modules`; other models hold theirs in `nn.ModuleList` / `nn.Sequential` containers.
Every repeated class becomes blocks (an encoder's and a decoder's layers, classes that alternate
in one list), in forward order; what is not a block (embeddings, heads, final norms) stays in the
root FSDP unit. Two rules keep every block a unit FSDP2 can shard:

- a block that shares a parameter with anything outside itself (tied weights) stays in the root
  unit with its sharer: FSDP2 refuses a parameter managed by two units;
- where one block of a list holds most of the list's parameters (a ConvNeXt-like last stage), the
  list's blocks are split into the repeated blocks inside them, so that no unit is most of the
  model.

A model with no list of blocks at all, whose blocks are attributes (a UNet written by hand:
`self.down1`, `self.down2`, `self.mid`, ...), has as blocks the outermost submodules of each class
it repeats that are layers of their own (`_from_attributes`). Without them it had none: nothing
could be checkpointed, and FSDP2 gathered the whole model as one unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from torch import nn

Blocks = list[tuple[str, nn.Module]]

# A list of blocks holding less than this share of the largest list's parameters stays in the
# root unit: its own units would add collectives and free almost nothing.
_MIN_SHARE_OF_LARGEST = 0.1


def find_blocks(model: nn.Module) -> Blocks:
    """Return the repeated blocks of `model` as (qualified name, module), in forward order."""
    return blocks_and_notes(model)[0]


def blocks_and_notes(model: nn.Module) -> tuple[Blocks, list[str]]:
    """The blocks (`find_blocks`), and a note for the plan's reasons on each block left out
    because it shares a parameter with another unit."""
    found: Blocks = []
    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        found = _repeated(_outermost_of_classes(model, set(no_split)))
    if not found:
        found = _from_containers(model)
    if not found:
        found = _from_attributes(model)
    return without_shared(model, found)


def _outermost_of_classes(model: nn.Module, class_names: set[str]) -> Blocks:
    found: Blocks = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in class_names:
            continue
        # Skip a match nested inside an earlier match: only the outermost is a block.
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _repeated(blocks: Blocks) -> Blocks:
    """The blocks whose class occurs more than once: an embeddings module that
    `_no_split_modules` names (BERT, ViT) is one of a kind, not a repeated block."""
    counts = Counter(type(m) for _, m in blocks)
    return [(n, m) for n, m in blocks if counts[type(m)] > 1]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _members(container: nn.Module, name: str) -> Blocks:
    """The children of a ModuleList/Sequential that are blocks: all of them when they share one
    class; in a list of several classes, those of a class that repeats and that are layers of
    their own (a Sequential of Linear and activation layers is an MLP, not a list of blocks).
    None of a list of lists (Funnel-Transformer's stages of layers): a ModuleList has no
    forward, which FSDP2 and checkpointing wrap; the lists inside are each a list of blocks."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return []
    children = list(container.named_children())
    if any(isinstance(child, (nn.ModuleList, nn.ModuleDict)) for _, child in children):
        return []
    prefix = f"{name}." if name else ""  # the model itself may be the container
    counts = Counter(type(child) for _, child in children)
    if len(counts) == 1:
        members = children
    else:
        members = [
            (n, c)
            for n, c in children
            if counts[type(c)] > 1 and next(c.children(), None) is not None and _numel(c) > 0
        ]
    if len(members) < 2 or sum(_numel(c) for _, c in members) == 0:
        return []
    return [(prefix + n, c) for n, c in members]


def _groups(root: nn.Module, prefix: str) -> list[Blocks]:
    """The outermost lists of blocks under `root` (itself included), in forward order."""
    groups: list[Blocks] = []
    claimed: list[str] = []
    for name, module in root.named_modules(prefix=prefix):
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        members = _members(module, name)
        if members:
            groups.append(members)
            claimed += [n for n, _ in members]
    return groups


def _split(group: Blocks) -> Blocks:
    """`group`, or where one block holds most of its parameters, the blocks inside each of its
    blocks (a block without repeated blocks inside stays whole)."""
    sizes = [_numel(m) for _, m in group]
    if 2 * max(sizes) <= sum(sizes):
        return group
    split: Blocks = []
    for name, module in group:
        inner = [b for g in _groups(module, name) if g != [(name, module)] for b in _split(g)]
        split += inner or [(name, module)]
    return split


def _from_containers(model: nn.Module) -> Blocks:
    groups = _groups(model, "")
    if not groups:
        return []
    largest = max(sum(_numel(m) for _, m in g) for g in groups)
    kept = [g for g in groups if sum(_numel(m) for _, m in g) >= _MIN_SHARE_OF_LARGEST * largest]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted((b for g in kept for b in _split(g)), key=lambda b: order[b[0]])


def _from_attributes(model: nn.Module) -> Blocks:
    """The outermost submodules of each class the model repeats, where they are layers of their
    own (a module with children and parameters: not a Linear, not a list, which has no forward
    to wrap); a class whose instances hold less than `_MIN_SHARE_OF_LARGEST` of the largest
    class's parameters is left in the root unit. In the model's order."""
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if module is not model
        and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and next(module.children(), None) is not None
        and _numel(module) > 0
    ]
    counts = Counter(type(m) for _, m in layers)
    found: Blocks = []
    for name, module in layers:  # a parent before its children: the outermost is met first
        if counts[type(module)] > 1 and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    sizes: Counter[type] = Counter()
    for _, module in found:
        sizes[type(module)] += _numel(module)
    largest = max(sizes.values(), default=0)
    return [(n, m) for n, m in found if sizes[type(m)] >= _MIN_SHARE_OF_LARGEST * largest]


def _unit_of(name: str, block_names: Iterable[str]) -> str:
    return next((b for b in block_names if name == b or name.startswith(b + ".")), "")


def without_shared(model: nn.Module, blocks: Blocks) -> tuple[Blocks, list[str]]:
    """Leave out every block that shares a parameter with another unit (the root or another
    block): FSDP2 raises "Parameter ... is shared with a parameter already managed by another
    FSDP group" otherwise. Left out, a block's parameters belong to the root unit, its sharer's."""
    names = [n for n, _ in blocks]
    units: dict[int, dict[str, str]] = {}  # parameter -> unit -> a qualified name there
    for module_name, module in model.named_modules(remove_duplicate=False):
        unit = _unit_of(module_name, names)
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            units.setdefault(id(param), {}).setdefault(unit, full)
    notes: list[str] = []
    shared: set[str] = set()
    for where in units.values():
        if len(where) < 2:
            continue
        for unit in sorted(u for u in where if u and u not in shared):
            shared.add(unit)
            other = next(full for u, full in where.items() if u != unit)
            notes.append(
                f"{unit} is not a block: its parameter '{where[unit]}' is shared with "
                f"'{other}', so it stays in the root FSDP unit (FSDP2 needs tied parameters in "
                f"one unit)"
            )
    return [(n, m) for n, m in blocks if n not in shared], notes
