"""`autoshard.accelerate_kwargs`: a Plan as accelerate's own configuration.

One process: the objects it returns are valid for the installed accelerate (their
`__post_init__` validation ran) and carry the plan's choices; accelerate's own FSDP2 auto-wrap
policy, built from the plugin, selects exactly the blocks autoshard found.

Under `accelerate launch` on 2 CPU processes (tests/workers/accel.py, one launch): `autoshard.plan`
before any process group plans for the launched ranks; `prepare` works unchanged; an
`Accelerator` built from a DDP plan trains in step with a single-process reference. accelerate
1.15 runs FSDP only on accelerators: on CPU it ignores the plugin and wraps in DDP (recorded, and
warned about). Its FSDP2 preparation is run anyway by setting the distributed type it would set on
a GPU, to check what the plugin makes of the model: units, resharding, checkpointing, tied
weights.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import ACCELERATE, Launch, launch
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import autoshard
import autoshard.io.accelerate
from autoshard.decide.blocks import find_blocks

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from _common import ScalarNet, build, global_batches, shard  # noqa: E402

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
RTOL_FP32 = 1e-4  # as tests/test_distributed.py: reduction order only


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def _plan(model: nn.Module | None = None, **options: Any) -> tuple[autoshard.Plan, nn.Module]:
    if model is None:
        model, _ = build()
    optimizer = torch.optim.AdamW(model.parameters())
    options = {"world_size": 2, "device_memory": "1GiB", "mixed_precision": "no", **options}
    return autoshard.plan(model, optimizer, shard(global_batches(1)[0], 0), **options), model


def _kwargs(plan: autoshard.Plan, model: nn.Module) -> tuple[dict[str, Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = autoshard.accelerate_kwargs(plan, model)
    return kwargs, [str(w.message) for w in caught]


def test_exported() -> None:
    assert "accelerate_kwargs" in autoshard.__all__


# ---------------------------------------------------------------------------------------------
# FSDP plans


@pytest.mark.parametrize(("strategy", "reshard"), [("full_shard", True), ("shard_grad_op", False)])
def test_sharded_plan_is_an_fsdp2_plugin(strategy: str, reshard: bool) -> None:
    plan, model = _plan(strategy=strategy, activation_checkpointing=0)
    kwargs, _ = _kwargs(plan, model)
    plugin = kwargs["fsdp_plugin"]
    assert isinstance(plugin, FullyShardedDataParallelPlugin)
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is reshard
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.activation_checkpointing is False
    assert plugin.mixed_precision_policy is None
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert kwargs["mixed_precision"] == "no"
    assert "kwargs_handlers" not in kwargs


def test_cpu_offload_plan_is_the_plugin_with_cpu_offload() -> None:
    plan, model = _plan(strategy="full_shard")
    # CPU_OFFLOAD is a candidate only on CUDA: the same plan as it would come out there
    plan = replace(plan, strategy=autoshard.Strategy.CPU_OFFLOAD, cpu_offload=True)
    kwargs, _ = _kwargs(plan, model)
    plugin = kwargs["fsdp_plugin"]
    assert plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)


def test_hybrid_shard_plan_is_refused_with_what_accelerate_needs() -> None:
    plan, model = _plan(strategy="full_shard")
    plan = replace(plan, strategy=autoshard.Strategy.HYBRID_SHARD)
    with pytest.raises(ValueError, match="HYBRID_SHARD.*ParallelismConfig.*autoshard.prepare"):
        autoshard.accelerate_kwargs(plan, model)


def test_a_sharded_plan_of_parameters_of_no_dimension_is_refused_for_accelerate() -> None:
    """prepare keeps them whole under FSDP2 and averages their gradients; accelerate's plugin
    would call fully_shard on them (refused) or, as ignored modules, not average them."""
    model, _ = build(cls=ScalarNet)
    plan, model = _plan(model, strategy="full_shard")
    with pytest.raises(
        ValueError, match=r"5 parameter\(s\) of no dimension.*'temperature'.*autoshard.prepare"
    ):
        autoshard.accelerate_kwargs(plan, model)
    plan, model = _plan(model, strategy="ddp")
    kwargs, _ = _kwargs(plan, model)
    assert "fsdp_plugin" not in kwargs


@pytest.mark.parametrize(("mp", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_is_the_string_and_the_fsdp2_policy(mp: str, dtype: torch.dtype) -> None:
    plan, model = _plan(strategy="full_shard", mixed_precision=mp)
    kwargs, _ = _kwargs(plan, model)
    assert kwargs["mixed_precision"] == mp
    # As prepare applies it: compute in the low dtype, reduce gradients in fp32.
    policy = kwargs["fsdp_plugin"].mixed_precision_policy
    assert policy == MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


@pytest.mark.parametrize(
    ("checkpointed", "expected", "warns"), [(0, False, False), (2, True, True), (4, True, False)]
)
def test_checkpointing_a_number_of_blocks_becomes_all_or_none(
    checkpointed: int, expected: bool, warns: bool
) -> None:
    plan, model = _plan(strategy="full_shard", activation_checkpointing=checkpointed)
    assert plan.activation_checkpointing == checkpointed
    kwargs, caught = _kwargs(plan, model)
    assert kwargs["fsdp_plugin"].activation_checkpointing is expected
    all_or_none = [w for w in caught if "all of them or none" in w]
    assert bool(all_or_none) is warns, caught
    if warns:
        assert "checkpoints 2 of 4 blocks" in all_or_none[0] and "all 4 will be" in all_or_none[0]


def _units(plugin: FullyShardedDataParallelPlugin, model: nn.Module) -> list[str]:
    """The modules accelerate's own FSDP2 preparation would fully_shard (besides the root)."""
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert policy is not None
    return [name for name, module in model.named_modules() if name and policy(module)]


