"""measure.known: a batch tensor whose elements are all one value (an attention mask of ones) is
followed through the fake step's operators and read back where the real step reads it, and
transformers' mask code takes the real step's branch on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from autoshard.measure.cache import describe_batch
from autoshard.measure.fake import fake_mode, fake_tensor, wider_fake_kernels
from autoshard.measure.known import KNOWN_NUMEL, transformers_reads_known_values, uniform_value

CPU = torch.device("cpu")


def _fast_all(tensor: torch.Tensor) -> torch.Tensor:
    """transformers' `masking_utils.fast_all`: is every element of a bool mask true."""
    return tensor.sum() == tensor.numel()


def test_a_batch_tensor_of_one_value_is_known_through_casts_slices_and_sums() -> None:
    mode = fake_mode()
    real = torch.ones(2, 8, dtype=torch.long)  # made outside the mode: the batch's values
    with mode:
        mask = fake_tensor(mode, real, CPU)
        padding = mask.to(torch.bool)[:, 2:]
        assert bool(_fast_all(padding))
        assert int(mask.sum()) == 16
        assert bool((mask == 1).all())
        assert not bool(padding.logical_not().any())
        assert bool(mask.unsqueeze(1).expand(2, 4, 8).reshape(-1).all())


def test_a_batch_tensor_of_several_values_is_not_known() -> None:
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, -2:] = 0
    mode = fake_mode()
    with mode:
        mask = fake_tensor(mode, padded, CPU)
        with pytest.raises(DataDependentOutputException):
            bool(_fast_all(mask.to(torch.bool)))


def test_a_value_written_over_in_place_or_through_a_view_is_forgotten() -> None:
    mode = fake_mode()
    real, another = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    with mode:
        mask = fake_tensor(mode, real, CPU)
        other = fake_tensor(mode, another, CPU)
        mask[0].zero_()
        with pytest.raises(DataDependentOutputException):
            bool(mask.all())
        assert bool(other.all())  # another tensor's value stays


def test_a_write_into_a_tensor_without_a_storage_forgets_every_value() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,))
    real = torch.ones(2, 8, dtype=torch.long)
    mode = fake_mode()
    with mode:
        fake_sparse = mode.from_tensor(sparse)
        mask = fake_tensor(mode, real, CPU)
        assert bool(mask.all())
        fake_sparse.mul_(2)  # no storage to tell it from the mask's: nothing is kept
        with pytest.raises(DataDependentOutputException):
            bool(mask.all())


def test_a_tensor_given_another_storage_or_reduced_across_ranks_is_forgotten() -> None:
    from autoshard.measure.fake import fake_mesh

    real, other = torch.ones(4, dtype=torch.long), torch.arange(4)
    with fake_mesh(4, 0, "cpu"):
        mode = fake_mode()
        with mode:
            mask = fake_tensor(mode, real, CPU)
            mask.set_(fake_tensor(mode, other, CPU))  # no schema says set_ writes its values
            with pytest.raises(DataDependentOutputException):
                bool(mask.all())
            count = fake_tensor(mode, real, CPU).sum()
            torch.distributed.all_reduce(count)  # the other ranks' counts are in it: never run
            with pytest.raises(DataDependentOutputException):
                int(count)


def test_values_are_held_as_their_dtype_holds_them() -> None:
    mode = fake_mode()
    with mode:
        assert torch.full((1,), -1, dtype=torch.uint8).item() == 255
        assert torch.full((1,), 70000.0, dtype=torch.float16).item() == float("inf")
        assert torch.full((2,), 0.1, dtype=torch.bfloat16).sum().item() == pytest.approx(0.2, 1e-2)
    signed = torch.tensor([-0.0, 0.0])
    assert uniform_value(signed) is None  # equal, but 1 / x tells them apart


def test_what_mixes_a_known_value_with_an_activation_or_draws_is_not_known() -> None:
    mode = fake_mode()
    real = torch.ones(2, 8)
    with mode:
        mask = fake_tensor(mode, real, CPU)
        activation = torch.randn(2, 8)
        with pytest.raises(DataDependentOutputException):
            bool((mask * activation).all())
        with pytest.raises(DataDependentOutputException):
            bool((torch.rand_like(mask) < 2).all())  # a draw is never run for real
        with pytest.raises(DataDependentOutputException):
            bool((torch.empty_like(mask) == 0).all())  # nor what leaves memory as it was


