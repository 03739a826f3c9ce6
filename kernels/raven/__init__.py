"""Triton kernels for Raven: `chunk_raven` (training and prefill, with backward), `fused_recurrent_raven` (decode),
and `naive_raven`, the PyTorch reference both are tested against."""

from .chunk import chunk_raven
from .fused_recurrent import fused_recurrent_raven
from .naive import naive_raven

__all__ = ["chunk_raven", "fused_recurrent_raven", "naive_raven"]
