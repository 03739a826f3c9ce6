"""Triton kernels for Raven: `chunk_raven` (training and prefill, with backward), `fused_recurrent_raven` (decode),
`naive_raven`, the PyTorch reference both are tested against, and `topk_slots`, the router's top-K for prefill."""

from .chunk import chunk_raven
from .fused_recurrent import fused_recurrent_raven
from .naive import naive_raven
from .route import topk_slots

__all__ = ["chunk_raven", "fused_recurrent_raven", "naive_raven", "topk_slots"]
