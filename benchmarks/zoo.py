"""Model zoo for the benchmarks: small models whose repeated blocks sit in an `nn.ModuleList`.

Every builder has the same signature, `build(per_rank_batch, *, rank=0, seed=0, device=cpu,
**size)`, and returns a `ZooModel(model, optimizer, batch, loss_fn)`: the model built from `seed`
(identical on every rank), an AdamW on its parameters, one batch as `rank` feeds it, and the loss
`loss_fn(output, batch)` that both `autoshard.prepare`'s trial step and the timed loop use.

The default sizes make one step take tens to a few hundred ms on one CPU core per rank:

- `gpt`: the demo's GPT-2-style decoder (`autoshard._demo.GPT`, 0.9M parameters, 4 blocks).
- `mlp`: a plain stack of residual MLP blocks; many parameters for little compute, so the
  strategies differ mostly in communication and memory.
- `vit`: a ViT-style encoder (patch embedding, class token, pre-LN transformer blocks, head).
  `vit_large(...)` gives ViT-Large's shape (width 1024, 24 blocks, 16 heads, patch 16, 224 px);
  `benchmarks/ddp_vs_fsdp.py` shrinks its depth and image size on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autoshard._demo import GPT, GPTConfig

LossFn = Callable[[Any, Any], torch.Tensor]


class ZooModel(NamedTuple):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, ...]
    loss_fn: LossFn


def _generator(seed: int, rank: int) -> torch.Generator:
    # every rank its own data, the same from run to run
    return torch.Generator().manual_seed(10_007 * seed + 101 * rank + 1)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def classification_loss(output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of logits against the batch's labels (its last element), in fp32."""
    return F.cross_entropy(output.float(), batch[-1])


def gpt_loss(output: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The demo GPT computes its own next-token loss from the targets it is given."""
    loss: torch.Tensor = output.loss
    return loss


# ---------------------------------------------------------------------------------------------
# GPT


def build_gpt(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    d_model: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    seq_len: int = 64,
    vocab_size: int = 256,
) -> ZooModel:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=vocab_size, block_size=seq_len, d_model=d_model, n_layer=n_layer, n_head=n_head
    )
    model = GPT(cfg).to(device)
    g = _generator(seed, rank)
    tokens = torch.randint(vocab_size, (per_rank_batch, seq_len + 1), generator=g)
    batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
    return ZooModel(model, _adamw(model), batch, gpt_loss)


# ---------------------------------------------------------------------------------------------
# MLP


class MLPBlock(nn.Module):
    """Pre-LN residual MLP block: x + W2 gelu(W1 ln(x))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, hidden: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_mlp(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    in_features: int = 256,
    width: int = 512,
    hidden: int = 1024,
    depth: int = 6,
    classes: int = 16,
) -> ZooModel:
    torch.manual_seed(seed)
    model = MLP(in_features, width, hidden, depth, classes).to(device)
    g = _generator(seed, rank)
    x = torch.randn(per_rank_batch, in_features, generator=g)
    y = torch.randint(classes, (per_rank_batch,), generator=g)
    return ZooModel(model, _adamw(model), (x.to(device), y.to(device)), classification_loss)


# ---------------------------------------------------------------------------------------------
# ViT


class ViTBlock(nn.Module):
    """Pre-LN transformer encoder block (ViT): x + MHSA(ln(x)), then x + MLP(ln(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be divisible by heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v)  # bidirectional: an encoder
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(
        self, image_size: int, patch: int, width: int, depth: int, heads: int, classes: int
    ) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size={image_size} must be a multiple of patch={patch}")
        tokens = (image_size // patch) ** 2 + 1  # patches plus the class token
        self.patch_embed = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, width)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build_vit(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    image_size: int = 64,
    patch: int = 16,
    width: int = 256,
    depth: int = 6,
    heads: int = 4,
    classes: int = 100,
) -> ZooModel:
    torch.manual_seed(seed)
    model = ViT(image_size, patch, width, depth, heads, classes).to(device)
    g = _generator(seed, rank)
    images = torch.randn(per_rank_batch, 3, image_size, image_size, generator=g)
    labels = torch.randint(classes, (per_rank_batch,), generator=g)
    return ZooModel(
        model, _adamw(model), (images.to(device), labels.to(device)), classification_loss
    )


# ViT-Large/16 (Dosovitskiy et al. 2021, table 1): 24 blocks, width 1024, MLP 4096, 16 heads.
VIT_LARGE = dict(width=1024, depth=24, heads=16, patch=16, image_size=224, classes=1000)


def build_vit_large(per_rank_batch: int, **kwargs: Any) -> ZooModel:
    """ViT-L/16 at 224 px (304M parameters); keyword arguments override its shape."""
    return build_vit(per_rank_batch, **{**VIT_LARGE, **kwargs})


BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "gpt": build_gpt,
    "mlp": build_mlp,
    "vit": build_vit,
    "vit_large": build_vit_large,
}
# per-rank batch each model is benchmarked with by default
DEFAULT_BATCH = {"gpt": 8, "mlp": 32, "vit": 8, "vit_large": 4}


def build(name: str, per_rank_batch: int | None = None, **kwargs: Any) -> ZooModel:
    """Build zoo model `name` with its default per-rank batch unless one is given."""
    if name not in BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {', '.join(BUILDERS)}")
    batch = DEFAULT_BATCH[name] if per_rank_batch is None else per_rank_batch
    return BUILDERS[name](batch, **kwargs)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
