"""The demo's command-line options, shared by `autoshard demo` (which checks them before it
launches any process) and the demo's ranks (which parse them again), and with `autoshard plan`
for the options that steer the choice."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from autoshard._units import parse_bytes
from autoshard.decide.precision import REQUESTS
from autoshard.decide.validate import parse_strategy
from autoshard.strategies.strategy import Strategy


def _int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_steps_arg = _int_at_least(2, " (the demo checks that the loss went down)")


def _ac_arg(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a number of blocks, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or >= 0 blocks, got {value}")
    return value


def _strategy_arg(text: str) -> str:
    try:  # the library's own check, so that `--strategy fsdp` gets its "did you mean"
        parse_strategy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.lower()


def _size_arg(text: str) -> int:
    # parsed here, with the library's own rules, so a typo fails before torchrun starts ranks
    try:
        return parse_bytes(text, what="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_decision_options(parser: argparse.ArgumentParser) -> None:
    """Options that steer autoshard's choice; `autoshard demo` and `autoshard plan` share them."""
    strategies = ["auto", *(s.value for s in Strategy)]
    parser.add_argument(
        "--strategy", default="auto", type=_strategy_arg, metavar="{" + ",".join(strategies) + "}"
    )
    parser.add_argument("--mixed-precision", default="auto", choices=REQUESTS)
    parser.add_argument(
        "--activation-checkpointing",
        type=_ac_arg,
        default="auto",
        help="'auto' or the number of blocks to checkpoint",
    )
    parser.add_argument(
        "--memory-limit",
        type=_size_arg,
        default=None,
        help="cap on usable memory per rank: bytes or e.g. '6GiB'",
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to `parser`; `autoshard demo` validates with these before launch."""
    parser.add_argument("--steps", type=_steps_arg, default=40)
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=16,
        help="global batch, split across ranks (default: 16)",
    )
    parser.add_argument("--seq-len", type=_positive_int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    add_decision_options(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=_positive_int, default=5)


def build_parser(prog: str = "python -m autoshard.cli.demo_rank") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_options(parser)
    return parser


def options_to_argv(args: argparse.Namespace) -> list[str]:
    """Turn parsed demo options back into argv, for handing them to the torchrun children.

    Relies on every demo option being spelled `--dest-with-dashes` and taking one value.
    """
    argv: list[str] = []
    for dest in vars(build_parser().parse_args([])):
        value = getattr(args, dest, None)
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    return argv
