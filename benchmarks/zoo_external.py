"""External model zoo: real model classes nobody in this project wrote, the estimator's
regression suite (issue 12).

Every entry builds a small model from its library's config class (nothing is downloaded), one
batch as rank `rank` feeds it, an AdamW over its trainable parameters, and its loss:
`build(name, per_rank_batch=None, *, rank=0, seed=0, device="cpu")` returns the same
`zoo.ZooModel(model, optimizer, batch, loss_fn)` as the project's own zoo (`benchmarks/zoo.py`),
so `benchmarks/estimate_accuracy.py` measures either. Batches are what the model's `forward`
takes: a dict (keyword arguments, Hugging Face's convention) or a tuple (positional); the loss
is the model's own `output.loss` where it computes one.

The families, and what each exercises:

- `llama`: LlamaForCausalLM, grouped-query attention (4 heads, 2 KV heads), untied head.
- `mistral`: MistralForCausalLM, GQA and a sliding window shorter than the sequence.
- `mixtral`: MixtralForCausalLM, a sparse mixture of experts (4 experts, top 2): transformers 5
  runs the experts through `torch._grouped_mm`.
- `qwen_moe`: Qwen2MoeForCausalLM, routed experts beside a shared expert.
- `gpt2`: GPT2LMHeadModel, the head tied to the input embedding.
- `bert`: BertForMaskedLM, an encoder whose MLM decoder is tied to the word embeddings.
- `albert`: AlbertForMaskedLM, one layer shared by every block, factorised embeddings.
- `t5`: T5ForConditionalGeneration, encoder-decoder with relative position biases.
- `whisper`: WhisperForConditionalGeneration, speech: conv front end over log-mel features,
  encoder-decoder.
- `wav2vec2`: Wav2Vec2ForCTC, speech from the raw waveform: a conv feature encoder with
  GroupNorm, a grouped positional convolution, SpecAugment in training (random frames replaced
  by a learned vector, `hidden[mask] = embedding`) and the CTC loss; LayerDrop off (at 0.1, its
  default, it skips layers at random on each rank apart, which rules FSDP2 out).
- `mamba`: MambaForCausalLM, a selective state-space model, no attention; without the
  `mamba-ssm` kernels transformers runs its scan in torch, a Python loop over the tokens.
- `clip`: CLIPModel, a text and a vision tower trained contrastively (its own loss,
  `return_loss=True`), with a learned temperature of no dimension (`logit_scale`).
- `vit`: ViTForImageClassification.
- `convnext`: ConvNextForImageClassification, depthwise 7x7 convolutions, LayerNorm, stages.
- `resnet_hf`: ResNetForImageClassification, BatchNorm (running statistics are buffers).
- `swin`: SwinForImageClassification, windowed attention whose every other block shifts its
  windows (`torch.roll` over two dimensions), patch merging between stages.
- `segformer`: SegformerForSemanticSegmentation, a pixel-wise head: each stage's features
  upsampled bilinearly to a quarter of the image, the logits to the labels' size for the loss.
- `resnext`: a hand-written ResNeXt (grouped 3x3 convolutions, BatchNorm) in plain torch.
- `denoiser`: a hand-written convolutional U-Net in plain torch (nearest upsampling, skip
  connections), trained as a diffusion model is: `F.mse_loss` of the predicted noise.
- `lora`: PEFT LoRA (rank 8) on a Llama: the base frozen, only the adapters train (peft is a
  `bench` extra; without it this entry raises ImportError naming it).
- `frozen_gpt2`: GPT2LMHeadModel with its embeddings and first block frozen.
- `dict_out`: a plain-torch encoder whose forward returns a dict with its own loss.
- `nn_transformer`: `nn.Transformer` (encoder and decoder layers) as a seq2seq model.
- `nn_encoder`: `nn.TransformerEncoder` as a sequence classifier.
- `mixed_blocks`: attention blocks and MLP blocks of two classes, alternating.

`FAST` is the subset CI runs (tests/test_estimate_accuracy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZooModel

SEQ = 32
VOCAB = 512


def model_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss the model computed itself (`output.loss`, or `output["loss"]`)."""
    loss = output["loss"] if isinstance(output, dict) else output.loss
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the model returned no loss (got {type(output).__name__})")
    return loss


