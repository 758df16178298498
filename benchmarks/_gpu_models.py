"""The GPU suite's models and configurations: GPU-sized, and tiny for the dry run (CPU)."""

from __future__ import annotations

import copy
from typing import Any

import torch

FAKE_WORLD = 8

# name: (zoo builder, per-rank batch, sizes); GPU sizes, then the dry run's (CPU, tiny).
GPU_MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    # TinyLlama-1.1B's shape (22 blocks of width 2048, 32 heads, 4 KV heads; the zoo's SwiGLU
    # width is 8/3 x 2048 = 5472, not 5632): 1.01B parameters, input and output embeddings tied
    "llama_1b": (
        "llama",
        1,
        dict(width=2048, depth=22, heads=32, kv_heads=4, seq_len=2048, vocab_size=32000),
    ),
    # GPT-2 medium (355M): 24 blocks of width 1024, 16 heads, context 1024
    "gpt2_medium": (
        "gpt",
        8,
        dict(d_model=1024, n_layer=24, n_head=16, seq_len=1024, vocab_size=50257),
    ),
    "vit_large": ("vit_large", 32, {}),  # ViT-L/16 at 224 px (304M)
    # ResNet-shaped: ResNet-50's stage widths at 224 px, basic blocks (3 per stage), cuDNN convs
    "resnet": (
        "resnet",
        64,
        dict(image_size=224, widths=(64, 128, 256, 512), blocks_per_stage=3, classes=1000),
    ),
}
DRY_MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama_1b": (
        "llama",
        2,
        dict(width=64, depth=2, heads=4, kv_heads=2, seq_len=32, vocab_size=128),
    ),
    "gpt2_medium": ("gpt", 2, dict(d_model=64, n_layer=2, n_head=4, seq_len=32, vocab_size=128)),
    "vit_large": (
        "vit",
        2,
        dict(image_size=32, patch=8, width=64, depth=2, heads=4, classes=10),
    ),
    "resnet": ("resnet", 4, dict(image_size=16, widths=(8, 16), blocks_per_stage=1, classes=10)),
}
# (model, world size, strategy, every block checkpointed), in the order they run: the most
# telling first, since the section's time budget skips what it cannot hold. World 1 runs in a
# one-rank group, world 8 on the fake group.
GPU_CONFIGS: list[tuple[str, int, str, bool]] = [
    ("llama_1b", 1, "local", False),
    ("llama_1b", 1, "full_shard", False),
    ("gpt2_medium", 1, "local", False),
    ("gpt2_medium", 1, "full_shard", False),
    ("resnet", 1, "local", False),
    ("vit_large", 1, "local", False),
    ("llama_1b", FAKE_WORLD, "full_shard", False),
    ("llama_1b", FAKE_WORLD, "shard_grad_op", False),
    ("gpt2_medium", FAKE_WORLD, "full_shard", False),
    ("resnet", FAKE_WORLD, "full_shard", False),
    ("vit_large", FAKE_WORLD, "full_shard", False),
    ("gpt2_medium", 1, "ddp", False),
    ("gpt2_medium", 1, "shard_grad_op", False),
    ("resnet", 1, "full_shard", False),
    ("vit_large", 1, "full_shard", False),
    ("llama_1b", 1, "full_shard", True),
    ("llama_1b", FAKE_WORLD, "full_shard", True),
]
# One configuration per code path: LOCAL, FSDP2 on a one-rank group, FSDP2 at world 8 (fake).
DRY_CONFIGS: list[tuple[str, int, str, bool]] = [
    ("gpt2_medium", 1, "local", False),
    ("resnet", 1, "full_shard", False),
    ("llama_1b", FAKE_WORLD, "full_shard", False),
]


def models_for(dry_run: bool) -> dict[str, tuple[str, int, dict[str, Any]]]:
    return DRY_MODELS if dry_run else GPU_MODELS


def configs(dry_run: bool) -> list[tuple[str, int, str, bool]]:
    return DRY_CONFIGS if dry_run else GPU_CONFIGS


def build(name: str, models: dict[str, Any], device: torch.device) -> Any:
    """Model `name` from `models` on `device`, a fresh AdamW over it, its batch and loss.

    Built once per process on the host (`zoo.build`; initialising a 1B model there takes
    seconds) and copied for each configuration, which wraps and trains its own copy."""
    import zoo

    key = (name, repr(models[name]))
    if key not in _MASTERS:
        kind, batch, sizes = models[name]
        _MASTERS[key] = zoo.build(kind, batch, device=torch.device("cpu"), **sizes)
    master = _MASTERS[key]
    model = copy.deepcopy(master.model).to(device)  # tied parameters stay tied
    optimizer = zoo._adamw(model)  # as every zoo builder makes it
    batch = tuple(t.to(device) for t in master.batch)
    return zoo.ZooModel(model, optimizer, batch, master.loss_fn)


_MASTERS: dict[tuple[str, str], Any] = {}
