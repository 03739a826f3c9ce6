"""Triton kernels for Raven: `chunk_raven` (training and prefill, with backward), `fused_recurrent_raven` (decode)
and `topk_slots`, the router's top-K for prefill; naive.py holds `naive_raven`, the PyTorch reference both ops are
tested against."""

from .chunk import chunk_raven
from .fused_recurrent import fused_recurrent_raven
from .route import topk_slots

__all__ = ["chunk_raven", "fused_recurrent_raven", "topk_slots"]
