"""SILA kernels: the fused recurrent op (forward and backward) and a generation step in one kernel; naive.py holds
their PyTorch reference (with raven_layers.sila.SILAMixer.recurrence_inputs for the step's preparation)."""

from .fused_recurrent import fused_recurrent_sila, fused_recurrent_sila_decode

__all__ = ["fused_recurrent_sila", "fused_recurrent_sila_decode"]