def classification_loss(output: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.float(), batch[-1])


def _generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_007 * seed + 101 * rank + 1)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _hf(model: nn.Module) -> nn.Module:
    """A Hugging Face model as a trainer uses it: training mode, no dropout randomness needed."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache (transformers' Trainer does the same)
    return model.train()


def _tokens(n: int, g: torch.Generator, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(vocab, (n, seq), generator=g)


def _lm_batch(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _tokens(n, g)
    return {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------------------------------------
# Decoder LMs


def _llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
        **kw,
    )


def llama(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(_llama_config()), _lm_batch(n, g)


def mistral(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        sliding_window=SEQ // 2,
    )
    return MistralForCausalLM(config), _lm_batch(n, g)


def mixtral(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ,
    )
    return MixtralForCausalLM(config), _lm_batch(n, g)


def qwen_moe(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ,
    )
    return Qwen2MoeForCausalLM(config), _lm_batch(n, g)


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )


def gpt2(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(_gpt2_config()), _lm_batch(n, g)


def neox(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    """GPT-NeoX (Pythia): parallel attention and MLP residuals, rotary on a quarter of each head,
    untied head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=2 * SEQ,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    return GPTNeoXForCausalLM(config), _lm_batch(n, g)


def frozen_gpt2(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config())
    for module in (model.transformer.wte, model.transformer.wpe, model.transformer.h[0]):
        module.requires_grad_(False)
    return model, _lm_batch(n, g)


