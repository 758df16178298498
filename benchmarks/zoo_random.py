"""Random hand-written models, one per seed: held-out models for the estimator, each combining
choices no zoo entry combines (`benchmarks/estimate_accuracy.py --zoo benchmarks/zoo_random.py`).

Entry `r<seed>` is a sequence model whose blocks sit in one ModuleList (autoshard's blocks), drawn
from `random.Random(seed)`:

- input: token ids through an embedding, or dense features through a linear layer; a positional
  table as a buffer (persistent or not) or none;
- 2 to 20 blocks (16 and more: simulated shallow and extended), pre- or post-norm, LayerNorm,
  an RMSNorm written out (an fp32 island under autocast) or none;
- attention through `scaled_dot_product_attention` or written out (the score matrix, a mask,
  softmax), causal or not, with dropout or not, grouped-query (keys and values repeated) or
  not; blocks alternating with attention-free ones; a pyramid whose second half is twice as
  wide (and, for a classifier, half as long);
- an MLP, gated or not, GELU (exact or tanh), ReLU or SiLU (in place or not), dropout;
- a language-model head (tied to the embedding or not) or a pooled classifier; the first block
  frozen or not;
- the optimizer: AdamW, Adam with AMSGrad, SGD with momentum, RMSprop, Adagrad (its state made
  as it is built) or NAdam, over one group or the usual two (decayed matrices first, then the
  embedding, biases and norms).

`describe(seed)` says what a seed drew. The batch is 2 or 4 sequences of 16, 32 or 64 positions.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZooModel

VOCAB = 300
FEATURES = 24
CLASSES = 10
MAX_POSITIONS = 64
# entries r0 .. r<SEEDS - 1>; any other seed builds as well (`build("r1234", ...)`)
SEEDS = 200


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * scale.to(x.dtype) * self.weight


def _norm(kind: str, width: int) -> nn.Module:
    return {"layer": nn.LayerNorm(width), "rms": RMSNorm(width), "none": nn.Identity()}[kind]


class Attention(nn.Module):
    def __init__(self, width: int, spec: dict[str, Any], bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads = spec["heads"], spec["kv_heads"]
        self.head_dim = width // self.heads
        self.causal, self.dropout = spec["causal"], spec["attn_dropout"]
        self.q = nn.Linear(width, width, bias=bias)
        self.k = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width)
        self.written_out = spec["written_out"]  # the score matrix made and kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.written_out:
            scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
            if self.causal:
                above = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(above, float("-inf"))
            y = F.dropout(scores.softmax(-1), dropout, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int, spec: dict[str, Any]) -> None:
        super().__init__()
        hidden = width * spec["mult"]
        self.up = nn.Linear(width, hidden)
        self.gate = nn.Linear(width, hidden, bias=False) if spec["gated"] else None
        self.down = nn.Linear(hidden, width)
        self.act = {
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU("tanh"),
            "relu": nn.ReLU(inplace=spec["inplace"]),
            "silu": nn.SiLU(inplace=spec["inplace"]),
        }[spec["act"]]
        self.drop = nn.Dropout(spec["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = self.act(self.gate(x)) * h if self.gate is not None else self.act(h)
        return self.drop(self.down(h))


class Block(nn.Module):
    def __init__(self, width: int, spec: dict[str, Any], attention: bool, rng: random.Random):
        super().__init__()
        self.pre_norm = spec["pre_norm"]
        self.attn = Attention(width, spec, bias=rng.random() < 0.5) if attention else None
        # an attention-free block has no first norm: no parameter is left without a gradient
        self.norm1 = _norm(spec["norm"], width) if attention else None
        self.norm2 = _norm(spec["norm"], width)
        self.mlp = MLP(width, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn is not None and self.norm1 is not None:
            x = x + self.attn(self.norm1(x)) if self.pre_norm else self.norm1(x + self.attn(x))
        return x + self.mlp(self.norm2(x)) if self.pre_norm else self.norm2(x + self.mlp(x))


class Widen(nn.Module):
    """A pyramid's stage change: twice the width, and half the length where `pool`."""

    def __init__(self, width: int, pool: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool:
            x = F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)
        return self.proj(x)


