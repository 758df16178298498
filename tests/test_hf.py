"""Hugging Face transformers models: a tiny GPT-2 and a tiny Llama (tied embeddings, built from
configs, nothing downloaded) through autoshard.

One process: blocks found from `_no_split_modules`, and the FakeTensorMode trace measures exactly
what a real step saves for backward. Two gloo ranks (tests/workers/hf.py, one launch): every
strategy wraps them, tied weights stay one parameter in one FSDP unit, the trial step's loss is
`output.loss`, and the losses match a single-process reference. Issue 12 adds BERT, ALBERT, T5
and Whisper (and GPT-2 again) with blocks checkpointed and under `auto` with a tight limit, and
gradient accumulation in the trial step.

Skipped when transformers is not installed; the `test` extra installs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]')"
)

import torch  # noqa: E402
from _dist import Launch, launch  # noqa: E402

from autoshard.decide.blocks import find_blocks  # noqa: E402
from autoshard.measure.trace import _Attribution, _unpack, profile_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from _hf import PER_RANK, SEQ, VOCAB, ZOO, build, tied  # noqa: E402

MODELS = ["gpt2", "llama"]
STRATEGIES = ["ddp", "shard_grad_op", "full_shard", "auto"]
BLOCKS = {
    "gpt2": ("GPT2Block", ["transformer.h.0", "transformer.h.1"]),
    "llama": ("LlamaDecoderLayer", ["model.layers.0", "model.layers.1"]),
}
# fp32 parity: as in tests/test_distributed.py (RTOL_FP32), the distributed run differs from the
# reference only in the order of floating-point reductions (two 4-sequence means averaged instead
# of one 8-sequence mean); observed differences are ~1e-7 relative, a real error moves them by %.
RTOL_FP32 = 1e-4


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------------------------------------
# One process


@pytest.mark.parametrize("name", MODELS)
def test_blocks_come_from_no_split_modules(name: str) -> None:
    model = build(name)
    cls, expected = BLOCKS[name]
    assert cls in model._no_split_modules
    assert [n for n, _ in find_blocks(model)] == expected
    assert tied(model), "the tiny models tie lm_head to the input embedding"


@pytest.mark.parametrize("name", MODELS)
def test_fake_trace_saves_what_a_real_step_saves(name: str) -> None:
    """The FakeTensorMode trace of an HF model attributes the same bytes to each block as a real
    forward/backward with the same saved-tensor hooks."""
    model = build(name)
    blocks = [b for _, b in find_blocks(model)]
    batch = _batch()
    fake = profile_step(model, blocks, batch, None, None)

    existing = {t.untyped_storage()._cdata for t in [*model.parameters(), *batch.values()]}
    real = _Attribution(len(blocks), existing)
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: real.enter(i)))
        handles.append(block.register_forward_hook(lambda m, a, o: real.leave()))
    with torch.autograd.graph.saved_tensors_hooks(real.pack, _unpack):
        loss = model(**batch).loss
    loss.backward()
    for handle in handles:
        handle.remove()

    assert all(b > 0 for b in fake.block_saved_bytes)
    assert fake.block_saved_bytes == tuple(real.saved_by(i) for i in range(len(blocks)))
    assert fake.before_saved_bytes == real.saved_by("before")
    assert fake.after_saved_bytes == real.saved_by("after")
    assert fake.unused_parameters == ()


@pytest.mark.parametrize("name", MODELS)
def test_plan_handles_a_padded_attention_mask(name: str) -> None:
    """transformers 5 skips its data-dependent mask check on fake tensors, so a padded batch is
    traced. transformers 4 inspects the mask in Python (`padding_mask.all()`), which no fake
    tensor can answer: the plan then comes out without an activation estimate, saying why."""
    import transformers

    import autoshard

    model = build(name)
    batch = _batch()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, :5] = 0
    optimizer = torch.optim.AdamW(model.parameters())
    plan = autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="no"
    )
    assert plan.num_blocks == 2
    assert any("_no_split_modules" in r for r in plan.reasons), plan.reasons
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert any(r.startswith("activations traced") for r in plan.reasons), plan.reasons
    else:
        assert any("could not be traced (DataDependent" in r for r in plan.reasons), plan.reasons


# ---------------------------------------------------------------------------------------------
# Two gloo ranks


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    # 30 cases; the zoo's simulations of T5 and Whisper take seconds each: the whole launch took
    # 365 s of cases (395 s in all) on a 2-core machine shared with other jobs. A hang guard only.
    return launch("hf", Path(tmp_path_factory.mktemp("hf")), timeout=600)


def _mean_losses(ranks: list[dict]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks), strict=True)]


@pytest.mark.dist
def test_hf_launch_finished_cleanly(hf: Launch) -> None:
    if hf.timed_out or hf.returncode != 0:
        pytest.fail(hf.report("the launch did not finish cleanly"), pytrace=False)
    hf.case("__finished__")


@pytest.mark.dist
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_wraps_with_blocks_and_tied_weights(hf: Launch, name: str, strategy: str) -> None:
    for r in hf.case(f"{name}_{strategy}"):
        assert r["num_blocks"] == 2 and r["blocks"] == BLOCKS[name][1], r["reasons"]
        assert any("_no_split_modules" in reason for reason in r["reasons"]), r["reasons"]
        assert any(reason.startswith("activations traced") for reason in r["reasons"])
        if strategy != "auto":
            assert r["strategy"] == strategy
        assert r["optimizer_is_same"] and r["same_param_names"]
        assert r["tied_after_prepare"] and r["tied_after_training"], "lm_head lost its tie"
        assert r["optimizer_holds_embedding_once"], "the tied weight is one optimizer entry"
        if r["strategy"] == "ddp":
            assert r["is_ddp"] and not r["is_fsdp"]
        else:
            assert r["is_fsdp"] and r["block_is_fsdp"] == [True, True]
            # Embedding and lm_head share one weight, sharded once, by the root unit only.
            assert r["embedding_units"] == ["<root>"], r["embedding_units"]


@pytest.mark.dist
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_hf_trial_step_uses_output_loss(hf: Launch, name: str, strategy: str) -> None:
    for r in hf.case(f"{name}_{strategy}"):
        assert len(r["attempts"]) == 1 and r["attempts"][0] == "fit", r["attempts"]
        # AdamW without state: two trial steps, each on the model's own output.loss.
        assert r["trial_losses_are_output_loss"] == [True, True]


@pytest.mark.dist
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_hf_losses_match_single_process_reference(hf: Launch, name: str, strategy: str) -> None:
    ranks = hf.case(f"{name}_{strategy}")
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0], "each rank trains on its own half"
    expected = hf.case("reference")[0][name]
    actual = _mean_losses(ranks)
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))
    assert actual == pytest.approx(expected, rel=RTOL_FP32, abs=0), (
        f"largest relative difference {worst:.3g}\nactual   {actual}\nexpected {expected}"
    )


# ---------------------------------------------------------------------------------------------
# Issue 12: models nobody here wrote, on 2 gloo ranks


ZOO_BLOCKS = {
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],  # not bert.embeddings
    "albert": [],  # one layer shared by every block: the model is one unit
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "whisper": [f"model.{part}.layers.{i}" for part in ("encoder", "decoder") for i in (0, 1)],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
}


def test_zoo_blocks() -> None:
    for name, expected in ZOO_BLOCKS.items():
        assert [n for n, _ in find_blocks(build(name))] == expected, name


def test_vit_embeddings_are_not_a_block() -> None:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
    )
    model = ViTModel(config)
    assert "ViTEmbeddings" in model._no_split_modules
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "ViTLayer"]
    assert len(layers) == 2 and [n for n, _ in find_blocks(model)] == layers


def test_a_decoder_with_cross_attention_checkpointed_by_layer_trains_as_unchecked() -> None:
    """GPT-2 passes its KV cache to each block by position, and leaves it out only where its
    model's own flag is set: checkpointed layer by layer, the cross-attention read its keys and
    values from the cache in the recomputation and saved fewer tensors ("CheckpointError: ... A
    different number of tensors was saved"), so that a vision encoder-decoder with a GPT-2
    decoder raised "no candidate can train this model" with checkpointing on (a held-out
    sweep). The gradients of a step equal those of the unchecked model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import autoshard

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        add_cross_attention=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    batch = {
        "input_ids": ids,
        "labels": ids,
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=generator),
    }
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    reference = GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    prepared, _, plan = autoshard.prepare(
        model,
        torch.optim.AdamW(model.parameters()),
        batch,
        mixed_precision="no",
        activation_checkpointing=True,
    )
    assert plan.activation_checkpointing == plan.num_blocks == 2
    for trained in (prepared, reference):
        trained(**batch).loss.backward()
    for (name, param), kept in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and kept.grad is not None, name
        torch.testing.assert_close(param.grad, kept.grad, msg=name)


