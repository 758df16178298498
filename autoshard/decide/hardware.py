"""The cost model's throughput figures: round constants per device class, or measured ones.

`hardware_for` gives the constants; a `Throughput` measured on the device (the GPU suite,
`benchmarks/gpu_suite.py`, measures bf16 matmul FLOP/s and device memory bandwidth) replaces the
figures it names. Pure: nothing here touches a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    """Throughput assumptions of the cost model. They rank candidates against each other; they are
    not predictions of step time.

    Attributes:
        flops_per_s: sustained matmul throughput in the compute dtype.
        intra_node_bytes_per_s: collective bus bandwidth between ranks of one node.
        inter_node_bytes_per_s: collective bus bandwidth across nodes.
        memory_bytes_per_s: device memory bandwidth (FSDP2's copy-in/copy-out of gathered buffers).
        collective_latency_s: fixed cost of launching one collective.
        host_link_bytes_per_s: host <-> device copies under CPU offload (PCIe).
        host_memory_bytes_per_s: host memory bandwidth, which bounds the optimizer step on CPU.
        kernel_launch_s: the least time one operator of an eager step takes, whatever its size:
            the host's dispatch and the kernel's launch. A step of many small operators is bound
            by it (the demo's GPT measured 13 ms a step on an H100, its FLOPs modelled at 0.0 ms).
        fsdp_unit_s: FSDP2's own host work per unit and step, beside its collectives'
            launches: its hooks in forward and backward, the reduce-scatter's copy-in, casts and
            bookkeeping, which the step waits on.
        fsdp_gather_s: FSDP2's own host work per all-gather of a unit: copy-in, copy-out and
            casts (ZeRO-3 gathers each block twice a step, ZeRO-2 once).
        dtensor_op_s: the host's time for one operator on DTensors beyond a plain operator's
            (DTensor's dispatch and sharding propagation): FSDP2's optimizer step runs every
            operator on DTensor shards, the per-parameter loop (`foreach=False`) one per
            parameter and operator (on an H200, 17 to 116 ms a step more than foreach).
        operator_bytes_per_s: the bandwidth the model's own memory-bound operators reach, for
            the bytes its forward and backward move (`measure.rates`); None: memory_bytes_per_s.
        source: where the figures came from (constants, or which of them were measured).
    """

    flops_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    memory_bytes_per_s: float
    collective_latency_s: float
    host_link_bytes_per_s: float = 2.5e10  # PCIe 4.0 x16, about 80% of 32 GB/s
    host_memory_bytes_per_s: float = 2e10
    # about a CUDA launch plus torch's dispatch of one operator on a current host
    kernel_launch_s: float = 5e-6
    fsdp_unit_s: float = 0.0
    fsdp_gather_s: float = 0.0
    dtensor_op_s: float = 0.0
    operator_bytes_per_s: float | None = None
    source: str = "constants for the device class"

    @property
    def traffic_bytes_per_s(self) -> float:
        """The bandwidth the model's own operators' bytes are priced at."""
        return self.operator_bytes_per_s or self.memory_bytes_per_s


# The figures a measurement can give, as a plan names them
_MEASURED = {
    "flops_per_s": "flops",
    "memory_bytes_per_s": "memory bytes",
    "kernel_launch_s": "operator launch time",
    "fsdp_unit_s": "FSDP2's host time per unit",
    "fsdp_gather_s": "FSDP2's host time per all-gather",
    "dtensor_op_s": "DTensor's host time per operator",
}


@dataclass(frozen=True)
class Throughput:
    """Figures measured on the device; None leaves the constant in place.

    Attributes:
        flops_per_s: sustained matmul FLOP/s in the compute dtype (a large square matmul).
        memory_bytes_per_s: device memory bandwidth, bytes read plus written per second by a
            large copy.
        where: how and where they were measured, for the plan's reasons and reports.
        kernel_launch_s: seconds per operator of a run of tiny ones (`Hardware.kernel_launch_s`).
        fsdp_unit_s: seconds of FSDP2's own host work per unit and step
            (`Hardware.fsdp_unit_s`).
        fsdp_gather_s: seconds of FSDP2's own host work per all-gather of a unit
            (`Hardware.fsdp_gather_s`).
        model_flops_per_s: the FLOP/s of one model's own step, its FLOP-bound operators run
            at their own shapes (`measure.rates`): the cost model's FLOP/s for that model's
            plan, in place of `flops_per_s`.
        model_memory_bytes_per_s: the bandwidth of that model's own memory-bound operators,
            run at their own shapes (`measure.rates`): the cost model's for the bytes its
            forward and backward move (`Hardware.operator_bytes_per_s`).
        model_memory_where: how that was measured.
        dtensor_op_s: seconds of host time per operator on DTensors beyond a plain operator's
            (`Hardware.dtensor_op_s`).
    """

    flops_per_s: float | None = None
    memory_bytes_per_s: float | None = None
    where: str = "measured"
    kernel_launch_s: float | None = None
    fsdp_unit_s: float | None = None
    fsdp_gather_s: float | None = None
    model_flops_per_s: float | None = None
    model_where: str = ""
    model_memory_bytes_per_s: float | None = None
    model_memory_where: str = ""
    dtensor_op_s: float | None = None

    @property
    def model_figures(self) -> str | None:
        """What of the model's own was measured and how, as a plan says it; None: nothing."""
        parts = []
        if self.model_flops_per_s is not None:
            parts.append(f"FLOP/s the model's own, {self.model_where}")
        if self.model_memory_bytes_per_s is not None:
            parts.append(f"operator bandwidth the model's own, {self.model_memory_where}")
        return "; ".join(parts) or None

    def __post_init__(self) -> None:
        for name in (*_MEASURED, "model_flops_per_s", "model_memory_bytes_per_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Throughput.{name} must be a number or None, got "
                    f"{type(value).__name__} {value!r}"
                )
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"Throughput.{name} must be a finite positive number, got {value!r}; "
                    f"pass None to keep the constant"
                )


# DTensor's host time per operator, the host's whatever the device: 15 to 50 us measured by
# `measure.device._dtensor_op_time` on a busy 2-core EPYC (torch 2.13 and 2.11); on an H200 host
# (torch 2.11) AdamW's loop under FULL_SHARD stepped 300 to 490 us per parameter slower than
# foreach, 8 operators each (benchmarks/RESULTS.md, 2026-12-04); `prepare` measures it on the
# training host.
DTENSOR_OP_S = 3e-5


def hardware_for(
    device_type: str,
    capability: tuple[int, int] | None,
    low_precision: bool,
    measured: Throughput | None = None,
) -> Hardware:
    """Round figures for the device class: about half the datasheet peak, as training sustains;
    each figure `measured` gives replaces its constant (FLOP/s and the operators' bandwidth the
    model's own, where measured)."""
    hardware = _constants(device_type, capability, low_precision)
    if measured is None:
        return hardware
    taken = {name: value for name in _MEASURED if (value := getattr(measured, name)) is not None}
    if not taken:
        return hardware
    names = " and ".join(_MEASURED[name] for name in taken)
    source = f"{names} {measured.where}; the rest constants"
    if measured.model_flops_per_s is not None:
        taken["flops_per_s"] = measured.model_flops_per_s
    if measured.model_memory_bytes_per_s is not None:
        taken["operator_bytes_per_s"] = measured.model_memory_bytes_per_s
    if measured.model_figures is not None:
        source = f"{source}; {measured.model_figures}"
    return replace(hardware, **taken, source=source)


def _constants(
    device_type: str, capability: tuple[int, int] | None, low_precision: bool
) -> Hardware:
    if device_type != "cuda":
        # gloo over loopback/TCP; a CPU core sustains tens of GFLOP/s in fp32 matmul. Each FSDP2
        # collective costs about 4 ms on gloo with its copy-in/out and Python bookkeeping:
        # (FSDP step - DDP step) / collectives was 4-5 ms for three models on 2 ranks of a 2-core
        # CPU (benchmarks/RESULTS.md, 2026-11-22).
        return Hardware(5e10, 2e9, 1e9, 1e10, 4e-3, dtensor_op_s=DTENSOR_OP_S)
    major = capability[0] if capability else 8
    if major >= 9:  # Hopper: ~990 TFLOP/s dense bf16, ~67 fp32 (TF32 off by default in torch)
        flops = 4e14 if low_precision else 3e13
    elif major == 8:  # Ampere: ~312 bf16, ~19.5 fp32
        flops = 1.5e14 if low_precision else 1e13
    else:  # Volta/Turing: ~125 fp16 tensor cores, ~15 fp32
        flops = 6e13 if low_precision else 7e12
    # NVLink-class intra-node bus bandwidth, 200 Gb/s-class inter-node, HBM-class memory.
    # FSDP2's own host work is the host's, not the GPU's: per unit and step 0.89-0.93 ms (bf16
    # parameters) or 0.55-0.60 ms (fp32), per all-gather 0.25-0.31 ms, measured by
    # `measure.device._fsdp_host_times` on a 2-core EPYC, torch 2.13 (benchmarks/RESULTS.md,
    # 2026-11-28); `prepare` measures them on the training host.
    unit = 9e-4 if low_precision else 6e-4
    return Hardware(
        flops,
        1.5e11,
        2.5e10,
        2e12,
        2e-5,
        fsdp_unit_s=unit,
        fsdp_gather_s=3e-4,
        dtensor_op_s=DTENSOR_OP_S,
    )
