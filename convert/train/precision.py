"""Frozen linear weights held in the autocast dtype while a stage runs.

Under bf16 autocast every `nn.Linear` casts its float32 weight and bias to bf16 at each call, and a frozen weight
gives the same bf16 tensor every time: holding it in bf16 for the length of the stage gives bit-identical results
without the casts (a kernel launch and a copy of the weight per call, in the teacher's forward and the student's
kept layers). The float32 tensors are put back when the stage ends, so what is saved is unchanged.

    with frozen_linears_in([teacher, student], torch.bfloat16, enabled=mixed_precision == "bf16"):
        ...  # forwards under torch.autocast(dtype=torch.bfloat16)

Left as they are: trainable tensors (the optimizer holds them), weights shared with a module that is not a linear
layer (a tied embedding: its lookup is not autocast, so a bf16 copy would change the residual stream), sharded
tensors (FSDP2 casts through its own mixed-precision policy) and anything not float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _shared_outside_linears(model: nn.Module) -> set[int]:
    """ids of the parameters held by a module that is not a linear layer (a tied embedding's weight)."""
    return {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}


def _castable(p: torch.Tensor | None, shared: set[int]) -> bool:
    return (
        p is not None
        and not p.requires_grad
        and p.dtype == torch.float32
        and id(p) not in shared
        and type(p) in (torch.Tensor, nn.Parameter)  # not a DTensor or another subclass
    )


@contextmanager
def frozen_linears_in(models: Iterable[nn.Module | None], dtype: torch.dtype, enabled: bool = True) -> Iterator[int]:
    """Hold the frozen float32 weights and biases of every `nn.Linear` in `models` (None entries skipped) in `dtype`
    until the block ends; yields how many tensors were swapped. Exact only where those layers run under autocast
    to `dtype`: the caller passes `enabled` accordingly. A tensor shared by several linear layers is cast once."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    copies: dict[int, nn.Parameter] = {}
    try:
        for model in models if enabled else ():
            if model is None:
                continue
            shared = _shared_outside_linears(model)
            for module in model.modules():
                if not isinstance(module, nn.Linear):
                    continue
                for name in ("weight", "bias"):
                    p = module._parameters.get(name)
                    if not _castable(p, shared):
                        continue
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                    swapped.append((module, name, p))
                    module._parameters[name] = copies[id(p)]
        yield len(copies)
    finally:
        for module, name, p in reversed(swapped):
            module._parameters[name] = p