def test_accelerate_wraps_exactly_the_blocks_autoshard_found() -> None:
    plan, model = _plan(strategy="full_shard")
    kwargs, _ = _kwargs(plan, model)
    assert _units(kwargs["fsdp_plugin"], model) == [n for n, _ in find_blocks(model)]
    kwargs["fsdp_plugin"].set_auto_wrap_policy(model)  # what Accelerator.prepare calls first


@pytest.mark.parametrize(("name", "cls"), [("gpt2", "GPT2Block"), ("llama", "LlamaDecoderLayer")])
def test_accelerate_wraps_exactly_the_blocks_of_hf_models(name: str, cls: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from _hf import build as build_hf

    model = build_hf(name)
    ids = torch.randint(128, (2, 8))
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        {"input_ids": ids, "labels": ids},
        world_size=2,
        device_memory="1GiB",
        strategy="full_shard",
        mixed_precision="no",
    )
    kwargs, _ = _kwargs(plan, model)
    assert kwargs["fsdp_plugin"].transformer_cls_names_to_wrap == [cls]
    assert _units(kwargs["fsdp_plugin"], model) == [n for n, _ in find_blocks(model)]


def test_block_class_used_elsewhere_warns() -> None:
    """accelerate wraps by class name: a Sequential block class also matches the Sequential head."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)
            )
            self.head = nn.Sequential(nn.Linear(16, 4))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x), y)

    torch.manual_seed(0)
    model = Model()
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        (torch.randn(4, 16), torch.randint(4, (4,))),
        world_size=2,
        device_memory="1GiB",
        strategy="full_shard",
        mixed_precision="no",
    )
    _, caught = _kwargs(plan, model)
    assert any("wraps modules by class name" in w and "'head'" in w for w in caught), caught


def test_a_tied_module_of_the_block_class_is_refused_before_accelerate_wraps_it() -> None:
    """The last block shares its weight with the head: autoshard keeps it in the root unit, but
    accelerate, wrapping by class name, would make it a unit and FSDP2 would refuse it."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 16)
            self.head.weight = self.blocks[2].weight  # tied

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x), y)

    torch.manual_seed(0)
    model = Model()
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        (torch.randn(4, 16), torch.randint(16, (4,))),
        world_size=2,
        device_memory="1GiB",
        strategy="full_shard",
        mixed_precision="no",
    )
    assert plan.num_blocks == 2, plan.reasons  # blocks.2 stays in the root
    with pytest.raises(ValueError, match=r"'blocks\.2' \(Linear, the class of the blocks\) shares"):
        autoshard.accelerate_kwargs(plan, model)


