"""Every command and example in README.md runs as written.

The README is parsed: its ```bash lines, its ```python blocks and the commands quoted inline.
Each must appear in one of the tables below, which say how it runs here (or, for the few that
cannot run inside a test, why not): a README edit that adds or changes a command fails
`test_every_readme_command_is_covered` until the table says how to run it. Python blocks run as
files in a scratch directory, under `python` and, where the README says so, under a launcher.
Launches of several ranks and long runs are marked `slow`.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _dist import REPO, run_tree

README = REPO / "README.md"
COMMAND_RE = re.compile(r"^(autoshard (demo|plan)|python3?|torchrun|accelerate launch|pip)\s+\S")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands(text: str) -> list[str]:
    """Shell commands of the README: each line of a bash block (continuations joined, comments
    dropped) and each inline `code` span that starts like a command and has arguments."""
    commands: list[str] = []
    for block in _blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split("  #")[0].split())
            if line and not line.startswith("#"):
                commands.append(line)
    for span in re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", text):
        span = " ".join(span.split())
        if COMMAND_RE.match(span) and span not in commands:
            commands.append(span)
    return commands


@dataclass(frozen=True)
class Snippet:
    """A ```python block of the README, found by a line only it has."""

    marker: str
    file: str | None  # the name it runs as; None: not a program (a signature or a fragment)
    why_not: str = ""


SNIPPETS = [
    Snippet(
        "print(plan)  # what was chosen",
        None,
        "a fragment: model, optimizer and batch are "
        "the reader's; train.py below is the complete script",
    ),
    Snippet(
        "trial_step=True, dataloader=None, accumulation_steps=1, max_batch=False,",
        None,
        "a signature",
    ),
    Snippet("prepared = autoshard.prepare(model, optimizer, example_batch=batch)", "train.py"),
    Snippet("from autoshard.cli.demo import plan_example", "plan_example.py"),
    Snippet("autoshard.save(path, model, optimizer=None) -> pathlib.Path", None, "a signature"),
    Snippet('autoshard.save("checkpoints/latest", model, optimizer)', "checkpoint.py"),
    Snippet("loader = autoshard.shard_dataloader(loader, *, seed=None)", None, "a signature"),
    Snippet("TensorDataset(torch.randn(1000, 16)", "shard_data.py"),
    Snippet("from transformers import LlamaConfig", "hf_llama.py"),
    Snippet("Accelerator(**autoshard.accelerate_kwargs(plan, model))", "train_accelerate.py"),
]

# Commands run here, as written (program names mapped to this interpreter), and whether slow.
RUN = {
    "autoshard plan autoshard.cli.demo:plan_example --world-size 8 --device-memory 80GiB": False,
    "autoshard demo --help": False,
    "python train.py": False,
    "python train_accelerate.py": False,
    "python examples/train_gpt.py": False,
    "autoshard plan benchmarks.planner:llama_7b --world-size 1024 --nodes 128 --device-memory "
    "80GiB --batch-size 1 --seq-len 1024": True,
    "autoshard demo --nproc 2 --strategy full_shard --steps 60": True,
    "torchrun --nproc-per-node 2 train.py": True,
    "torchrun --nproc-per-node 2 examples/train_gpt.py --strategy full_shard": True,
    "accelerate launch --multi_gpu --num_processes 2 examples/train_gpt.py": True,
    "accelerate launch --multi_gpu --num_processes 2 train_accelerate.py": True,
}
INSTALL = "creates .venv and installs into it: .ci/run runs exactly this install"
NOT_RUN = {
    'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && '
    ".venv/bin/autoshard demo": f"{INSTALL}; `autoshard demo` itself runs in "
    "test_autoshard_demo_trains",
    'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && '
    ".venv/bin/python -m pytest --full -n 2": f"{INSTALL}, then runs this suite",
    "pip install -e .": "installs into the reader's own environment",
    '.venv/bin/pip install -e ".[dev]"': INSTALL,
    '.venv/bin/pip install -e ".[bench]"': INSTALL,
    ".venv/bin/python -m pytest": "runs this suite",
    ".venv/bin/python -m pytest --full -n 2": "runs this suite",
    ".venv/bin/ruff check .": "CI's lint step",
    ".venv/bin/mypy autoshard": "CI's type check",
    "bash .ci/run": "CI itself",
    ".venv/bin/python benchmarks/gpu_suite.py --out gpu-report": (
        "needs CUDA GPUs; tests/test_gpu_suite.py runs its --dry-run on the CPU"
    ),
    "autoshard demo [--nproc N] [--steps 40] [--batch-size 16] [--strategy auto] ...": "a synopsis",
    "autoshard plan MODULE:FACTORY [--world-size N] [--nodes M] [--device-memory 80GiB] "
    "[--device cuda|cpu] [--host-memory 64GiB] [--batch-size B] [--seq-len S] "
    "[--memory-limit ...] [--strategy ...] [--mixed-precision ...] [--max-batch] "
    "[--materialize] [--json] [--plot FILE.png]": ("a synopsis"),
    "python -m autoshard ...": "a synopsis",
    "autoshard demo --memory-limit 4MiB": "exits 2 by design; tests/test_cli.py runs it",
    "autoshard plan ... --json": "a synopsis; tests/test_cli.py runs `autoshard plan --json`",
    "autoshard plan ... --plot plan.png": "a synopsis; tests/test_plot.py runs `--plot`",
    "autoshard plan ... --max-batch": "a synopsis; tests/test_batch_size.py runs `--max-batch`",
    "torchrun --nproc-per-node 8 train.py": "needs 8 GPUs; the 2-rank form runs here",
    'pip install "autoshard[plot]"': "installs into the reader's own environment",
    "accelerate launch --cpu --num_processes 2": "quoted as what not to do",
    "torchrun --nproc-per-node 2": "a launcher named in prose, with the script named beside it",
    # Benchmarks take minutes at the README's sizes (see the README's Benchmarks section);
    # tests/test_benchmarks.py runs compare.py, and the others' code paths, at smoke sizes.
    ".venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/compare.py --models gpt,mlp "
    "--steps 5 --warmup 2 --out benchmarks/out": "a benchmark (minutes)",
    ".venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/ddp_vs_fsdp.py": "a benchmark",
    ".venv/bin/python benchmarks/estimate_accuracy.py --world-sizes 1,2 --json "
    "benchmarks/out/estimate_accuracy.json": "a benchmark (minutes)",
    ".venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/estimate_accuracy.py --models "
    "gpt,llama --ac off": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/planner.py [--world-size 1024 --nodes 128 --seq-len 1024]": (
        "a synopsis; the planner benchmark's command is the `autoshard plan ... llama_7b` above"
    ),
}
# Every command gets a hard limit so that a hang fails the test instead of blocking CI.
TIMEOUT_S = 300
PROGRAMS = {
    "autoshard": ("-m", "autoshard"),
    ".venv/bin/autoshard": ("-m", "autoshard"),
    "python": (),
    "python3": (),
    ".venv/bin/python": (),
    "torchrun": ("-m", "torch.distributed.run"),
    ".venv/bin/torchrun": ("-m", "torch.distributed.run"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_command(command: str, cwd: Path) -> tuple[int, str]:
    """Run a README command with this interpreter; returns (exit status, stdout + stderr)."""
    words = shlex.split(command)
    if words[:2] == ["accelerate", "launch"]:
        argv = [sys.executable, "-m", "accelerate.commands.launch", *words[2:]]
    else:
        argv = [sys.executable, *PROGRAMS[words[0]], *words[1:]]
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        # torchrun without --standalone (and accelerate, which starts torchrun) listens on port
        # 29500 unless told otherwise: a free one keeps concurrent runs apart.
        PET_MASTER_PORT=str(_free_port()),
    )
    env.pop("TORCHELASTIC_RUN_ID", None)
    returncode, output, timed_out = run_tree(argv, cwd, env, TIMEOUT_S)
    if timed_out:
        return -1, f"timed out after {TIMEOUT_S}s\n{output}"
    return returncode, output


def _snippet_for(block: str) -> Snippet:
    found = [s for s in SNIPPETS if s.marker in block]
    assert len(found) == 1, f"README python block matches {len(found)} table entries:\n{block}"
    return found[0]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's python blocks written out under their names, in a scratch directory that
    also links the repository's examples/ and benchmarks/ (commands name them relatively)."""
    root = tmp_path_factory.mktemp("readme")
    for block in _blocks(README.read_text(), "python"):
        snippet = _snippet_for(block)
        if snippet.file is not None:
            (root / snippet.file).write_text(block)
    for name in ("examples", "benchmarks"):
        (root / name).symlink_to(REPO / name)
    return root


def test_every_readme_command_is_covered() -> None:
    text = README.read_text()
    commands = readme_commands(text)
    unknown = [c for c in commands if c not in RUN and c not in NOT_RUN]
    assert not unknown, f"README commands no test runs or excuses (add them to RUN): {unknown}"
    stale = [c for c in (*RUN, *NOT_RUN) if c not in commands]
    assert not stale, f"commands in the tables but no longer in the README: {stale}"
    blocks = _blocks(text, "python")
    used = {_snippet_for(b).marker for b in blocks}
    assert used == {s.marker for s in SNIPPETS}, "a README python block in SNIPPETS is gone"
    runs = {s.file for s in SNIPPETS if s.file}
    named = {w for c in RUN for w in shlex.split(c) if w.endswith(".py")}
    assert runs - named <= {"plan_example.py", "checkpoint.py", "shard_data.py", "hf_llama.py"}


def _params() -> list[object]:
    return [
        pytest.param(c, marks=[pytest.mark.slow] if slow else [], id=c[:60])
        for c, slow in RUN.items()
    ]


@pytest.mark.parametrize("command", _params())
def test_readme_command_runs(command: str, scripts: Path) -> None:
    returncode, output = run_command(command, scripts)
    assert returncode == 0, f"`{command}` exited {returncode}:\n{output[-6000:]}"
    assert "Traceback" not in output, f"`{command}` printed a traceback:\n{output[-6000:]}"


# The blocks the README shows without a command line of their own: run with `python`, and the
# checkpoint one (a multi-rank snippet) also under torchrun.
SNIPPET_RUNS = {
    # slow: the same plan as the `autoshard plan ... plan_example` command, which runs by default
    "python plan_example.py": True,
    "python checkpoint.py": False,
    "python shard_data.py": False,
    "python hf_llama.py": True,  # slow: tests/test_hf.py covers these models by default
    "torchrun --standalone --nproc-per-node 2 checkpoint.py": True,
}


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if s else [], id=c) for c, s in SNIPPET_RUNS.items()],
)
def test_readme_snippet_runs(command: str, scripts: Path) -> None:
    if "hf_llama" in command:
        pytest.importorskip("transformers")
    returncode, output = run_command(command, scripts)
    assert returncode == 0, f"`{command}` exited {returncode}:\n{output[-6000:]}"
    assert "Traceback" not in output, f"`{command}` printed a traceback:\n{output[-6000:]}"


@pytest.mark.slow
def test_autoshard_demo_trains(scripts: Path) -> None:
    """The quick start's `autoshard demo`: it exits 0 only when the loss went down."""
    returncode, output = run_command("autoshard demo", scripts)
    assert returncode == 0, output[-6000:]
    assert "loss went down" in output
    # each rank runs a module the package never imports: runpy has nothing to warn about
    assert "RuntimeWarning" not in output and "found in sys.modules" not in output, output
