"""The package's layers, as docs/architecture.md draws them, checked on the source: what each
folder may import from the others (every import, those inside functions included; only
`if TYPE_CHECKING:` blocks, which never run, are exempt)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoshard"

# layer -> the layers of autoshard it must not import
FORBIDDEN = {
    "strategies": {"decide", "measure", "wrap", "io", "cli", "api", "pipeline", "collective"},
    "decide": {"measure", "wrap", "io", "cli", "api", "pipeline", "collective"},
    "measure": {"io", "cli", "api", "pipeline"},
    "wrap": {"measure", "io", "cli", "api", "pipeline"},
    "collective": {"decide", "measure", "wrap", "io", "cli", "api", "pipeline"},
    "io": {"measure", "cli", "api", "pipeline"},
    "base": {"strategies", "decide", "measure", "wrap", "io", "cli", "api", "pipeline"},
    "pipeline": {"cli", "api"},
    "api": {"cli"},
    "cli": set(),
}


def layer_of(path: Path) -> str:
    """The layer of a module: its folder, else its own name (api, pipeline, collective), and
    the shared helpers (`_world`, `_units`, `_batch`, ...) are the base."""
    parts = path.relative_to(PACKAGE).parts
    if len(parts) > 1:
        return parts[0]
    name = path.stem
    if name == "__main__":  # `python -m autoshard`: the command line's entry point
        return "cli"
    return name if name in ("api", "pipeline", "collective") else "base"


def imported_layers(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "autoshard":  # from autoshard import cli
                names = [f"autoshard.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "autoshard" and len(parts) > 1:
                target = parts[1]
                found.add((target if not target.startswith("_") else "base", node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_module_is_in_a_layer() -> None:
    assert {layer_of(p) for p in MODULES} <= set(FORBIDDEN)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path: Path) -> None:
    layer = layer_of(path)
    bad = sorted(
        f"line {line}: autoshard.{target}"
        for target, line in imported_layers(path)
        if target in FORBIDDEN[layer]
    )
    assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports what its layer must not: {bad}"


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The test above can fail: a decide module importing wrap is caught, inside a function too,
    and a TYPE_CHECKING import is not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from autoshard.measure import trace\n"
        "def f():\n    from autoshard.wrap.apply import apply\n"
    )
    assert imported_layers(source) == {("wrap", 5)}
