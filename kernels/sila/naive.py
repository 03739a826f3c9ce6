"""Reference for the SILA kernels: `raven_layers.sila.sila_recurrent`, plus packed variable-length sequences."""

from __future__ import annotations

import torch

from raven_layers.sila import sila_recurrent


def naive_recurrent_sila(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sila_recurrent` (same shapes and results); with cu_seqlens [N + 1] (B == 1) one call per packed sequence.

    q: [B, T, H, G, d_k], k: [B, T, H, d_k], v: [B, T, H, d_v], alpha: [B, T, H, G], beta_x/gamma_x: [B, T, H],
    w_beta/w_gamma: [H, d_v], initial_state: [N, H, d_v, d_k], mask: [B, T] bool.
    Returns o [B, T, H, G, d_v] and the final memory [N, H, d_v, d_k], in float32 (float64 for float64 inputs).
    """
    if cu_seqlens is None:
        return sila_recurrent(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask)
    outputs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        per_step = [x[:, bos:eos] for x in (q, k, v, alpha, beta_x, gamma_x)]
        h0 = None if initial_state is None else initial_state[n : n + 1]
        m = None if mask is None else mask[:, bos:eos]
        if eos == bos:  # an empty sequence: no output, the memory passes through
            B, _, H, G, K = q.shape
            o = q.new_zeros(B, 0, H, G, v.shape[-1], dtype=torch.promote_types(q.dtype, torch.float32))
            ht = q.new_zeros(1, H, v.shape[-1], K, dtype=o.dtype) if h0 is None else h0.to(o.dtype)
        else:
            o, ht = sila_recurrent(*per_step, w_beta, w_gamma, h0, m)
        outputs.append(o)
        finals.append(ht)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0)
