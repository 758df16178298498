"""The GPU suite's report: report.json as the sections left it, report.md for people."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoshard._units import human


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Each test case of a pytest JUnit XML: name, outcome, seconds, message, captured output."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (found.get("message") or found.text or "")[:2000]
        output = case.find("system-out")
        cases.append(
            {
                "name": case.get("name", "?"),
                "outcome": outcome,
                "seconds": float(case.get("time", 0) or 0),
                "message": message,
                "output": (output.text or "")[-3000:] if output is not None else "",
            }
        )
    return cases


def log_cases(path: Path) -> list[dict[str, Any]]:
    """Outcomes from pytest's verbose log (`tests/x.py::test_y PASSED`), for a run stopped before
    it wrote its XML."""
    cases: list[dict[str, Any]] = []
    if not path.exists():
        return cases
    for line in path.read_text(errors="replace").splitlines():
        match = re.match(r"^\S+::(\S+) (PASSED|FAILED|SKIPPED|ERROR)", line)
        if match:
            outcome = {"PASSED": "passed", "SKIPPED": "skipped"}.get(match[2], "failed")
            cases.append(
                {"name": match[1], "outcome": outcome, "seconds": 0.0, "message": "", "output": ""}
            )
    return cases


def _bytes(value: Any) -> str:
    return "-" if value is None else human(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _count(value: int) -> str:
    return f"{value / 1e6:.0f}M" if value >= 10**6 else f"{value / 1e3:.0f}k"


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def _cell(text: str) -> str:
    """`text` as one markdown table cell: no line break, no column separator."""
    return " ".join(text.split()).replace("|", "/")


def _secs(value: Any) -> str:
    return "-" if value is None else f"{value:.1f} s"


def tests_md(result: dict[str, Any]) -> list[str]:
    counts = result["counts"]
    lines = [
        f"`{result['command']}`: exit {result['returncode']}; {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped (pytest: {result.get('pytest')})",
        "",
        "| test | outcome | s | message |",
        "|---|---|---|---|",
    ]
    for c in result["cases"]:
        message = c["message"].splitlines()[0][:160] if c["message"] else ""
        lines.append(f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {message} |")
    return lines


def compat_md(result: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [versions, "", "| feature | present | used by | without it |", "|---|---|---|---|"]
    for r in result["features"]:
        present = "yes" if r["present"] else f"**no** {r['note']}"
        lines.append(f"| {r['feature']} | {present} | {r['used_by']} | {r['fallback']} |")
    return lines


def calibration_md(result: dict[str, Any]) -> list[str]:
    lines = [
        f"matmul in {result['dtype']}; a figure off by more than 20% is taken from the measurement",
        "",
        "| figure | constant (`hardware_for`) | measured | off by | used |",
        "|---|---|---|---|---|",
    ]
    taken = result["throughput"]
    for name, f in result["figures"].items():
        used = "measured" if taken.get(name) is not None else "constant"
        lines.append(
            f"| {name} | {f['constant']:.3g} | {_number(f['measured'])} | {_pct(f['off_by'])} | "
            f"{used} |"
        )
    hw = result["hardware"]
    lines += ["", f"`hardware_for(..., measured=Throughput(...))` gives: {json.dumps(hw)}"]
    return lines


def accuracy_md(result: dict[str, Any]) -> list[str]:
    lines = [
        f"mixed precision {result['mixed_precision']}; estimate = tensor terms (overheads left "
        f"out), measured = allocator peak over the measured steps; error = (estimate - "
        f"measured) / measured",
        "",
        "| model | world | strategy | AdamW | AC | params | estimate | measured | error | "
        "reserved | usable | step (measured) | modelled (the plan's) | "
        "modelled (a large matmul's FLOP/s, a large copy's bandwidth) |",
        "|" + "---|" * 14,
    ]
    for r in result["rows"]:
        # AdamW: "default" is AdamW() (foreach on CUDA), else foreach=False/True or fused=True
        optimizer = r.get("optimizer", "default")
        lead = f"| {r['model']} | {r['world_size']} | {r['strategy']} | {optimizer} |"
        if "failed" in r:
            lines.append(f"{lead} failed: {_cell(r['failed'])[:200]} |" + " |" * 9)
            continue
        params = _count(r["params"])
        if r.get("trainable", r["params"]) != r["params"]:
            params += f" ({_count(r['trainable'])} trained)"
        lines.append(
            f"{lead} {r['checkpointed']}/{r['num_blocks']} | {params} | "
            f"{_bytes(r['estimate_bytes'])} | {_bytes(r['measured_bytes'])} | "
            f"{_pct(r['error'])} | {_bytes(r['reserved_bytes'])} | {_bytes(r['usable_bytes'])} | "
            f"{_seconds(r['step_s'])} | {_seconds(r['modelled_step_s'])} | "
            f"{_seconds(r['modelled_step_s_measured_throughput'])} |"
        )
    for skipped in result.get("skipped", []):
        lines.append(f"\nskipped: {skipped}")
    s = result.get("summary")
    if s and s.get("configurations"):
        verdict = {True: "met", False: "NOT met", None: "not measured"}
        # the targets the rows were held to (issue 22's: 2%, 5%, -3%), as the section wrote them
        t = s.get("targets", {"median": 0.02, "worst": 0.05, "under": -0.03})
        lines += [
            "",
            f"- median |error| {100 * s['median_abs_error']:.1f}% (target <= "
            f"{100 * t['median']:g}%: {verdict[s['median_ok']]})",
            f"- worst |error| {100 * s['worst_abs_error']:.1f}% at {s['worst_at']} (target <= "
            f"{100 * t['worst']:g}%: {verdict[s['worst_ok']]})",
            f"- most negative error {_pct(s['most_negative_error'])} (target >= "
            f"{100 * t['under']:g}%: {verdict[s['underestimate_ok']]})",
            f"- reserved peak within the usable memory: {verdict[s['reserved_ok']]}",
        ]
    return lines


def oom_md(result: dict[str, Any]) -> list[str]:
    lines = [
        f"memory_limit {_bytes(result['limit_bytes'])}",
        "",
        "| attempt | outcome |",
        "|---|---|",
    ]
    for a in result["attempts"]:
        rung = f"{a['strategy']} AC {a['checkpointed']}/{result['num_blocks']}"
        lines.append(f"| {rung} | {a['description']} |")
    before, after = result["caller_before"], result["caller_after"]
    lines += ["", f"losses after prepare: {', '.join(f'{x:.4g}' for x in result['losses'])}"]
    if before:
        lines += [
            f"- caller's memory fraction {before['fraction']} before, {after['fraction']} after "
            f"(restored: {result['fraction_restored']})",
            f"- caller's max_memory_allocated {_bytes(before['peak_allocated'])} before, "
            f"{_bytes(after['peak_allocated'])} after (kept: {result['peak_restored']})",
        ]
    return lines


def prepare_md(result: dict[str, Any]) -> list[str]:
    target = result["target_s"]
    lines = [
        f"`autoshard.prepare` under auto, one rank of a one-rank group, as a first launch; the "
        f"decision's target: within {target:g} s (issue 24), the trial step on top. Seconds of "
        f"wall time; the trace and the simulations are within the decision.",
        "",
        "| model | params | plan | prepare | decision | trace | simulations | fake steps | "
        "wrap | trial | trial (2 steps) | modelled step | within target |",
        "|" + "---|" * 13,
    ]
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"| {r['model']} | failed: {_cell(r['failed'])[:200]} |" + " |" * 11)
            continue
        plan = f"{r['strategy']} AC {r['checkpointed']}/{r['num_blocks']} {r['mixed_precision']}"
        lines.append(
            f"| {r['model']} | {_count(r['params'])} | {plan} | {r['prepare_s']:.1f} | "
            f"{r['decision_s']:.1f} | {r['trace_s']:.1f} | {r['simulations_s']:.1f} | "
            f"{r['fake_steps']} | {r['wrap_s']:.1f} | {r['trial_s']:.1f} | "
            f"{_seconds(r['trial_steps_s'])} | {_seconds(r['modelled_step_s'])} | "
            f"{'yes' if r['decision_within_target'] else '**no**'} |"
        )
    for skipped in result.get("skipped", []):
        lines.append(f"\nskipped: {skipped}")
    models = {r.get("cost_model") for r in result["rows"] if r.get("cost_model")}
    lines += ["", *(f"- step times modelled from {m}" for m in sorted(models))]
    return lines


def external_md(result: dict[str, Any]) -> list[str]:
    target = result["target_s"]
    lines = [
        "The external zoo's families at world 1, AdamW with its defaults. Modes: `auto` = "
        "`prepare` with every choice left to autoshard and its trial, as a first launch (the "
        f"decision's target: within {target:g} s, issue 24); `full_shard`, `ddp`, "
        "`full_shard_ac` (every block checkpointed) = that strategy forced, no trial. estimate = "
        "tensor terms and cuBLAS workspaces, measured = allocator peak over the measured steps; "
        "error = (estimate - measured) / measured, and beside it with the workspaces left out of "
        "both (a small model's peak is mostly theirs). Seconds of wall time.",
        "",
        "| model | mode | plan | params | estimate | measured | error | error, workspaces out | "
        "prepare | decision | trace | simulations | trial (2 steps) | step (measured) | "
        "modelled step |",
        "|" + "---|" * 15,
    ]
    for r in result["rows"]:
        lead = f"| {r['model']} | {r['mode']} |"
        if "failed" in r:
            lines.append(f"{lead} failed: {_cell(r['failed'])[:200]} |" + " |" * 12)
            continue
        plan = f"{r['strategy']} AC {r['checkpointed']}/{r['num_blocks']} {r['mixed_precision']}"
        params = _count(r["params"])
        if r["trainable"] != r["params"]:
            params += f" ({_count(r['trainable'])} trained)"
        decision = f"{r['decision_s']:.1f}" + ("" if r["decision_within_target"] else " **over**")
        lines.append(
            f"{lead} {plan} | {params} | {_bytes(r['estimate_bytes'])} | "
            f"{_bytes(r['measured_bytes'])} | {_pct(r['error'])} | {_pct(r['tensor_error'])} | "
            f"{r['prepare_s']:.1f} | {decision} | {r['trace_s']:.1f} | "
            f"{r['simulations_s']:.1f} | {_seconds(r['trial_steps_s'])} | "
            f"{_seconds(r['step_s'])} | {_seconds(r['modelled_step_s'])} |"
        )
    for skipped in result.get("skipped", []):
        lines.append(f"\nskipped: {skipped}")
    s = result.get("summary", {})
    lines.append("")
    for name, found in (("error", s), ("error, workspaces out", s.get("tensors", {}))):
        if not found.get("configurations"):
            continue
        t = found["targets"]  # as the section held the rows to them
        lines.append(
            f"- {name}: median |error| {100 * found['median_abs_error']:.1f}%, worst "
            f"{100 * found['worst_abs_error']:.1f}% at {found['worst_at']}, most negative "
            f"{_pct(found['most_negative_error'])} (issue 22's targets: "
            f"{100 * t['median']:g}%, {100 * t['worst']:g}%, {100 * t['under']:g}%: "
            f"{'met' if found['met'] else 'NOT met'})"
        )
    if s.get("auto_rows"):
        lines.append(
            f"- decision within {target:g} s for {s['within_target']} of {s['auto_rows']} auto "
            f"row(s) (median {_secs(s['median_decision_s'])}, slowest "
            f"{_secs(s['slowest_decision_s'])})"
        )
    return lines


def summary_lines(sections: dict[str, Any]) -> list[str]:
    """One line per section: what it found, in a word."""
    lines = []
    for name, entry in sections.items():
        result = entry.get("result") or {}
        if name == "tests" and result:
            c = result["counts"]
            lines.append(
                f"- tests ({entry['status']}): {c['passed']} passed, {c['failed']} failed, "
                f"{c['skipped']} skipped"
            )
        elif entry["status"] != "ok":
            lines.append(f"- {name}: {entry['status']}")
        elif name == "compat":
            absent = ", ".join(result["absent"]) or "none"
            lines.append(f"- compat: absent: {absent}")
        elif name == "calibration":
            taken = [k for k, v in result["throughput"].items() if k != "where" and v is not None]
            lines.append(f"- calibration: taken from the measurement: {', '.join(taken) or 'none'}")
        elif name == "accuracy":
            met = result.get("summary", {}).get("met")
            lines.append(f"- accuracy: targets {'met' if met else 'NOT met'}")
        elif name == "oom":
            fell_back = result["attempts"][0]["outcome"] == "out_of_memory"
            lines.append(
                f"- oom: first rung ran out of memory: {fell_back}; trained after: "
                f"{result['attempts'][-1]['description']}; fraction restored: "
                f"{result['fraction_restored']}; peak kept: {result['peak_restored']}"
            )
        elif name == "prepare":
            s = result["summary"]
            lines.append(
                f"- prepare: decision within {result['target_s']:g} s for {s['within_target']} of "
                f"{s['models']} model(s) (median {_secs(s['median_decision_s'])}, slowest "
                f"{_secs(s['slowest_decision_s'])}); {s['failed']} failed, "
                f"{len(result.get('skipped', []))} skipped"
            )
        elif name == "external":
            s = result["summary"]
            verdict = {True: "met", False: "NOT met", None: "not measured"}
            met, tensors = verdict[s["met"]], verdict[s["tensors"]["met"]]
            lines.append(
                f"- external: {s['rows']} row(s), estimate targets {met} ({tensors} with the "
                f"workspaces left out); decision within "
                f"{result['target_s']:g} s for {s['within_target']} of "
                f"{s['auto_rows']} family(ies); {s['failed']} failed, "
                f"{len(result.get('skipped', []))} skipped"
            )
    return lines


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "tests": tests_md,
    "compat": compat_md,
    "calibration": calibration_md,
    "accuracy": accuracy_md,
    "oom": oom_md,
    "prepare": prepare_md,
    "external": external_md,
}


def write(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    m = report["machine"]
    kind = (
        "dry run (CPU, small sizes: the figures check the code, not the GPU)"
        if report["dry_run"]
        else "GPU run"
    )
    lines = [
        f"# autoshard GPU suite: {kind}",
        "",
        f"{report['date']}; {report['seconds']:.0f} s; torch {m.get('torch')}, CUDA "
        f"{m.get('cuda')}, GPU {m.get('gpu')} (capability {m.get('capability')}, "
        f"{_bytes(m.get('gpu_memory_bytes'))}); {m.get('cpu_count')} CPUs",
    ]
    lines += ["", "## Summary", "", *summary_lines(report["sections"])]
    if report["dry_run"]:
        lines.append("- (dry run: CPU figures of tiny models, not held to the GPU targets)")
    for name, entry in report["sections"].items():
        budget = report["budgets_s"].get(name)
        lines += [
            "",
            f"## {name}: {entry['status']} ({entry.get('seconds', '-')} s of {budget} s)",
            "",
        ]
        if entry.get("error"):
            lines.append(f"error: `{entry['error'][:600]}`")
        result = entry.get("result")
        if result:
            try:
                lines += RENDER[name](result)
            except Exception as error:  # a partial result may lack fields: the JSON has it all
                lines.append(f"(not rendered: {type(error).__name__}: {error}; see report.json)")
    (out / "report.md").write_text("\n".join(lines) + "\n")
