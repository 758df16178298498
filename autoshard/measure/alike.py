"""Whether blocks compute alike: what lets a deep model be simulated with a few of them and
extended (`measure.layout`).

Equal parameter shapes are not enough. Transformers' decoders alternate sliding-window and
global attention in layers of one class and shape (Qwen2, Mistral, Gemma 2 and 3 through
`config.layer_types`; GPT-Neo's `attention_type`), and a copy with the first few blocks would
run only the first kinds: the extension would then stand for blocks it never ran (issue 24). The
difference lives in each layer's attributes (`self.sliding_window = ... if self.layer_type ==
"sliding_attention" else None`), so they are compared: every module's plain attributes (numbers,
strings, flags, None, tuples of them), the names of its callable ones (a partial's arguments
too), each submodule's class (an activation chosen per layer has no parameters to tell it) and
every parameter's and buffer's shape, dtype and trainability. An attribute that counts the
blocks (`layer_idx`: one more per block) is no difference. Attributes that differ without
changing memory (timm's drop-path rates, which grow with depth) cost the extension, never the
estimate: such blocks are simulated whole.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_ABSENT = object()

# A block as compared: "module.attribute" inside the block -> its value
Described = dict[str, Any]


def describe(block: nn.Module) -> Described:
    """What tells `block` from another of its list: its modules' classes and plain and callable
    attributes, its parameters' and buffers' shapes."""
    described: Described = {}
    for name, module in block.named_modules():
        described[f"{name}.__class__"] = type(module).__qualname__  # GELU or ReLU: no shapes
        for attr, value in vars(module).items():
            if _plain(value):
                described[f"{name}.{attr}"] = value
            elif callable(value) and not isinstance(value, nn.Module):
                described[f"{name}.{attr}"] = _callable(value)
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        described[f"{name}.__tensor__"] = (
            tuple(tensor.shape),
            tensor.dtype,
            getattr(tensor, "requires_grad", False),
        )
    return described


def alike(a: Described, b: Described, apart: int = 1) -> bool:
    """Whether the blocks described compute alike, `apart` positions apart in their list."""
    return _difference(a, b, apart) is None


def differing(blocks: list[nn.Module]) -> str | None:
    """The first attribute ("module.attribute" inside a block) in which neighbouring `blocks`
    differ beyond their position, or None where they compute alike."""
    described = [describe(block) for block in blocks]
    for a, b in zip(described, described[1:], strict=False):
        key = _difference(a, b, 1)
        if key is not None:
            return key
    return None


def _difference(a: Described, b: Described, apart: int) -> str | None:
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if x != y and not _counts_blocks(x, y, apart):
            return key
    return None


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


def _counts_blocks(x: Any, y: Any, apart: int) -> bool:
    """The second block's value is the first's plus their distance (a layer index)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (x, y)):
        return False
    return bool(y - x == apart)
