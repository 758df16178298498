"""What must be the same on every rank before `prepare` changes anything: the model's shapes, the
optimizer and its hyper-parameters, the arguments. Ranks that differ in any of it would run
different collectives (and wait for each other forever) or train replicas that drift apart, so they
are refused together, naming what differs. Buffers that differ are only warned about: the wrapping
makes every rank use rank 0's, as DDP does."""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch import nn

from autoshard._world import RankReport
from autoshard.decide.validate import Request


def fingerprint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    request: Request,
    loss_fn: Any,
    trial_step: bool,
) -> tuple[tuple[str, Any], ...]:
    """Everything that decides which collectives a rank will run or how it trains, by name."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
    groups = tuple(len(g["params"]) for g in optimizer.param_groups)
    return (
        ("model", digest.hexdigest()[:16]),
        ("optimizer", (type(optimizer).__name__, groups)),
        ("optimizer's hyper-parameters", hyper_parameters(optimizer)),
        ("optimizer state", len(optimizer.state)),  # resumed on some ranks only?
        ("example_batch", batch is None),
        ("strategy", request.strategy),
        ("mixed_precision", request.mixed_precision),
        ("activation_checkpointing", request.activation_checkpointing),
        ("memory_limit", request.memory_limit),
        ("trial_step", trial_step),
        ("loss_fn", loss_fn is None),
        ("torch", torch.__version__),
    )


def hyper_parameters(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], ...]:
    """Each param group's options (lr, betas, weight_decay, ...) as plain comparable values."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item() if value.numel() == 1 else repr(value.tolist())
        if isinstance(value, (bool, int, float, str, type(None))):
            return value
        if isinstance(value, (tuple, list)):
            return tuple(plain(v) for v in value)
        return repr(value)

    return tuple(
        {k: plain(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    )


def raise_if_inconsistent(reports: list[RankReport]) -> None:
    """The same on every rank (every rank holds every report): raise a ValueError naming what
    differs between rank 0 and another rank."""
    reference = reports[0].fingerprint
    differing = [r.rank for r in reports if r.fingerprint != reference]
    if not differing:
        return
    other = reports[differing[0]].fingerprint
    fields = [name for (name, a), (_, b) in zip(reference, other, strict=True) if a != b]
    detail = ""
    if fields == ["optimizer's hyper-parameters"]:
        detail = _hyper_parameter_detail(dict(reference)[fields[0]], dict(other)[fields[0]])
        detail = f": {detail} on rank 0 and rank {differing[0]}"
    raise ValueError(
        f"ranks disagree with rank 0 on {', '.join(fields)} (ranks {differing}){detail}; every "
        f"rank must call prepare() with the same model, the same optimizer built with the same "
        f"options (state included: resume it on every rank or none), an example_batch on every "
        f"rank or none, and the same arguments"
    )


def _hyper_parameter_detail(mine: tuple[dict[str, Any], ...], theirs: tuple[Any, ...]) -> str:
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"param group {index} has {key}={a.get(key)!r} vs {key}={b.get(key)!r}"
    return f"{len(mine)} vs {len(theirs)} param groups"


def buffer_digests(model: nn.Module) -> dict[str, str]:
    """A digest of each buffer's bytes, to find buffers that differ between ranks."""
    digests = {}
    for name, buffer in model.named_buffers():
        if buffer.is_meta:
            continue
        data = buffer.detach().to("cpu").contiguous().reshape(-1)
        try:
            raw = data.view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):
            raw = repr(data.tolist()).encode()
        digests[name] = hashlib.sha256(raw).hexdigest()[:16]
    return digests


def warn_if_buffers_differ(reports: list[RankReport], rank: int) -> list[str]:
    """Warn (on rank 0) about buffers whose values differ between ranks; returns their names."""
    reference = reports[0].buffers
    names = sorted(
        {n for r in reports[1:] for n, d in r.buffers.items() if reference.get(n, d) != d}
    )
    if names and rank == 0:
        shown = ", ".join(f"'{n}'" for n in names[:5]) + (", ..." if len(names) > 5 else "")
        warnings.warn(
            f"{len(names)} buffer(s) hold different values on different ranks ({shown}); "
            f"prepare() makes every rank use rank 0's, as DistributedDataParallel does, so the "
            f"other ranks' values are replaced (and a checkpoint saves rank 0's). If they must "
            f"differ per rank, keep them outside the model",
            UserWarning,
            stacklevel=3,
        )
    return names
