"""The GPU suite's model families that broke the estimate on the first GPU run, in plain torch
(no transformers or peft, so that the dry run needs neither): each builder has the zoo's
signature, `build(per_rank_batch, *, rank=0, seed=0, device=cpu, **size)` -> `zoo.ZooModel`.

- `gqa`: a Qwen2-shaped decoder: grouped-query attention through
  `F.scaled_dot_product_attention(..., enable_gqa=True)` (key/value heads not repeated, as
  transformers' SDPA path calls it), biases on q/k/v, input and output embeddings tied.
- `moe`: a Mixtral-shaped decoder whose MLP is a mixture of experts held as stacked 3-D
  parameters (experts x in x out, as transformers 5 holds them), routed by expert choice
  (Zhou et al. 2022: each expert takes its top `capacity` tokens, so every shape is static),
  untied head.
- `big_vocab`: a decoder with a 256k vocabulary (Gemma's), embedding and head tied, key/value
  heads repeated before SDPA: the embedding is most of its parameters.
- `enc_dec`: a BART-shaped encoder-decoder (pre-LN, cross-attention, one embedding shared by
  encoder, decoder and head), its two block stacks in two `nn.ModuleList`s.
- `lora`: the `gqa` decoder frozen, with rank-r adapters beside q, k, v and o (LoRA, Hu et al.
  2021): only the adapters train, so gradients and optimizer state are a sliver of the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo import RMSNorm, ZooModel, _generator, apply_rotary, lm_loss, rotary_tables


class Attention(nn.Module):
    """Self- or cross-attention with `kv_heads` <= `heads` key/value heads: repeated to `heads`
    (`repeat=True`, Llama's `repeat_kv`) or handed to SDPA as they are (`enable_gqa`)."""

    def __init__(
        self, width: int, heads: int, kv_heads: int, *, bias: bool = False, repeat: bool = False
    ) -> None:
        super().__init__()
        if width % heads or heads % kv_heads:
            raise ValueError(f"width={width}, heads={heads}, kv_heads={kv_heads} do not divide")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.repeat = repeat
        self.wq = nn.Linear(width, width, bias=bias)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        rope: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        b, t, c = x.shape
        source = x if memory is None else memory
        s = source.shape[1]
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(source).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(source).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0, :t].to(q.dtype), rope[1, :t].to(q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.kv_heads != self.heads
        if gqa and self.repeat:
            n = self.heads // self.kv_heads
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=gqa and not self.repeat
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)  # gate
        self.w3 = nn.Linear(width, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, width, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """SwiGLU experts as stacked (experts, in, out) parameters, routed by expert choice: expert
    e runs on its `capacity` highest-scoring tokens, each output weighted by its router score."""

    def __init__(self, width: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, width, hidden) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        scores = self.router(tokens).float().softmax(dim=-1)  # (tokens, experts)
        capacity = b * t * self.top_k // scores.shape[1]  # on average top_k experts a token
        weight, index = scores.t().topk(capacity, dim=-1)  # (experts, capacity)
        picked = tokens[index]  # (experts, capacity, width)
        w1, w3, w2 = (w.to(picked.dtype) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch.bmm(picked, w1)) * torch.bmm(picked, w3)
        out = torch.bmm(h, w2) * weight.unsqueeze(-1).to(h.dtype)
        y = torch.zeros_like(tokens).index_add_(0, index.flatten(), out.flatten(0, 1).to(x.dtype))
        return y.view(b, t, c)


class DecoderBlock(nn.Module):
    """Pre-RMSNorm: x + attn(norm(x)) with RoPE, then x + mlp(norm(x)) (SwiGLU or experts)."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, **kw: Any) -> None:
        super().__init__()
        experts, top_k = kw.pop("experts", 0), kw.pop("top_k", 2)
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.attn = Attention(width, heads, kv_heads, **kw)
        self.mlp = Experts(width, hidden, experts, top_k) if experts else SwiGLU(width, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope=rope)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(
        self, vocab: int, width: int, depth: int, heads: int, seq_len: int, *, tied: bool, **kw: Any
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads, **kw) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight  # one parameter, two uses
        self.register_buffer("rope", rotary_tables(seq_len, width // heads), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope)
        return self.lm_head(self.norm(x))


def _lm(model: nn.Module, batch: int, seq_len: int, vocab: int, rank: int, seed: int) -> Any:
    tokens = torch.randint(vocab, (batch, seq_len + 1), generator=_generator(seed, rank))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _zoo(model: nn.Module, batch: tuple[torch.Tensor, ...], device: Any, loss: Any) -> ZooModel:
    model = model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    return ZooModel(model, optimizer, tuple(t.to(device) for t in batch), loss)


def build_decoder(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    vocab_size: int = 256,
    width: int = 64,
    depth: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 128,
    seq_len: int = 32,
    tied: bool = True,
    **kw: Any,
) -> ZooModel:
    """`gqa`, `moe` and `big_vocab`: one decoder, shaped by its keywords (`experts`, `top_k`,
    `bias` on q/k/v, `repeat` the key/value heads)."""
    torch.manual_seed(seed)
    model = Decoder(
        vocab_size, width, depth, heads, seq_len, tied=tied, kv_heads=kv_heads, hidden=hidden, **kw
    )
    return _zoo(model, _lm(model, per_rank_batch, seq_len, vocab_size, rank, seed), device, lm_loss)


class LoRALinear(nn.Module):
    """base(x) + B(A(x)) * alpha / r, `base` frozen; B starts at zero (the adapted model starts
    as the base)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def build_lora(per_rank_batch: int, *, rank_r: int = 16, **kw: Any) -> ZooModel:
    """The `gqa` decoder frozen, adapters of rank `rank_r` on every attention projection."""
    device = kw.pop("device", "cpu")
    base = build_decoder(per_rank_batch, device=device, **kw)
    model = base.model.requires_grad_(False)
    for block in model.blocks:
        for name in ("wq", "wk", "wv", "wo"):
            setattr(block.attn, name, LoRALinear(getattr(block.attn, name), rank_r))
    return _zoo(model, base.batch, device, lm_loss)


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, cross: bool) -> None:
        super().__init__()
        self.self_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, heads, bias=True)
        self.cross_norm = nn.LayerNorm(width) if cross else None
        self.cross = Attention(width, heads, heads, bias=True) if cross else None
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.self_norm(x), causal=memory is not None)
        if self.cross is not None and self.cross_norm is not None:
            x = x + self.cross(self.cross_norm(x), memory=memory, causal=False)
        return x + self.mlp(self.mlp_norm(x))