def test_small_tensors_made_full_of_one_value_are_known_large_ones_are_not() -> None:
    mode = fake_mode()
    with mode:
        activation = torch.randn(4, 3)
        assert not bool(torch.zeros_like(activation).any())
        assert int(torch.full((3,), 7).sum()) == 21
        assert bool(torch.ones(3, dtype=torch.bool).all())
        with pytest.raises(DataDependentOutputException):
            bool(torch.zeros(3, dtype=torch.complex64).abs().sum() == 0)  # complex: not kept
        large = torch.ones(KNOWN_NUMEL + 1, dtype=torch.bool)
        with pytest.raises(DataDependentOutputException):
            bool(large.all())


def _packed_sequence_indices(positions: torch.Tensor) -> torch.Tensor:
    """transformers' `masking_utils.find_packed_sequence_indices` before its early exit: each
    position's sequence, from where consecutive positions do not step by one."""
    first = positions[:, :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def test_positions_made_by_arange_carry_their_contents_through_what_is_computed_from_them() -> None:
    mode = fake_mode()
    with mode:
        positions = torch.arange(0, 8).unsqueeze(0).expand(2, -1)
        assert bool((_packed_sequence_indices(positions)[:, -1] == 0).all())  # one sequence
        assert int(positions.sum()) == 56
        packed = torch.cat([positions[:, :5], torch.arange(3).expand(2, -1)], dim=-1)
        assert bool((_packed_sequence_indices(packed)[:, -1] == 1).all())  # two sequences
        assert int(torch.arange(4, 20, 4).prod()) == 4 * 8 * 12 * 16  # start, end, step
        # what a write touches is forgotten
        written = torch.arange(8)
        written[3] = 100
        with pytest.raises(DataDependentOutputException):
            bool((written < 8).all())
        # mixed with an activation, or too many to hold: not known
        activation = torch.randn(8)
        with pytest.raises(DataDependentOutputException):
            bool((torch.arange(8) + activation > -100).all())
        with pytest.raises(DataDependentOutputException):
            bool((torch.arange(KNOWN_NUMEL + 1) >= 0).all())


def test_nn_transformer_checking_a_causal_mask_of_constants_is_traced_on_fake_tensors() -> None:
    """nn.Transformer reads whether its target mask is the causal one (`_detect_is_causal_mask`):
    a mask made of constants (`generate_square_subsequent_mask`) is known, so the step is traced
    on fake tensors, where it was measured on real ones."""
    import autoshard

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.transformer = nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)

        def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
            return self.transformer(self.embed(source), self.embed(target), tgt_mask=mask).sum()

    model = Seq2Seq()
    batch = (torch.randint(64, (4, 12)), torch.randint(64, (4, 8)))
    plan = autoshard.plan(model, torch.optim.AdamW(model.parameters()), batch, mixed_precision="no")
    text = " ".join(plan.reasons)
    assert "could not be traced" not in text and "not simulated" not in text, text


def test_a_mask_of_ones_longer_than_what_is_run_for_real_is_known_where_sizes_do_not_matter() -> (
    None
):
    """Outputs above `KNOWN_NUMEL` are not made for real: a cast or an elementwise operator is
    run on one element, a view carries its input's value. The real step drops a mask of ones at
    any length; known only up to a million elements, the estimate jumped 8.9% at 8,193 x 128
    tokens and the largest-batch search stopped there (8,192 rows, against 31,075 found now)."""
    rows = KNOWN_NUMEL // 64 + 1
    ones = torch.ones(rows, 64, dtype=torch.long)  # made outside the mode: the batch's values
    padded = torch.ones(rows, 64, dtype=torch.long)
    padded[-1, -1] = 0
    mode = fake_mode()
    with mode:
        mask = fake_tensor(mode, ones, CPU)
        padding = mask.to(torch.bool)  # a cast
        assert bool(_fast_all(padding))  # a sum of the whole, a comparison
        assert not bool(padding.logical_not().any())  # elementwise
        expanded = padding[:, None, None, :].expand(rows, 2, 64, 64)  # views, 2**25 elements
        assert bool(expanded[-1, -1, -1, -1])
        assert int((mask * 3 - 1).amax()) == 2  # elementwise on a scalar
        assert bool((mask.float() == mask).all())  # two known tensors, two dtypes
        with pytest.raises(DataDependentOutputException):
            bool(mask.view(torch.float64).sum() > 0)  # a view of its bits: not the same value
        with pytest.raises(DataDependentOutputException):
            int(mask.cumsum(-1).amax())  # its value depends on the sizes
        unknown = fake_tensor(mode, padded, CPU)
        with pytest.raises(DataDependentOutputException):
            bool(_fast_all(unknown.to(torch.bool)))


