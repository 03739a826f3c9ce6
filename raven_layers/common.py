"""What every mixer shares: validated settings, RMSNorm, and initialising the parameters attention lacks.

Copied next to every exported model with the mixers; it must import nothing but torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields

import torch
from torch import nn


class MixerSettings:
    """Base of the mixers' frozen settings dataclasses. Subclasses set NAME ("raven") and LABEL ("Raven")."""

    NAME = "mixer"
    LABEL = "mixer"

    def fail(self, name: str, allowed: str):
        raise ValueError(f"{self.NAME}.{name} = {getattr(self, name)!r} is not allowed; expected {allowed}")

    @staticmethod
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    @staticmethod
    def is_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def check_positive_ints(self, *names: str):
        for name in names:
            if not self.is_int(getattr(self, name)) or getattr(self, name) < 1:
                self.fail(name, "an integer >= 1")

    def check_bools(self, *names: str):
        for name in names:
            if not isinstance(getattr(self, name), bool):
                self.fail(name, "true or false")

    @classmethod
    def from_dict(cls, values: dict):
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"unknown {cls.LABEL} setting(s) {unknown}; allowed: {allowed}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 like the Llama/Qwen norms it may be initialised from."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@torch.no_grad()
def init_fresh_parameters(module: nn.Module, inits: dict[str, Callable[[torch.Tensor], object]]):
    """Apply `inits[name]` to each parameter of `module` that exists and was not loaded from a checkpoint
    (transformers flags those `_is_hf_initialized`; they are never overwritten)."""
    for name, init in inits.items():
        param = getattr(module, name, None)
        if param is not None and not getattr(param, "_is_hf_initialized", False):
            init(param)
