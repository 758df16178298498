"""The trial step: OOM injected on one rank in forward, backward or the optimizer step; OOM on every
rung; a non-OOM error on one rank; everything restored bitwise (also after a fallback); the same
losses as a run without a trial; memory_limit enforced on CPU by the measured peak; trial_step=False
and the loss conventions.

Usage (from tests/_dist.py): torchrun --nproc-per-node 2 trial.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    CLASSES,
    DATA_SEED,
    IN_FEATURES,
    Cases,
    Net,
    all_finite,
    build,
    full,
    is_fsdp,
    local_batches,
    rank,
    train,
)
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import autoshard

STRATEGIES = ("ddp", "shard_grad_op", "full_shard")
WIDTH = 32
DEPTH = 4
# Rows each rank feeds in the OOM cases: enough that activations dominate the estimated peak, so
# that checkpointing more blocks lowers it (next_rung only moves to rungs estimated smaller).
ROWS = 512
TRAIN_STEPS = 4
RNG_SEED = 4321

cases = Cases()


# ---------------------------------------------------------------------------------------------
# Helpers


def fixed_batch(rows: int = ROWS) -> dict[str, torch.Tensor]:
    """One batch of a learnable task (a linear teacher), the SAME on every rank: training on it
    repeatedly must lower the loss, and both ranks must see the same losses."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=gen)
    x = torch.randn(rows, IN_FEATURES, generator=gen)
    return {"x": x, "y": (x @ teacher).argmax(dim=1)}


class Inject:
    """Raises torch.OutOfMemoryError from a user hook, on the ranks in `on_ranks`, on the first
    real call (or on every real call with `always`), as a failed allocation would."""

    def __init__(self, on_ranks: Iterable[int], *, always: bool = False) -> None:
        self.armed = rank() in set(on_ranks)
        self.always = always
        self.fired = 0
        self.fake_calls = 0
        self.real_calls = 0

    def __call__(self, tensors: Iterable[Any]) -> None:
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        # prepare() first traces the model under FakeTensorMode to measure its activations (no
        # real memory is used there), and user hooks run during that trace too: a call on fake
        # tensors is the trace, not the trial step, and must not count as the first call.
        if any(is_fake(t) for t in tensors):
            self.fake_calls += 1
            return
        self.real_calls += 1
        if self.armed and (self.always or not self.fired):
            self.fired += 1
            raise torch.OutOfMemoryError(
                f"injected: rank {rank()} tried to allocate 1.00 GiB (test hook, call "
                f"{self.real_calls})"
            )

    def record(self) -> dict[str, Any]:
        return {"fired": self.fired, "fake_calls": self.fake_calls, "real_calls": self.real_calls}


def install(where: str, model: Net, optimizer: torch.optim.Optimizer, inject: Inject) -> Any:
    """Register `inject` as a user-level hook in `where`: forward, backward or step."""
    block = model.blocks[1]
    if where == "forward":
        return block.register_forward_pre_hook(lambda module, args: inject(args))
    if where == "backward":
        return block.register_full_backward_hook(
            lambda module, grad_input, grad_output: inject(grad_output)
        )
    if where == "step":
        return optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: inject(p for g in opt.param_groups for p in g["params"])
        )
    if where == "forward_unless_sharded":  # as if only a sharded model fitted
        return block.register_forward_pre_hook(
            lambda module, args: None if is_fsdp(module) else inject(args)
        )
    raise ValueError(where)


def plan_info(plan: autoshard.Plan) -> dict[str, Any]:
    return {
        "strategy": plan.strategy.value,
        "activation_checkpointing": plan.activation_checkpointing,
        "estimated_peak_bytes": plan.estimated_peak_bytes,
        "measured_peak_bytes": plan.measured_peak_bytes,
        "device_memory_bytes": plan.device_memory_bytes,
        "attempts": [
            {
                "strategy": a.strategy.value,
                "activation_checkpointing": a.activation_checkpointing,
                "outcome": a.outcome.value,
                "out_of_memory_ranks": list(a.out_of_memory_ranks),
                "measured_peak_bytes": a.measured_peak_bytes,
            }
            for a in plan.attempts
        ],
        "candidates": {
            f"{c.strategy.value}/{c.activation_checkpointing}": c.estimated_peak_bytes
            for c in plan.candidates
        },
        "reasons": list(plan.reasons),
    }