def lora(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError(
            f"zoo entry 'lora' needs peft ({error}); install it with pip install -e '.[bench]'"
        ) from error
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM(_llama_config())
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    return get_peft_model(base, config), _lm_batch(n, g)


# ---------------------------------------------------------------------------------------------
# Encoders, encoder-decoders, speech


def _mlm_batch(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _tokens(n, g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one label per row
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def bert(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=2 * SEQ,
    )
    return BertForMaskedLM(config), _mlm_batch(n, g)


def albert(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=2 * SEQ,
    )
    return AlbertForMaskedLM(config), _mlm_batch(n, g)


def t5(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    batch = {"input_ids": _tokens(n, g), "labels": _tokens(n, g, seq=SEQ // 2)}
    return T5ForConditionalGeneration(config), batch


def whisper(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    mel, frames = 16, 64
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=mel,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=frames // 2,
        max_target_positions=SEQ,
        decoder_start_token_id=1,
        pad_token_id=0,
    )
    batch = {
        "input_features": torch.randn(n, mel, frames, generator=g),
        "labels": _tokens(n, g, seq=SEQ // 2),
    }
    return WhisperForConditionalGeneration(config), batch


def wav2vec2(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        pad_token_id=0,
        ctc_loss_reduction="mean",
        layerdrop=0.0,
    )
    batch = {
        "input_values": torch.randn(n, 1600, generator=g),
        "labels": torch.randint(1, 32, (n, 8), generator=g),
    }
    return Wav2Vec2ForCTC(config), batch


def mamba(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=4, expand=2
    )
    return MambaForCausalLM(config), _lm_batch(n, g)


def clip(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": SEQ,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=32,
    )
    batch = {
        "input_ids": _tokens(n, g),
        "pixel_values": torch.randn(n, 3, 32, 32, generator=g),
        "return_loss": True,
    }
    return CLIPModel(config), batch


# ---------------------------------------------------------------------------------------------
# Vision


def _image_batch(n: int, g: torch.Generator, size: int, classes: int) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(n, 3, size, size, generator=g),
        "labels": torch.randint(classes, (n,), generator=g),
    }


def vit(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        num_labels=10,
    )
    return ViTForImageClassification(config), _image_batch(n, g, 32, 10)


def convnext(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10, image_size=64
    )
    return ConvNextForImageClassification(config), _image_batch(n, g, 64, 10)


def resnet_hf(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=10,
    )
    return ResNetForImageClassification(config), _image_batch(n, g, 64, 10)


def swin(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=32,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        num_labels=10,
    )
    return SwinForImageClassification(config), _image_batch(n, g, 32, 10)


def segformer(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(
        depths=[1, 1, 2, 1],
        hidden_sizes=[16, 32, 64, 128],
        num_attention_heads=[1, 2, 4, 8],
        decoder_hidden_size=64,
        num_labels=10,
    )
    batch = {
        "pixel_values": torch.randn(n, 3, 64, 64, generator=g),
        "labels": torch.randint(10, (n, 64, 64), generator=g),
    }
    return SegformerForSemanticSegmentation(config), batch


class ResNeXtBlock(nn.Module):
    """Bottleneck with a grouped 3x3 convolution (Xie et al. 2017) and BatchNorm."""

    def __init__(self, width: int, groups: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(width, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 1, bias=False),
            nn.BatchNorm2d(width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


class ResNeXt(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width)
        )
        self.blocks = nn.Sequential(*(ResNeXtBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(images)))
        return self.head(x.mean(dim=(2, 3)))


def resnext(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    images = torch.randn(n, 3, 32, 32, generator=g)
    return ResNeXt(), (images, torch.randint(10, (n,), generator=g))


class DenoiserStage(nn.Module):
    """Two 3x3 convolutions with GroupNorm and SiLU, and a residual connection."""

    def __init__(self, into: int, out: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.GroupNorm(4, into),
            nn.SiLU(),
            nn.Conv2d(into, out, 3, padding=1),
            nn.GroupNorm(4, out),
            nn.SiLU(),
            nn.Conv2d(out, out, 3, padding=1),
        )
        self.skip = nn.Conv2d(into, out, 1) if into != out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.body(x)


class Denoiser(nn.Module):
    """A small U-Net: down by strided convolutions, up by nearest upsampling, the encoder's
    features concatenated in; it predicts the noise added to its input."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, width, 3, padding=1)
        self.down = nn.ModuleList([DenoiserStage(width, width), DenoiserStage(width, 2 * width)])
        self.pool = nn.ModuleList(
            [nn.Conv2d(width, width, 3, 2, 1), nn.Conv2d(2 * width, 2 * width, 3, 2, 1)]
        )
        self.mid = DenoiserStage(2 * width, 2 * width)
        self.up = nn.ModuleList([DenoiserStage(4 * width, width), DenoiserStage(2 * width, width)])
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, noisy: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(noisy)
        skips = []
        for stage, pool in zip(self.down, self.pool, strict=True):
            h = stage(h)
            skips.append(h)
            h = pool(h)
        h = self.mid(h)
        for stage in self.up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = stage(torch.cat([h, skips.pop()], dim=1))
        return self.out(h)


def _noise_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(output.float(), batch[1])


def denoiser(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    images = torch.randn(n, 3, 32, 32, generator=g)
    noise = torch.randn(n, 3, 32, 32, generator=g)
    return Denoiser(), (images + noise, noise)


# ---------------------------------------------------------------------------------------------
# Plain torch: dict outputs, nn.Transformer, alternating block classes


class DictEncoder(nn.Module):
    """An encoder whose forward takes keyword arguments and returns a dict with its loss."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.encoder(self.embed(input_ids)))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return {"loss": loss, "logits": logits}


def dict_out(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    return DictEncoder(), _lm_batch(n, g)


class Seq2Seq(nn.Module):
    """`nn.Transformer` with embeddings and a head: source and target token ids in, logits out."""

    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.transformer = nn.Transformer(
            width, 4, layers, layers, 4 * width, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(
        self, source: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], device=target.device)
        out = self.transformer(self.embed(source), self.embed(target), tgt_mask=mask)
        return self.head(out)


def _seq2seq_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), batch[2].flatten())


def nn_transformer(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    source, target = _tokens(n, g), _tokens(n, g, seq=SEQ // 2 + 1)
    return Seq2Seq(), (source, target[:, :-1].contiguous(), target[:, 1:].contiguous())


class EncoderClassifier(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def nn_encoder(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    return EncoderClassifier(), (_tokens(n, g), torch.randint(10, (n,), generator=g))


class AttentionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class FeedForwardBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MixedBlocks(nn.Module):
    """Attention and feed-forward blocks of two classes, alternating in one ModuleList."""

    def __init__(self, width: int = 64, pairs: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(
            block
            for _ in range(pairs)
            for block in (AttentionBlock(width), FeedForwardBlock(width))
        )
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def mixed_blocks(n: int, g: torch.Generator) -> tuple[nn.Module, Any]:
    return MixedBlocks(), (_tokens(n, g), torch.randint(10, (n,), generator=g))


# ---------------------------------------------------------------------------------------------
# The registry

Factory = Callable[[int, torch.Generator], tuple[nn.Module, Any]]
# name: (factory, default per-rank batch, loss)
ENTRIES: dict[str, tuple[Factory, int, Callable[[Any, Any], torch.Tensor]]] = {
    "llama": (llama, 4, model_loss),
    "mistral": (mistral, 4, model_loss),
    "mixtral": (mixtral, 4, model_loss),
    "qwen_moe": (qwen_moe, 4, model_loss),
    "gpt2": (gpt2, 4, model_loss),
    "neox": (neox, 4, model_loss),
    "bert": (bert, 4, model_loss),
    "albert": (albert, 4, model_loss),
    "t5": (t5, 4, model_loss),
    "whisper": (whisper, 4, model_loss),
    "wav2vec2": (wav2vec2, 4, model_loss),
    "mamba": (mamba, 4, model_loss),
    "clip": (clip, 4, model_loss),
    "vit": (vit, 4, model_loss),
    "convnext": (convnext, 4, model_loss),
    "resnet_hf": (resnet_hf, 4, model_loss),
    "swin": (swin, 4, model_loss),
    "segformer": (segformer, 4, model_loss),
    "resnext": (resnext, 8, classification_loss),
    "denoiser": (denoiser, 4, _noise_loss),
    "lora": (lora, 4, model_loss),
    "frozen_gpt2": (frozen_gpt2, 4, model_loss),
    "dict_out": (dict_out, 4, model_loss),
    "nn_transformer": (nn_transformer, 4, _seq2seq_loss),
    "nn_encoder": (nn_encoder, 4, classification_loss),
    "mixed_blocks": (mixed_blocks, 4, classification_loss),
}
# The CI subset: MoE, tied embeddings, an encoder-decoder, LoRA on a GQA decoder (Llama), and a
# plain-torch encoder returning a dict.
FAST = ("mixtral", "gpt2", "t5", "lora", "dict_out")


def build(
    name: str,
    per_rank_batch: int | None = None,
    *,
    rank: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> ZooModel:
    """Zoo entry `name`: the model built from `seed` (the same on every rank), this rank's batch,
    an AdamW over the trainable parameters and the loss."""
    if name not in ENTRIES:
        raise ValueError(f"unknown external zoo model {name!r}; choose from {', '.join(ENTRIES)}")
    factory, default_batch, loss = ENTRIES[name]
    torch.manual_seed(seed)
    model, batch = factory(per_rank_batch or default_batch, _generator(seed, rank))
    model = _hf(model).to(device)
    if isinstance(batch, dict):  # tensors, and flags such as CLIP's return_loss=True
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    else:
        batch = tuple(t.to(device) for t in batch)
    return ZooModel(model, _adamw(model), batch, loss)
