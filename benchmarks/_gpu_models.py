"""The GPU suite's models and configurations: GPU-sized, and tiny for the dry run (CPU)."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch

FAKE_WORLD = 8
# AdamW's three implementations, each with its own temporaries (the first GPU run: under
# FULL_SHARD the estimate was +35% and +48% with foreach, -2% and -7% with the for-loop, +53%
# fused); "default" is `AdamW()` as the zoo makes it (foreach on CUDA).
OPTIMIZERS: dict[str, dict[str, bool]] = {
    "default": {},
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}

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
    # The families of the first GPU run's misses (`_gpu_families`), a few hundred M parameters
    # each at short sequences, so that each configuration takes seconds.
    # Qwen2-0.5B's width, heads (14, 2 KV, SDPA's enable_gqa) and vocabulary at half its depth:
    # 314M, 136M of them the tied embedding
    "qwen_gqa": (
        "gqa",
        4,
        dict(
            width=896,
            depth=12,
            heads=14,
            kv_heads=2,
            hidden=4864,
            seq_len=512,
            vocab_size=151936,
            bias=True,
        ),
    ),  # fmt: skip
    # Mixtral-shaped: 8 experts of width 1408 per block, each token to 2 on average: 363M
    "moe": (
        "moe",
        4,
        dict(
            width=1024,
            depth=8,
            heads=16,
            kv_heads=4,
            hidden=1408,
            seq_len=512,
            vocab_size=32000,
            tied=False,
            experts=8,
            top_k=2,
            repeat=True,
        ),
    ),  # fmt: skip
    # a 256k vocabulary (Gemma's) tied: 262M of its 331M parameters are the embedding
    "big_vocab": (
        "big_vocab",
        2,
        dict(
            width=1024,
            depth=6,
            heads=16,
            kv_heads=8,
            hidden=2752,
            seq_len=512,
            vocab_size=256000,
            repeat=True,
        ),
    ),  # fmt: skip
    # BART-large's width, heads and vocabulary at half its depth (6 + 6 blocks): 227M
    "enc_dec": (
        "enc_dec",
        8,
        dict(
            width=1024,
            layers=6,
            heads=16,
            hidden=4096,
            source_len=512,
            target_len=128,
            vocab_size=50265,
        ),
    ),  # fmt: skip
    # a 593M Llama-shaped decoder frozen, rank-16 adapters on q, k, v, o (2.4M trainable)
    "lora": (
        "lora",
        4,
        dict(
            width=2048,
            depth=12,
            heads=16,
            kv_heads=4,
            hidden=5504,
            seq_len=512,
            vocab_size=32000,
            repeat=True,
            rank_r=16,
        ),
    ),  # fmt: skip
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
    "qwen_gqa": ("gqa", 2, dict(heads=4, kv_heads=2, bias=True)),
    "moe": ("moe", 2, dict(tied=False, experts=4, top_k=2, repeat=True)),
    "big_vocab": ("big_vocab", 2, dict(vocab_size=4096, repeat=True)),
    "enc_dec": ("enc_dec", 2, {}),
    "lora": ("lora", 2, dict(repeat=True, rank_r=4)),
}
FAMILIES = ("qwen_gqa", "moe", "big_vocab", "enc_dec", "lora")


class Config(NamedTuple):
    """One measured configuration; world 1 runs in a one-rank group, world 8 on the fake one."""

    model: str
    world: int
    strategy: str
    checkpoint_all: bool = False  # every block checkpointed
    optimizer: str = "default"  # a key of OPTIMIZERS


def _family_rows(world: int) -> list[Config]:
    """Each family at `world`: LOCAL (world 1 only), then FULL_SHARD with each implementation
    of AdamW. By world, not by family: a run of world-1 rows shares one process group."""
    rows = []
    for name in FAMILIES:
        rows += [Config(name, 1, "local", optimizer="foreach")] if world == 1 else []
        rows += [
            Config(name, world, "full_shard", optimizer=o) for o in OPTIMIZERS if o != "default"
        ]
    return rows


# In the order they run: the most telling first, since the section's time budget skips what it
# cannot hold: the first run's rows, each new family's, then the first run's less telling ones.
GPU_CONFIGS: list[Config] = [Config(*c) for c in [
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
    # the first run's -6.0% (the depth extension's moving peak, fixed on the CPU since)
    ("llama_1b", FAKE_WORLD, "full_shard", True),
]] + _family_rows(1) + _family_rows(FAKE_WORLD) + [Config(*c) for c in [
    ("gpt2_medium", 1, "ddp", False),
    ("gpt2_medium", 1, "shard_grad_op", False),
    ("resnet", 1, "full_shard", False),
    ("vit_large", 1, "full_shard", False),
    ("llama_1b", 1, "full_shard", True),
]]  # fmt: skip
# One configuration per code path (LOCAL, FSDP2 on a one-rank group, FSDP2 at world 8 on the
# fake one), and every family and AdamW implementation at least once.
DRY_CONFIGS: list[Config] = [
    Config("gpt2_medium", 1, "local"),
    Config("resnet", 1, "full_shard"),
    Config("qwen_gqa", 1, "local", optimizer="for-loop"),
    Config("moe", 1, "full_shard", optimizer="fused"),
    Config("lora", 1, "full_shard", optimizer="foreach"),
    Config("llama_1b", FAKE_WORLD, "full_shard"),
    Config("big_vocab", FAKE_WORLD, "full_shard", optimizer="fused"),
    Config("enc_dec", FAKE_WORLD, "full_shard", optimizer="for-loop"),
]


def models_for(dry_run: bool) -> dict[str, tuple[str, int, dict[str, Any]]]:
    return DRY_MODELS if dry_run else GPU_MODELS


def configs(dry_run: bool) -> list[Config]:
    return DRY_CONFIGS if dry_run else GPU_CONFIGS


def build(
    name: str, models: dict[str, Any], device: torch.device, optimizer: str = "default"
) -> Any:
    """Model `name` from `models` on `device`, a fresh AdamW over its trainable parameters
    (implementation `optimizer`, a key of OPTIMIZERS), its batch and loss.

    Built once per process on the host (`zoo.build`; initialising a 1B model there takes
    seconds) and copied for each configuration, which wraps and trains its own copy."""
    import _gpu_families
    import zoo

    key = (name, repr(models[name]))
    if key not in _MASTERS:
        kind, batch, sizes = models[name]
        builder = _gpu_families.BUILDERS.get(kind) or zoo.BUILDERS[kind]
        _MASTERS[key] = builder(batch, device=torch.device("cpu"), **sizes)
    master = _MASTERS[key]
    model = copy.deepcopy(master.model).to(device)  # tied parameters stay tied
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(trainable, lr=1e-3, **OPTIMIZERS[optimizer])
    batch = tuple(t.to(device) for t in master.batch)
    return zoo.ZooModel(model, adamw, batch, master.loss_fn)


_MASTERS: dict[tuple[str, str], Any] = {}
