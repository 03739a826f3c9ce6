"""Argument checks and conversions shared by the Raven kernels' public functions."""

from __future__ import annotations

import torch


def slot_indices(idx: torch.Tensor) -> torch.Tensor:
    """idx as the kernels read it, contiguous: int32 and int64 (topk's) as they are, so that no cast kernel runs per
    call; other integer dtypes as int32."""
    return (idx if idx.dtype in (torch.int32, torch.int64) else idx.to(torch.int32)).contiguous()


def check_inputs(q, k, v, a, idx, r, num_slots, initial_state, cu_seqlens) -> None:
    """Raise a ValueError naming the first argument whose shape or value the kernels do not accept."""
    if q.dim() != 5:
        raise ValueError(f"q must be [B, T, H, G, d], got shape {tuple(q.shape)}")
    B, T, H, G, D = q.shape
    for name, x, shape in (("k", k, (B, T, H, D)), ("v", v, (B, T, H, D)), ("a", a, (B, T, H))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} to match q {list(q.shape)}, got {list(x.shape)}")
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (B, T, H) or tuple(r.shape) != tuple(idx.shape):
        raise ValueError(
            f"idx and r must both be [B, T, H, K] = [{B}, {T}, {H}, K], got {list(idx.shape)} and {list(r.shape)}"
        )
    if idx.dtype.is_floating_point:
        raise ValueError(f"idx must hold integer slot indices, got dtype {idx.dtype}")
    if not 1 <= idx.shape[-1] <= num_slots:
        raise ValueError(f"top-K = {idx.shape[-1]} must lie in [1, num_slots = {num_slots}]")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed input with batch size 1, got batch size {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] offsets, got shape {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        for name, s in zip(("S^k", "S^v"), initial_state):
            if tuple(s.shape) != (N, H, num_slots, D):
                raise ValueError(
                    f"initial state {name} must be [N, H, M, d] = {[N, H, num_slots, D]}, got {list(s.shape)}"
                )
