"""Raven's router choice for prefill and training: the top-K slots of every token and head in one Triton kernel.

`torch.topk` over [B, T, H, M] router logits runs a radix select per row; for the many short rows of a long prompt
(T H rows of M = 256) it was the largest op of a Raven prefill after attention (kernels/raven/NOTES.md, "Router
top-K"). Here every program sorts a block of rows on chip: each logit becomes one int64 key, its float order in the
high 32 bits and its slot in the low bits, so one bitonic sort orders values and carries indices, and ties go to
the lower slot (`kernels/rows.py: indices_by_score`, whose order the one-kernel decode steps pick in too). The reference
is `torch.topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rows import indices_by_score

TILE_KEYS = 4096  # int64 keys a program sorts at most, [BR, BM]; fewer rows when there are fewer


@triton.jit
def raven_fwd_kernel_topk(x, idx, N, M: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr):
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    o_m = tl.arange(0, BM)
    m_r, m_m = o_r < N, o_m < M
    p_x = x + o_r[:, None].to(tl.int64) * M + o_m[None, :]
    b_x = tl.load(p_x, mask=m_r[:, None] & m_m[None, :], other=float("-inf")).to(tl.float32)  # [BR, BM]
    b_idx = indices_by_score(b_x, M, BM)  # [BR, BM] slots, best first
    p_idx = idx + o_r[:, None].to(tl.int64) * K + o_m[None, :]
    tl.store(p_idx, b_idx, mask=m_r[:, None] & (o_m < K)[None, :])


def topk_slots(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of `logits` [..., M] along the last dim: their indices [..., k] int64, best first, the lower
    index first among equal values (as `logits.topk(k).indices` up to the order of ties). No gradient: gather the
    values with `logits.gather(-1, idx)`."""
    M = logits.shape[-1]
    if not 1 <= k <= M:
        raise ValueError(f"topk_slots: k = {k} must lie in [1, M = {M}]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"topk_slots: logits.dtype = {logits.dtype}; allowed: float32, bfloat16, float16")
    x = logits.detach().reshape(-1, M).contiguous()  # [N, M]
    N, BM = x.shape[0], triton.next_power_of_2(M)
    idx = torch.empty(*logits.shape[:-1], k, device=logits.device, dtype=torch.int64)
    BR = max(1, min(TILE_KEYS // BM, triton.next_power_of_2(N)))  # rows per program: a [BR, BM] tile of keys
    if N:
        raven_fwd_kernel_topk[(triton.cdiv(N, BR),)](x, idx, N, M, k, BR, BM, num_warps=4)
    return idx
