"""The argument checks the one-kernel decode steps' wrappers share (SILA, Raven, SSE): every tensor's shape, the
products read as row views of one fused product, and the float32 states the kernels update in place."""

from __future__ import annotations

import torch


def check_shapes(expected: dict[str, tuple[torch.Tensor, tuple]], source: str) -> None:
    """A ValueError naming the first tensor whose shape is not the one given for it ({name: (tensor, shape)});
    `source` says where the shapes come from."""
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from {source}), got {tuple(x.shape)}")


def check_row_views(products: dict[str, torch.Tensor | None]) -> None:
    """A ValueError naming the first product (None: absent) whose last dim is not contiguous: the kernels read each
    row at its own stride, so rows may be views of one fused product, their channels not."""
    for name, x in products.items():
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (rows may be strided), got strides {x.stride()}")


def check_in_place(states: dict[str, torch.Tensor]) -> None:
    """A ValueError naming the first state that a kernel cannot update in place: it must be contiguous float32."""
    for name, x in states.items():
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} is updated in place: it must be contiguous float32, got {x.dtype}"
                             f"{'' if x.is_contiguous() else ', not contiguous'}")  # fmt: skip
