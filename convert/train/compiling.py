"""The mixers' PyTorch work compiled while a stage trains (the recipes' `compile` field of align, train and extend).

Around its Triton kernels a mixer runs dozens of small PyTorch operations per layer: projections, routing, gates,
the read-out's norm and gate (`Mixer.glue`). Eager, each is a kernel launch forward and more backward, and align's
step is bound by those launches, not by the GPU (docs/TRAINING_SPEED.md). Compiled by torch.compile they fuse into a
few kernels; the Triton kernels and anything that syncs with the host stay eager between the compiled parts. Every
layer of a mixer shares one compiled graph (its parameters are the graph's inputs), so a stage compiles each part
once, at its first step.

    with compiled_glue([hybrid], enabled=resolve_compile(settings.compile, device, parallel.sharded)):
        ...  # the stage's steps
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from raven_layers.common import Mixer

CompileSetting = bool | Literal["auto"]


def resolve_compile(setting: CompileSetting, device: torch.device, sharded: bool = False) -> bool:
    """Whether a stage compiles its mixers' glue: "auto" does on a CUDA device without FSDP sharding (on the CPU a
    compile costs more than the steps save; sharded parameters are DTensors the glue is not traced with); True and
    False are obeyed."""
    if setting == "auto":
        return torch.device(device).type == "cuda" and not sharded
    return bool(setting)


@contextmanager
def compiled_glue(models: Iterable[nn.Module | None], enabled: bool = True) -> Iterator[list[Mixer]]:
    """Set `compile_glue` on every mixer of `models` (None entries skipped) while the block runs, and put back what
    each had after it, also on an exception. Yields the mixers it set."""
    mixers = [m for model in models if model is not None for m in model.modules() if isinstance(m, Mixer)]
    if not enabled:
        yield []
        return
    before = [m.__dict__.get("compile_glue") for m in mixers]  # None: the class default
    for mixer in mixers:
        mixer.compile_glue = True
    try:
        yield mixers
    finally:
        for mixer, value in zip(mixers, before):
            if value is None:
                del mixer.compile_glue
            else:
                mixer.compile_glue = value