def draw(seed: int) -> dict[str, Any]:
    """What seed `seed` builds (`RandomNet`), its optimizer and its batch."""
    r = random.Random(seed)
    tokens = r.random() < 0.7
    spec: dict[str, Any] = {
        "width": r.choice([32, 48, 64, 96, 128]),
        "tokens": tokens,
        "language_model": tokens and r.random() < 0.7,
        "positions": r.choice(["persistent", "buffer", "none"]),
        "depth": r.choice([2, 3, 4, 6, 8, 12, 16, 17, 20]),
        "pre_norm": r.random() < 0.8,
        "norm": r.choice(["layer", "layer", "rms", "none"]),
        "heads": r.choice([2, 4]),
        "causal": r.random() < 0.6,
        "attn_dropout": r.choice([0.0, 0.0, 0.1]),
        "written_out": r.random() < 0.3,
        "alternate": r.random() < 0.2,
        "mult": r.choice([2, 4]),
        "act": r.choice(["gelu", "gelu_tanh", "relu", "silu"]),
        "gated": r.random() < 0.4,
        "dropout": r.choice([0.0, 0.1]),
        "inplace": r.random() < 0.3,
        "frozen_first": r.random() < 0.25,
        "optimizer": r.choice(["adamw", "adamw", "adam_amsgrad", "sgd", "rmsprop", "adagrad"]),
        "two_groups": r.random() < 0.5,
        "batch": r.choice([2, 4]),
        "length": r.choice([16, 32, 64]),
    }
    spec["kv_heads"] = spec["heads"] if r.random() < 0.6 else 1
    spec["pyramid"] = spec["depth"] >= 4 and r.random() < 0.3
    spec["pool"] = spec["pyramid"] and not spec["language_model"] and r.random() < 0.5
    spec["tied"] = spec["language_model"] and not spec["pyramid"] and r.random() < 0.5
    return spec


class RandomNet(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        spec = draw(seed)
        rng = random.Random(seed + 1)
        self.spec = spec
        width = spec["width"]
        self.embed = nn.Embedding(VOCAB, width) if spec["tokens"] else nn.Linear(FEATURES, width)
        positions = torch.randn(1, MAX_POSITIONS, width) * 0.02
        self.register_buffer(
            "positions",
            None if spec["positions"] == "none" else positions,
            persistent=spec["positions"] == "persistent",
        )
        self.blocks = nn.ModuleList()
        self.widen = nn.ModuleDict()
        for i in range(spec["depth"]):
            if spec["pyramid"] and i == spec["depth"] // 2:
                self.widen[str(i)] = Widen(width, spec["pool"])
                width *= 2
            attention = not (spec["alternate"] and i % 2)
            self.blocks.append(Block(width, spec, attention, rng))
        self.norm = _norm(spec["norm"], width)
        self.head = nn.Linear(width, VOCAB if spec["language_model"] else CLASSES, bias=False)
        if spec["tied"]:
            self.head.weight = self.embed.weight
        if spec["frozen_first"]:
            self.blocks[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (the loss is the caller's: the batch's labels are not read here)."""
        h = self.embed(x)
        if self.positions is not None:
            h = h + self.positions[:, : h.shape[1]]
        for i, block in enumerate(self.blocks):
            if str(i) in self.widen:
                h = self.widen[str(i)](h)
            h = block(h)
        h = self.norm(h)
        return self.head(h) if self.spec["language_model"] else self.head(h.mean(1))


def _optimizer(model: nn.Module, spec: dict[str, Any]) -> torch.optim.Optimizer:
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: Any = [p for _, p in trained]
    if spec["two_groups"]:
        decayed = [p for n, p in trained if p.ndim == 2 and "embed" not in n]
        rest = [p for n, p in trained if p.ndim < 2 or "embed" in n]
        groups = [{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kind = spec["optimizer"]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(groups, lr=1e-3, amsgrad=True)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-3)
    return torch.optim.Adagrad(groups, lr=1e-2)


def _language_model_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())


def _classifier_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.float(), batch[1])


ENTRIES: dict[str, None] = {f"r{seed}": None for seed in range(SEEDS)}


def describe(seed: int) -> str:
    """One line: what entry `r<seed>` draws."""
    spec = draw(seed)
    return f"r{seed}: " + ", ".join(f"{k}={v}" for k, v in spec.items())


def build(
    name: str,
    per_rank_batch: int | None = None,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> ZooModel:
    """Entry `name` (`r<model seed>`): the model (the same on every rank), this rank's batch, its
    optimizer and its loss; `seed` varies the weights and the data, not the architecture."""
    if not (name.startswith("r") and name[1:].isdigit()):
        raise ValueError(f"unknown random zoo model {name!r}: entries are r0, r1, ...")
    model_seed = int(name[1:])
    torch.manual_seed(1000 * seed + model_seed)
    model = RandomNet(model_seed).to(device)
    spec = model.spec
    n, t = per_rank_batch or spec["batch"], spec["length"]
    g = torch.Generator().manual_seed(10_007 * seed + 101 * rank + model_seed)
    if spec["tokens"]:
        x = torch.randint(VOCAB, (n, t), generator=g)
    else:
        x = torch.randn(n, t, FEATURES, generator=g)
    if spec["language_model"]:
        y = torch.randint(VOCAB, (n, t), generator=g)
    else:
        y = torch.randint(CLASSES, (n,), generator=g)
    loss = _language_model_loss if spec["language_model"] else _classifier_loss
    return ZooModel(model, _optimizer(model, spec), (x.to(device), y.to(device)), loss)