def test_a_mask_of_one_value_selects_all_or_nothing_forward_and_backward_with_no_real_step() -> (
    None
):
    """`nonzero` of a mask that carries a value, which indexing with a boolean mask calls: every
    element or none, wherever it is asked (the backward's `index_put` too). Writing through the
    mask (`new[mask] = x`) forgets the written tensor's values, not the mask's: it forgot both,
    and the backward's indexing then raised."""
    mode = fake_mode()
    with wider_fake_kernels("cpu"), mode:
        hidden = torch.randn(2, 5, 3, requires_grad=True)
        lang_ids = 0 * torch.ones(2)  # as X-MOD makes its default language's ids
        chosen, other = lang_ids == 0, lang_ids == 1
        assert hidden[chosen].shape == (2, 5, 3) and hidden[other].shape == (0, 5, 3)
        assert hidden.masked_select(chosen[:, None, None]).shape == (30,)
        assert torch.nonzero(other).shape == (0, 1)
        new = torch.zeros_like(hidden)
        new[chosen] = hidden[chosen] * 2
        new.sum().backward()
        assert hidden.grad is not None and hidden.grad.shape == hidden.shape
        with pytest.raises(DynamicOutputShapeException):
            torch.nonzero(torch.randn(4) > 0)  # values unknown: torch's own, which raises


