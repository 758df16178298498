"""The operator check (`measure.operators`, issue 24) with each block on meta tensors against the
check with every block on fake tensors: for each family of `benchmarks/deep_families.py`, both
verdicts (which blocks differ, None where all run alike), whether the blocks ran on meta, and the
CPU seconds each took. Built on meta and checked on CPU fake tensors under bf16 autocast, as a
mixed-precision plan checks them.

    python benchmarks/operator_check.py
    python benchmarks/operator_check.py --families llama,qwen3_moe --dtype fp32

Exit status 1 where any verdict differs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import deep_families  # noqa: E402

from autoshard.decide.blocks import find_blocks  # noqa: E402
from autoshard.measure import operators  # noqa: E402
from autoshard.measure.layout import repeats  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
_CHOSEN = operators.operators_by_block  # as the check runs: meta, else fake tensors


def checked(family: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """Both verdicts for `family`, whether its blocks ran on meta, and each check's seconds."""
    built = deep_families.build(family)
    found = find_blocks(built.model)
    names, blocks = [n for n, _ in found], [b for _, b in found]
    layout = repeats(built.model, names)
    if layout is None:
        return {"family": family, "blocks": len(blocks), "layout": None}
    row: dict[str, Any] = {"family": family, "blocks": len(blocks), "layout": layout}
    recorded = operators._recorded
    for kind, meta in (("meta", True), ("fake", False)):
        row[f"{kind}_failed"] = None

        def only(*args: Any, kind: str = kind, meta: bool = meta) -> Any:
            try:
                return recorded(*args, meta=meta)
            except Exception as error:
                row[f"{kind}_failed"] = f"{type(error).__name__}: {str(error)[:80]}"
                raise

        operators.operators_by_block = only  # type: ignore[assignment]
        start = time.process_time()
        try:
            row[kind] = operators.first_unlike(
                built.model, blocks, names, layout, built.batch, dtype, torch.device("cpu")
            )
        except Exception:  # noqa: BLE001 - the check's caller then trusts the attributes
            row[kind] = "(failed)"
        finally:
            operators.operators_by_block = _CHOSEN  # type: ignore[assignment]
        row[f"{kind}_s"] = time.process_time() - start
    return row


def _which(verdict: str | None) -> str | None:
    """Which blocks differ: the verdict without the first differing operator, which may be
    named otherwise on meta (autocast's casts made where a torch function is called, attention
    without a fused kernel)."""
    return None if verdict is None else verdict.split(" (")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(deep_families.FAMILIES))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, autocast {args.dtype}")
    print("| family | blocks | verdict on meta | on fake | blocks on meta | meta s | fake s |")
    print("|---|---|---|---|---|---|---|")
    differ = 0
    totals = [0.0, 0.0]
    for family in args.families.split(","):
        row = checked(family, DTYPES[args.dtype])
        if row["layout"] is None:
            print(f"| {family} | {row['blocks']} | (blocks do not repeat) | | | | |")
            continue
        same = _which(row["meta"]) == _which(row["fake"])
        differ += not same
        ran = "yes" if row["meta_failed"] is None else f"no ({row['meta_failed']})"
        totals[0] += row["meta_s"]
        totals[1] += row["fake_s"]
        print(
            f"| {family} | {row['blocks']} | {_which(row['meta'])} | {_which(row['fake'])}"
            f"{'' if same else ' **differs**'} | {ran} | {row['meta_s']:.2f} "
            f"| {row['fake_s']:.2f} |"
        )
    print(
        f"\nin all: {totals[0]:.1f} s on meta, {totals[1]:.1f} s on fake tensors; "
        f"{differ} verdict(s) differ"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