def _assert_parity(hf: Launch, name: str, ranks: list[dict]) -> None:
    expected = hf.case("zoo_reference")[0][name]
    actual = _mean_losses(ranks)
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))
    assert actual == pytest.approx(expected, rel=RTOL_FP32, abs=0), (
        f"{name}: largest relative difference {worst:.3g}\nactual   {actual}\nexpected {expected}"
    )


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "shard_grad_op", "full_shard"])
@pytest.mark.parametrize("name", [n for n in ZOO if n != "gpt2"])
def test_zoo_trains_under_every_strategy(hf: Launch, name: str, strategy: str) -> None:
    """BERT's tied decoder under FSDP raised "Parameter ... is shared with a parameter already
    managed by another FSDP group"; T5 and Whisper with their decoder blocks checkpointed raised
    CheckpointError (DDP and ZeRO-2 run here with every block checkpointed)."""
    ranks = hf.case(f"zoo_{name}_{strategy}")
    for r in ranks:
        assert r["strategy"] == strategy and r["num_blocks"] == len(ZOO_BLOCKS[name])
        if strategy != "full_shard":
            assert r["activation_checkpointing"] == r["num_blocks"]
        assert r["attempts"] and r["attempts"][-1] == "fit", r["attempts"]
        assert not any(x.startswith("not offered") for x in r["reasons"]), r["reasons"]
    if name in ("t5", "whisper"):
        assert any("transformers' own checkpointing" in x for x in ranks[0]["reasons"])
    _assert_parity(hf, name, ranks)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_auto_under_a_tight_limit(hf: Launch, name: str) -> None:
    ranks = hf.case(f"zoo_{name}_auto")
    for r in ranks:
        assert r["attempts"] and r["attempts"][-1] == "fit", r["attempts"]
        assert r["estimated"] <= r["limit"], r["candidates"]
        if r["below"] == "full_shard":  # no unchecked candidate fits: blocks are checkpointed
            assert r["activation_checkpointing"] > 0, r["candidates"]
        else:  # no blocks: DDP does not fit
            assert r["strategy"] in ("shard_grad_op", "full_shard"), r["candidates"]
    _assert_parity(hf, name, ranks)


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "full_shard"])
def test_trial_step_accumulates_gradients_as_planned(hf: Launch, strategy: str) -> None:
    for r in hf.case(f"accumulate_{strategy}"):
        assert r["real_forwards"] == 2 * 2, "two trial steps (fresh AdamW) of 2 micro-batches"
        assert r["attempts"] and r["attempts"][-1] == "fit", r["attempts"]
        assert any(x.startswith("gradient accumulation over 2") for x in r["reasons"])
        # Within what the plan fitted to the memory: the estimate, plus under FSDP2 the one
        # unit's sharded gradient kept free for a reduce-scatter output allocated before its
        # input is freed, which on gloo happens in some steps and not in others
        # (`decide.cost.reserve_bytes`; 0 under DDP). FULL_SHARD measured up to 1.5 KiB above
        # the estimate alone in 2 of the 4 runs seen.
        bound = r["estimated"] + r["reserve"]
        assert r["measured"] <= bound, (r["measured"], r["estimated"], r["reserve"])


