"""Pure deciding: estimates, cost model, candidates, the Plan and its rendering. Imports neither
`autoshard.measure` nor `autoshard.wrap` (tests/test_layout.py)."""
