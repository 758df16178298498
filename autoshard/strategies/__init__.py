"""One recipe per strategy, in one registry (see docs/architecture.md)."""

from autoshard.strategies.strategy import Strategy

__all__ = ["Strategy"]