# ---------------------------------------------------------------------------------------------
# DDP and one-process plans, and what is not expressible


def _with_unused() -> nn.Module:
    model, _ = build()
    model.unused = nn.Linear(4, 4)
    return model


@pytest.mark.parametrize("unused", [False, True])
def test_ddp_plan_is_ddp_kwargs(unused: bool) -> None:
    plan, model = _plan(_with_unused() if unused else None, strategy="ddp")
    assert plan.unused_parameters == (("unused.weight", "unused.bias") if unused else ())
    kwargs, caught = _kwargs(plan, model)
    assert "fsdp_plugin" not in kwargs and caught == []
    (handler,) = kwargs["kwargs_handlers"]
    assert isinstance(handler, DistributedDataParallelKwargs)
    # to_kwargs(): what accelerate passes to DistributedDataParallel (the non-default values)
    expected = {"gradient_as_bucket_view": True}
    if unused:
        expected["find_unused_parameters"] = True
    assert handler.to_kwargs() == expected


def test_ddp_plan_with_checkpointing_warns() -> None:
    plan, model = _plan(strategy="ddp", activation_checkpointing=2)
    _, caught = _kwargs(plan, model)
    assert any("accelerate checkpoints activations only with fsdp_plugin" in w for w in caught)


def test_one_process_plan_is_only_mixed_precision() -> None:
    plan, model = _plan(world_size=1)
    assert plan.strategy == autoshard.Strategy.LOCAL
    kwargs, _ = _kwargs(plan, model)
    assert set(kwargs) - {"cpu"} == {"mixed_precision"}


def test_cpu_flag_and_fsdp_warning_only_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, model = _plan(strategy="full_shard")
    monkeypatch.setattr(autoshard.io.accelerate, "_cuda", lambda: False)
    kwargs, caught = _kwargs(plan, model)
    assert kwargs["cpu"] is True
    assert any("accelerate runs FSDP only on accelerators" in w for w in caught), caught
    monkeypatch.setattr(autoshard.io.accelerate, "_cuda", lambda: True)
    kwargs, caught = _kwargs(plan, model)
    assert "cpu" not in kwargs and caught == []


def test_plan_of_another_model_is_refused() -> None:
    plan, _ = _plan()
    other, _ = build(depth=3)
    with pytest.raises(ValueError, match="4 repeated block.*this model has 3"):
        autoshard.accelerate_kwargs(plan, other)


def test_plan_before_the_process_group_plans_for_the_launched_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun / accelerate launch an Accelerator script plans before any process group
    exists; the plan is still for the launched number of ranks."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    model, optimizer = build()
    plan = autoshard.plan(model, optimizer, shard(global_batches(1)[0], 0), mixed_precision="no")
    assert plan.world_size == 4
    assert plan.strategy != autoshard.Strategy.LOCAL
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------
# Under accelerate launch, 2 CPU processes


@pytest.fixture(scope="module")
def accel(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return launch("accel", Path(tmp_path_factory.mktemp("accel")), launcher=ACCELERATE)


def _mean(ranks: list[dict[str, Any]]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks), strict=True)]


def _assert_matches_reference(accel: Launch, ranks: list[dict[str, Any]]) -> None:
    expected = accel.case("reference")[0]["losses"]
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0], "each rank trains on its own half"
    assert _mean(ranks) == pytest.approx(expected, rel=RTOL_FP32, abs=0), (_mean(ranks), expected)