def timed_prepare(*args: Any, **kwargs: Any) -> tuple[autoshard.Prepared, float]:
    started = time.perf_counter()
    prepared = autoshard.prepare(*args, **kwargs)
    return prepared, time.perf_counter() - started


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Count Python-level all_reduce calls: the trial's sync points (Agreement.sync, the DDP comm
    hook's allreduce_hook) go through it; plain DDP (C++ reducer) and FSDP2 (all-gather,
    reduce-scatter) training do not, so any count while training is a sync point left behind."""
    count = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = original


def plain_losses(steps: int, batch: dict[str, torch.Tensor], **build_kwargs: Any) -> list[float]:
    """One process, no autoshard, no injection: what training on `batch` gives."""
    model, optimizer = build(WIDTH, DEPTH, **build_kwargs)
    return train(model, optimizer, [batch] * steps)


# ---------------------------------------------------------------------------------------------
# 1. OOM on rank 1 only, in forward, backward or the optimizer step: both ranks fall back together


def _oom_on_rank1(where: str, strategy: str) -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    inject = Inject(on_ranks=[1])
    handle = install(where, model, optimizer, inject)
    batch = fixed_batch()
    (wrapped, _, plan), seconds = timed_prepare(
        model, optimizer, batch, strategy=strategy, mixed_precision="no"
    )
    handle.remove()
    with counting_all_reduce() as all_reduces:
        losses = train(wrapped, optimizer, [batch] * TRAIN_STEPS)
    return {
        **plan_info(plan),
        **inject.record(),
        "all_reduces_while_training": all_reduces[0],
        "prepare_seconds": seconds,
        "is_fsdp": is_fsdp(wrapped),
        "is_ddp": isinstance(wrapped, nn.parallel.DistributedDataParallel),
        "losses": losses,
        "plain_losses": plain_losses(TRAIN_STEPS, batch),
    }


for _where in ("forward", "backward", "step"):
    for _strategy in ("auto", "full_shard"):
        cases.case(
            functools.partial(_oom_on_rank1, _where, _strategy),
            name=f"oom_rank1_{_where}_{_strategy}",
        )


@cases.case
def oom_unless_sharded_on_rank0() -> dict[str, Any]:
    """OOM on rank 0 whenever the model is not sharded, at a small batch (the optimizer step
    dominates the estimate, so checkpointing is not estimated to help): DDP -> FSDP in place.
    Training afterwards must be bitwise that of the same rung forced without a trial step."""
    model, optimizer = build(batchnorm=True, dropout=0.1)
    inject = Inject(on_ranks=[0], always=True)
    handle = install("forward_unless_sharded", model, optimizer, inject)
    batches = local_batches(5)
    torch.manual_seed(RNG_SEED)
    (wrapped, _, plan), seconds = timed_prepare(model, optimizer, batches[0], mixed_precision="no")
    handle.remove()
    losses = train(wrapped, optimizer, batches)
    forced, forced_plan = _five_losses(
        strategy=plan.strategy.value,
        activation_checkpointing=plan.activation_checkpointing,
        trial_step=False,
    )
    return {
        **plan_info(plan),
        **inject.record(),
        "prepare_seconds": seconds,
        "is_fsdp": is_fsdp(wrapped),
        "losses": losses,
        "forced_losses": forced,
        "forced_attempts": len(forced_plan.attempts),
    }


@cases.case
def oom_unless_sharded_checkpointing_cannot_cure() -> dict[str, Any]:
    """OOM on both ranks whenever the model is not sharded, at a batch where checkpointing more
    blocks is estimated to help: every DDP rung runs out of memory, every FSDP rung fits."""
    model, optimizer = build(WIDTH, DEPTH)
    inject = Inject(on_ranks=[0, 1], always=True)
    handle = install("forward_unless_sharded", model, optimizer, inject)
    started = time.perf_counter()
    outcome: dict[str, Any] = {"raised": None}
    try:
        _, _, plan = autoshard.prepare(model, optimizer, fixed_batch(), mixed_precision="no")
        outcome.update(plan_info(plan))
    except autoshard.DoesNotFit as error:
        outcome["raised"] = f"{type(error).__name__}: {error}"
    handle.remove()
    return {**outcome, **inject.record(), "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------------------------------------
# 2. OOM on both ranks on every rung: DoesNotFit on both, no hang


def _oom_everywhere(strategy: str) -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    inject = Inject(on_ranks=[0, 1], always=True)
    handle = install("forward", model, optimizer, inject)
    started = time.perf_counter()
    try:
        autoshard.prepare(model, optimizer, fixed_batch(), strategy=strategy, mixed_precision="no")
    except Exception as error:
        raised: dict[str, Any] = {
            "type": type(error).__name__,
            "is_does_not_fit": isinstance(error, autoshard.DoesNotFit),
            "message": str(error),
            "missing_bytes": getattr(error, "missing_bytes", "<none>"),
        }
    else:
        raised = {"type": None, "is_does_not_fit": False, "message": None}
    handle.remove()
    return {**raised, **inject.record(), "seconds": time.perf_counter() - started}


for _strategy in ("auto", "full_shard"):
    cases.case(functools.partial(_oom_everywhere, _strategy), name=f"oom_every_rung_{_strategy}")


# ---------------------------------------------------------------------------------------------
# 3. A non-OOM error in forward on rank 0 only: re-raised unchanged there, rank 1 fails fast


class FailingNet(Net):
    """Net whose forward raises a ValueError on real tensors while `fail` is set, and appends it to
    `raised`, which is not the model's (the trial step puts the model's attributes back)."""

    fail = False

    def __init__(self, width: int, depth: int, raised: list[ValueError]) -> None:
        super().__init__(width, depth)
        self.keep = raised.append  # a method, not a container: the trial leaves it alone

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.fail and not is_fake(x):  # not during prepare()'s FakeTensorMode trace
            error = ValueError(f"bad row in the batch on rank {rank()} (test)")
            self.keep(error)
            raise error
        return super().forward(x, y)


def _value_error_on_rank0(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    raised: list[ValueError] = []
    model = FailingNet(WIDTH, DEPTH, raised)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.fail = rank() == 0
    started = time.perf_counter()
    caught: Exception | None = None
    try:
        autoshard.prepare(model, optimizer, fixed_batch(), strategy=strategy, mixed_precision="no")
    except Exception as error:
        caught = error
    return {
        "type": type(caught).__name__ if caught is not None else None,
        "message": str(caught) if caught is not None else None,
        "is_the_raised_object": any(caught is error for error in raised),
        "raised_message": str(raised[0]) if raised else None,
        "seconds": time.perf_counter() - started,
    }


for _strategy in ("auto", "full_shard"):
    cases.case(
        functools.partial(_value_error_on_rank0, _strategy), name=f"value_error_rank0_{_strategy}"
    )


# ---------------------------------------------------------------------------------------------
# 4. Nothing lost, bitwise: parameters, buffers (BatchNorm running stats), optimizer state, RNG,
#    gradients; with and without an OOM fallback; with a fresh optimizer and one that has state


def _block_seen(module: nn.Module, args: Any, output: Any) -> None:
    """A forward hook a model's own forward registers (as transformers 5 installs its
    output-capturing hooks on its first call)."""


def _own_hooks(model: nn.Module) -> tuple[int, Any]:
    """How many `_block_seen` hooks the first block holds, and the mark the model sets with them."""
    hooks = model.blocks[0]._forward_hooks.values()
    return sum(hook is _block_seen for hook in hooks), vars(model).get("hooked")


class KeepingNet(Net):
    """Net whose forward keeps what user code keeps on its modules: a count of its calls, a list
    of the batch sizes it saw, an attribute it sets on its first call, a block's cache, a hook
    it registers on its first call (and marks itself so)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.rows_seen: list[int] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        self.rows_seen.append(x.shape[0])
        self.first_rows = getattr(self, "first_rows", x.shape[0])
        self.blocks[0].cache = {"rows": x.shape[0]}
        if not getattr(self, "hooked", False):
            self.blocks[0].register_forward_hook(_block_seen)
            self.hooked = True
        return super().forward(x, y)


