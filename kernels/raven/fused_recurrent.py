"""Raven step by step, for decoding: each step rewrites only the K selected slots of S^k and S^v in place and reads
every slot once, the softmax over slots done online while the slots stream by."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..split import Partials, split_count
from .utils import check_inputs, slot_indices


def decode_config(M: int, G: int, D: int) -> tuple[int, int]:
    """Slots per block of the streaming loop ([BM, D] float32 tiles of S^k and S^v) and warps per program: 8-slot
    blocks at one warp, unsplit, were the fastest of a sweep over block sizes, warps and splits (docs/KERNELS.md,
    Settings: Raven decode blocks)."""
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    return max(1, min(8, triton.next_power_of_2(M), 1024 // (BG * BD))), 1


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
    m_part,
    l_part,
    o_part,
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
    MB: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_nh, i_sp = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = i_n * T, i_n * T + T
    o_g, o_d, o_k = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BK)
    m_g, m_d, m_k = o_g < G, o_d < D, o_k < K
    p_s = (i_n * H + i_h) * M * D
    for t in range(bos, eos):
        p_gd = ((t * H + i_h) * G + o_g[:, None]) * D + o_d[None, :]
        b_q = tl.load(q + p_gd, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale  # [BG, BD]
        b_k = tl.load(k + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_a = tl.load(a + t * H + i_h).to(tl.float32)
        b_i = tl.load(idx + (t * H + i_h) * K + o_k, mask=m_k, other=-1)
        b_lfk = b_a * tl.load(r + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_mx = tl.full([BG], -1e30, dtype=tl.float32)  # finite: a range of padding slots weighs 0, not NaN
        b_l = tl.zeros([BG], dtype=tl.float32)
        b_o = tl.zeros([BG, BD], dtype=tl.float32)
        for i_m in range(i_sp * MB, i_sp * MB + MB):  # this program's range of slot blocks
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
        if NS == 1:
            tl.store(o + p_gd, (b_o / b_l[:, None]).to(o.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
        else:  # one token (T == 1): the ranges' partial readouts, merged by merge_fwd_kernel
            p_part = (i_nh * NS + i_sp) * BG + o_g
            tl.store(m_part + p_part, b_mx)
            tl.store(l_part + p_part, b_l)
            tl.store(o_part + p_part[:, None] * BD + o_d[None, :], b_o)
        tl.debug_barrier()  # this step's writes land before the next step reads the slots


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
    B, _, H, _, D = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = tuple(q.new_zeros(N, H, num_slots, D, dtype=torch.float32) for _ in range(2))
    for name, s in zip(("S^k", "S^v"), initial_state):
        if s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(
                f"initial state {name} is updated in place: it must be contiguous float32, "
                f"got {s.dtype}{'' if s.is_contiguous() else ', not contiguous'}"
            )
    q, k, v, a, r = (x.contiguous() for x in (q, k, v, a, r))
    o = raven_decode(q, k, v, a, slot_indices(idx), r, *initial_state, cu_seqlens, float(scale), num_slots)
    return o, (initial_state if output_final_state else None)


@torch.library.custom_op("raven_hybrid::raven_decode", mutates_args=("sk", "sv"))
def raven_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    idx: torch.Tensor,
    r: torch.Tensor,
    sk: torch.Tensor,
    sv: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    num_slots: int,
) -> torch.Tensor:
    """The kernel launch of `fused_recurrent_raven` (checked, contiguous inputs) as a custom op that updates the
    state (sk, sv) in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, T, H, G, D = q.shape
    K, M = idx.shape[-1], num_slots
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(q)
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    BM, warps = decode_config(M, G, D)
    blocks = triton.cdiv(M, BM)
    # one token per sequence: the slots split over several programs per head when the heads alone leave SMs idle
    NS = split_count(N * H, blocks, q.device) if T == 1 and cu_seqlens is None else 1
    part = Partials(N * H, NS, G, D, q.device) if NS > 1 else None
    raven_fwd_kernel_fused_recurrent[(N * H, NS)](
        q,
        k,
        v,
        a,
        idx,
        r,
        sk,
        sv,
        o,
        part and part.m,
        part and part.l,
        part and part.o,
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
        triton.cdiv(blocks, NS),
        cu_seqlens is not None,
        num_warps=warps,
    )
    if part is not None:
        part.merge(o)
    return o


@raven_decode.register_fake
def _(q, k, v, a, idx, r, sk, sv, cu_seqlens, scale, num_slots):
    return torch.empty_like(q)
