"""References of the product kernels, for the tests.

`naive_norm_linear`, for `norm_linear` and `add_norm_linear`: transformers' RMSNorm (Llama's, Qwen3's, Mistral's:
float32 statistics, the normalized rows cast back before the weight's product) and then F.linear, in PyTorch.

`naive_silu_mul_linear`, for `silu_mul_linear`: an MLP's down projection of its gated activation, as Llama's MLP
computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (+ residual), norm_weight [K], weight [N, K] -> (linear(RMSNorm(h)) [..., N], h), h = x + residual
    (x where residual is None)."""
    h = x if residual is None else x + residual
    h32 = h.to(torch.float32)
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return F.linear(norm_weight * normed, weight), h


def naive_silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate, up [..., K], weight [N, K] -> linear(silu(gate) * up, weight) [..., N]."""
    return F.linear(F.silu(gate) * up, weight)
