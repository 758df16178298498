"""Tiny Hugging Face causal LMs built from configs (nothing is downloaded), and their batches.

Shared by the 2-rank worker (tests/workers/hf.py) and the one-process tests (tests/test_hf.py).
Both models tie the output projection to the input embedding, as GPT-2 and many Llamas do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
LAYERS = 2
SEQ = 16
PER_RANK = 4  # sequences each rank feeds
WORLD = 2
SEED = 0
DATA_SEED = 4321


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        # no dropout: the distributed run and the reference must compute the same function
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}


def build(name: str) -> nn.Module:
    """The same weights on every rank and in every reference: seeded."""
    torch.manual_seed(SEED)
    return MODELS[name]()


def tied(model: nn.Module) -> bool:
    """The output projection's weight is the input embedding's weight: one parameter object."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight  # type: ignore[operator]


def global_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches of WORLD * PER_RANK token sequences; labels = input_ids (the model
    shifts them), no padding, so every rank's mean token loss averages to the global one."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    batches = []
    for _ in range(steps):
        ids = torch.randint(VOCAB, (WORLD * PER_RANK, SEQ), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def shard(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in batch.items()}