def _restore(strategy: str, stateful: bool, oom: str | None) -> dict[str, Any]:
    """`oom`: None (the first rung fits), "forward" or "step" (rank 1 runs out of memory there in
    the first attempt; with "step" rank 0 has already updated its parameters, optimizer state and
    BatchNorm statistics when it learns of it)."""
    # BatchNorm: running statistics a training step updates. Dropout: the step draws from the RNG.
    model, optimizer = build(WIDTH, DEPTH, batchnorm=True, dropout=0.1, cls=KeepingNet)
    batch = fixed_batch()
    if stateful:  # AdamW state from steps taken on the plain model, the same on both ranks
        train(model, optimizer, [fixed_batch(16)] * 2)
    kept = (model.calls, list(model.rows_seen), vars(model).get("first_rows"))
    cache = vars(model.blocks[0]).get("cache")  # set by the stateful steps, else absent
    hooks = _own_hooks(model)  # (1, True) after the stateful steps, else (0, None)
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    state = {
        names[id(p)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    inject = Inject(on_ranks=[1] if oom else [])
    handle = install(oom or "forward", model, optimizer, inject)
    torch.manual_seed(RNG_SEED)
    rng = torch.get_rng_state()
    _, _, plan = autoshard.prepare(model, optimizer, batch, strategy=strategy, mixed_precision="no")
    rng_after = torch.get_rng_state()
    handle.remove()
    params_after = {n: full(p).detach() for n, p in model.named_parameters()}
    buffers_after = dict(model.named_buffers())
    current = {id(p): n for n, p in model.named_parameters()}
    state_after = {
        current.get(id(p), "<not a module parameter>"): s for p, s in optimizer.state.items()
    }
    state_diff = []
    for name, saved in state.items():
        live = state_after.get(name)
        if live is None or sorted(live) != sorted(saved):
            state_diff.append(f"{name}: keys {sorted(live or {})} != {sorted(saved)}")
            continue
        for key, value in saved.items():
            now = live[key]
            if isinstance(value, torch.Tensor):
                equal = torch.equal(full(now).to(value.device), value)
            else:
                equal = now == value
            if not equal:
                state_diff.append(f"{name}.{key}")
    return {
        **plan_info(plan),
        **inject.record(),
        "same_param_names": list(params) == list(params_after),
        "params_changed": [n for n in params if not torch.equal(params[n], params_after[n])],
        "buffer_names": list(buffers),
        "buffers_changed": [
            n for n in buffers if not torch.equal(buffers[n], buffers_after[n].to(buffers[n]))
        ],
        "grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "state_names_before": sorted(state),
        "state_names_after": sorted(state_after),
        "state_keys_are_module_params": all(id(p) in current for p in optimizer.state),
        "state_diff": state_diff,
        "group_options_changed": [
            k
            for k, v in optimizer.param_groups[0].items()
            if k != "params" and options.get(k, "<missing>") != v
        ],
        "rng_equal": torch.equal(rng, rng_after),
        "attributes_kept": (model.calls, model.rows_seen, vars(model).get("first_rows")) == kept,
        "block_cache_kept": vars(model.blocks[0]).get("cache") == cache,
        "own_hooks_kept": _own_hooks(model) == hooks,
        "state_dict_hooks": sum(len(m._state_dict_pre_hooks) for m in model.modules()),
    }


for _strategy in STRATEGIES:
    for _stateful in (False, True):
        for _oom in (None, "forward", "step"):
            cases.case(
                functools.partial(_restore, _strategy, _stateful, _oom),
                name=f"restore_{_strategy}_{'stateful' if _stateful else 'fresh'}_"
                f"{f'oom_{_oom}' if _oom else 'fit'}",
            )


# ---------------------------------------------------------------------------------------------
# 5. prepare(strategy="auto") with the trial step trains exactly as the chosen wrapping, forced,
#    without one


def _five_losses(seed: int = RNG_SEED, **options: Any) -> tuple[list[float], autoshard.Plan]:
    model, optimizer = build(batchnorm=True, dropout=0.1)  # dropout: the RNG matters
    batches = local_batches(5)
    torch.manual_seed(seed)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batches[0], mixed_precision="no", **options
    )
    return train(wrapped, optimizer, batches), plan


@cases.case
def auto_trial_matches_forced_without_trial() -> dict[str, Any]:
    auto, plan = _five_losses(strategy="auto")
    forced, forced_plan = _five_losses(
        strategy=plan.strategy.value,
        activation_checkpointing=plan.activation_checkpointing,
        trial_step=False,
    )
    # Control: another RNG state changes the losses, so the comparison above can see one.
    other, _ = _five_losses(
        RNG_SEED + 1,
        strategy=plan.strategy.value,
        activation_checkpointing=plan.activation_checkpointing,
        trial_step=False,
    )
    return {
        "auto": plan_info(plan),
        "forced": plan_info(forced_plan),
        "auto_losses": auto,
        "forced_losses": forced,
        "other_seed_losses": other,
    }


# ---------------------------------------------------------------------------------------------
# 6. memory_limit on CPU: the measured peak above the usable memory counts as an OOM


class Workspace(Net):
    """Net whose forward allocates a scratch buffer of `workspace_numel` floats that nothing saves
    for backward, above 2 rows only (as a kernel takes a workspace above some size), and reads a
    number back that depends on the batch's values. No fake step can run such a forward, so the
    estimate comes from a trace of its first 1 and 2 rows on real tensors, scaled
    (`trace.profile_scaled`), which cannot see this buffer (it counts one every size makes:
    `forward_rise_bytes`); the trial step's measurement does. (A number read back from the
    zeros alone is known to the fake step, `measure.known`, which then counts the buffer.)"""

    workspace_numel = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            scratch = torch.zeros(self.workspace_numel if len(x) > 2 else 0, device=x.device)
            # 1.0: the buffer does not change the result
            scale = 1.0 + float(scratch.sum() * x.mean())
            del scratch
        return super().forward(x * scale, y)


MEMORY_WIDTH = 64  # parameters, gradients and optimizer state dominate at a small batch


def _workspace_model() -> tuple[Workspace, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Workspace(MEMORY_WIDTH, DEPTH)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # 1.7x the parameter bytes (AdamW: parameters + gradients + state = 4x): more than the ~13% by
    # which DDP's estimate exceeds its tracked peak on torch 2.13 CPU, so DDP's measurement goes
    # over a limit set at its estimate; less than what sharding saves on 2 ranks (about 2x the
    # parameter bytes), so a sharded rung still measures under that limit.
    model.workspace_numel = int(1.7 * param_bytes) // 4
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@cases.case
def memory_limit_plain_model() -> dict[str, Any]:
    """The plain model: estimate against measurement (the estimate is conservative here)."""
    model, optimizer = build(MEMORY_WIDTH, DEPTH)
    batch = local_batches(1)[0]
    what_if = autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1TiB", mixed_precision="no"
    )
    _, _, plan = autoshard.prepare(model, optimizer, batch, strategy="ddp", mixed_precision="no")
    ddp = next(
        c
        for c in what_if.candidates
        if c.strategy.value == "ddp" and c.activation_checkpointing == 0
    )
    return {"estimated_ddp": ddp.estimated_peak_bytes, **plan_info(plan)}


@cases.case
def memory_limit_exceeded_by_measurement() -> dict[str, Any]:
    model, optimizer = _workspace_model()
    batch = local_batches(1)[0]
    what_if = autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1TiB", mixed_precision="no"
    )
    ddp = next(
        c
        for c in what_if.candidates
        if c.strategy.value == "ddp" and c.activation_checkpointing == 0
    )
    limit = ddp.estimated_peak_bytes  # DDP fits by the estimate, exactly
    (wrapped, _, plan), seconds = timed_prepare(
        model, optimizer, batch, memory_limit=limit, mixed_precision="no"
    )
    return {
        **plan_info(plan),
        "limit": limit,
        "what_if_strategy": what_if.strategy.value,
        "estimated_ddp": ddp.estimated_peak_bytes,
        "prepare_seconds": seconds,
        "is_fsdp": is_fsdp(wrapped),
        "losses": train(wrapped, optimizer, local_batches(TRAIN_STEPS, fixed=True)),
    }


