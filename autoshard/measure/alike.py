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
blocks of the list (`layer_idx`: its position plus one constant, in every block that holds it)
is no difference; any other int must be equal (a top-k of 1 in some layers, 2 in others is not
a layer index, though it steps by one). Attributes that differ without
changing memory (timm's drop-path rates, which grow with depth) cost the extension, never the
estimate: such blocks are simulated whole. What blocks hold cannot tell a block that computes by
its position alone (`layer_idx % 4` in its forward, or a parent calling every sixth differently):
`measure.operators` checks blocks found alike here against the operators they run.
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


def counting(described: list[Described]) -> frozenset[str]:
    """The attributes that count the blocks of one list (`layer_idx`): an int in every block that
    has it, at least `COUNTED_IN` of them, its position in the list plus one constant. Only these
    may differ between blocks alike, and only in value: a block with one and a block without are
    unlike. Not only those in every block: a hybrid decoder's attention keeps its `layer_idx`
    where its other mixers keep none (Jamba, LFM2, Qwen3-Next, RecurrentGemma: attention every
    second layer), and its blocks never matched one period apart, so each was simulated whole."""
    holders: dict[str, list[int]] = {}
    for i, d in enumerate(described):
        for key in d:
            holders.setdefault(key, []).append(i)
    return frozenset(
        key
        for key, at in holders.items()
        if len(at) >= COUNTED_IN
        and all(_is_int(described[i][key]) for i in at)
        and len({described[i][key] - i for i in at}) == 1
    )


# Blocks that must hold an attribute for it to count them: two stepping by their distance could
# be anything (a top-k of 2 and 3 in the last two layers); three in step are a position.
COUNTED_IN = 3


def alike(a: Described, b: Described, counted: frozenset[str] = frozenset()) -> bool:
    """Whether the blocks described compute alike: equal but for the `counted` attributes."""
    return _difference(a, b, counted) is None


def differing(blocks: list[nn.Module]) -> str | None:
    """The first attribute ("module.attribute" inside a block) in which neighbouring `blocks`
    differ beyond their position, or None where they compute alike."""
    described = [describe(block) for block in blocks]
    counted = counting(described)
    for a, b in zip(described, described[1:], strict=False):
        key = _difference(a, b, counted)
        if key is not None:
            return key
    return None


def _difference(a: Described, b: Described, counted: frozenset[str]) -> str | None:
    for key in sorted(a.keys() | b.keys()):
        mine, theirs = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if mine != theirs and (key not in counted or _ABSENT in (mine, theirs)):
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
