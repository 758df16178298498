"""GPU suite section "compat": every torch feature autoshard checks for at run time (an import
guarded by try, a `hasattr`/`getattr` on a torch object, a private field), present or absent
here, and what autoshard does without it. The list is kept beside the package's checks by hand;
`tests/test_gpu_suite.py` pins that each probe runs. Every private name of
`autoshard._torch_compat.SYMBOLS` not listed by hand gets a row of its own."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _import(path: str) -> Callable[[], bool]:
    def probe() -> bool:
        module, _, name = path.partition(":")
        loaded = importlib.import_module(module)
        return not name or hasattr(loaded, name)

    return probe


def _attr(owner: Callable[[], Any], name: str) -> Callable[[], bool]:
    return lambda: hasattr(owner(), name)


def _has_symbol(name: str) -> bool:
    from autoshard._torch_compat import missing

    return missing(name) is None


def _fsdp_module() -> Any:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _tracker_fields() -> bool:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    return all(
        hasattr(tracker, n)
        for n in ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    )


def _pluggable_comms() -> bool:
    """FSDP2 param groups with `_all_gather_comm`/`_reduce_scatter_comm`, on a one-rank fake
    group (what `sync.fsdp_sync_points` swaps)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from autoshard._torch_compat import fake_store, fsdp_param_groups, has_pluggable_comms

    if dist.is_initialized():
        raise RuntimeError("a process group exists already")
    dist.init_process_group("fake", rank=0, world_size=1, store=fake_store())
    try:
        module: nn.Module = nn.Linear(4, 4)
        fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        groups = [
            g for m in module.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)
        ]
        return bool(groups) and has_pluggable_comms(groups)
    finally:
        dist.destroy_process_group()


def _pynvml() -> bool:
    import pynvml

    if not torch.cuda.is_available():
        return True  # importable; NVML itself needs a GPU
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    return True


