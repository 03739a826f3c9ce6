"""Triton kernels for Raven: `chunk_raven` (training and prefill, with backward), `fused_recurrent_raven` (decode),
`fused_recurrent_raven_decode` (a generation step from the projections, routing included) and `topk_slots`, the
router's top-K for prefill; naive.py holds `naive_raven`, the PyTorch reference the ops are tested against."""

from .chunk import chunk_raven
from .fused_recurrent import fused_recurrent_raven, fused_recurrent_raven_decode
from .route import topk_slots

__all__ = ["chunk_raven", "fused_recurrent_raven", "fused_recurrent_raven_decode", "topk_slots"]
