"""SILA kernels: the fused recurrent op (forward and backward) and its PyTorch reference."""

from .fused_recurrent import fused_recurrent_sila
from .naive import naive_recurrent_sila

__all__ = ["fused_recurrent_sila", "naive_recurrent_sila"]
