"""GPU suite, the external zoo on the device (`gpu_suite.py` section "external").

The suite's other sections use GPU-sized models of a few families written here; the held-out
families a user brings are closer to `benchmarks/zoo_external.py`: real model classes nobody in
this project wrote (transformers, peft, plain torch), checked on the CPU against gloo's allocation
profile and never on a GPU. What only the device shows: CUDA's kernels (Mamba's scan in torch,
CLIP's parameter of no dimension under FSDP2 on NCCL, wav2vec2's masking, Swin's roll and
Segformer's upsampling), cuBLAS's workspaces beside small models, the foreach AdamW CUDA runs by
default, and issue 24's "on a GPU `prepare()` of each external family within 5 s plus its trial
step".

Each family, as a `torchrun --nproc-per-node 1` user's script runs it: one rank of a one-rank
process group (NCCL; gloo on the CPU dry run), the model and batch on the device, AdamW with its
defaults (foreach on CUDA), then `autoshard.prepare(model, optimizer, batch, loss_fn=...)` timed
by phase (`_gpu_prepare.timed_prepare`) in one of the `MODES`:
- "auto": every choice left to autoshard, with its trial, as a first launch (the cache on in an
  empty directory, what the process measured before forgotten): issue 24's time;
- "full_shard", "ddp", "full_shard_ac": that strategy forced (every block checkpointed for the
  last), no trial, the cache off and the device's figures kept: FSDP2 on NCCL, DDP's buckets,
  checkpointed blocks at world 1, which the auto plan of a small model never chooses;
then one step and three measured steps of the prepared model, the estimate (tensor terms and
cuBLAS workspaces) against `torch.cuda.max_memory_allocated` (`_gpu_accuracy`: on the CPU dry
run, the live tensor bytes, blind to kernels' scratch memory). A small model's peak is mostly
the workspaces (2 x 32 MiB on an H100), which hide an error in its tensors: each row also gives
the error with them left out of both sides (`tensor_error`; the measured ones freed after the
steps to find their size). The rows run in `order`, the most telling first: the section's budget
skips what it cannot hold; `--sections external --budget external=540` runs it alone over more.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from _gpu_accuracy import (
    Meter,
    figures,
    held_workspace_bytes,
    row_problems,
    run_steps,
    summary,
)
from _gpu_prepare import DECISION_TARGET_S, _Phases, decisions, rows_within, timed_prepare

# First the families whose CUDA paths no GPU run has seen (RESULTS.md's owed lists), then the
# rest of the zoo in its own order
FIRST = ("mamba", "clip", "wav2vec2", "swin", "segformer", "denoiser", "whisper", "mixtral")
# The dry run (CPU): a transformers decoder with a tied head and a dict batch
DRY_ORDER = ("gpt2",)
# How each row prepares: every choice left to autoshard, as a first launch with its trial; then
# a strategy forced, no trial, the process's measured figures kept (the plan made again): FSDP2
# on NCCL, DDP's buckets, every block checkpointed
FORCED = {"trial_step": False}
MODES: dict[str, dict[str, Any]] = {
    "auto": {},
    "full_shard": {"strategy": "full_shard", **FORCED},
    "ddp": {"strategy": "ddp", **FORCED},
    "full_shard_ac": {"strategy": "full_shard", "activation_checkpointing": True, **FORCED},
}


def order(dry_run: bool) -> list[tuple[str, str]]:
    """(family, mode) in the order the rows run, most telling first, as the suite's budget holds
    the first few: the first families' auto and FULL_SHARD rows (the CUDA kernels and FSDP2 on
    NCCL no GPU run has seen), then mode by mode the rest."""
    import zoo_external

    if dry_run:
        return [(name, mode) for mode in MODES for name in DRY_ORDER]
    rest = [name for name in zoo_external.ENTRIES if name not in FIRST]
    rows = [(name, mode) for name in FIRST for mode in ("auto", "full_shard")]
    rows += [(name, mode) for mode in ("auto", "full_shard") for name in rest]
    rows += [(name, mode) for mode in MODES if mode not in ("auto", "full_shard") for name in
             (*FIRST, *rest)]  # fmt: skip
    return rows


def run(
    device: torch.device,
    dry_run: bool,
    deadline: float,
    progress: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The rows in `order`, as many as `deadline` (time.time()) holds; `progress` gets the
    result so far after each."""
    entries = [
        ({"model": name, "mode": mode}, functools.partial(measure, name, mode, device))
        for name, mode in order(dry_run)
    ]
    return rows_within(entries, device, deadline, progress, _result)


def measure(name: str, mode: str, device: torch.device) -> dict[str, Any]:
    """Family `name` prepared in `mode`, then stepped and measured."""
    import zoo_external

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    meter = Meter(device)  # before the model: what it and its training allocate is counted
    built = zoo_external.build(name, device=device)
    timer = _Phases()
    prepared, total = timed_prepare(timer, built, first_launch=mode == "auto", **MODES[mode])
    plan = prepared.plan
    times = run_steps(prepared.model, built.optimizer, built.batch, built.loss_fn, meter, device)
    row = figures(plan, meter, times, None, None)
    # The workspaces, a fixed 2 x 32 MiB on an H100, are most of a small model's peak: the
    # tensor terms' error, without them on both sides, beside the whole one
    held = held_workspace_bytes(device)
    tensors = row["measured_bytes"] - held
    estimated = row["estimate_bytes"] - row["footprint"]["workspace"]
    trial = [a.seconds for a in plan.attempts if a.seconds is not None]
    row.update(
        model=name,
        mode=mode,
        world_size=1,
        optimizer="default",
        strategy=plan.strategy.value,
        checkpointed=plan.activation_checkpointing,
        num_blocks=plan.num_blocks,
        mixed_precision=plan.mixed_precision.value,
        params=sum(p.numel() for p in built.model.parameters()),
        trainable=sum(p.numel() for p in built.model.parameters() if p.requires_grad),
        workspace_held_bytes=held,
        tensor_error=(estimated - tensors) / tensors,
        prepare_s=total,
        **{f"{phase}_s": value for phase, value in timer.seconds.items()},
        fake_steps=timer.fake_steps,
        trial_steps_s=trial[-1] if trial else None,  # its two steps (a fresh optimizer)
        decision_within_target=timer.seconds["decision"] <= DECISION_TARGET_S,
    )
    row["problems"] = row_problems(row)
    del prepared, built, plan
    return row


def _result(rows: list[dict[str, Any]], skipped: list[str]) -> dict[str, Any]:
    done = [r for r in rows if "failed" not in r]
    auto = [r for r in done if r["mode"] == "auto"]
    return {
        "rows": rows,
        "skipped": skipped,
        "target_s": DECISION_TARGET_S,
        "summary": {
            **_summarised(done, "error"),  # the estimates against issue 22's targets
            "tensors": _summarised(done, "tensor_error"),  # the same, workspaces left out
            "rows": len(done),
            "failed": len(rows) - len(done),
            "auto_rows": len(auto),
            **decisions(auto),  # prepare's time where it decided, as a first launch
        },
    }


def _summarised(rows: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """`summary` of the rows with `field` as their error, its worst row named by family and mode
    (`summary`'s label names the strategy the plan chose: two modes alike); `met` None where no
    row was measured."""
    if not rows:
        return {"configurations": 0, "met": None}
    found = summary([{**r, "error": r[field]} for r in rows])
    worst = max(rows, key=lambda r: abs(r[field]))
    return {**found, "worst_at": f"{worst['model']} {worst['mode']}"}
