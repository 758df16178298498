"""Deep, narrow models of many families: the depth extension's regression set
(`measure.simulate`, benchmarks/depth_extension.py, tests/test_depth_families.py).

A model of 16 or more alike blocks is simulated at a few depths and extended to its full depth;
each entry here has at least 16 blocks in each of its block lists (32 where the blocks repeat
with a period of 2 or follow a lead of unlike ones: the extension copies whole periods and every
lead, so it needs twice the depth to save as much), and is narrow (width 64-128,
vocabulary 512-1000, 32-64 tokens, batch 2) so that simulating it whole, the reference the
extension is checked against, takes seconds on two CPU cores. Every model is built on the meta
device (no memory, nothing downloaded): `build(name)` returns the same
`zoo.ZooModel(model, optimizer, batch, loss_fn)` as `benchmarks/zoo.py` and
`benchmarks/zoo_external.py`, with an AdamW over the trainable parameters. Batches are real CPU
tensors (token ids, labels, images, log-mel features), a dict of keyword arguments for Hugging
Face models (whose loss is their own `output.loss`) and a tuple for the others.

The layouts, and the families of each:

- one list of alike blocks: `llama` (GQA), `mistral` (a sliding window shorter than the
  sequence), `gpt2` (tied head), `neox`, `bert` (MLM, tied decoder), `vit`, `mixtral` (every
  layer MoE), the own zoo's `zoo_llama`, `zoo_gpt`, `zoo_vit`, `zoo_mlp`;
- one list, layers alternating in what they compute but not in shape: `qwen2_alternating`
  (sliding and full attention, `layer_types`);
- two lists, encoder and decoder: `t5`, `whisper`, `bart`;
- a prefix of unlike blocks: `qwen_moe_prefix` (the first two layers dense, the rest MoE,
  `mlp_only_layers`), `deepseek_v3` (`first_k_dense_replace=2`, multi-head latent attention);
- periodic blocks: `qwen_moe_step2` (MoE every second layer, `decoder_sparse_step=2`),
  `mixed_blocks` (attention and feed-forward blocks of two classes alternating in one list).

Families added on 2026-11-25, each held out of every zoo until then: one list of alike blocks,
`phi3` (fused projections), `falcon` (multi-query, parallel attention), `bloom` (ALiBi), `opt`,
`gptj` (parallel residual), `bigcode` (multi-query), `qwen3_moe` and `olmoe` (every layer MoE),
`mamba` (state-space blocks, no attention), `deberta` (disentangled relative attention),
`dinov2`; periodic, `gemma2` (sliding and global attention alternating, soft-capping) and
`modernbert` (global attention every third layer after a lead of one, 64 layers); two lists,
`mbart`.

    python benchmarks/deep_families.py            # build each, list its blocks and parameters
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo  # noqa: E402
import zoo_external  # noqa: E402
from zoo import ZooModel  # noqa: E402
from zoo_external import model_loss  # noqa: E402

DEPTH = 16  # blocks per list: the least the extension applies to
DEEP = 2 * DEPTH  # periodic and lead-first layouts: DEPTH periods of 2, or a lead and 30 more
SEQ = 32
VOCAB = 512
BATCH = 2
META = torch.device("meta")


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(10_007 * seed + 1)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _hf(cls: Any, config: Any) -> nn.Module:
    """A Hugging Face model built on meta from `config`, as a trainer uses it (no KV cache)."""
    if hasattr(config, "use_cache"):
        config.use_cache = False
    with META:
        model = cls(config)
    return model.train()


def _tokens(g: torch.Generator, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(vocab, (BATCH, seq), generator=g)


def _lm_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _tokens(g)
    return {"input_ids": ids, "labels": ids.clone()}


def _zoo(model: nn.Module, batch: Any, loss_fn: Any = model_loss) -> ZooModel:
    """The entry: the model, an AdamW over its trainable parameters, the batch, the loss."""
    return ZooModel(model, _adamw(model), batch, loss_fn)


def _lm(cls: Any, config: Any) -> ZooModel:
    return _zoo(_hf(cls, config), _lm_batch(_generator()))


# ---------------------------------------------------------------------------------------------
# Decoder LMs, one list of blocks


def _decoder(**kw: Any) -> dict[str, Any]:
    """The options decoder configs share (width 64, 4 heads over 2 KV heads, 16 layers), `kw`
    over them."""
    shared = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
    )
    return {**shared, **kw}


def llama() -> ZooModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _lm(LlamaForCausalLM, LlamaConfig(**_decoder(tie_word_embeddings=False)))


def mistral() -> ZooModel:
    from transformers import MistralConfig, MistralForCausalLM

    return _lm(MistralForCausalLM, MistralConfig(**_decoder(sliding_window=SEQ // 2)))


def qwen2_alternating() -> ZooModel:
    """Qwen2 whose layers alternate sliding-window and full attention (`layer_types`): one shape,
    two computations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_decoder(
            use_sliding_window=True,
            sliding_window=SEQ // 2,
            layer_types=["sliding_attention", "full_attention"] * (DEEP // 2),
            num_hidden_layers=DEEP,
        )
    )
    return _lm(Qwen2ForCausalLM, config)