@pytest.mark.dist
def test_accelerate_launch_finished_cleanly(accel: Launch) -> None:
    if accel.timed_out or accel.returncode != 0:
        pytest.fail(accel.report("the launch did not finish cleanly"), pytrace=False)
    accel.case("__finished__")


@pytest.mark.dist
def test_plan_under_accelerate_launch_is_for_both_processes(accel: Launch) -> None:
    for r in accel.case("plan_before_process_group"):
        assert r["launched_by_accelerate"]
        assert r["pg_before"] is False and r["pg_after"] is False, "plan() starts no group"
        assert r["world_size"] == 2
        assert r["strategy"] != "local"


@pytest.mark.dist
def test_prepare_works_unchanged_under_accelerate_launch(accel: Launch) -> None:
    ranks = accel.case("prepare_under_accelerate_launch")
    for r in ranks:
        assert r["reasons"][0].startswith("launched by accelerate launch with no GPU"), r
        assert r["backend"] == "gloo" and r["world_size"] == 2
        assert r["strategy"] == "full_shard" and r["is_fsdp"]
    _assert_matches_reference(accel, ranks)


@pytest.mark.dist
def test_accelerator_from_a_ddp_plan_trains_in_step(accel: Launch) -> None:
    ranks = accel.case("accelerator_ddp")
    for r in ranks:
        assert r["plan_world_size"] == 2
        assert r["kwargs"] == ["cpu", "kwargs_handlers", "mixed_precision"]
        assert r["warnings"] == [], "a DDP plan maps to accelerate without loss"
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["num_processes"] == 2
        assert r["is_ddp"]
        assert r["unused_parameters"] == ["unused.weight", "unused.bias"]
        assert r["find_unused_parameters"] is True, "else DDP fails on the second step"
        assert r["gradient_as_bucket_view"] is True
    _assert_matches_reference(accel, ranks)


@pytest.mark.dist
def test_accelerate_on_cpu_ignores_the_fsdp_plugin_and_autoshard_says_so(accel: Launch) -> None:
    ranks = accel.case("accelerator_fsdp_plan_on_cpu")
    for r in ranks:
        assert any("accelerate runs FSDP only on accelerators" in w for w in r["warnings"])
        # What accelerate 1.15 does with fsdp_plugin on CPU: DDP under MULTI_CPU.
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert not r["is_fsdp"] and r["wrapped_type"] == "DistributedDataParallel"
    _assert_matches_reference(accel, ranks)


@pytest.mark.dist
@pytest.mark.parametrize(("strategy", "reshard"), [("full_shard", True), ("shard_grad_op", False)])
def test_accelerates_fsdp2_path_with_the_plugin(
    accel: Launch, strategy: str, reshard: bool
) -> None:
    ranks = accel.case(f"forced_fsdp2_{strategy}")
    blocks = [f"blocks.{i}" for i in range(4)]
    for r in ranks:
        assert r["is_fsdp2"] and r["wrapped_type"] == "FSDPNet"
        units = r["reshard_after_forward"]
        assert sorted(units) == sorted(["<root>", *blocks]), units
        assert all(units[b] is reshard for b in blocks), units
        assert r["checkpointed"] == blocks, "the plan's 1 block becomes all 4 under accelerate"
    _assert_matches_reference(accel, ranks)


@pytest.mark.dist
def test_accelerates_fsdp2_path_keeps_hf_tied_weights(accel: Launch) -> None:
    ranks = accel.case("forced_fsdp2_gpt2_tied")
    if "skipped" in ranks[0]:
        pytest.skip(ranks[0]["skipped"])
    for r in ranks:
        assert r["tied"] and r["tied_after_step"]
        assert r["checkpointed"] == ["transformer.h.0", "transformer.h.1"]
        units = r["reshard_after_forward"]
        assert units["transformer.h.0"] is True and units["transformer.h.1"] is True
        # accelerate groups the tied embedding with ln_f and lm_head in one unit
        assert {"transformer.wte", "lm_head"} <= set(units)