class _Adapters(nn.Module):
    """Language adapters as X-MOD routes them: ids of the default language made by
    `torch.ones`, each adapter's rows picked and written back with a boolean mask."""

    def __init__(self, width: int = 32, languages: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.adapters = nn.ModuleList(nn.Linear(width, width) for _ in range(languages))
        self.head = nn.Linear(width, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        lang_ids = 0 * torch.ones(ids.shape[0], device=ids.device)
        routed = torch.zeros_like(hidden)
        for index, adapter in enumerate(self.adapters):
            mask = lang_ids == index
            routed[mask] = adapter(hidden[mask])
        return self.head(hidden + routed).logsumexp(-1).mean()


def test_a_model_routing_by_a_language_id_it_makes_is_simulated_built_or_on_meta() -> None:
    """The thirtieth session's sweep: X-MOD was never simulated (+3.0%, by formula), and built
    on meta it could not be planned at all."""
    import autoshard

    ids = torch.randint(0, 64, (4, 16))
    estimates = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = _Adapters()
        where = {} if device == "cpu" else dict(world_size=1, device="cpu", device_memory="8GiB")
        plan = autoshard.plan(
            model,
            torch.optim.AdamW(model.parameters()),
            ids,
            loss_fn=lambda out, _: out,
            mixed_precision="no",
            activation_checkpointing=0,
            **where,
        )
        said = " ".join(plan.reasons)
        assert "not simulated" not in said and "could not be traced" not in said, plan.reasons
        estimates.append(plan.chosen.estimated_peak_bytes)
    assert estimates[0] == estimates[1]


def test_uniform_value_of_real_tensors() -> None:
    assert uniform_value(torch.ones(3, 4, dtype=torch.long)) == 1
    assert uniform_value(torch.zeros(5, dtype=torch.bool)) is False
    assert uniform_value(torch.tensor([1, 0])) is None
    assert uniform_value(torch.ones(0)) is None
    assert uniform_value(torch.ones(2, device="meta")) is None
    assert uniform_value(torch.ones(KNOWN_NUMEL + 1, dtype=torch.bool)) is True  # any size
    late = torch.ones(KNOWN_NUMEL + 1, dtype=torch.long)
    late[-1] = 0  # past the first look
    assert uniform_value(late) is None
    assert uniform_value(torch.tensor([0.0, -0.0])) is None  # 1 / x tells them
    assert uniform_value(torch.zeros(3, dtype=torch.bits8)) is None  # no comparison for bits


def test_the_cache_tells_a_mask_of_ones_from_a_padded_one() -> None:
    ids = torch.randint(0, 10, (2, 8))
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    ones = describe_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert ones == describe_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert ones != describe_batch({"input_ids": ids, "attention_mask": padded})


def test_transformers_sees_a_fake_tensor_of_known_value_as_real_while_a_fake_mode_runs() -> None:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "is_fake_tensor"):
        pytest.skip("this transformers does not take fake tensors for tracing")
    original = import_utils.is_fake_tensor
    ones, padded = torch.ones(2, 8, dtype=torch.bool), torch.ones(2, 8, dtype=torch.bool)
    padded[0, -2:] = False
    ids = torch.zeros(2, 8, dtype=torch.long)  # token ids of one value: no mask
    mode = fake_mode()
    with mode:
        known = fake_tensor(mode, ones, CPU)
        unknown = fake_tensor(mode, padded, CPU)
        known_ids = fake_tensor(mode, ids, CPU)
        assert not import_utils.is_tracing(known)
        assert import_utils.is_tracing(unknown)
        # transformers guards reading other tensors with it (`pad_token_id in input_ids[:, [-1,
        # 0]]`): only masks are answered
        assert import_utils.is_tracing(known_ids)
        # a tensor the step made whose values are known (the packed-sequence indices of the
        # positions it made) is read, as the real step reads it
        assert not import_utils.is_tracing(_packed_sequence_indices(torch.arange(8)[None]))
        with transformers_reads_known_values():  # nested: the outermost puts it back
            assert not import_utils.is_tracing(known)
        assert not import_utils.is_tracing(known)
    assert import_utils.is_fake_tensor is original


def test_an_encoder_given_token_ids_of_one_value_and_no_mask_is_still_simulated() -> None:
    """transformers warns where the last or first token is padding and no mask was given: it
    reads `pad_token_id in input_ids[:, [-1, 0]]` unless `is_tracing(input_ids)`. Token ids of
    one value (a smoke test's zeros) are known, the index is not: answering no there failed
    the fake step."""
    transformers = pytest.importorskip("transformers")
    import autoshard

    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        pad_token_id=0,
    )
    model = transformers.BertForMaskedLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long)
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        {"input_ids": ids, "labels": ids},
        mixed_precision="no",
        activation_checkpointing=0,
    )
    assert any("simulated" in reason for reason in plan.reasons), plan.reasons


def _qwen2(device: str = "cpu") -> torch.nn.Module:
    """A grouped-query-attention decoder (8 heads, 1 key/value head)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=1,
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.Qwen2ForCausalLM(config)


@pytest.mark.parametrize("device", ["cpu", "meta"], ids=["built", "what-if on meta"])
def test_a_decoder_given_a_mask_of_ones_is_estimated_as_without_it(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The real step drops a mask of ones and attends with `is_causal` on the key/value heads as
    they are; one with padding it builds, and repeats the keys and values for every head. The
    simulation built the mask and repeated them for both: the mask of ones planned 264,192 B
    above the same batch without it (7%), all of it the padded batch's extra. A model on meta
    has its batch moved there: the mask keeps its one value (`_batch.batch_for_meta`)."""
    import autoshard

    where = {} if device == "cpu" else dict(world_size=1, device="cpu", device_memory="8GiB")

    monkeypatch.setenv("AUTOSHARD_CACHE", "0")
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[0, -16:] = 0
    masks = {"none": None, "ones": torch.ones_like(ids), "padded": padded}
    peaks = {}
    for name, mask in masks.items():
        batch = {"input_ids": ids, "labels": ids}
        if mask is not None:
            batch["attention_mask"] = mask
        model = _qwen2(device)
        optimizer = torch.optim.AdamW(model.parameters())
        plan = autoshard.plan(
            model, optimizer, batch, mixed_precision="no", activation_checkpointing=0, **where
        )
        assert any("simulated" in reason for reason in plan.reasons)
        peaks[name] = plan.chosen.estimated_peak_bytes
        # a plan that took the mask-free branch on the batch's values says so
        said = "transformers' mask code found the attention mask all true"
        assert any(said in reason for reason in plan.reasons) == (name == "ones"), plan.reasons
    mask_bytes = ids.numel() * ids.element_size()
    assert 0 <= peaks["ones"] - peaks["none"] <= mask_bytes
    assert peaks["padded"] - peaks["ones"] > 64 * mask_bytes  # the mask built, heads repeated


