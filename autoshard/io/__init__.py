"""Checkpoints (DCP), data sharding, accelerate's kwargs."""
