"""SSE decode step (Triton): each (batch row, kv head) gathers only the partitions its tokens select, updates them
in place and reads them, one token after another: S^i = diag(exp(log_g)) S^i + k^T v, o = scale sum_i q^i S^i."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk import _new


@triton.jit
def sse_fwd_kernel_decode(
    q,
    k,
    v,
    g,
    idx,
    state,
    o,
    scale,
    T,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    P: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BG: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_g, o_k, o_v = tl.arange(0, BG), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_g, m_k, m_v = o_g < G, o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    for t in range(T):
        tok = i_b.to(tl.int64) * T + t
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_o = tl.zeros([BG, BV], dtype=tl.float32)
        for m in range(M):
            e = (tok * H + i_h) * M + m  # entry of this token
            i_p = tl.load(idx + e).to(tl.int64)
            b_k = tl.load(k + e * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            b_g = tl.load(g + e * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            p_s = state + ((i_bh.to(tl.int64) * P + i_p) * K + o_k[:, None]) * V + o_v[None, :]
            b_s = tl.load(p_s, mask=m_kv, other=0.0) * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]  # [BK, BV]
            tl.store(p_s, b_s, mask=m_kv)
            for i_g in range(G):
                b_q = tl.load(q + (((tok * H + i_h) * G + i_g) * M + m) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_o = tl.where((o_g == i_g)[:, None], b_o + tl.sum(b_q[:, None] * b_s, axis=0)[None, :], b_o)
        p_o = o + ((tok * H + i_h) * G + o_g[:, None]) * V + o_v[None, :]
        tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_g[:, None] & m_v[None, :])
        tl.debug_barrier()  # the next token reads what this one stored


def fused_recurrent_sse(q, k, v, log_g, idx, num_partitions: int, scale: float, initial_state=None):
    """SSE recurrence for decoding (forward only; same arguments and results as `sse_recurrent`).

    Only the partitions in `idx` are read or written. A float32 contiguous `initial_state` is updated in place and
    returned; any other is copied to float32 first, and None starts from zeros.

    Args:
        q: [B, T, H, G, M, c]; k, log_g: [B, T, H, M, c]; v: [B, T, H, d]; idx: [B, T, H, M] in [0, P), distinct
            within a token.
        num_partitions: P, partitions of the state (routed + shared).
        initial_state: [B, H, P, c, d]; zeros when None.

    Returns:
        o: [B, T, H, G, d] in q's dtype, and the state [B, H, P, c, d] float32.
    """
    B, T, H, G, M, K = q.shape
    V, P = v.shape[-1], num_partitions
    if initial_state is None:
        state = q.new_zeros(B, H, P, K, V, dtype=torch.float32)
    elif initial_state.shape != (B, H, P, K, V):
        raise ValueError(f"fused_recurrent_sse: initial_state {tuple(initial_state.shape)}; expected {(B, H, P, K, V)}")
    elif initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state
    else:
        state = initial_state.float().contiguous()
    q, k, v, log_g, idx = (x.contiguous() for x in (q, k, v, log_g, idx))
    return sse_decode(q, k, v, log_g, idx, state, float(scale)), state


@torch.library.custom_op("raven_hybrid::sse_decode", mutates_args=("state",))
def sse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    idx: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel launch of `fused_recurrent_sse` (checked, contiguous inputs) as a custom op that updates `state`
    [B, H, P, c, d] in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, T, H, G, M, K = q.shape
    V, P = v.shape[-1], state.shape[2]
    o = _new((B, T, H, G, V), q, q.dtype)
    BK, BV = max(16, triton.next_power_of_2(K)), min(64, max(16, triton.next_power_of_2(V)))
    if B * H and T:
        sse_fwd_kernel_decode[(B * H, triton.cdiv(V, BV))](
            q, k, v, log_g, idx, state, o, scale, T, H, G, M, P, K, V, triton.next_power_of_2(G), BK, BV, num_warps=4
        )
    return o


@sse_decode.register_fake
def _(q, k, v, log_g, idx, state, scale):
    return q.new_empty(*q.shape[:-2], v.shape[-1])
