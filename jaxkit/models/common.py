"""What the model kinds' contracts share, below all of them (the package's __init__ holds
the contract and imports every kind)."""

from __future__ import annotations

from collections.abc import Sequence

# (config key, size, mesh axes) of each parameter dimension the partition rules shard.
Sizes = list[tuple[str, int, tuple[str, ...]]]
# Each param as (the last key of its path, its size): "kernel", "bias", "embedding", ...
Params = Sequence[tuple[str, int]]
