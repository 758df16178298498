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
by phase as a first launch (`_gpu_prepare.first_launch`: the cache on in an empty directory, the
device's and host's figures forgotten), in one of the `MODES`:
- "auto": every choice left to autoshard, with its trial step;
- "full_shard", "ddp", "full_shard_ac": that strategy forced (every block checkpointed for the
  last), no trial: FSDP2 on NCCL, DDP's buckets, checkpointed blocks at world 1, which the auto
  plan of a small model never chooses;
then one step and three measured steps of the prepared model, the estimate (tensor terms and
cuBLAS workspaces) against `torch.cuda.max_memory_allocated` (`_gpu_accuracy`: on the CPU dry
run, the live tensor bytes, blind to kernels' scratch memory). Mode by mode, every family's row
before the next mode's, the families whose CUDA paths were never seen first: the section's budget
skips what it cannot hold; `--sections external --budget external=540` runs it alone over more.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from _gpu_accuracy import Meter, figures, row_problems, run_steps, summary
from _gpu_prepare import DECISION_TARGET_S, _Phases, decisions, first_launch, rows_within

# First the families whose CUDA paths no GPU run has seen (RESULTS.md's owed lists), then the
# rest of the zoo in its own order
FIRST = ("mamba", "clip", "wav2vec2", "swin", "segformer", "denoiser", "whisper", "mixtral")
# The dry run (CPU): a transformers decoder with a tied head and a dict batch
DRY_ORDER = ("gpt2",)
# How each row prepares, in the order the rows run: every choice left to autoshard (with its
# trial), then strategies forced (no trial), FULL_SHARD first (FSDP2 on NCCL), DDP (its buckets),
# FULL_SHARD with every block checkpointed
FORCED = {"trial_step": False}
MODES: dict[str, dict[str, Any]] = {
    "auto": {},
    "full_shard": {"strategy": "full_shard", **FORCED},
    "ddp": {"strategy": "ddp", **FORCED},
    "full_shard_ac": {"strategy": "full_shard", "activation_checkpointing": True, **FORCED},
}


def order(dry_run: bool) -> list[str]:
    import zoo_external

    if dry_run:
        return list(DRY_ORDER)
    return [*FIRST, *(name for name in zoo_external.ENTRIES if name not in FIRST)]


def run(
    device: torch.device,
    dry_run: bool,
    deadline: float,
    progress: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Mode by mode (`MODES`), every family's row, as many as `deadline` (time.time()) holds;
    `progress` gets the result so far after each."""
    entries = [
        ({"model": name, "mode": mode}, functools.partial(measure, name, mode, device))
        for mode in MODES
        for name in order(dry_run)
    ]
    return rows_within(entries, device, deadline, progress, _result)


def measure(name: str, mode: str, device: torch.device) -> dict[str, Any]:
    """Family `name` prepared in `mode` as a first launch, then stepped and measured."""
    import zoo_external

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    meter = Meter(device)  # before the model: what it and its training allocate is counted
    built = zoo_external.build(name, device=device)
    timer = _Phases()
    prepared, total = first_launch(timer, built, **MODES[mode])
    plan = prepared.plan
    times = run_steps(prepared.model, built.optimizer, built.batch, built.loss_fn, meter, device)
    row = figures(plan, meter, times, None, None)
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
        prepare_s=total,
        **{f"{phase}_s": value for phase, value in timer.seconds.items()},
        fake_steps=timer.fake_steps,
        trial_step_s=trial[-1] if trial else None,
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
            **summary(done),  # the estimates against the targets
            "rows": len(done),
            "failed": len(rows) - len(done),
            "auto_rows": len(auto),
            **decisions(auto),  # prepare's time where it decided
        },
    }
