"""SILA kernels: the fused recurrent op (forward and backward) and its in-place decode step; naive.py holds their
PyTorch reference."""

from .fused_recurrent import fused_recurrent_sila, fused_recurrent_sila_decode

__all__ = ["fused_recurrent_sila", "fused_recurrent_sila_decode"]
