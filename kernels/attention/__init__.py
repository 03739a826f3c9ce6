"""Triton kernel for the kept attention layers' decode steps over a static cache: `decode_attention` (split over
the slots, flash-decoding); naive.py holds the PyTorch reference it is tested against."""

from .decode import decode_attention

__all__ = ["decode_attention"]
