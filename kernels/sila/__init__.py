"""SILA kernels: the fused recurrent op (forward and backward); naive.py holds its PyTorch reference."""

from .fused_recurrent import fused_recurrent_sila

__all__ = ["fused_recurrent_sila"]
