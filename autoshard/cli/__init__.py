"""The `autoshard` command and the demo."""

from autoshard.cli.main import main

__all__ = ["main"]