@pytest.mark.parametrize("device", ["cpu", "meta"], ids=["built", "what-if on meta"])
def test_a_decoder_trained_without_its_cache_and_no_mask_is_estimated_as_with_it(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Without a cache (`use_cache=False`, which `gradient_checkpointing_enable` sets on the
    model) and without an attention mask, transformers asks whether the positions it made hold
    packed sequences (`find_packed_sequence_indices`), unless they are fake (`is_tracing`):
    the simulation then kept their indices, built the mask and repeated the keys and values
    for every head, where the real step finds one sequence a row and drops the mask, with or
    without the cache. A Llama-shaped model of 4 layers, 2 x 128 tokens: 8.9% above its
    measured peak, where with the cache it was exact."""
    import autoshard

    where = {} if device == "cpu" else dict(world_size=1, device="cpu", device_memory="8GiB")
    monkeypatch.setenv("AUTOSHARD_CACHE", "0")
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for use_cache in (True, False):
        model = _qwen2(device)
        model.config.use_cache = use_cache
        plan = autoshard.plan(
            model,
            torch.optim.AdamW(model.parameters()),
            {"input_ids": ids, "labels": ids},
            mixed_precision="no",
            activation_checkpointing=0,
            **where,
        )
        assert any("simulated" in reason for reason in plan.reasons)
        peaks[use_cache] = plan.chosen.estimated_peak_bytes
    assert peaks[False] == peaks[True]


def test_a_what_if_plan_given_a_mask_of_ones_of_millions_of_tokens_drops_it_as_training_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above `KNOWN_NUMEL` tokens the mask of ones was planned as padded (the thirtieth
    session's sweep: +8.9% at 8,193 x 128 tokens on a Qwen3-shaped model, and `max_batch`
    stopped at 8,192 rows for it), though the real step drops it at any length: the mask costs
    what its bytes cost, per byte the same at 8 rows and at a million tokens."""
    import autoshard

    monkeypatch.setenv("AUTOSHARD_CACHE", "0")
    seq = 128
    cost = {}
    for rows in (8, KNOWN_NUMEL // seq + 1):
        ids = torch.randint(0, 128, (rows, seq))
        peaks = {}
        for name in ("none", "ones"):
            batch = {"input_ids": ids, "labels": ids}
            if name == "ones":
                batch["attention_mask"] = torch.ones_like(ids)
            model = _qwen2("meta")
            plan = autoshard.plan(
                model,
                torch.optim.AdamW(model.parameters()),
                batch,
                world_size=1,
                device="cuda",  # not "cpu", which times kernels' scratch on real tensors
                device_memory="64GiB",
                mixed_precision="no",
                activation_checkpointing=0,
            )
            peaks[name] = plan.chosen.estimated_peak_bytes
        cost[rows] = (peaks["ones"] - peaks["none"]) / (ids.numel() * ids.element_size())
    small, large = cost.values()
    assert small > 0
    assert large == pytest.approx(small, rel=0.01), cost


def test_a_batch_moved_to_meta_keeps_its_one_values_cut_repeated_and_pickled() -> None:
    import pickle

    from autoshard._batch import batch_for_meta, first_rows, resized

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    moved, note = batch_for_meta(model, batch)
    assert note is not None and "one value" in note
    assert uniform_value(moved["attention_mask"]) == 1
    assert uniform_value(moved["input_ids"]) is None
    assert uniform_value(first_rows(moved, 2, 1)["attention_mask"]) == 1
    assert uniform_value(resized(moved, 2, 5)["attention_mask"]) == 1
    assert uniform_value(pickle.loads(pickle.dumps(moved))["attention_mask"]) == 1  # a worker's
    assert uniform_value(batch["attention_mask"]) == 1  # the caller's batch is left as it was
    assert not hasattr(batch["attention_mask"], "autoshard_one_value")
