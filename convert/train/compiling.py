"""The small operations of a training step compiled while a stage runs (the recipes' `compile` field of align, train
and extend).

Align's and stage 2's steps are bound by the host launching small kernels, not by the GPU (docs/lab/TRAINING_SPEED.md).
Two kinds of work are compiled by torch.compile, each into a few fused kernels:
- around its Triton kernels a mixer runs dozens of small PyTorch operations per layer: projections, routing, gates,
  the read-out's norm and gate (`Mixer.glue`); the Triton kernels and anything that syncs with the host stay eager
  between the compiled parts;
- every decoder layer's norms and MLP (the teacher's in align, the student's and the teacher's in stage 2); the
  attention stays eager (align's taps are hooks on it, and its masks change with the packing).
Every layer shares one compiled graph per part (the parameters are the graph's inputs), so a stage compiles each
part once, at its first step.

    with compiled_parts([teacher, hybrid], enabled=resolve_compile(settings.compile, device, parallel.sharded)):
        ...  # the stage's steps
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from raven_layers.common import Mixer, recompile_limits

CompileSetting = bool | Literal["auto"]
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")  # of a decoder layer, compiled whole
# compilations per part: teacher and student, with and without gradients, training and validation shapes
RECOMPILE_LIMIT = 64


def resolve_compile(setting: CompileSetting, device: torch.device, sharded: bool = False) -> bool:
    """Whether a stage compiles: "auto" does on a CUDA device without FSDP sharding (on the CPU a compile costs more
    than the steps save; sharded parameters are DTensors the parts are not traced with); True and False are
    obeyed."""
    if setting == "auto":
        return torch.device(device).type == "cuda" and not sharded
    return bool(setting)


def layer_parts(model: nn.Module) -> list[nn.Module]:
    """The norms and MLP of every decoder layer of `model` (a transformers causal LM or a hybrid): LAYER_PARTS."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or []
    return [part for layer in layers for name in LAYER_PARTS if (part := getattr(layer, name, None)) is not None]


@contextmanager
def compiled_parts(models: Iterable[nn.Module | None], enabled: bool = True) -> Iterator[list[nn.Module]]:
    """While the block runs, every mixer of `models` (None entries skipped) runs its glue compiled (`compile_glue`)
    and every decoder layer its norms and MLP (`nn.Module.compile`); afterwards each is as it was, also on an
    exception. Yields the mixers and parts it compiled."""
    if not enabled:
        yield []
        return
    models = [model for model in models if model is not None]
    mixers = [m for model in models for m in model.modules() if isinstance(m, Mixer)]
    parts = [part for model in models for part in layer_parts(model)]
    glue_before = [m.__dict__.get("compile_glue") for m in mixers]  # None: the class default
    calls_before = [part._compiled_call_impl for part in parts]
    for mixer in mixers:
        mixer.compile_glue = True
    for part in parts:
        part.compile()
    try:
        with torch._dynamo.config.patch(**recompile_limits(RECOMPILE_LIMIT)):
            yield mixers + parts
    finally:
        for mixer, value in zip(mixers, glue_before):
            if value is None:
                del mixer.compile_glue
            else:
                mixer.compile_glue = value
        for part, call in zip(parts, calls_before):
            part._compiled_call_impl = call