def gpt2() -> ZooModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=DEPTH,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    return _lm(GPT2LMHeadModel, config)


def neox() -> ZooModel:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        max_position_embeddings=2 * SEQ,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    return _lm(GPTNeoXForCausalLM, config)


# ---------------------------------------------------------------------------------------------
# Mixtures of experts


def _qwen_moe(**kw: Any) -> ZooModel:
    """Qwen2-MoE, 32 layers."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=DEEP,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ,
        **kw,
    )
    return _lm(Qwen2MoeForCausalLM, config)


def qwen_moe_step2() -> ZooModel:
    """MoE every second layer (1, 3, 5, ...), a dense MLP in the others: period 2."""
    return _qwen_moe(decoder_sparse_step=2)


def qwen_moe_prefix() -> ZooModel:
    """The first two layers dense, the other 30 MoE: a prefix of unlike blocks."""
    return _qwen_moe(mlp_only_layers=[0, 1])


def mixtral() -> ZooModel:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ,
    )
    return _lm(MixtralForCausalLM, config)


def deepseek_v3() -> ZooModel:
    """DeepSeek-V3's layout: multi-head latent attention, the first two of 32 layers dense, the
    rest routed experts (grouped top-k) beside a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=DEEP,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )
    return _lm(DeepseekV3ForCausalLM, config)


# ---------------------------------------------------------------------------------------------
# Encoders, encoder-decoders, speech, vision


def bert() -> ZooModel:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=2 * SEQ,
    )
    model = _hf(BertForMaskedLM, config)
    g = _generator()
    ids = _tokens(g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one label per row
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return _zoo(model, batch)


def vit() -> ZooModel:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        intermediate_size=256,
        num_labels=10,
    )
    model = _hf(ViTForImageClassification, config)
    g = _generator()
    batch = {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(10, (BATCH,), generator=g),
    }
    return _zoo(model, batch)


