"""Which submodules are the repeated blocks: the units of sharding and of checkpointing."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the repeated blocks of `model` as (qualified name, module), in forward order.

    Hugging Face models name their blocks in `_no_split_modules` (class names); the outermost
    modules of those classes are the blocks. Otherwise the blocks are the children of the largest
    (by parameter count) `nn.ModuleList` / `nn.Sequential` whose children all share one class. A
    model with neither has no blocks and is handled as one unit.
    """
    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        blocks = _outermost_of_classes(model, set(no_split))
        if blocks:
            return blocks
    return _largest_uniform_container(model)


def _outermost_of_classes(model: nn.Module, class_names: set[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in class_names:
            continue
        # Skip a match nested inside an earlier match: only the outermost is a block.
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _largest_uniform_container(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    best_key = (0, 0)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        key = (numel, len(children))
        if numel > 0 and key > best_key:
            best_key = key
            prefix = f"{name}." if name else ""  # the model itself may be the container
            best = [(prefix + child_name, child) for child_name, child in children]
    return best