class EncoderDecoder(nn.Module):
    """Source and target token ids in, target logits out; one embedding for both sides and the
    head (BART's), learned positions."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(1024, width)
        self.encoder = nn.ModuleList(
            EncoderBlock(width, heads, hidden, False) for _ in range(layers)
        )
        self.decoder = nn.ModuleList(
            EncoderBlock(width, heads, hidden, True) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def _in(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.positions.weight[: tokens.shape[1]]

    def forward(
        self, source: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        memory = self._in(source)
        for block in self.encoder:
            memory = block(memory)
        x = self._in(target)
        for block in self.decoder:
            x = block(x, memory)
        return self.lm_head(self.norm(x))


def build_enc_dec(
    per_rank_batch: int,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    vocab_size: int = 256,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    hidden: int = 256,
    source_len: int = 32,
    target_len: int = 16,
) -> ZooModel:
    torch.manual_seed(seed)
    model = EncoderDecoder(vocab_size, width, layers, heads, hidden)
    g = _generator(seed, rank)
    source = torch.randint(vocab_size, (per_rank_batch, source_len), generator=g)
    target = torch.randint(vocab_size, (per_rank_batch, target_len + 1), generator=g)
    batch = (source, target[:, :-1].contiguous(), target[:, 1:].contiguous())
    return _zoo(model, batch, device, lm_loss)


BUILDERS = {
    "gqa": build_decoder,
    "moe": build_decoder,
    "big_vocab": build_decoder,
    "enc_dec": build_enc_dec,
    "lora": build_lora,
}
