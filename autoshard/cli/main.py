"""The `autoshard` command: `autoshard demo` trains a small GPT, `autoshard plan` answers what-ifs.

    autoshard demo [--nproc N] [--steps 40 --strategy full_shard ...]
    autoshard plan mypkg.models:build --world-size 8 --device-memory 80GiB

This is a program, so unlike the library it prints.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import autoshard
from autoshard.cli import demo
from autoshard.cli.options import (
    _positive_int,
    _size_arg,
    add_decision_options,
    add_options,
    options_to_argv,
)
from autoshard.decide import plot

_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _factory(text: str) -> str:
    if not _FACTORY_RE.match(text):
        raise argparse.ArgumentTypeError(
            f"expected MODULE:FACTORY such as 'mypkg.models:build', got {text!r}"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,plan}")

    _add_demo_parser(sub)
    _add_plan_parser(sub)
    return parser


def _add_demo_parser(sub: Any) -> None:
    demo_parser = sub.add_parser(
        "demo",
        help="train a small GPT on this machine under autoshard.prepare",
        description="Train a small GPT-2-style model with autoshard.prepare. Outside torchrun, "
        "relaunches itself through torchrun with --nproc processes.",
    )
    demo_parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="processes to launch (default: number of CUDA GPUs, else 2 on CPU)",
    )
    add_options(demo_parser)
    demo_parser.set_defaults(run=_run_demo, subparser=demo_parser)


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the plan autoshard would choose, without wrapping anything",
        description="Build a model from MODULE:FACTORY and print autoshard.plan() for it. "
        "FACTORY() returns a model, or a tuple (model, optimizer, example_batch).",
    )
    plan.add_argument("factory", type=_factory, metavar="MODULE:FACTORY")
    plan.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help="ranks to plan for (default: the current world, else 1)",
    )
    plan.add_argument(
        "--device-memory",
        type=_size_arg,
        default=None,
        help="memory of one device, bytes or e.g. '80GiB' (default: measured here)",
    )
    plan.add_argument(
        "--nodes",
        type=_positive_int,
        default=1,
        help="nodes the ranks span; more than one adds HYBRID_SHARD (default: 1)",
    )
    plan.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="what the ranks train on (default: cuda when --device-memory is given, else this "
        "machine's device)",
    )
    plan.add_argument(
        "--host-memory",
        type=_size_arg,
        default=None,
        help="host RAM per rank for CPU offload, e.g. '64GiB' (default: not checked)",
    )
    plan.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="per-rank batch size, passed to FACTORY(batch_size=...) if it takes it",
    )
    plan.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="sequence length, passed to FACTORY(seq_len=...) if it takes it",
    )
    plan.add_argument(
        "--max-batch",
        action="store_true",
        help="also find each candidate's largest per-rank batch that fits, by simulating a "
        "few batch sizes (the table's batch column)",
    )
    plan.add_argument(
        "--materialize",
        action="store_true",
        help="build the model on this machine's memory instead of the meta device",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON (Plan.to_dict()) instead of the table",
    )
    plan.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw each candidate's memory by term against the usable memory "
        '(Plan.plot) into FILE.png; needs matplotlib: pip install "autoshard[plot]"',
    )
    add_decision_options(plan)
    plan.set_defaults(run=_run_plan, subparser=plan)


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    demo_argv = options_to_argv(args)
    if _inside_torchrun():
        if args.nproc is not None and os.environ.get("RANK", "0") == "0":
            print(
                "autoshard demo: --nproc ignored: already running under a launcher", file=sys.stderr
            )
        return demo.main(demo_argv)
    nproc = args.nproc if args.nproc is not None else _default_nproc()
    if args.batch_size % nproc:
        # checked here so the error comes once, before any process starts
        parser.error(f"--batch-size {args.batch_size} must be divisible by --nproc {nproc}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "autoshard.cli.demo_rank",
        *demo_argv,
    ]
    print("autoshard demo: launching", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's choice too, minus its banner saying so
    with tempfile.TemporaryDirectory(prefix="autoshard-demo-") as tmp:
        status_file = os.path.join(tmp, "status")
        env[demo.STATUS_FILE_ENV] = status_file
        returncode = subprocess.run(cmd, check=False, env=env).returncode
        if returncode != 0 or not os.path.exists(status_file):
            return returncode or 1  # a rank crashed: torchrun has said which, and how
        with open(status_file) as f:
            return int(f.read())


def _call_factory(
    parser: argparse.ArgumentParser, factory: Any, spec: str, args: argparse.Namespace
) -> Any:
    """FACTORY(batch_size=..., seq_len=...) with the sizes given (each only if it takes it),
    built on the meta device: a 7B model costs no memory, and the trace and the simulation
    only need shapes."""
    sizes = {"batch_size": args.batch_size, "seq_len": args.seq_len}
    try:
        accepted: Mapping[str, inspect.Parameter] = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in sizes.items() if v is not None and (k in accepted or takes_any)}
    ignored = [
        f"--{k.replace('_', '-')}" for k, v in sizes.items() if v is not None and k not in kwargs
    ]
    if ignored:
        parser.error(f"{spec} takes no {', '.join(ignored)} (add a keyword parameter for it)")
    if args.materialize:
        return factory(**kwargs)
    with torch.device("meta"):
        return factory(**kwargs)


def _load_factory(
    parser: argparse.ArgumentParser, spec: str, args: argparse.Namespace
) -> tuple[Any, Any, Any]:
    module_name, _, attr = spec.partition(":")
    # A console script does not put the working directory on sys.path; `python -m` does. Add it
    # so `autoshard plan mymodel:build` finds ./mymodel.py either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        parser.error(f"cannot import module {module_name!r} from {spec!r}: {exc}")
    factory = getattr(module, attr, None)
    if not callable(factory):
        parser.error(f"module {module_name!r} has no callable {attr!r}")
    made = _call_factory(parser, factory, spec, args)
    if isinstance(made, nn.Module):
        return made, torch.optim.AdamW(made.parameters()), None
    if isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module):
        return made  # a CPU batch beside a meta model is moved to meta by plan() itself
    parser.error(
        f"{spec}() returned {type(made).__name__}; expected an nn.Module or a tuple "
        "(model, optimizer, example_batch)"
    )


def _run_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="autoshard: %(message)s", stream=sys.stderr)
    if args.plot is not None:
        _check_plot(parser, args.plot)  # before the minutes a large plan may take
    model, optimizer, batch = _load_factory(parser, args.factory, args)
    device = args.device or ("cuda" if args.device_memory is not None else None)
    try:
        plan = autoshard.plan(
            model,
            optimizer,
            example_batch=batch,
            world_size=args.world_size,
            num_nodes=args.nodes,
            device=device,
            host_memory=args.host_memory,
            device_memory=args.device_memory,
            memory_limit=args.memory_limit,
            strategy=args.strategy,
            mixed_precision=args.mixed_precision,
            activation_checkpointing=args.activation_checkpointing,
            max_batch=args.max_batch,
        )
    except ValueError as exc:  # autoshard's user-facing errors: bad sizes, impossible settings
        parser.error(str(exc))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan)
    if args.plot is not None:
        plan.plot(args.plot)
        print(f"autoshard plan: drew the plan in {args.plot}", file=sys.stderr)
    return 0


def _check_plot(parser: argparse.ArgumentParser, path: str) -> None:
    """--plot's matplotlib and folder, checked before planning."""
    try:
        plot.require_matplotlib()
    except ImportError as exc:
        parser.error(f"--plot: {exc}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"--plot {path}: the folder {folder} does not exist")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autoshard` console script and of `python -m autoshard`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # errors found after parsing go through the subcommand's parser, so its usage is shown
    return int(args.run(args.subparser, args))
