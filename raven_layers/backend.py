"""Which implementation the mixers run: the toolkit's Triton kernels (package `raven_kernels`) or the PyTorch forms.

    RAVEN_BACKEND=auto    kernels for CUDA tensors (not float64) when the toolkit's kernels import, else PyTorch
    RAVEN_BACKEND=triton  kernels always (on CPU only under TRITON_INTERPRET=1); an error if they cannot import
    RAVEN_BACKEND=torch   the PyTorch forms always (debugging, reference runs)

The environment variable sets the default; `set_backend` and the `use_backend` context manager override it in
process. Each mixer's declaration names its kernel module (`MixerSpec.kernels`, e.g. "raven_kernels.raven"). An exported
model bundles this file but not the kernels: where the toolkit is not installed it runs the PyTorch forms. It must
import nothing but torch: it is copied next to every exported model.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "RAVEN_BACKEND"

_override: str | None = None
_modules: dict[str, ModuleType | None] = {}


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} = {name!r} is not a backend; allowed: {list(BACKENDS)}")
    return name


def get_backend() -> str:
    """The backend in force: `set_backend`'s choice, else $RAVEN_BACKEND, else "auto"."""
    if _override is not None:
        return _override
    return _check(os.environ.get(ENV_VAR, "auto"), ENV_VAR)


def set_backend(name: str | None) -> None:
    """Force a backend for this process ("auto", "triton" or "torch"); None goes back to $RAVEN_BACKEND."""
    global _override
    _override = None if name is None else _check(name, "backend")


@contextmanager
def use_backend(name: str):
    """Run a block under one backend, then restore the previous choice."""
    global _override
    previous = _override
    set_backend(name)
    try:
        yield
    finally:
        _override = previous


def _import_kernels(name: str) -> ModuleType | None:
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(name)
        except ImportError:  # toolkit or triton not installed: an exported model running on its own
            _modules[name] = None
    return _modules[name]


def preload(names) -> None:
    """Import the kernel modules `names` now: torch.compile cannot trace an import inside the code it compiles."""
    if get_backend() != "torch":
        for name in names:
            _import_kernels(name)


def kernel_module(name: str, like: torch.Tensor) -> ModuleType | None:
    """The kernel module `name` ("raven_kernels.raven") to run on tensors like `like`, or None for the PyTorch path."""
    backend = get_backend()
    if backend == "torch":
        return None
    module = _import_kernels(name)
    if backend == "triton":
        if module is None:
            raise RuntimeError(
                f"{ENV_VAR}=triton but {name} cannot be imported: install the toolkit (pip install -e .)"
            )
        return module
    return module if like.is_cuda and like.dtype != torch.float64 else None  # the kernels compute in float32