FEATURES: list[tuple[str, str, str, Callable[[], bool]]] = [
    (
        "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
        "fake.unavailable, step: simulated FSDP2 steps",
        "estimates are analytic (formulas), the plan says so",
        _import("torch.distributed._tools.fsdp2_mem_tracker:FSDPMemTracker"),
    ),
    (
        "torch.distributed._tools.mem_tracker.MemTracker",
        "fake.unavailable, step: simulated LOCAL/DDP steps",
        "estimates are analytic",
        _import("torch.distributed._tools.mem_tracker:MemTracker"),
    ),
    (
        "MemTracker private peak fields (_update_peak_stats, _peak_mem, ...)",
        "step._global_peak_only, step._reset_peak",
        "simulation slower; phases share one peak (overestimates only)",
        _tracker_fields,
    ),
    (
        "torch.testing._internal.distributed.fake_pg (backend 'fake')",
        "fake.fake_mesh: simulation at any world size",
        "estimates are analytic",
        _import("torch.testing._internal.distributed.fake_pg:FakeStore"),
    ),
    (
        "torch.distributed.fsdp.fully_shard",
        "_apply: SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, CPU_OFFLOAD",
        "none: the sharded strategies cannot run",
        _import("torch.distributed.fsdp:fully_shard"),
    ),
    (
        "MixedPrecisionPolicy(output_dtype=...)",
        "engines.shard_module",
        "none: FSDP2 mixed precision fails",
        lambda: (
            "output_dtype"
            in {
                f.name
                for f in dataclasses.fields(
                    importlib.import_module("torch.distributed.fsdp").MixedPrecisionPolicy
                )
            }
        ),
    ),
    (
        "FSDPModule.reset_iter_state (torch 2.13 on), else TrainingState for the same reset on "
        "torch 2.11/2.12's private fields",
        "trial._clean_up (_torch_compat.fsdp_reset_iter_state): recovery after an OOM under FSDP2",
        "an OOM under FSDP2 in the trial raises instead of falling back",
        lambda: _attr(_fsdp_module, "reset_iter_state")() or _has_symbol("TrainingState"),
    ),
    (
        "FSDPModule.set_reshard_after_forward",
        "apply.apply: ZeRO-2 -> ZeRO-3 in place",
        "none: the SHARD_GRAD_OP -> FULL_SHARD fallback fails",
        _attr(_fsdp_module, "set_reshard_after_forward"),
    ),
    (
        "FSDP2 pluggable comms: param groups (state._fsdp_param_groups, older _fsdp_param_group) "
        "with _all_gather_comm/_reduce_scatter_comm",
        "sync.fsdp_sync_points: OOM agreement at every collective",
        "ranks agree only before the optimizer step and after the trial (the plan notes it)",
        _pluggable_comms,
    ),
    (
        "torch.cuda.get_per_process_memory_fraction",
        "meter.memory_cap: the caller's memory fraction put back",
        "the fraction is reset to 1.0 after the trial (a caller's own cap is lost)",
        _attr(lambda: torch.cuda, "get_per_process_memory_fraction"),
    ),
    (
        "aten.cudnn_batch_norm_backward",
        "workspace.OPERATORS: cuDNN batch-norm scratch measured",
        "its scratch memory is not in the estimate",
        _attr(lambda: torch.ops.aten, "cudnn_batch_norm_backward"),
    ),
    (
        "torch.autograd.profiler._is_profiler_enabled, torch._C._profiler._EventType",
        "_workspace: CPU kernel scratch measured with the profiler",
        "CPU kernel scratch not in the estimate",
        lambda: (
            hasattr(torch.autograd.profiler, "_is_profiler_enabled")
            and _import("torch._C._profiler:_EventType")()
        ),
    ),
    (
        "torch.utils._python_dispatch._disable_current_modes",
        "workspace._probe",
        "none: importing autoshard fails",
        _import("torch.utils._python_dispatch:_disable_current_modes"),
    ),
    (
        "torch.distributed._composable.checkpoint",
        "apply.checkpoint_blocks, simulate",
        "none: activation checkpointing fails",
        _import("torch.distributed._composable:checkpoint"),
    ),
    (
        "pynvml (nvidia-ml-py)",
        "_world._gpu_memory: free memory of this GPU",
        "torch.cuda.mem_get_info (the plan names the source)",
        _pynvml,
    ),
    (
        "torch._grouped_mm",
        "not called by autoshard; transformers 5 MoE experts (fake kernel bf16-only on 2.13)",
        "tracing an MoE model fails: estimates analytic for it",
        _attr(lambda: torch, "_grouped_mm"),
    ),
    (
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "_trace, _simulate: the example batch traced without real memory",
        "none: the trace fails, activations are not estimated (the trial step measures them)",
        _import("torch._subclasses.fake_tensor:FakeTensorMode"),
    ),
    (
        "torch.utils.flop_counter.FlopCounterMode",
        "_trace: forward FLOPs for the cost model",
        "none: the trace fails",
        _import("torch.utils.flop_counter:FlopCounterMode"),
    ),
    (
        "DeviceMesh.from_group(mesh_dim_names=...), new_group(use_local_synchronization=...)",
        "fake.fake_mesh inside a job (plan() or prepare() under torchrun)",
        "estimates are analytic inside a job",
        lambda: (
            "mesh_dim_names" in _parameters("torch.distributed.device_mesh:DeviceMesh.from_group")
            and "use_local_synchronization" in _parameters("torch.distributed:new_group")
        ),
    ),
    (
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
        "apply.grad_scaler: fp16 under FSDP2",
        "none: fp16 with a sharded strategy fails",
        _import("torch.distributed.fsdp.sharded_grad_scaler:ShardedGradScaler"),
    ),
    (
        "torch.distributed.checkpoint.state_dict.get_state_dict",
        "_checkpoint, _dcp: autoshard.save/load",
        "none: checkpoints fail",
        _import("torch.distributed.checkpoint.state_dict:get_state_dict"),
    ),
]


def _symbol(name: str) -> Callable[[], bool]:
    def probe() -> bool:
        from autoshard._torch_compat import resolve

        return resolve(name) is not None  # raises, naming the symbol, where this torch lacks it

    return probe


def _compat_rows() -> list[tuple[str, str, str, Callable[[], bool]]]:
    """A row for each private torch name of `autoshard._torch_compat.SYMBOLS` not probed above."""
    from autoshard._torch_compat import SYMBOLS

    listed = " ".join(row[0] for row in FEATURES)
    return [
        (s.dotted, f"_torch_compat: {s.used_for}", "see autoshard/_torch_compat.py", _symbol(n))
        for n, s in SYMBOLS.items()
        if s.dotted not in listed
    ]


FEATURES += _compat_rows()


def _parameters(path: str) -> set[str]:
    import inspect

    module, _, name = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return set(inspect.signature(target).parameters)


def compat() -> dict[str, Any]:
    rows = []
    for feature, used_by, without, probe in FEATURES:
        try:
            present, note = bool(probe()), ""
        except Exception as error:  # a probe that raises: the feature is not usable here
            present, note = False, f"{type(error).__name__}: {error}"[:200]
        rows.append(
            {
                "feature": feature,
                "present": present,
                "used_by": used_by,
                "fallback": without,
                "note": note,
            }
        )
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("accelerate", "transformers", "pynvml"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception:  # reported as missing
            versions[name] = None
    return {
        "features": rows,
        "versions": versions,
        "absent": [r["feature"] for r in rows if not r["present"]],
    }