@cases.case
def held_bytes_sharded() -> dict[str, Any]:
    """What the trial counts as the training's own under FULL_SHARD: this rank's shards."""
    from torch.distributed.tensor import DTensor

    from autoshard.wrap.meter import held_bytes

    model, optimizer = build(MEMORY_WIDTH, DEPTH)
    wrapped, optimizer, _ = autoshard.prepare(
        model, optimizer, local_batches(1)[0], strategy="full_shard", mixed_precision="no"
    )
    tensors = [*wrapped.parameters(), *wrapped.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return {
        "held": held_bytes(wrapped, optimizer, torch.device("cpu")),
        # every rank's together: a DTensor's numel is the whole tensor's
        "whole": sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)),
        "sharded": any(isinstance(p, DTensor) for p in wrapped.parameters()),
    }


# ---------------------------------------------------------------------------------------------
# 7. trial_step=False, and how the trial step turns the output into a loss


@cases.case
def trial_step_off() -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    inject = Inject(on_ranks=[0, 1], always=True)  # would fail any real forward in prepare()
    handle = install("forward", model, optimizer, inject)
    _, _, plan = autoshard.prepare(
        model, optimizer, fixed_batch(), strategy="ddp", mixed_precision="no", trial_step=False
    )
    handle.remove()
    return {**plan_info(plan), **inject.record()}


