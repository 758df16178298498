"""Model zoo for the benchmarks: small models whose repeated blocks sit in an `nn.ModuleList`.

Every builder has the same signature, `build(per_rank_batch, *, rank=0, seed=0, device=cpu,
**size)`, and returns a `ZooModel(model, optimizer, batch, loss_fn)`: the model built from `seed`
(identical on every rank), an AdamW on its parameters, one batch as `rank` feeds it, and the loss
`loss_fn(output, batch)` that both `autoshard.prepare`'s trial step and the timed loop use.

The default sizes make one step take tens to a few hundred ms on one CPU core per rank:

- `gpt`: the demo's GPT-2-style decoder (`autoshard.cli.demo.GPT`, 0.9M parameters, 4 blocks).
- `mlp`: a plain stack of residual MLP blocks; many parameters for little compute, so the
  strategies differ mostly in communication and memory.
- `vit`: a ViT-style encoder (patch embedding, class token, pre-LN transformer blocks, head).
  `vit_large(...)` gives ViT-Large's shape (width 1024, 24 blocks, 16 heads, patch 16, 224 px);
  `benchmarks/ddp_vs_fsdp.py` shrinks its depth and image size on CPU.
- `llama`: a Llama-style decoder (RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query
  attention, input and output embeddings tied: `lm_head.weight is embed.weight`); 0.8M parameters.
- `resnet`: a ResNet-style CNN (stem conv + BatchNorm, residual basic blocks in one
  `nn.Sequential`, global-average-pooled head); activations dominate its memory, and its
  BatchNorm running statistics are buffers, not parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.cli.demo import GPT, GPTConfig

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


# ---------------------------------------------------------------------------------------------
# Llama


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistic in fp32 (Zhang & Sennrich 2019; Llama's norm)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10_000.0) -> torch.Tensor:
    """(2, seq_len, head_dim): cos and sin of RoPE's angles (Su et al. 2021), halves repeated as
    Llama's `rotate_half` layout expects."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    """Pre-RMSNorm decoder block: x + attn(norm(x)) with RoPE and grouped-query attention, then
    x + W2(silu(W1 norm(x)) * W3 norm(x)) (SwiGLU, Shazeer 2020). No biases, as in Llama."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        if width % heads or heads % kv_heads:
            raise ValueError(
                f"width={width} must be divisible by heads={heads}, and heads by "
                f"kv_heads={kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.attn_norm = RMSNorm(width)
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.mlp_norm = RMSNorm(width)
        self.w1 = nn.Linear(width, hidden, bias=False)  # gate
        self.w3 = nn.Linear(width, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, width, bias=False)  # down

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0, :t].to(x.dtype), rope[1, :t].to(x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.heads // self.kv_heads  # each key/value head serves `repeat` query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        width: int,
        depth: int,
        heads: int,
        kv_heads: int,
        seq_len: int,
        hidden: int | None = None,
    ) -> None:
        super().__init__()
        if hidden is None:
            hidden = 32 * -(-(8 * width // 3) // 32)  # Llama's 8/3 x width, rounded up to 32
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(
            LlamaBlock(width, heads, kv_heads, hidden) for _ in range(depth)
        )
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one parameter, two uses
        # not a parameter and not saved: derived from the shape, as Llama's rotary embedding
        self.register_buffer("rope", rotary_tables(seq_len, width // heads), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope)
        return self.lm_head(self.norm(x))


def lm_loss(output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross-entropy of (B, T, vocab) logits against the batch's targets, in fp32."""
    return F.cross_entropy(output.float().flatten(0, 1), batch[-1].flatten())


def build_llama(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    width: int = 128,
    depth: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 64,
    vocab_size: int = 512,
) -> ZooModel:
    torch.manual_seed(seed)
    model = Llama(vocab_size, width, depth, heads, kv_heads, seq_len).to(device)
    g = _generator(seed, rank)
    tokens = torch.randint(vocab_size, (per_rank_batch, seq_len + 1), generator=g)
    batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
    return ZooModel(model, _adamw(model), batch, lm_loss)


# ---------------------------------------------------------------------------------------------
# ResNet


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016): relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)),
    the shortcut a strided 1x1 conv + BN where the shape changes."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks = []
        inp = widths[0]
        for stage, width in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1  # each later stage halves the size
                blocks.append(BasicBlock(inp, width, stride))
                inp = width
        # one container of one class: the repeated blocks autoshard shards and checkpoints
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(inp, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return self.head(x.mean(dim=(2, 3)))  # global average pooling


def build_resnet(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    image_size: int = 32,
    widths: tuple[int, ...] = (16, 32, 64),
    blocks_per_stage: int = 2,
    classes: int = 10,
) -> ZooModel:
    torch.manual_seed(seed)
    model = ResNet(widths, blocks_per_stage, classes).to(device)
    g = _generator(seed, rank)
    images = torch.randn(per_rank_batch, 3, image_size, image_size, generator=g)
    labels = torch.randint(classes, (per_rank_batch,), generator=g)
    return ZooModel(
        model, _adamw(model), (images.to(device), labels.to(device)), classification_loss
    )


BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "gpt": build_gpt,
    "mlp": build_mlp,
    "vit": build_vit,
    "vit_large": build_vit_large,
    "llama": build_llama,
    "resnet": build_resnet,
}
# per-rank batch each model is benchmarked with by default
DEFAULT_BATCH = {"gpt": 8, "mlp": 32, "vit": 8, "vit_large": 4, "llama": 8, "resnet": 16}


def build(name: str, per_rank_batch: int | None = None, **kwargs: Any) -> ZooModel:
    """Build zoo model `name` with its default per-rank batch unless one is given."""
    if name not in BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {', '.join(BUILDERS)}")
    batch = DEFAULT_BATCH[name] if per_rank_batch is None else per_rank_batch
    return BUILDERS[name](batch, **kwargs)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
