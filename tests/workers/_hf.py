"""Tiny Hugging Face models built from configs (nothing is downloaded), and their batches.

Shared by the 2-rank worker (tests/workers/hf.py) and the one-process tests (tests/test_hf.py).
The causal LMs tie the output projection to the input embedding, as GPT-2 and many Llamas do.
ZOO adds the families of issue 12, each tying its output projection too: BERT (masked LM, its
embeddings named in `_no_split_modules`), ALBERT (one layer shared by every block), T5 and
Whisper (encoder-decoder, a KV cache on by default).
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


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=HIDDEN // 2,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    return AlbertForMaskedLM(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // 4,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


MEL_BINS = 8


def whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MEL_BINS,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_source_positions=SEQ,
        max_target_positions=SEQ,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}
ZOO: dict[str, Callable[[], nn.Module]] = {
    "bert": bert,
    "albert": albert,
    "t5": t5,
    "whisper": whisper,
    "gpt2": gpt2,
}


def build(name: str) -> nn.Module:
    """The same weights on every rank and in every reference: seeded."""
    torch.manual_seed(SEED)
    return {**MODELS, **ZOO}[name]()


def zoo_batches(name: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """`steps` global batches for a ZOO model: the same number of label tokens in every
    sequence (no padding), so every rank's mean token loss averages to the global one."""
    if name in ("gpt2", "bert", "albert"):
        return global_batches(steps)
    gen = torch.Generator().manual_seed(DATA_SEED)
    rows = WORLD * PER_RANK
    batches = []
    for _ in range(steps):
        labels = torch.randint(1, VOCAB, (rows, SEQ // 2), generator=gen)
        if name == "t5":
            inputs = {"input_ids": torch.randint(1, VOCAB, (rows, SEQ), generator=gen)}
        else:  # whisper: log-mel features, twice as many frames as encoder positions
            inputs = {"input_features": torch.randn(rows, MEL_BINS, 2 * SEQ, generator=gen)}
        batches.append({**inputs, "labels": labels})
    return batches


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