@dataclass
class Output:
    """A Hugging Face style output: `.loss` and `.logits`."""

    loss: torch.Tensor
    logits: torch.Tensor


class Outputs(Net):
    """Net returning {"logits"} (no loss), an Output with .loss, or the bare logits tensor; it
    records the gradient each real output tensor receives in backward into `grads`, which is not
    the model's (what the trial step leaves in the model's own attributes is put back)."""

    def __init__(self, kind: str, grads: dict[str, list[torch.Tensor]]) -> None:
        super().__init__(WIDTH, DEPTH)
        self.kind = kind
        self.record = grads.__getitem__  # a method, not a container: the trial leaves it alone

    def _watch(self, name: str, tensor: torch.Tensor) -> None:
        if not is_fake(tensor):  # not during prepare()'s FakeTensorMode trace
            tensor.register_hook(lambda g: self.record(name).append(g.detach().clone()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        self._watch("logits", logits)
        if self.kind == "dict":
            return {"logits": logits}
        if self.kind == "loss":
            loss = F.cross_entropy(logits, y)
            self._watch("loss", loss)
            return Output(loss=loss, logits=logits)
        return logits


def _loss_convention(kind: str, with_loss_fn: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    recorded: dict[str, list[torch.Tensor]] = {"logits": [], "loss": []}
    model = Outputs(kind, recorded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = local_batches(1)[0]
    calls: list[dict[str, Any]] = []

    def loss_fn(output: Any, given: Any) -> torch.Tensor:
        logits = output["logits"]
        calls.append(
            {
                "fake": is_fake(logits),
                "output_type": type(output).__name__,
                "output_keys": sorted(output),
                "logits_shape": list(logits.shape),
                "batch_keys": sorted(given),
                "batch_equal": all(torch.equal(given[k], batch[k]) for k in batch)
                if not is_fake(given["x"])
                else None,
            }
        )
        return F.cross_entropy(logits, given["y"])

    _, _, plan = autoshard.prepare(
        model,
        optimizer,
        batch,
        loss_fn=loss_fn if with_loss_fn else None,
        strategy="ddp",
        mixed_precision="no",
    )
    grads = {
        name: [
            {
                "dtype": str(g.dtype),
                "shape": list(g.shape),
                "all_ones": bool(torch.equal(g, torch.ones_like(g))),
            }
            for g in values
        ]
        for name, values in recorded.items()
    }
    return {**plan_info(plan), "loss_fn_calls": calls, "grads": grads}


cases.case(functools.partial(_loss_convention, "dict", True), name="loss_fn_is_used")
cases.case(functools.partial(_loss_convention, "loss", False), name="output_loss_is_used")
cases.case(functools.partial(_loss_convention, "tensor", False), name="output_summed")


# ---------------------------------------------------------------------------------------------
# Last: after every failure above, both ranks still meet in the same collectives and train


@cases.case
def still_in_step() -> dict[str, Any]:
    model, optimizer = build(WIDTH, DEPTH)
    batch = fixed_batch(64)
    wrapped, _, plan = autoshard.prepare(
        model, optimizer, batch, strategy="full_shard", mixed_precision="no"
    )
    losses = train(wrapped, optimizer, [batch] * TRAIN_STEPS)
    marker = torch.tensor([float(rank() + 1)])
    dist.all_reduce(marker)
    return {
        **plan_info(plan),
        "losses": losses,
        "finite": all_finite(losses),
        "all_reduce": float(marker),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases.main()
