"""A launch setting of the decode kernels (a tiling, a split, warps) that a benchmark overrides for a block.

    with TILES.use(DecodeTiles(block=64)):   # every launch within reads TILES.value
        ...

The sweeps (scripts/bench/sweep_*.py, bench_products.py) time each choice this way; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class LaunchSetting(Generic[T]):
    """A module's launch setting: `value`, the default until `use` replaces it for a block."""

    def __init__(self, default: T):
        self.value = default

    @contextmanager
    def use(self, value: T) -> Iterator[T]:
        before, self.value = self.value, value
        try:
            yield value
        finally:
            self.value = before
