"""One rank of `autoshard demo`: the module the command launches under torchrun.

A module of its own, which the `autoshard.cli` package never imports: `python -m
autoshard.cli.demo` found the demo already imported by the package (`autoshard.cli.main` uses it)
and runpy warned so, once per rank, before the demo's first line.
"""

from __future__ import annotations

import sys

from autoshard.cli import demo

if __name__ == "__main__":
    sys.exit(demo.main())
