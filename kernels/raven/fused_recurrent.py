"""Raven step by step, for decoding: each step rewrites only the K selected slots of S^k and S^v in place and reads
every slot once, the softmax over slots done online while the slots stream by. The slots of one (sequence, head)
can be split over several programs, each leaving a partial softmax that raven_fwd_kernel_merge combines: more
loads in flight when there are few (sequence, head) pairs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import check_inputs


def decode_config(M: int, G: int, D: int, NH: int) -> tuple[int, int, int]:
    """Slots per block of the streaming loop ([BM, D] float32 tiles of S^k and S^v), warps per program, and the
    programs each (sequence, head) of the NH splits its slots over. On the H100 at B = 64, H = 16, d = 128 (one
    step, no split): 32-slot blocks at 4 warps 137.0 us at M = 256 and 45.4 us at M = 64, against 141.3 / 56.6 with
    64-slot blocks, 139.6 / 64.5 with 16, and 173-202 / 47-70 at 8 or 16 warps."""
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    BM = max(1, min(32, triton.next_power_of_2(M), 4096 // (BG * BD)))
    return BM, 4, 1


@triton.jit
def raven_fwd_kernel_fused_recurrent(
    q,
    k,
    v,
    a,
    idx,
    r,
    sk,
    sv,
    o,
    o_part,
    lse_part,
    cu_seqlens,
    scale,
    T,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    K: tl.constexpr,
    BG: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Program (sequence and head, share of the slots). With NS > 1 shares, each step leaves its share's
    normalised output in o_part [T, H, NS, G, D] and logsumexp in lse_part [T, H, NS, G] (float32) for
    raven_fwd_kernel_merge; with one, the output itself."""
    i_nh, i_sp = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = i_n * T, i_n * T + T
    o_g, o_d, o_k = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BK)
    m_g, m_d, m_k = o_g < G, o_d < D, o_k < K
    p_s = (i_n * H + i_h) * M * D
    n_blocks = tl.cdiv(tl.cdiv(M, NS), BM)  # slot blocks per share
    i_lo, i_hi = i_sp * n_blocks, tl.minimum((i_sp + 1) * n_blocks, tl.cdiv(M, BM))  # empty when M < NS BM
    for t in range(bos, eos):
        p_gd = ((t * H + i_h) * G + o_g[:, None]) * D + o_d[None, :]
        b_q = tl.load(q + p_gd, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale  # [BG, BD]
        b_k = tl.load(k + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_a = tl.load(a + t * H + i_h).to(tl.float32)
        b_i = tl.load(idx + (t * H + i_h) * K + o_k, mask=m_k, other=-1)
        b_lfk = b_a * tl.load(r + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_mx = tl.full([BG], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BG], dtype=tl.float32)
        b_o = tl.zeros([BG, BD], dtype=tl.float32)
        for i_m in range(i_lo, i_hi):
            o_m = i_m * BM + tl.arange(0, BM)
            m_m = o_m < M
            m_md = m_m[:, None] & m_d[None, :]
            p_md = p_s + o_m[:, None] * D + o_d[None, :]
            b_lf = tl.sum(tl.where(b_i[None, :] == o_m[:, None], b_lfk[None, :], 0.0), 1)  # [BM]
            series = -b_lf * (1.0 + b_lf * (0.5 + b_lf * (1.0 / 6.0 + b_lf * (1.0 / 24.0 + b_lf / 120.0))))
            b_w = tl.where(b_lf > -0.1, series, 1.0 - tl.exp(b_lf))[:, None]  # 1 - exp(log_f), exact when tiny
            b_f = tl.exp(b_lf)[:, None]
            b_sk = b_f * tl.load(sk + p_md, mask=m_md, other=0.0) + b_w * b_k[None, :]  # [BM, BD]
            b_sv = b_f * tl.load(sv + p_md, mask=m_md, other=0.0) + b_w * b_v[None, :]
            m_w = m_md & (b_lf < 0.0)[:, None]  # only the written slots go back
            tl.store(sk + p_md, b_sk, mask=m_w)
            tl.store(sv + p_md, b_sv, mask=m_w)
            b_s = tl.sum(b_q[:, None, :] * b_sk[None, :, :], 2)  # [BG, BM]
            b_s = tl.where(m_m[None, :], b_s, float("-inf"))
            b_mn = tl.maximum(b_mx, tl.max(b_s, 1))
            b_alpha = tl.exp(b_mx - b_mn)
            b_p = tl.exp(b_s - b_mn[:, None])
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_o = b_o * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_sv[None, :, :], 1)
            b_mx = b_mn
        b_l = tl.maximum(b_l, 1.0)  # >= 1 already wherever a slot was read (the maximum's own term)
        b_o = b_o / b_l[:, None]
        if NS == 1:
            tl.store(o + p_gd, b_o.to(o.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
        else:  # a share without slots leaves lse = -inf and zeros, which the merge weighs by 0
            p_part = (t * H + i_h) * NS + i_sp
            tl.store(o_part + (p_part * G + o_g[:, None]) * D + o_d[None, :], b_o, mask=m_g[:, None] & m_d[None, :])
            tl.store(lse_part + p_part * G + o_g, b_mx + tl.log(b_l), mask=m_g)
        tl.debug_barrier()  # this step's writes land before the next step reads the slots


@triton.jit
def raven_fwd_kernel_merge(
    o_part, lse_part, o, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NS: tl.constexpr
):
    """One (token, head, query head): the NS shares' softmax partials weighed by exp(lse_share - lse)."""
    i_thg = tl.program_id(0)
    i_th = i_thg // G
    i_g = i_thg % G
    o_s, o_d = tl.arange(0, NS), tl.arange(0, BD)
    b_lse = tl.load(lse_part + (i_th * NS + o_s) * G + i_g)  # [NS]
    b_w = tl.exp(b_lse - tl.max(b_lse, 0))
    b_w = b_w / tl.sum(b_w, 0)
    b_o = tl.load(o_part + ((i_th * NS + o_s[:, None]) * G + i_g) * D + o_d[None, :], mask=(o_d < D)[None, :])
    b_o = tl.sum(b_w[:, None] * b_o, 0)  # [BD]
    tl.store(o + i_thg * D + o_d, b_o.to(o.dtype.element_ty), mask=o_d < D)


def fused_recurrent_raven(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    idx: torch.Tensor,
    r: torch.Tensor,
    scale: float,
    num_slots: int,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Raven one token at a time (decoding), forward only. The initial state is updated IN PLACE (it must be
    float32 and contiguous) and returned as the final state; without one, zeros are used.

    Args:
        q: [B, T, H, G, d]; k, v: [B, T, H, d]; a: [B, T, H]; idx, r: [B, T, H, K] (as in `chunk_raven`).
        initial_state: (S^k, S^v), each [N, H, M, d] float32, overwritten with the final state.
        cu_seqlens: [N + 1] offsets of sequences packed along T (B == 1).

    Returns:
        o [B, T, H, G, d] in q's dtype, and (S^k, S^v) each [N, H, M, d] float32 or None.
    """
    check_inputs(q, k, v, a, idx, r, num_slots, initial_state, cu_seqlens)
    B, T, H, G, D = q.shape
    K, M = idx.shape[-1], num_slots
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = (q.new_zeros(N, H, M, D, dtype=torch.float32), q.new_zeros(N, H, M, D, dtype=torch.float32))
    for name, s in zip(("S^k", "S^v"), initial_state):
        if s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(
                f"initial state {name} is updated in place: it must be contiguous float32, "
                f"got {s.dtype}{'' if s.is_contiguous() else ', not contiguous'}"
            )
    q, k, v, a, r = (x.contiguous() for x in (q, k, v, a, r))
    idx = (idx if idx.dtype in (torch.int32, torch.int64) else idx.to(torch.int32)).contiguous()  # no cast per step
    o = torch.empty_like(q)
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    BM, warps, NS = decode_config(M, G, D, N * H)
    o_part = lse_part = None
    if NS > 1:
        o_part = q.new_empty(B * T, H, NS, G, D, dtype=torch.float32)
        lse_part = q.new_empty(B * T, H, NS, G, dtype=torch.float32)
    raven_fwd_kernel_fused_recurrent[(N * H, NS)](
        q,
        k,
        v,
        a,
        idx,
        r,
        initial_state[0],
        initial_state[1],
        o,
        o_part,
        lse_part,
        cu_seqlens,
        float(scale),
        T,
        H,
        G,
        M,
        D,
        K,
        BG,
        BM,
        BD,
        triton.next_power_of_2(K),
        NS,
        cu_seqlens is not None,
        num_warps=warps,
    )
    if NS > 1 and o.numel():
        raven_fwd_kernel_merge[(B * T * H * G,)](o_part, lse_part, o, H, G, D, BD, NS)
    return o, (initial_state if output_final_state else None)
