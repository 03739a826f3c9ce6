"""Reference for the Raven kernels: the dense log-retention built from the router's choice, then the PyTorch
recurrence of raven_layers.raven run sequence by sequence."""

from __future__ import annotations

import torch

from raven_layers.raven import raven_recurrent


def dense_log_f(a: torch.Tensor, idx: torch.Tensor, r: torch.Tensor, num_slots: int) -> torch.Tensor:
    """log_f [B, T, H, M]: a_t * r_t[j] at slot idx_t[j], 0 on the slots a token does not write."""
    dtype = torch.promote_types(r.dtype, torch.float32)
    vals = a.to(dtype).unsqueeze(-1) * r.to(dtype)  # [B, T, H, K]
    return torch.zeros(*idx.shape[:-1], num_slots, dtype=dtype, device=r.device).scatter(-1, idx.long(), vals)


def naive_raven(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    idx: torch.Tensor,
    r: torch.Tensor,
    scale: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    num_slots: int = 256,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Raven by the step-by-step recurrence (float32 or float64; differentiable by autograd).

    Args:
        q: [B, T, H, G, d] queries, G per key/value head.
        k, v: [B, T, H, d].
        a: [B, T, H] log-decay per head and token (<= 0; 0 at padding).
        idx: [B, T, H, K] slots each token writes; r: [B, T, H, K] their routing weights (>= 0).
        initial_state: (S^k, S^v), each [N, H, M, d] (N = B, or the number of sequences with cu_seqlens).
        cu_seqlens: [N + 1] offsets of packed sequences (B == 1); each starts from its own initial state.

    Returns:
        o [B, T, H, G, d] and the final state (S^k, S^v), each [N, H, M, d].
    """
    log_f = dense_log_f(a, idx, r, num_slots)
    if cu_seqlens is None:
        return raven_recurrent(q, k, v, log_f, scale, initial_state)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed input with batch size 1, got batch size {q.shape[0]}")
    outputs, finals_k, finals_v = [], [], []
    bounds = cu_seqlens.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else (initial_state[0][n : n + 1], initial_state[1][n : n + 1])
        o, (s_k, s_v) = raven_recurrent(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], log_f[:, bos:eos], scale, state)
        outputs.append(o)
        finals_k.append(s_k)
        finals_v.append(s_v)
    return torch.cat(outputs, dim=1), (torch.cat(finals_k), torch.cat(finals_v))