def t5() -> ZooModel:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=DEPTH,
        num_decoder_layers=DEPTH,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = _hf(T5ForConditionalGeneration, config)
    g = _generator()
    batch = {"input_ids": _tokens(g), "labels": _tokens(g, seq=SEQ // 2)}
    return _zoo(model, batch)


def whisper() -> ZooModel:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    mel, frames = 16, 64
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=mel,
        d_model=64,
        encoder_layers=DEPTH,
        decoder_layers=DEPTH,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=frames // 2,
        max_target_positions=SEQ,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = _hf(WhisperForConditionalGeneration, config)
    g = _generator()
    batch = {
        "input_features": torch.randn(BATCH, mel, frames, generator=g),
        "labels": _tokens(g, seq=SEQ // 2),
    }
    return _zoo(model, batch)


def bart() -> ZooModel:
    from transformers import BartConfig, BartForConditionalGeneration

    return _bart_like(BartConfig, BartForConditionalGeneration)


def _bart_like(config_class: Any, model_class: Any) -> ZooModel:
    """BART's layout (or mBART's: layer norms after the embeddings and at each stack's end)."""
    config = config_class(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=DEPTH,
        decoder_layers=DEPTH,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=2 * SEQ,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    model = _hf(model_class, config)
    g = _generator()
    # ids from 3 up: no pad, BOS or EOS token in the middle of a row
    batch = {
        "input_ids": 3 + _tokens(g, vocab=VOCAB - 3),
        "labels": 3 + _tokens(g, seq=SEQ // 2, vocab=VOCAB - 3),
    }
    return _zoo(model, batch)


# ---------------------------------------------------------------------------------------------
# More families (held out from every zoo until 2026-11-25, when each first ran here)


def gemma2() -> ZooModel:
    """Gemma 2: sliding and global attention alternating, logit soft-capping, norms after each
    sub-layer too; 32 layers (period 2)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**_decoder(head_dim=16, sliding_window=SEQ // 2, num_hidden_layers=DEEP))
    return _lm(Gemma2ForCausalLM, config)


def phi3() -> ZooModel:
    """Phi-3: query, key and value in one fused projection, gate and up in another."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _lm(Phi3ForCausalLM, Phi3Config(**_decoder(pad_token_id=0)))


def falcon() -> ZooModel:
    """Falcon: multi-query attention, attention and MLP in parallel off one norm."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
    )
    return _lm(FalconForCausalLM, config)


def bloom() -> ZooModel:
    """BLOOM: ALiBi position biases (no position embedding), an embedding layer norm."""
    from transformers import BloomConfig, BloomForCausalLM

    return _lm(
        BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=DEPTH, n_head=4)
    )


def opt() -> ZooModel:
    """OPT: learned position embeddings, ReLU MLP."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=DEPTH,
        ffn_dim=176,
        num_attention_heads=4,
        max_position_embeddings=2 * SEQ,
        word_embed_proj_dim=64,
    )
    return _lm(OPTForCausalLM, config)


def gptj() -> ZooModel:
    """GPT-J: parallel residual, rotary on part of each head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=DEPTH, n_head=4, rotary_dim=8, n_positions=2 * SEQ
    )
    return _lm(GPTJForCausalLM, config)


def bigcode() -> ZooModel:
    """GPT-BigCode (StarCoder): multi-query attention in GPT-2's layout."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=DEPTH, n_head=4, n_positions=2 * SEQ, multi_query=True
    )
    return _lm(GPTBigCodeForCausalLM, config)


def qwen3_moe() -> ZooModel:
    """Qwen3-MoE: every layer MoE (4 experts, top 2), norms on queries and keys."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_decoder(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    )
    return _lm(Qwen3MoeForCausalLM, config)


def olmoe() -> ZooModel:
    """OLMoE: every layer MoE (4 experts, top 2)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(**_decoder(num_experts=4, num_experts_per_tok=2, pad_token_id=0))
    return _lm(OlmoeForCausalLM, config)


def mamba() -> ZooModel:
    """Mamba: selective state-space blocks, no attention (transformers' PyTorch scan)."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=DEPTH, state_size=8, expand=2
    )
    return _lm(MambaForCausalLM, config)


def _mlm(cls: Any, config: Any) -> ZooModel:
    ids = _tokens(_generator())
    return _zoo(_hf(cls, config), {"input_ids": ids, "labels": ids.clone()})


def deberta() -> ZooModel:
    """DeBERTa-v2: disentangled attention over relative position buckets."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    config = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        intermediate_size=176,
        max_position_embeddings=2 * SEQ,
        relative_attention=True,
        position_buckets=16,
        pos_att_type=["p2c", "c2p"],
    )
    return _mlm(DebertaV2ForMaskedLM, config)


def modernbert() -> ZooModel:
    """ModernBERT: global attention every third layer, local (sliding) in the others, the first
    layer without its attention norm: a lead of one, then periods of 3; 64 layers (at 48 the
    three shallow runs would hold 45 of them: no saving, simulated whole)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4 * DEPTH,
        num_attention_heads=4,
        intermediate_size=176,
        max_position_embeddings=2 * SEQ,
        global_attn_every_n_layers=3,
        local_attention=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return _mlm(ModernBertForMaskedLM, config)


def mbart() -> ZooModel:
    """mBART: BART's layout with layer norms after the embeddings and at each stack's end."""
    from transformers import MBartConfig, MBartForConditionalGeneration

    return _bart_like(MBartConfig, MBartForConditionalGeneration)


def _images(model: nn.Module, size: int) -> ZooModel:
    g = _generator()
    batch = {
        "pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
        "labels": torch.randint(10, (BATCH,), generator=g),
    }
    return _zoo(model, batch)


def dinov2() -> ZooModel:
    """DINOv2: a ViT with layer scale, interpolated position embeddings."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    config = Dinov2Config(
        hidden_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
        num_labels=10,
    )
    return _images(_hf(Dinov2ForImageClassification, config), 32)


# ---------------------------------------------------------------------------------------------
# The project's own zoo (benchmarks/zoo.py), and blocks of two classes alternating


def zoo_llama() -> ZooModel:
    return zoo.BUILDERS["llama"](
        BATCH, device=META, width=128, depth=DEPTH, heads=4, kv_heads=2, seq_len=64
    )


def zoo_gpt() -> ZooModel:
    return zoo.BUILDERS["gpt"](
        BATCH, device=META, d_model=128, n_layer=DEPTH, n_head=4, seq_len=64, vocab_size=512
    )


def zoo_vit() -> ZooModel:
    return zoo.BUILDERS["vit"](
        BATCH, device=META, image_size=32, patch=8, width=128, depth=DEPTH, heads=4, classes=10
    )


def zoo_mlp() -> ZooModel:
    return zoo.BUILDERS["mlp"](
        8, device=META, in_features=64, width=128, hidden=256, depth=DEPTH, classes=10
    )


def mixed_blocks() -> ZooModel:
    """An attention block and a feed-forward block, alternating in one ModuleList: 16 pairs."""
    with META:
        model = zoo_external.MixedBlocks(width=64, pairs=DEPTH)
    g = _generator()
    batch = (_tokens(g), torch.randint(10, (BATCH,), generator=g))
    return _zoo(model, batch, zoo_external.classification_loss)


# ---------------------------------------------------------------------------------------------
# The registry

# name: (builder, layout)
FAMILIES: dict[str, tuple[Callable[[], ZooModel], str]] = {
    "llama": (llama, "one list"),
    "mistral": (mistral, "one list, sliding window"),
    "qwen2_alternating": (qwen2_alternating, "one list, sliding/full alternating"),
    "gpt2": (gpt2, "one list, tied head"),
    "neox": (neox, "one list"),
    "bert": (bert, "one list, MLM"),
    "vit": (vit, "one list"),
    "t5": (t5, "encoder + decoder"),
    "whisper": (whisper, "encoder + decoder"),
    "bart": (bart, "encoder + decoder"),
    "qwen_moe_step2": (qwen_moe_step2, "MoE every 2nd layer"),
    "qwen_moe_prefix": (qwen_moe_prefix, "2 dense, then MoE"),
    "mixtral": (mixtral, "one list, all MoE"),
    "deepseek_v3": (deepseek_v3, "2 dense, then MoE; MLA"),
    "zoo_llama": (zoo_llama, "one list (own zoo)"),
    "zoo_gpt": (zoo_gpt, "one list (own zoo)"),
    "zoo_vit": (zoo_vit, "one list (own zoo)"),
    "zoo_mlp": (zoo_mlp, "one list (own zoo)"),
    "mixed_blocks": (mixed_blocks, "two classes alternating"),
    "gemma2": (gemma2, "one list, sliding/global alternating"),
    "phi3": (phi3, "one list, fused projections"),
    "falcon": (falcon, "one list, parallel attention"),
    "bloom": (bloom, "one list, ALiBi"),
    "opt": (opt, "one list"),
    "gptj": (gptj, "one list, parallel residual"),
    "bigcode": (bigcode, "one list, multi-query"),
    "qwen3_moe": (qwen3_moe, "one list, all MoE"),
    "olmoe": (olmoe, "one list, all MoE"),
    "mamba": (mamba, "one list, state-space"),
    "deberta": (deberta, "one list, relative positions"),
    "modernbert": (modernbert, "one list, global every 3rd"),
    "mbart": (mbart, "encoder + decoder"),
    "dinov2": (dinov2, "one list"),
}


def build(name: str, seed: int = 0) -> ZooModel:
    """Family `name`, built on meta from `seed` (the batch is the same for every seed)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    return FAMILIES[name][0]()


def main() -> None:
    from autoshard.decide.blocks import find_blocks

    for name, (_, layout) in FAMILIES.items():
        built = build(name)
        blocks = find_blocks(built.model)
        classes = sorted({type(m).__name__ for _, m in blocks})
        params = sum(p.numel() for p in built.model.parameters())
        print(f"{name:18} {layout:34} {len(blocks):3} blocks {params / 1e6:6.2f}M  {classes}")


if __name__ == "__main__":
    main()
