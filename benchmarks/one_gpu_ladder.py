"""The one-GPU ladder (issue 23) measured: for each model family at memory_limit = 60% and 35% of
its unwrapped need, `auto` under plain `python` and under `torchrun`, against every forced rung
the plan lists as fitting.

    python benchmarks/one_gpu_ladder.py --out DIR            # one CUDA GPU, at most 9 minutes
    python benchmarks/one_gpu_ladder.py --out DIR --dry-run  # CPU, tiny sizes: the plumbing

Writes DIR/report.md and DIR/report.json (rewritten after every family and forced rung), and
each child's output to DIR/logs/. Every step is a child process with a hard timeout:

1. survey, per family (`python`): `autoshard.plan(..., device="cuda")` with no limit. The
   unwrapped need is its LOCAL candidate with 0 blocks checkpointed, estimated peak plus the
   reserve kept beside it: the least memory_limit under which the plan trains the model
   unwrapped. Then a plan at each limit (what is simulated depends on the usable memory): the
   rungs it lists as fitting (autoshard's own `all_candidates` on that plan's inputs: each
   strategy weighed, 0..n blocks checkpointed) and its choice, the prediction for auto. The
   LOCAL 0-checkpoint rung is also trained with no limit, for its measured peak (reported only).
2. auto, per family, fraction and launcher (`python child`, `torchrun --nproc-per-node 1
   child`): the model built on the GPU, AdamW's defaults, `prepare(..., memory_limit=limit)`,
   then the allocator capped at the limit (`set_per_process_memory_fraction`: the process may
   reserve no more, as on a GPU that small), its peak statistics reset, and STEPS steps, the
   last TIMED timed: the chosen rung, its estimate, `max_memory_allocated`, the step time, and
   any OOM or DoesNotFit text.
3. forced, after every family's survey and auto runs: each rung listed as fitting, trained the
   same way with strategy and activation_checkpointing forced (no trial step: an OOM shows in
   the steps), under `python` only, once, at the tightest limit it fits (so it fits every
   looser one; the allocator's retries show whether the cap slowed it). A wave at a time over
   the families, each family's likeliest fastest rung first (the fewest blocks checkpointed of
   each strategy), so that a budget that runs out skips the slow ones. regret = the fastest
   forced step / auto's step; at least REGRET_TARGET passes.

Survey and auto runs share the budget less FORCED_SHARE equally among the families (what one
leaves goes to the next, and to the forced rungs); a child the time left cannot hold (judged
by the longest child of its kind so far) is skipped and recorded. To finish what a run skipped,
run again with `--families` naming fewer. On the CPU dry run CPU_OFFLOAD is unavailable (it
moves GPU memory to the host), so the ladder there has only LOCAL rungs, 35% fits nothing, and
the peak is the live tensor bytes: it checks the plumbing (plans, launches, measurements,
report), not the acceptance. Nothing needs installing: every process imports autoshard and the
benchmarks' modules from this checkout, from whatever directory it was started in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FRACTIONS = (0.60, 0.35)
LAUNCHERS = ("python", "torchrun")
STEPS, TIMED = 5, 3  # the first step creates AdamW's state; the last TIMED are timed
REGRET_TARGET = 0.95
# Seconds (GPU, dry run): the whole run, one child at most. The GPU total keeps the run under
# the 10 minutes one command may hold a GPU machine for, with room for the report.
TOTAL_BUDGET_S = (520, 1500)
CHILD_TIMEOUT_S = (150, 300)
# The share of the total kept for the forced rungs, which run after every family's survey and
# auto runs (and get whatever those leave besides)
FORCED_SHARE = 0.3


def _sized(name: str, batch: int | None = None, **sizes: Any) -> tuple[str, int, dict[str, Any]]:
    """A GPU suite model (`_gpu_models.GPU_MODELS`) with some of its sizes changed."""
    from _gpu_models import GPU_MODELS

    kind, default_batch, base = GPU_MODELS[name]
    return kind, batch or default_batch, {**base, **sizes}


# name: (builder, batch, sizes), as `_gpu_models.build` reads them. The GPU suite's families made
# smaller (100-180M parameters), so that a child, CPU offload's host AdamW step included, takes
# seconds: each one's ladder has LOCAL or CPU_OFFLOAD rungs at both fractions.
GPU_FAMILIES = {
    # Qwen2-0.5B's blocks (grouped-query attention) at half its depth, Llama's 32k vocabulary
    # (with Qwen's 152k, the logits alone exceed 35% of the need): 118M
    "qwen_gqa": _sized("qwen_gqa", depth=6, vocab_size=32000),
    "moe": _sized("moe", depth=3),  # Mixtral-shaped, 8 experts: 177M
    "enc_dec": _sized("enc_dec", layers=3),  # BART-large's width, 3 + 3 blocks: 141M
    # ViT-B/16 at 224 px (86M); its activations are most of its need
    "vit_base": (
        "vit",
        64,
        dict(image_size=224, patch=16, width=768, depth=12, heads=12, classes=1000),
    ),
}
# Tiny, with activations most of the need, so that checkpointing fits 60% on the CPU
DRY_FAMILIES = {
    "qwen_gqa": ("gqa", 16, dict(heads=4, kv_heads=2, bias=True, seq_len=128, depth=3)),
    "moe": ("moe", 16, dict(tied=False, experts=4, top_k=2, repeat=True, seq_len=128, depth=3)),
    "enc_dec": ("enc_dec", 16, dict(source_len=128, target_len=64, layers=2)),
    "vit_base": ("vit", 32, dict(image_size=32, patch=4, width=64, depth=3, heads=4, classes=10)),
}
NEED_REFERENCE = (
    "the unwrapped need is autoshard.plan()'s estimate for LOCAL with 0 blocks checkpointed "
    "(estimated peak + reserve: the least memory_limit the plan trains it unwrapped under), "
    "made in the survey child with no limit"
)


def families_for(dry_run: bool) -> dict[str, tuple[str, int, dict[str, Any]]]:
    return DRY_FAMILIES if dry_run else GPU_FAMILIES


# ---------------------------------------------------------------------------------------------
# The parent: launches the children within the budget, derives regret, writes the report


class Runner:
    """Launches the children, each within the current deadline."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out, self.dry_run = out, dry_run
        self.child_timeout = CHILD_TIMEOUT_S[int(dry_run)]
        self.longest: dict[str, float] = {}  # the longest child so far, by kind
        self.deadline = 0.0  # of the current phase (a family's survey and auto, or forced)

    def launch(self, kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one child (`spec["launcher"]`); its result, or why there is none."""
        left = self.deadline - time.time()
        if left < max(self.longest.get(kind, 0.0), 1.0):
            return {**spec, "outcome": "skipped", "error": "the time budget left cannot hold it"}
        result, log = self.out / "children" / f"{name}.json", self.out / "logs" / f"{name}.log"
        spec = {**spec, "dry_run": self.dry_run, "result": str(result), "kind": kind}
        spec_path = self.out / "children" / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        command = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
        if spec["launcher"] == "torchrun":
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [*run, "--nproc-per-node", "1", *command[1:]]
        timeout = min(self.child_timeout, left)
        began = time.time()
        code = _run_tree(command, timeout, log)
        seconds = round(time.time() - began, 1)
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)
        if result.exists():
            return {**json.loads(result.read_text()), "seconds": seconds}
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        why = f"timed out at {timeout:.0f}s" if code is None else f"exited with {code}"
        return {
            **spec,
            "outcome": "crashed",
            "error": f"{why}, no result: {tail}",
            "seconds": seconds,
        }

    def first(self, name: str, deadline: float) -> dict[str, Any]:
        """The survey, then auto at each fraction and launcher (the forced rungs come later)."""
        self.deadline = deadline
        entry: dict[str, Any] = {"share_s": round(deadline - time.time(), 1), "forced": []}
        survey = self.launch("survey", f"{name}-survey", {"family": name, "launcher": "python"})
        entry["survey"] = survey
        if survey.get("outcome") == "ok":
            entry["auto"] = [
                self.launch(
                    "auto", f"{name}-auto-{f:.2f}-{launcher}", _auto(name, survey, f, launcher)
                )
                for f in FRACTIONS
                for launcher in LAUNCHERS
            ]
        return entry

    def forced(self, families: dict[str, Any], deadline: float, written: Any) -> None:
        """Every family's forced rungs, a wave at a time (each family's likeliest fastest rung,
        then its next one), until `deadline`; `written()` after each."""
        self.deadline = deadline
        queues = {
            name: forced_order(f["survey"])
            for name, f in families.items()
            if f["survey"].get("outcome") == "ok"
        }
        while any(queues.values()):
            for name, queue in queues.items():
                if queue:
                    s, k, f = queue.pop(0)
                    spec = _forced(name, families[name]["survey"], f, s, k)
                    families[name]["forced"].append(
                        self.launch("forced", f"{name}-{s}-{k}-{f:.2f}", spec)
                    )
                    written()


def _run_tree(command: list[str], timeout: float, log: Path) -> int | None:
    """`command` as gpu_suite runs a section (in the repository, its own process group, output
    to `log`); None if it was killed at `timeout`. The whole tree is killed: torchrun starts its
    worker in a session of its own, which killing torchrun's group would leave holding the GPU."""
    import psutil
    from gpu_suite import _start

    process = _start(command, log, [str(HERE)])
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            tree = [process, *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:  # it ended meanwhile
            tree = []
        for each in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                each.kill()
        process.wait()
        return None


def _auto(name: str, survey: dict[str, Any], fraction: float, launcher: str) -> dict[str, Any]:
    limit = survey["limits"][f"{fraction:.2f}"]["limit_bytes"]
    return dict(
        family=name,
        fraction=fraction,
        launcher=launcher,
        limit_bytes=limit,
        strategy="auto",
        checkpointing="auto",
        trial_step=True,
    )


def _forced(
    name: str, survey: dict[str, Any], fraction: float, strategy: str, k: int
) -> dict[str, Any]:
    # the trial step proves nothing a timed run does not (an OOM shows in the steps)
    spec = _auto(name, survey, fraction, "python")
    return {**spec, "strategy": strategy, "checkpointing": k, "trial_step": False}


def forced_order(survey: dict[str, Any]) -> list[tuple[str, int, float]]:
    """Each rung that fits some fraction, once, at the tightest fraction it fits: for each
    fraction, each strategy's fewest-checkpointed fitting rung first, then the next ones."""
    tightest: dict[tuple[str, int], float] = {}
    waves: list[tuple[int, int, tuple[str, int]]] = []
    for order, fraction in enumerate(FRACTIONS):
        fitting = [(str(s), int(k)) for s, k in survey["limits"][f"{fraction:.2f}"]["fitting"]]
        for strategy in dict.fromkeys(s for s, _ in fitting):
            ks = sorted(k for s, k in fitting if s == strategy)
            waves += [(i, order, (strategy, k)) for i, k in enumerate(ks)]
        for rung in fitting:
            tightest[rung] = min(tightest.get(rung, 1.0), fraction)
    chosen = dict.fromkeys(rung for _, _, rung in sorted(waves))
    return [(s, k, tightest[(s, k)]) for s, k in chosen]


def rows(
    survey: dict[str, Any], autos: list[dict[str, Any]], forced: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per auto run: the fastest forced rung that fits its fraction, the regret, the verdict."""
    # keyed by the rung each trained (a forced rung the trial step left would show here)
    timed = {(f["chosen_strategy"], f["checkpointed"]): f for f in forced if f["outcome"] == "ok"}
    out = []
    for run in autos:
        fraction = run["fraction"]
        limits = survey["limits"][f"{fraction:.2f}"]
        fitting = [timed[tuple(r)] for r in limits["fitting"] if tuple(r) in timed]
        fastest = min(fitting, key=lambda f: f["step_s"], default=None)
        ok = run["outcome"] == "ok"
        regret = fastest["step_s"] / run["step_s"] if ok and fastest is not None else None
        row = {
            "fraction": fraction,
            "launcher": run["launcher"],
            "outcome": run["outcome"],
            "predicted": limits["predicted"],
            "chosen": [run["chosen_strategy"], run["checkpointed"]] if ok else None,
            "fastest_forced": [fastest["chosen_strategy"], fastest["checkpointed"]]
            if fastest
            else None,
            "fastest_forced_step_s": fastest["step_s"] if fastest else None,
            "forced_timed": len(fitting),
            "forced_fitting": len(limits["fitting"]),
            "regret": regret,
        }
        within = run.get("within_limit")
        row["passed"] = bool(ok and within and regret is not None and regret >= REGRET_TARGET)
        out.append(row)
    return out


def machine(families: dict[str, Any]) -> dict[str, Any]:
    """The host, and the torch and device the first survey child saw."""
    seen = next((f["survey"].get("machine") for f in families.values() if "survey" in f), None)
    info = {"python": platform.python_version(), "platform": platform.platform()}
    return {**info, "cpu_count": os.cpu_count(), **(seen or {})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="directory for report.md/report.json")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes")
    p.add_argument("--families", default=",".join(GPU_FAMILIES), help="comma-separated")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = [f for f in args.families if f not in GPU_FAMILIES]
    if unknown:
        p.error(f"unknown famil(ies) {', '.join(unknown)}; choose from {', '.join(GPU_FAMILIES)}")
    if args.child is None and args.out is None:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gpu_suite import on_path

    on_path()
    os.environ.setdefault("AUTOSHARD_CACHE", "0")  # every plan made cold, as in _bench.py
    if args.child is not None:
        return child(json.loads(args.child.read_text()))
    out: Path = args.out.resolve()
    if args.dry_run:  # the children too, the GPU hidden: on a GPU machine, torchrun would take it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for sub in ("children", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for stale in (out / sub).iterdir():  # a previous run's must not be read as this one's
            stale.unlink()
    runner, started = Runner(out, args.dry_run), time.time()
    deadline = started + TOTAL_BUDGET_S[int(args.dry_run)]
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "budget_s": TOTAL_BUDGET_S[int(args.dry_run)],
        "fractions": FRACTIONS,
        "launchers": LAUNCHERS,
        "steps": {"total": STEPS, "timed": TIMED},
        "regret_target": REGRET_TARGET,
        "need_reference": NEED_REFERENCE,
        "families": {},
    }
    families: dict[str, Any] = report["families"]

    def written() -> None:
        report["seconds"] = round(time.time() - started, 1)
        report["machine"] = machine(families)
        write(report, out)

    # survey and auto first, each family an equal share of what the forced rungs leave
    reserved = FORCED_SHARE * TOTAL_BUDGET_S[int(args.dry_run)]
    for index, name in enumerate(args.families):
        share = (deadline - reserved - time.time()) / (len(args.families) - index)
        families[name] = runner.first(name, time.time() + share)
        written()
    runner.forced(families, deadline, written)
    written()
    print(f"report written to {out / 'report.md'} and {out / 'report.json'}")
    return 0


# ---------------------------------------------------------------------------------------------
# The report


def write(report: dict[str, Any], out: Path) -> None:
    """report.json and report.md, with each family's rows derived from what has run so far."""
    for family in report["families"].values():
        runs = [family["survey"], *family.get("auto", []), *family["forced"]]
        family["seconds"] = round(sum(r.get("seconds", 0) for r in runs), 1)
        if "auto" in family:
            family["rows"] = rows(family["survey"], family["auto"], family["forced"])
    rows_ = [r for f in report["families"].values() for r in f.get("rows", [])]
    whole = len(FRACTIONS) * len(LAUNCHERS)
    report["summary"] = {
        "rows": len(rows_),
        "passed": sum(r["passed"] for r in rows_),
        "families": len(report["families"]),
        # every fraction under every launcher passed: the acceptance, for that family
        "families_passed": sorted(
            name
            for name, f in report["families"].items()
            if len(f.get("rows", [])) == whole and all(r["passed"] for r in f["rows"])
        ),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text("\n".join(markdown(report)) + "\n")


def _b(value: Any) -> str:
    from autoshard._units import human

    return "-" if value is None else human(value)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def _rung(rung: Any) -> str:
    """[strategy, checkpointed] as `local 2`; a text (why nothing fits) by its first words."""
    if not rung:
        return "-"
    return f"{rung[0]} {rung[1]}" if isinstance(rung, list) else str(rung).split(":")[0]


def markdown(report: dict[str, Any]) -> list[str]:
    m, s = report.get("machine", {}), report["summary"]
    lines = [
        "# One-GPU ladder" + (" (dry run, CPU)" if report["dry_run"] else ""),
        "",
        f"{report['date']}, {report.get('seconds', 0)} s of a {report['budget_s']} s budget; "
        f"torch {m.get('torch')}, {m.get('gpu') or 'no GPU'}. {s['passed']} of {s['rows']} "
        f"auto runs passed (trained, allocator peak within the limit, regret >= "
        f"{report['regret_target']}); every fraction and launcher passed for: "
        f"{', '.join(s['families_passed']) or 'none'}.",
        "",
        f"Reference: {report['need_reference']}. Each child trains {report['steps']['total']} "
        f"steps and times the last {report['steps']['timed']}; forced rungs run under python "
        f"once, at the tightest fraction they fit. regret = fastest forced step / auto's step. "
        f"est: the chosen rung's estimated peak less the overheads no allocation shows (CUDA "
        f"context, NCCL buffers, allocator margin), beside the allocator's peak; with them, "
        f"in report.json (estimated_peak_bytes).",
    ]
    if report["dry_run"]:
        lines += [
            "",
            "Dry run on the CPU: CPU_OFFLOAD is unavailable there (it moves GPU memory "
            "to the host), so only LOCAL rungs exist and the peak is the live tensor bytes. "
            "This checks the plumbing (plans, launches, measurements, report), not the "
            "acceptance.",
        ]
    for name, family in report["families"].items():
        lines += ["", *family_lines(name, family)]
    return lines


def _what(run: dict[str, Any]) -> str:
    return "auto" if run["strategy"] == "auto" else f"{run['strategy']} {run['checkpointing']}"


def family_lines(name: str, family: dict[str, Any]) -> list[str]:
    survey = family["survey"]
    head = f"## {name} ({family['seconds']} s; survey and auto had a {family['share_s']} s share)"
    if survey.get("outcome") != "ok":
        return [head, "", f"survey {survey.get('outcome')}: {survey.get('error', '')[:500]}"]
    lines = [
        head,
        "",
        f"{survey['params'] / 1e6:.1f}M parameters, {survey['num_blocks']} blocks; unwrapped need "
        f"{_b(survey['need_bytes'])} (estimate), LOCAL 0 measured peak "
        f"{_b(survey.get('local0_peak_bytes'))}.",
        "",
        "| fraction | launcher | outcome | chosen (predicted) | est | peak | limit | peak<=limit "
        "| step ms | fastest forced | its step ms | regret | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, row in zip(family["auto"], family["rows"], strict=True):
        regret = "-" if row["regret"] is None else f"{row['regret']:.3f}"
        lines.append(
            f"| {row['fraction']:.2f} | {row['launcher']} | {run['outcome']} "
            f"| {_rung(row['chosen'])} ({_rung(row['predicted'])}) "
            f"| {_b(run.get('estimated_tensor_bytes'))} | {_b(run.get('peak_allocated_bytes'))} "
            f"| {_b(run['limit_bytes'])} | {run.get('within_limit', '-')} "
            f"| {_ms(run.get('step_s'))} | {_rung(row['fastest_forced'])} "
            f"({row['forced_timed']}/{row['forced_fitting']} timed) "
            f"| {_ms(row['fastest_forced_step_s'])} | {regret} | {row['passed']} |"
        )
    lines += [
        "",
        "| forced rung | at | outcome | est | peak | step ms | alloc retries |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in family["forced"]:
        retries = (run.get("allocator") or {}).get("alloc_retries", "-")
        lines.append(
            f"| {run['strategy']} {run['checkpointing']} | {run['fraction']:.2f} "
            f"| {run['outcome']} | {_b(run.get('estimated_tensor_bytes'))} "
            f"| {_b(run.get('peak_allocated_bytes'))} | {_ms(run.get('step_s'))} | {retries} |"
        )
    problems = [r for r in [*family["auto"], *family["forced"]] if r["outcome"] != "ok"]
    lines += [""] + [
        f"- {_what(r)} under {r['launcher']} at {r['fraction']:.2f}: {r['outcome']}: "
        f"{str(r.get('error', ''))[:300]}"
        for r in problems
    ]
    return lines


# ---------------------------------------------------------------------------------------------
# The children: one survey or one training run each, a JSON result


def child(spec: dict[str, Any]) -> int:
    """Run `spec` and write its result (rank 0 only: under torchrun there is one rank)."""
    try:
        result = survey(spec) if spec["kind"] == "survey" else train(spec)
    except Exception as error:  # recorded; the parent goes on
        result = {
            "outcome": "error",
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["result"]).write_text(json.dumps({**spec, **result}, indent=1, default=str))
    return 0


def _setup(spec: dict[str, Any]) -> tuple[Any, Any, str]:
    """The device, a meter started before anything is allocated, the mixed precision."""
    import torch
    from _gpu_accuracy import Meter

    if not spec["dry_run"] and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: run with --dry-run on a CPU")
    cuda = not spec["dry_run"]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # the dry run's CPU does not compute bf16 natively; on the GPU auto is what a user gets
    return device, Meter(device), "auto" if cuda else "no"


def survey(spec: dict[str, Any]) -> dict[str, Any]:
    """The unwrapped need, then each limit's fitting rungs and auto's choice, each from a plan
    made at that limit (what is simulated depends on the usable memory), as prepare weighs it."""
    import torch
    from _gpu_models import build

    import autoshard
    from autoshard.decide.candidates import all_candidates

    device, meter, mp = _setup(spec)
    built = build(spec["family"], families_for(spec["dry_run"]), device)
    job = (built.model, built.optimizer, built.batch)
    inputs, plan = _weigh(built, mp, device, None)
    assert isinstance(plan, autoshard.Plan), plan  # no limit: every rung fits
    strategies = tuple(dict.fromkeys(c.strategy for c in plan.candidates))
    rungs = all_candidates(inputs, strategies, None, None)
    local0 = next(c for c in rungs if c.strategy == "local" and c.activation_checkpointing == 0)
    need = local0.estimated_peak_bytes + local0.reserve_bytes
    limits = {}
    for fraction in FRACTIONS:
        limit = int(fraction * need)
        at, chosen = _weigh(built, mp, device, limit)
        weighed = all_candidates(at, strategies, None, None)
        limits[f"{fraction:.2f}"] = dict(
            limit_bytes=limit,
            fitting=[[c.strategy.value, c.activation_checkpointing] for c in weighed if c.fits],
            predicted=chosen
            if isinstance(chosen, str)
            else [chosen.strategy.value, chosen.activation_checkpointing],
            rungs=[{**_candidate(c), "fits": c.fits} for c in weighed],
        )
    # the unwrapped rung trained with no limit: its measured peak, beside the estimated need
    prepared = autoshard.prepare(
        *job,
        loss_fn=built.loss_fn,
        strategy="local",
        activation_checkpointing=0,
        trial_step=False,
        mixed_precision=mp,
    )
    with meter.steps(*job):
        _, oom = _steps(prepared.model, built, device)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "outcome": "ok",
        "params": sum(p.numel() for p in built.model.parameters()),
        "num_blocks": plan.num_blocks,
        "mixed_precision": str(plan.mixed_precision),
        "need_bytes": need,
        "local0_peak_bytes": meter.peak if oom is None else None,
        "local0_oom": oom,
        "rungs": [_candidate(c) for c in rungs],
        "limits": limits,
        "machine": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": props.name if props else None,
            "gpu_memory_bytes": props.total_memory if props else None,
        },
    }


def _weigh(built: Any, mp: str, device: Any, limit: int | None) -> tuple[Any, Any]:
    """`autoshard.plan` at `limit`: the inputs it decided from, and its plan or, where nothing
    fits, the DoesNotFit text."""
    from _gpu_accuracy import captured_inputs

    import autoshard

    job = (built.model, built.optimizer, built.batch)
    options = dict(loss_fn=built.loss_fn, mixed_precision=mp, device=device.type)
    plan: Any
    with captured_inputs() as seen:
        try:
            plan = autoshard.plan(*job, memory_limit=limit, **options)
        except autoshard.DoesNotFit as error:
            plan = f"does not fit: {error}"[:600]
    return seen[-1], plan


def _candidate(c: Any) -> dict[str, Any]:
    return {
        "strategy": c.strategy.value,
        "checkpointed": c.activation_checkpointing,
        "need_bytes": c.estimated_peak_bytes + c.reserve_bytes,
        "estimated_peak_bytes": c.estimated_peak_bytes,
        "estimated_tensor_bytes": c.estimated_peak_bytes - c.footprint.overheads,
        "reserve_bytes": c.reserve_bytes,
        "host_bytes": c.host_bytes,
        "modelled_step_s": c.step_seconds,
    }


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """prepare at the limit (auto, or a forced rung), the allocator capped there, STEPS steps."""
    import torch
    import torch.distributed as dist
    from _gpu_models import build

    import autoshard

    device, meter, mp = _setup(spec)
    built = build(spec["family"], families_for(spec["dry_run"]), device)
    began = time.perf_counter()
    try:
        prepared = autoshard.prepare(
            built.model,
            built.optimizer,
            built.batch,
            loss_fn=built.loss_fn,
            strategy=spec["strategy"],
            activation_checkpointing=spec["checkpointing"],
            memory_limit=spec["limit_bytes"],
            mixed_precision=mp,
            trial_step=spec["trial_step"],
        )
    except autoshard.DoesNotFit as error:
        return {"outcome": "does_not_fit", "error": str(error)[:2000]}
    except torch.OutOfMemoryError as error:
        return {"outcome": "oom_in_prepare", "error": str(error)[:2000]}
    plan, prepare_s = prepared.plan, time.perf_counter() - began
    cap = _cap(device, spec["limit_bytes"])
    with meter.steps(prepared.model, built.optimizer, built.batch):
        times, oom = _steps(prepared.model, built, device)
    peak = meter.peak
    return {
        "outcome": "ok" if oom is None else "oom",
        "error": oom,
        "chosen_strategy": plan.strategy.value,
        "checkpointed": plan.activation_checkpointing,
        "num_blocks": plan.num_blocks,
        **{
            k: v
            for k, v in _candidate(plan.chosen).items()
            if k not in ("strategy", "checkpointed")
        },
        "trial_peak_bytes": plan.measured_peak_bytes,
        "attempts": [str(a) for a in plan.attempts],
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "own_group": any("group of its own" in r for r in plan.reasons),
        "prepare_s": prepare_s,
        "memory_fraction_cap": cap,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": meter.reserved(),
        "within_limit": None if peak is None else peak <= spec["limit_bytes"],
        "allocator": meter.diagnostics,
        "step_times_s": times,
        "step_s": statistics.median(times[-TIMED:]) if len(times) == STEPS else None,
    }


def _cap(device: Any, limit: int) -> float | None:
    """On CUDA, the allocator may reserve at most `limit` bytes from here on, as on a GPU that
    small (the CUDA context, outside the allocator, is not counted)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()  # cached blocks would be reused beyond the cap
    fraction = min(1.0, limit / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def _steps(model: Any, built: Any, device: Any) -> tuple[list[float], str | None]:
    """STEPS training steps, each timed; an OOM ends them and is returned as text."""
    import torch
    from _gpu_accuracy import step, sync

    times: list[float] = []
    held: list[Any] = [None]
    try:
        for _ in range(STEPS):
            sync(device)
            began = time.perf_counter()
            step(model, built.optimizer, built.batch, built.loss_fn, held)
            sync(device)
            times.append(time.perf_counter() - began)
    except torch.OutOfMemoryError as error:
        return times, f"step {len(times) + 1}: {error}"[:2000]
    return times, None


if __name__ == "__main__":
    sys.exit(main())
