"""A launch setting of the decode kernels (a tiling, a split, warps) that a benchmark overrides for a block.

    with TILES.use(DecodeTiles(block=64)):   # every launch within reads TILES.value
        ...

The sweeps (scripts/bench/sweep_*.py, bench_products.py) time each choice this way; not thread-safe.

`DEPENDENT_LAUNCH` is one such setting for every decode kernel: programmatic dependent launch (Hopper and later),
which a model's decode step turns on with Inductor's `triton.enable_pdl` (raven_layers/decode_fusion.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch
import triton
import triton.language as tl

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


# Whether the decode kernels launch programmatically dependent: each may start before the kernel ahead of it ends
# (its launch and scheduling hidden behind that kernel's tail) and waits for it before touching memory. None of them
# lets the kernel after it start early (no gdc_launch_dependents), so a kernel that waits for one of them also
# waits for everything before it.
DEPENDENT_LAUNCH = LaunchSetting(False)


def dependent_launch(device: torch.device) -> dict:
    """The launch arguments of a decode kernel that takes `PDL` (and calls `wait_for_inputs`): dependent where
    DEPENDENT_LAUNCH is set on a CUDA device of compute capability 9 or more."""
    on = bool(DEPENDENT_LAUNCH.value) and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A kernel's first step: launched dependent, wait until the kernel ahead has ended and its writes are seen."""
    if PDL:
        tl.extra.cuda.gdc_wait()