def test_layer_drop_is_found_where_a_model_keeps_a_probability_above_zero() -> None:
    """M2M100 skips each layer with probability 0.05 in training (its default); Whisper keeps
    0.0, Llama none: only the first needs DDP's search for unused parameters every step."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        M2M100Config,
        M2M100ForConditionalGeneration,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    from autoshard.strategies.engines import layer_drop

    tokens = {"vocab_size": 128, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    seq2seq = {
        **tokens,
        "decoder_start_token_id": 2,
        "d_model": 32,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
    }
    m2m = M2M100ForConditionalGeneration(M2M100Config(**seq2seq))
    assert layer_drop(m2m) == "'model.encoder.layerdrop' is 0.05"
    m2m.config.encoder_layerdrop = 0.0  # read from the modules, which keep their own
    assert layer_drop(m2m) == "'model.encoder.layerdrop' is 0.05"
    m2m.model.encoder.layerdrop = m2m.model.decoder.layerdrop = 0.0
    assert layer_drop(m2m) is None
    whisper = WhisperConfig(**seq2seq, num_mel_bins=8, max_source_positions=16)
    assert layer_drop(WhisperForConditionalGeneration(whisper)) is None
    llama = LlamaConfig(
        **tokens, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    assert layer_drop(LlamaForCausalLM(llama)) is None
