"""What prepare() does to state the caller holds: an LR scheduler built before it, optimizer state
from steps already taken, and everything the trial step touches (parameters, buffers, optimizer
state, RNG), per forced strategy.

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 state.py OUT_DIR
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from _common import (
    Cases,
    build,
    full,
    global_batches,
    is_fsdp,
    local_batches,
    max_abs_diff,
    reference_losses,
    shard,
    train,
)
from torch.distributed.tensor import DTensor

import autoshard

STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
LR_FACTORS = (1.0, 0.5, 0.0)  # the scheduler's factor per epoch: halve, then stop

cases = Cases()


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    after = _full_params(model)
    return [n for n in before if not torch.equal(before[n], after[n])]


# ---------------------------------------------------------------------------------------------
# 5. An LR scheduler built before prepare() keeps driving the re-bound optimizer


def _scheduler(strategy: str) -> dict[str, Any]:
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: LR_FACTORS[min(epoch, len(LR_FACTORS) - 1)]
    )
    batches = local_batches(3)
    wrapped, returned, _ = autoshard.prepare(
        model, optimizer, batches[0], strategy=strategy, mixed_precision="no"
    )
    group = optimizer.param_groups[0]
    module_params = list(model.parameters())
    info: dict[str, Any] = {
        "optimizer_is_same": returned is optimizer,
        "scheduler_optimizer_is_same": scheduler.optimizer is optimizer,
        "group_params_are_module_params": len(group["params"]) == len(module_params)
        and all(a is b for a, b in zip(group["params"], module_params, strict=True)),
        "group_params_dtensor": [isinstance(p, DTensor) for p in group["params"]],
        "is_fsdp": is_fsdp(wrapped),
        "lrs": [group["lr"]],
        "changed_per_step": [],
    }
    for step, batch in enumerate(batches):
        before = _full_params(model)
        train(wrapped, optimizer, [batch])
        info["changed_per_step"].append(len(_changed(before, model)))
        if step < len(batches) - 1:
            scheduler.step()
            info["lrs"].append(group["lr"])
    info["last_lr"] = scheduler.get_last_lr()
    info["num_params"] = len(module_params)
    return info


for _strategy in STRATEGIES:
    cases.case(functools.partial(_scheduler, _strategy), name=f"scheduler_{_strategy}")


# ---------------------------------------------------------------------------------------------
# 6. Optimizer state held before prepare() is re-keyed to the new parameters (and sharded)

PRE_STEPS = 3
POST_STEPS = 3


def _rekey(strategy: str) -> dict[str, Any]:
    model, optimizer = build()
    batches = global_batches(PRE_STEPS + POST_STEPS)
    # Steps on the plain model, full global batch on every rank, so all ranks hold the same state.
    pre_losses = train(model, optimizer, batches[:PRE_STEPS])
    names = {id(p): n for n, p in model.named_parameters()}
    before = {
        names[id(p)]: {k: v.detach().clone() for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    wrapped, _, _ = autoshard.prepare(
        model, optimizer, shard(batches[PRE_STEPS]), strategy=strategy, mixed_precision="no"
    )
    params = dict(model.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    keys = [by_id.get(id(k), "<not a module parameter>") for k in optimizer.state]
    per_param = {}
    for name, param in params.items():
        state = optimizer.state.get(param, {})
        entry: dict[str, Any] = {"has_state": bool(state)}
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key)
            if value is None:
                continue
            entry[f"{key}_dtensor"] = isinstance(value, DTensor)
            entry[f"{key}_placements_match"] = (
                isinstance(value, DTensor)
                and isinstance(param, DTensor)
                and value.placements == param.placements
                and value.device_mesh == param.device_mesh
            )
            entry[f"{key}_equal"] = torch.equal(full(value), before[name][key])
            entry[f"{key}_max_abs_diff"] = max_abs_diff(full(value), before[name][key])
        step = state.get("step")
        entry["step"] = float(step) if step is not None else None
        per_param[name] = entry
    post = [shard(b) for b in batches[PRE_STEPS:]]
    return {
        "param_dtensor": {n: isinstance(p, DTensor) for n, p in params.items()},
        "state_keys": keys,
        "param_names": list(params),
        "per_param": per_param,
        "pre_losses": pre_losses,
        "post_losses": train(wrapped, optimizer, post),
        "reference_losses": reference_losses(PRE_STEPS + POST_STEPS),
    }


for _strategy in STRATEGIES:
    cases.case(functools.partial(_rekey, _strategy), name=f"rekey_{_strategy}")


# ---------------------------------------------------------------------------------------------
# 7. Nothing lost by the trial step: parameters, buffers, optimizer state, RNG; same losses

RNG_SEED = 4321


def _trial(strategy: str, trial_step: bool) -> dict[str, Any]:
    # BatchNorm: running statistics a training step updates. Dropout: the step draws from the RNG.
    model, optimizer = build(batchnorm=True, dropout=0.1)
    batches = local_batches(5)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    torch.manual_seed(RNG_SEED)
    rng = torch.get_rng_state()
    wrapped, _, plan = autoshard.prepare(
        model,
        optimizer,
        batches[0],
        strategy=strategy,
        mixed_precision="no",
        trial_step=trial_step,
    )
    rng_after = torch.get_rng_state()
    params_after = {n: full(p).detach() for n, p in model.named_parameters()}
    buffers_after = dict(model.named_buffers())
    return {
        "attempts": [a.outcome.value for a in plan.attempts],
        "same_param_names": list(params) == list(params_after),
        "params_changed": [n for n in params if not torch.equal(params[n], params_after[n])],
        "buffer_names": list(buffers),
        "buffers_changed": [
            n for n in buffers if not torch.equal(buffers[n], buffers_after[n].to(buffers[n]))
        ],
        "grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "optimizer_state_len": len(optimizer.state),
        "group_options_changed": [
            k
            for k, v in optimizer.param_groups[0].items()
            if k != "params" and options.get(k, "<missing>") != v
        ],
        "rng_equal": torch.equal(rng, rng_after),
        "losses": train(wrapped, optimizer, batches),
    }


for _strategy in STRATEGIES:
    for _trial_step in (True, False):
        cases.case(
            functools.partial(_trial, _strategy, _trial_step),
            name=f"trial_{_strategy}_{'on' if _trial_step else 'off'}",
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main()
