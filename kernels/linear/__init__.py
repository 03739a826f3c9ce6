"""Triton kernels of a decode step's products; naive.py holds the PyTorch references they are tested against.

- `norm_linear`: RMSNorm and the product that reads it as one kernel, optionally with the residual add before the
  norm (`add_norm_linear`, which also returns the sum): a decode step's norm is a kernel of its own otherwise,
  whose latency costs as much as its product's at a batch of 1-128 rows.
- `silu_mul_linear`: an MLP's down projection with its gated activation, silu(gate) * up, computed as it is read.
"""

from .decode import add_norm_linear, norm_linear, silu_mul_linear

__all__ = ["add_norm_linear", "norm_linear", "silu_mul_linear"]
