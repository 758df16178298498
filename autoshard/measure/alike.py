"""Whether blocks of one class and shape also compute alike: what lets a deep model be simulated
at a few blocks and extended (`measure.simulate.shallow_depths`).

Equal parameter shapes are not enough. Transformers' decoders alternate sliding-window and
global attention in layers of one class and shape (Qwen2, Mistral, Gemma 2 and 3 through
`config.layer_types`; GPT-Neo's `attention_type`), and a copy with the first few blocks would
run only the first kinds: the extension would then stand for blocks it never ran (issue 24). The
difference lives in each layer's attributes (`self.sliding_window = ... if self.layer_type ==
"sliding_attention" else None`), so they are compared: every module's plain attributes (numbers,
strings, flags, None, tuples of them), the names of its callable ones (a partial's arguments
too) and each submodule's class (an activation chosen per layer has no parameters to tell it).
An attribute that counts the blocks (`layer_idx`: the block's position plus a constant) is no
difference. Attributes that differ without changing memory (timm's drop-path rates, which grow
with depth) cost the extension, never the estimate: such blocks are simulated whole.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_ABSENT = object()


def differing(blocks: list[nn.Module]) -> str | None:
    """The first attribute ("module.attribute" inside a block) whose value differs between the
    blocks beyond their position, or None where they compute alike."""
    described = [_describe(block) for block in blocks]
    for key in sorted(set().union(*described)):
        values = [d.get(key, _ABSENT) for d in described]
        if any(v != values[0] for v in values) and not _counts_blocks(values):
            return key
    return None


def _describe(block: nn.Module) -> dict[str, Any]:
    described: dict[str, Any] = {}
    for name, module in block.named_modules():
        described[f"{name}.__class__"] = type(module).__qualname__  # GELU or ReLU: no shapes
        for attr, value in vars(module).items():
            if _plain(value):
                described[f"{name}.{attr}"] = value
            elif callable(value) and not isinstance(value, nn.Module):
                described[f"{name}.{attr}"] = _callable(value)
    return described


def _callable(value: Any) -> Any:
    if isinstance(value, functools.partial):
        arguments = [a if _plain(a) else type(a).__qualname__ for a in value.args]
        keywords = {k: v if _plain(v) else type(v).__qualname__ for k, v in value.keywords.items()}
        return (_callable(value.func), tuple(arguments), tuple(sorted(keywords.items())))
    return getattr(value, "__qualname__", type(value).__qualname__)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _counts_blocks(values: list[Any]) -> bool:
    """Each block's value is its position plus one constant (a layer index)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return False
    return all(v - values[0] == i for i, v in enumerate(values))
