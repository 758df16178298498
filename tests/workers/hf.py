"""Hugging Face models (a tiny GPT-2 and a tiny Llama, tied embeddings) through prepare() with
every strategy: blocks from `_no_split_modules`, tied weights still one parameter after wrapping,
`output.loss` as the trial step's loss, and loss parity with a single-process reference.

The `zoo_*` cases (issue 12): BERT, ALBERT, T5, Whisper and GPT-2 under each forced strategy
(DDP and ZeRO-2 with every block checkpointed; GPT-2's are the cases above) and under `auto` with a
memory limit one byte below what the unchecked FULL_SHARD is estimated to need (below DDP's for
ALBERT, which has no blocks), each against its own single-process reference.

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 hf.py OUT_DIR
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from _common import LR, Cases, is_fsdp, rank, train
from _hf import MODELS, ZOO, build, global_batches, shard, tied, zoo_batches
from torch import nn

import autoshard
import autoshard.wrap.trial

STEPS = 4
STRATEGIES = ("ddp", "shard_grad_op", "full_shard", "auto")

cases = Cases()
# The plans of the cases so far, by "<model>_<strategy>": each zoo auto case's tight limit is set
# from them
_plans: dict[str, Any] = {}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


@contextlib.contextmanager
def _loss_spy() -> Iterator[list[bool]]:
    """Record, for each loss the trial step computes, whether it is the model's `output.loss`."""
    seen: list[bool] = []
    original = autoshard.wrap.trial.compute_loss

    def spy(output: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
        loss = original(output, batch, loss_fn)
        seen.append(loss is getattr(output, "loss", None))
        return loss

    autoshard.wrap.trial.compute_loss = spy
    try:
        yield seen
    finally:
        autoshard.wrap.trial.compute_loss = original


def _reference(name: str) -> list[float]:
    model = build(name)
    return train(model, _optimizer(model), global_batches(STEPS))


def _fsdp_unit_of(module: nn.Module, param: torch.Tensor) -> list[str]:
    """Names of the FSDP units (modules with fully_shard applied) that manage `param`."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for unit_name, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        if group is not None and any(p.sharded_param is param for p in group.fsdp_params):
            units.append(unit_name or "<root>")
    return units


def _prepared(name: str, strategy: str) -> dict[str, Any]:
    model = build(name)
    optimizer = _optimizer(model)
    batches = [shard(b, rank()) for b in global_batches(STEPS)]
    names_before = [n for n, _ in model.named_parameters()]
    blocks = [n for n, m in model.named_modules() if type(m).__name__ in model._no_split_modules]
    with _loss_spy() as seen:
        prepared = autoshard.prepare(
            model, optimizer, batches[0], strategy=strategy, mixed_precision="no"
        )
    wrapped, returned, plan = prepared
    _plans[f"{name}_{strategy}"] = plan
    embedding = model.get_input_embeddings().weight
    info: dict[str, Any] = {
        "strategy": plan.strategy.value,
        "num_blocks": plan.num_blocks,
        "reasons": list(plan.reasons),
        "attempts": [a.outcome.value for a in plan.attempts],
        "trial_losses_are_output_loss": seen,
        "is_ddp": isinstance(wrapped, nn.parallel.DistributedDataParallel),
        "is_fsdp": is_fsdp(wrapped),
        "optimizer_is_same": returned is optimizer,
        "tied_after_prepare": tied(model),
        "same_param_names": [n for n, _ in model.named_parameters()] == names_before,
        "optimizer_holds_embedding_once": sum(
            p is embedding for g in optimizer.param_groups for p in g["params"]
        )
        == 1,
        "embedding_units": _fsdp_unit_of(model, embedding) if is_fsdp(model) else [],
        "blocks": blocks,
        "block_is_fsdp": [is_fsdp(model.get_submodule(n)) for n in blocks],
    }
    info["losses"] = train(wrapped, optimizer, batches)
    info["tied_after_training"] = tied(model)
    return info


@cases.case
def reference() -> dict[str, Any]:
    """fp32, one process, the whole global batch each step; the same on both ranks."""
    return {name: _reference(name) for name in MODELS}


for _name in MODELS:
    for _strategy in STRATEGIES:
        cases.case(
            lambda n=_name, s=_strategy: _prepared(n, s),
            name=f"{_name}_{_strategy}",
        )


def _zoo(name: str, strategy: str, **options: Any) -> dict[str, Any]:
    model = build(name)
    optimizer = _optimizer(model)
    batches = [shard(b, rank()) for b in zoo_batches(name, STEPS)]
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], strategy=strategy, mixed_precision="no", **options
    )
    _plans[f"{name}_{strategy}"] = plan
    return {
        "strategy": plan.strategy.value,
        "activation_checkpointing": plan.activation_checkpointing,
        "num_blocks": plan.num_blocks,
        "reasons": list(plan.reasons),
        "attempts": [a.outcome.value for a in plan.attempts],
        "estimated": plan.estimated_peak_bytes,
        "measured": plan.measured_peak_bytes,
        "candidates": [
            (c.strategy.value, c.activation_checkpointing, c.estimated_peak_bytes)
            for c in plan.candidates
        ],
        "losses": train(wrapped, optimizer, batches),
    }


def _zoo_tight(name: str) -> dict[str, Any]:
    """auto under a limit no unchecked candidate fits (none but FSDP, for a model without
    blocks): it must shard and checkpoint."""
    below = "ddp" if _plans[f"{name}_ddp"].num_blocks == 0 else "full_shard"
    plan = _plans[f"{name}_{below}"]
    unchecked = next(c for c in plan.candidates if c.activation_checkpointing == 0)
    limit = unchecked.estimated_peak_bytes - 1
    return {"limit": limit, "below": below, **_zoo(name, "auto", memory_limit=limit)}


def _accumulating(strategy: str) -> dict[str, Any]:
    """GPT-2 with 2 micro-batches per optimizer step: the trial step runs both (gradient sync
    off on the first), and the estimate counts the gradients the first leaves alive."""
    from torch._subclasses.fake_tensor import is_fake

    model = build("gpt2")
    optimizer = _optimizer(model)
    batch = shard(global_batches(1)[0], rank())
    forwards: list[bool] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(not is_fake(kwargs["input_ids"])),
        with_kwargs=True,
    )
    _, _, plan = autoshard.prepare(
        model, optimizer, batch, strategy=strategy, mixed_precision="no", accumulation_steps=2
    )
    handle.remove()
    return {
        "real_forwards": sum(forwards),
        "attempts": [a.outcome.value for a in plan.attempts],
        "estimated": plan.estimated_peak_bytes,
        "reserve": plan.chosen.reserve_bytes,
        "measured": plan.measured_peak_bytes,
        "reasons": list(plan.reasons),
    }


for _strategy in ("ddp", "full_shard"):
    cases.case(lambda s=_strategy: _accumulating(s), name=f"accumulate_{_strategy}")


@cases.case
def zoo_reference() -> dict[str, Any]:
    """fp32, one process, the whole global batch each step; the same on both ranks."""
    references = {}
    for name in ZOO:
        model = build(name)
        references[name] = train(model, _optimizer(model), zoo_batches(name, STEPS))
    return references


for _name in ZOO:
    if _name != "gpt2":  # its forced strategies are the gpt2_* cases
        for _strategy, _checkpointing in (
            ("ddp", True),
            ("shard_grad_op", True),
            ("full_shard", "auto"),
        ):
            cases.case(
                lambda n=_name, s=_strategy, c=_checkpointing: _zoo(
                    n, s, activation_checkpointing=c
                ),
                name=f"zoo_{_name}_{_strategy}",
            )
    cases.case(lambda n=_name: _zoo_tight(n), name=f"zoo_{_name}_auto")


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main(init_process_group=False)
