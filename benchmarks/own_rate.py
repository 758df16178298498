"""The cost model's step against the step measured on this machine, its FLOP/s a large matmul's
or the model's own, and its operators' bandwidth a large copy's or the model's own
(`autoshard.measure.rates`, issue 26), where a GPU is not at hand.

Each model is built here (fp32, one process, unwrapped), planned as `LOCAL` (the plan's inputs
captured), and trained for a few steps (AdamW, torch's default implementation for the device),
the median step taken. The cost model's step (`cost.step_seconds`) is then computed from figures
measured here as `prepare` measures them on a GPU (`measure.device`: a square matmul's FLOP/s,
a large copy's bandwidth, the time per operator launch), once with that matmul's FLOP/s, once
with the model's own (its FLOP-bound calls run again at their shapes, forward and backward), and
once with the model's own bandwidth too (its memory-bound calls run again at their shapes).
On the CPU `prepare` measures none of this (the constants rank the candidates); the figures here
check the mechanism on real operators, and the GPU suite's prepare section measures the same on
a GPU.

    python benchmarks/own_rate.py                  # the default models, a few minutes
    python benchmarks/own_rate.py --models llama   # one of them
    python benchmarks/own_rate.py --models resnet --bytes 8 --cut-bytes 0
        # calls timed together within 8 MiB, those too large for what is left not timed (the
        # rule before b17f97a); without --cut-bytes 0 they run alone, at a cut batch where they
        # must (`rates._cut`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("AUTOSHARD_CACHE", "0")

import zoo  # noqa: E402
import zoo_external  # noqa: E402
from _gpu_accuracy import captured_inputs  # noqa: E402

import autoshard  # noqa: E402
from autoshard import Strategy  # noqa: E402
from autoshard._batch import call_model, compute_loss  # noqa: E402
from autoshard.decide.cost import step_seconds  # noqa: E402
from autoshard.measure import device as device_module  # noqa: E402
from autoshard.measure import rates  # noqa: E402
from autoshard.measure.rates import model_bandwidth, model_rate  # noqa: E402

# (zoo builder, "external:" for benchmarks/zoo_external.py's, per-rank batch, sizes): large
# enough that FLOP-bound operators matter on a CPU, small enough for seconds a step
MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama": ("llama", 4, dict(width=256, depth=4, heads=8, kv_heads=2, seq_len=256)),
    "gpt": ("gpt", 4, dict(d_model=256, n_layer=4, n_head=8, seq_len=256, vocab_size=8000)),
    "vit": ("vit", 16, dict(image_size=128)),
    "resnet": ("resnet", 32, {}),
    "mlp": ("mlp", 256, {}),
    # transformers' own classes (nobody here wrote them), at the external zoo's sizes
    "hf_llama": ("external:llama", 64, {}),
    "hf_gpt2": ("external:gpt2", 64, {}),
    "hf_convnext": ("external:convnext", 32, {}),
}
SMOKE = {"tiny": ("mlp", 4, {})}
_WARMUP, _STEPS = 2, 5
_MATMUL = 2048  # the square matmul timed for a CPU's FLOP/s (4096 on a GPU: seconds here)


def measured_step(built: Any) -> float:
    """The median of a few real steps (forward, loss, backward, AdamW step), in seconds."""
    model, optimizer, batch = built.model, built.optimizer, built.batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        compute_loss(call_model(model, batch), batch, built.loss_fn).backward()
        optimizer.step()

    for _ in range(_WARMUP):
        step()
    times = []
    for _ in range(_STEPS):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def row(name: str, spec: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    kind, batch, sizes = spec
    torch.manual_seed(0)
    if kind.startswith("external:"):
        built = zoo_external.build(kind.removeprefix("external:"), batch, **sizes)
    else:
        built = zoo.BUILDERS[kind](batch, **sizes)
    with captured_inputs() as seen:
        autoshard.plan(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            world_size=1,
            device="cpu",
            device_memory="16GiB",
            mixed_precision="no",
            strategy="local",
        )
    inputs = seen[-1]
    cpu = torch.device("cpu")
    device_module._MATMUL = _MATMUL
    flops = device_module._matmul_rate(cpu, torch.float32)
    hardware = replace(
        inputs.hardware,
        flops_per_s=flops,
        memory_bytes_per_s=device_module._copy_rate(cpu),
        kernel_launch_s=device_module._launch_time(cpu),
    )
    assert inputs.profile is not None
    own = model_rate(cpu, inputs.profile, flops, hardware.memory_bytes_per_s)
    moving = model_bandwidth(cpu, inputs.profile, hardware.memory_bytes_per_s)
    step = measured_step(built)
    matmul = step_seconds(replace(inputs, hardware=hardware), Strategy.LOCAL, 0)
    modelled_own = None
    if own is not None:
        hardware_own = replace(hardware, flops_per_s=own[0])
        modelled_own = step_seconds(replace(inputs, hardware=hardware_own), Strategy.LOCAL, 0)
    modelled_both = None
    if own is not None and moving is not None:
        hardware_both = replace(hardware, flops_per_s=own[0], operator_bytes_per_s=moving[0])
        modelled_both = step_seconds(replace(inputs, hardware=hardware_both), Strategy.LOCAL, 0)
    return {
        "model": name,
        "measured": step,
        "matmul_rate": flops,
        "own_rate": None if own is None else own[0],
        "own_where": "" if own is None else own[1],
        "modelled_matmul": matmul,
        "modelled_own": modelled_own,
        "copy_rate": hardware.memory_bytes_per_s,
        "own_bandwidth": None if moving is None else moving[0],
        "moving_where": "" if moving is None else moving[1],
        "modelled_both": modelled_both,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--smoke", action="store_true", help="one tiny model (the test's)")
    parser.add_argument(
        "--bytes", type=float, help="MiB the calls timed together take at most (rates._BYTES)"
    )
    parser.add_argument(
        "--cut-bytes",
        type=float,
        help="MiB a call too large for what is left runs alone within (rates._CUT_BYTES; 0: not "
        "timed)",
    )
    args = parser.parse_args(argv)
    if args.bytes is not None:
        rates._BYTES = int(args.bytes * 2**20)
    if args.cut_bytes is not None:
        rates._CUT_BYTES = int(args.cut_bytes * 2**20)
    chosen = SMOKE if args.smoke else {n: MODELS[n] for n in args.models.split(",")}
    print(
        f"{torch.__version__}, {torch.get_num_threads()} thread(s); the large matmul "
        f"{_MATMUL}x{_MATMUL} fp32; calls timed within {rates._BYTES / 2**20:g} MiB, a larger "
        f"one alone within {rates._CUT_BYTES / 2**20:g} MiB"
    )
    print(
        "| model | measured step | matmul's FLOP/s | own FLOP/s | copy's B/s | own B/s | "
        "modelled (matmul's, copy's) | modelled (own FLOP/s) | modelled (own FLOP/s and B/s) | "
        "own: what was timed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, spec in chosen.items():
        r = row(name, spec)

        def ms(seconds: float | None, r: dict[str, Any] = r) -> str:
            if seconds is None:
                return "-"
            return f"{seconds * 1e3:.1f} ms ({(seconds - r['measured']) / r['measured']:+.0%})"

        own = "-" if r["own_rate"] is None else f"{r['own_rate'] / 1e9:.1f} G"
        moving = "-" if r["own_bandwidth"] is None else f"{r['own_bandwidth'] / 1e9:.1f} G"
        where = "; ".join(w for w in (r["own_where"], r["moving_where"]) if w)
        print(
            f"| {name} | {r['measured'] * 1e3:.1f} ms | {r['matmul_rate'] / 1e9:.1f} G | {own} | "
            f"{r['copy_rate'] / 1e9:.1f} G | {moving} | {ms(r['modelled_matmul'])} | "
            f"{ms(r['modelled_own'])} | {ms(r['modelled_both'])} | {where} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
