"""Chunked Raven for training and prefill: forward and backward Triton kernels behind one autograd Function.

Forward: gates from the router (chunk_h.raven_fwd_kernel_gate), states entering every chunk (raven_fwd_kernel_h),
then per chunk and query head the two passes fused over blocks of slots with an online softmax: the key pass
gives a block of slot logits, the value pass reads that block at once, rescaled as the running maximum grows
(raven_fwd_kernel_o). Only the inputs, the output and its logsumexp are kept; backward recomputes the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_h import raven_bwd_kernel_dh, raven_fwd_kernel_gate, raven_fwd_kernel_h
from .intra import raven_factors, raven_mix, raven_read_m, raven_write_m
from .utils import check_inputs

BT, BC = 64, 16  # chunk and sub-chunk lengths


@triton.jit
def raven_fwd_kernel_o(
    q,
    k,
    v,
    g,
    w,
    hk,
    hv,
    o,
    lse,
    chunk_bos,
    chunk_len,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    i_c, i_hg = tl.program_id(0), tl.program_id(1)
    i_h = i_hg // G
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_q = tl.load(q + p_qd, mask=m_td, other=0.0)
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)
    b_A = tl.where(o_t[:, None] >= o_t[None, :], tl.dot(b_q, tl.trans(b_k)), 0.0)  # [BT, BT] causal q k^T
    b_q = b_q.to(tl.float32)
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_mx = tl.full([BT], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BD], dtype=tl.float32)
    b_B = tl.zeros([BT, BT], dtype=tl.float32)
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < M
        m_tm = m_t[:, None] & m_m[None, :]
        m_md = m_m[:, None] & m_d[None, :]
        b_g = tl.load(p_g + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)  # [BT, BM]
        b_w = tl.load(p_w + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)
        b_gl = tl.load(p_g + (L - 1) * H * M + o_m, mask=m_m, other=0.0)
        fast, b_qg, b_kg = raven_factors(b_g, b_gl, m_tm)
        b_kg *= b_w
        b_eg = tl.exp(b_g)
        b_hk = tl.load(hk + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)  # [BM, BD]
        b_s = b_eg * tl.dot(b_q, tl.trans(b_hk))
        b_s += raven_read_m(b_A, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_s = tl.where(m_m[None, :], b_s * scale, float("-inf"))
        b_mn = tl.maximum(b_mx, tl.max(b_s, 1))
        b_alpha = tl.exp(b_mx - b_mn)
        b_p = tl.exp(b_s - b_mn[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_hv = tl.load(hv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_o = b_o * b_alpha[:, None] + tl.dot(b_p * b_eg, b_hv)
        b_B = b_B * b_alpha[:, None] + raven_mix(b_p, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_mx = b_mn
    b_v = tl.load(v + p_kd, mask=m_td, other=0.0).to(tl.float32)
    b_o = (b_o + tl.dot(b_B, b_v)) / b_l[:, None]
    tl.store(o + p_qd, b_o.to(o.dtype.element_ty), mask=m_td)
    tl.store(lse + (bos + o_t) * H * G + i_hg, b_mx + tl.log(b_l), mask=m_t)


@triton.jit
def raven_bwd_kernel_dq(
    q,
    k,
    v,
    do,
    g,
    w,
    hk,
    hv,
    lse,
    delta,
    dq,
    p,
    ds,
    e,
    chunk_bos,
    chunk_len,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    """dq, and per token and slot the softmax weights p, the logit gradients ds and e = ds s + p dp (the gate
    gradient's read terms), each [T, H * G, M], for the kernels that follow."""
    i_c, i_hg = tl.program_id(0), tl.program_id(1)
    i_h = i_hg // G
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_q = tl.load(q + p_qd, mask=m_td, other=0.0)
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)
    b_v = tl.load(v + p_kd, mask=m_td, other=0.0)
    b_do = tl.load(do + p_qd, mask=m_td, other=0.0)
    m_c = o_t[:, None] >= o_t[None, :]
    b_A = tl.where(m_c, tl.dot(b_q, tl.trans(b_k)), 0.0)  # [BT, BT] causal q k^T
    b_C = tl.where(m_c, tl.dot(b_do, tl.trans(b_v)), 0.0)  # [BT, BT] causal do v^T
    b_q, b_do = b_q.to(tl.float32), b_do.to(tl.float32)
    b_lse = tl.load(lse + (bos + o_t) * H * G + i_hg, mask=m_t, other=0.0)
    b_delta = tl.load(delta + (bos + o_t) * H * G + i_hg, mask=m_t, other=0.0)
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_dq = tl.zeros([BT, BD], dtype=tl.float32)
    b_B = tl.zeros([BT, BT], dtype=tl.float32)
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < M
        m_tm = m_t[:, None] & m_m[None, :]
        m_md = m_m[:, None] & m_d[None, :]
        b_g = tl.load(p_g + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)
        b_w = tl.load(p_w + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)
        b_gl = tl.load(p_g + (L - 1) * H * M + o_m, mask=m_m, other=0.0)
        fast, b_qg, b_kg = raven_factors(b_g, b_gl, m_tm)
        b_kg *= b_w
        b_eg = tl.exp(b_g)
        b_hk = tl.load(hk + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_hv = tl.load(hv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_s = b_eg * tl.dot(b_q, tl.trans(b_hk))
        b_s += raven_read_m(b_A, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_p = tl.where(m_tm, tl.exp(b_s * scale - b_lse[:, None]), 0.0)
        b_dp = b_eg * tl.dot(b_do, tl.trans(b_hv))
        b_dp += raven_read_m(b_C, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_ds = scale * b_p * (b_dp - b_delta[:, None])
        p_tm = ((bos + o_t[:, None]) * H * G + i_hg) * M + o_m[None, :]
        tl.store(p + p_tm, b_p, mask=m_tm)
        tl.store(ds + p_tm, b_ds, mask=m_tm)
        tl.store(e + p_tm, b_ds * b_s + b_p * b_dp, mask=m_tm)
        b_dq += tl.dot(b_ds * b_eg, b_hk)
        b_B += raven_mix(b_ds, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
    b_dq += tl.dot(b_B, b_k.to(tl.float32))
    tl.store(dq + p_qd, b_dq.to(dq.dtype.element_ty), mask=m_td)


@triton.jit
def raven_bwd_kernel_dkv(
    q,
    k,
    v,
    do,
    g,
    w,
    dhk,
    dhv,
    p,
    ds,
    e,
    dk,
    dv,
    dlf,
    dlf_sum,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    """dk, dv, and the gradient of log_f summed over the rest of the chunk (dlf [T, H, M]) with the chunk totals
    (dlf_sum [NC, H, M]) that carry it into earlier chunks."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)
    b_v = tl.load(v + p_kd, mask=m_td, other=0.0)
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_dk = tl.zeros([BT, BD], dtype=tl.float32)
    b_dv = tl.zeros([BT, BD], dtype=tl.float32)
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < M
        m_tm = m_t[:, None] & m_m[None, :]
        m_md = m_m[:, None] & m_d[None, :]
        b_g = tl.load(p_g + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)
        b_w = tl.load(p_w + o_t[:, None] * H * M + o_m[None, :], mask=m_tm, other=0.0)
        b_gl = tl.load(p_g + (L - 1) * H * M + o_m, mask=m_m, other=0.0)
        b_dec = tl.where(m_tm, tl.exp(b_gl[None, :] - b_g), 0.0)  # [BT, BM] decay from each token to chunk end
        fast, b_qg, b_ig = raven_factors(b_g, b_gl, m_tm)
        b_kg = b_w * b_ig
        b_dhk = tl.load(dhk + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_dhv = tl.load(dhv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_dk += tl.dot(b_w * b_dec, b_dhk)
        b_dv += tl.dot(b_w * b_dec, b_dhv)
        b_dw = b_dec * (tl.dot(b_k.to(tl.float32), tl.trans(b_dhk)) + tl.dot(b_v.to(tl.float32), tl.trans(b_dhv)))
        b_e = tl.zeros([BT, BM], dtype=tl.float32)
        for i_g in range(G):
            i_hg = i_h * G + i_g
            p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
            b_q = tl.load(q + p_qd, mask=m_td, other=0.0)
            b_do = tl.load(do + p_qd, mask=m_td, other=0.0)
            b_A = tl.where(o_t[:, None] >= o_t[None, :], tl.dot(b_q, tl.trans(b_k)), 0.0)  # causal
            b_C = tl.where(o_t[:, None] >= o_t[None, :], tl.dot(b_do, tl.trans(b_v)), 0.0)
            p_P, p_S = p + (bos * H * G + i_hg) * M, ds + (bos * H * G + i_hg) * M
            p_tm = o_t[:, None] * H * G * M + o_m[None, :]
            b_p = tl.load(p_P + p_tm, mask=m_tm, other=0.0)
            b_ds = tl.load(p_S + p_tm, mask=m_tm, other=0.0)
            b_e += tl.load(e + (bos * H * G + i_hg) * M + p_tm, mask=m_tm, other=0.0)
            b_Bp = raven_mix(b_p, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
            b_Bs = raven_mix(b_ds, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
            b_dv += tl.dot(tl.trans(b_Bp), b_do.to(tl.float32))
            b_dk += tl.dot(tl.trans(b_Bs), b_q.to(tl.float32))
            b_dw += raven_write_m(b_C, b_p, b_g, b_qg, b_ig, fast, p_P, H * G * M, p_g, H * M, L, o_m, m_m, BT, BC)
            b_dw += raven_write_m(b_A, b_ds, b_g, b_qg, b_ig, fast, p_S, H * G * M, p_g, H * M, L, o_m, m_m, BT, BC)
        b_dgc = tl.where(m_tm, b_e - b_w * b_dw, 0.0)  # gradient of the cumulative log-retention
        b_tot = tl.sum(b_dgc, 0)
        b_dlf = b_tot[None, :] - tl.cumsum(b_dgc, 0) + b_dgc - (1.0 - b_w) * b_dw  # suffix sums, and through w
        tl.store(dlf + ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :], b_dlf, mask=m_tm)
        tl.store(dlf_sum + (i_c * H + i_h) * M + o_m, b_tot, mask=m_m)
    tl.store(dk + p_kd, b_dk.to(dk.dtype.element_ty), mask=m_td)
    tl.store(dv + p_kd, b_dv.to(dv.dtype.element_ty), mask=m_td)


def prepare_chunks(cu_seqlens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Chunks of BT tokens that never cross a sequence boundary: first token and length of each chunk [NC],
    the first chunk of each sequence [N + 1], and the chunk of each token [T]."""
    lens = cu_seqlens.diff()
    counts = (lens + BT - 1) // BT
    seq_chunks = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), counts)  # [NC]
    bos = cu_seqlens[seq] + (torch.arange(seq.numel(), device=lens.device) - seq_chunks[seq]) * BT
    length = torch.minimum(cu_seqlens[seq + 1] - bos, torch.full_like(bos, BT))
    return {
        "bos": bos.to(torch.int32),
        "len": length.to(torch.int32),
        "seq_chunks": seq_chunks.to(torch.int32),
        "seq": seq,
        "token_chunk": torch.repeat_interleave(torch.arange(seq.numel(), device=lens.device), length),
    }


def block_sizes(M: int, D: int) -> tuple[int, int]:
    """Slots per block and the (padded) head dim; every tl.dot dimension >= 16."""
    return min(64, max(16, triton.next_power_of_2(M))), max(16, triton.next_power_of_2(D))


def launch_config(D: int) -> dict[str, tuple[int, int, int]]:
    """(slots per block, warps, pipeline stages) of the per-chunk kernels, fixed by head dim; one stage: three
    stages of the state loads need 300 KB of shared memory in raven_fwd_kernel_o at d = 128."""
    return {
        "o": (64, 8 if D > 64 else 4, 1),
        "dq": (64, 8 if D > 64 else 4, 1),
        "dkv": (32 if D > 64 else 64, 8 if D > 64 else 4, 1),
    }


def scan_blocks(M: int, D: int, NH: int) -> tuple[int, int]:
    """Slots and head-dim columns per program of the sequential scans: small enough for ~2 programs per SM."""
    BM, BD = block_sizes(M, D)
    BM = min(BM, 32)
    BD = min(BD, 64 if triton.cdiv(M, BM) * triton.cdiv(D, 64) * NH >= 256 else 32)
    return BM, BD


def gates(a, idx, r, chunks, M):
    """g, w [T, H, M] float32: per-slot cumulative log-retention within each chunk, and 1 - exp(log_f)."""
    T, H, K = idx.shape
    BM, _ = block_sizes(M, 16)
    g = a.new_empty(T, H, M, dtype=torch.float32)
    w = torch.empty_like(g)
    NC = chunks["bos"].numel()
    raven_fwd_kernel_gate[(NC, H)](
        a, idx, r, g, w, chunks["bos"], chunks["len"], H, M, K, BT, BM, triton.next_power_of_2(K), num_warps=4
    )
    return g, w


def states(k, v, g, w, h0, chunks, M, output_final_state):
    """hk, hv [NC, H, M, D]: the states entering each chunk; and the final states [N, H, M, D] or None."""
    T, H, D = k.shape
    N, NC = chunks["seq_chunks"].numel() - 1, chunks["bos"].numel()
    BM, BD = scan_blocks(M, D, N * H)
    hk = k.new_empty(NC, H, M, D, dtype=torch.float32)
    hv = torch.empty_like(hk)
    ht = (k.new_empty(N, H, M, D, dtype=torch.float32), k.new_empty(N, H, M, D, dtype=torch.float32))
    h0 = h0 if h0 is not None else (None, None)
    raven_fwd_kernel_h[(triton.cdiv(M, BM), triton.cdiv(D, BD), N * H)](
        k,
        v,
        g,
        w,
        h0[0],
        h0[1],
        hk,
        hv,
        ht[0],
        ht[1],
        chunks["bos"],
        chunks["len"],
        chunks["seq_chunks"],
        H,
        M,
        D,
        BT,
        BM,
        BD,
        h0[0] is not None,
        output_final_state,
        num_warps=4,
    )
    return hk, hv, (ht if output_final_state else None)


def chunk_raven_fwd(q, k, v, a, idx, r, scale, M, h0, output_final_state, chunks):
    T, HG, D = q.shape
    H = k.shape[1]
    G = HG // H
    g, w = gates(a, idx, r, chunks, M)
    hk, hv, ht = states(k, v, g, w, h0, chunks, M, output_final_state)
    _, BD = block_sizes(M, D)
    BM, warps, stages = launch_config(D)["o"]
    BM = min(BM, block_sizes(M, D)[0])
    o = torch.empty_like(q)
    lse = q.new_empty(T, HG, dtype=torch.float32)
    raven_fwd_kernel_o[(chunks["bos"].numel(), HG)](
        q,
        k,
        v,
        g,
        w,
        hk,
        hv,
        o,
        lse,
        chunks["bos"],
        chunks["len"],
        scale,
        H,
        G,
        M,
        D,
        BT,
        BC,
        BM,
        BD,
        num_warps=warps,
        num_stages=stages,
    )
    return o, lse, ht


def chunk_raven_bwd(q, k, v, a, idx, r, scale, M, h0, o, lse, do, dht, chunks):
    T, HG, D = q.shape
    H = k.shape[1]
    G = HG // H
    N, NC = chunks["seq_chunks"].numel() - 1, chunks["bos"].numel()
    BM, BD = block_sizes(M, D)
    g, w = gates(a, idx, r, chunks, M)
    hk, hv, ht = states(k, v, g, w, h0, chunks, M, dht is not None)
    delta = (do.float() * o.float()).sum(-1)  # [T, H * G] = sum_m p dp, as in attention
    dq = torch.empty_like(q)
    p, ds, e = (q.new_empty(T, HG, M, dtype=torch.float32) for _ in range(3))
    BMq, warps, stages = launch_config(D)["dq"]
    raven_bwd_kernel_dq[(NC, HG)](
        q,
        k,
        v,
        do,
        g,
        w,
        hk,
        hv,
        lse,
        delta,
        dq,
        p,
        ds,
        e,
        chunks["bos"],
        chunks["len"],
        scale,
        H,
        G,
        M,
        D,
        BT,
        BC,
        min(BMq, BM),
        BD,
        num_warps=warps,
        num_stages=stages,
    )
    del hk, hv
    dhk, dhv = (q.new_empty(NC, H, M, D, dtype=torch.float32) for _ in range(2))
    dh0 = (torch.empty_like(h0[0]), torch.empty_like(h0[1])) if h0 is not None else (None, None)
    dht_k, dht_v = dht if dht is not None else (None, None)
    BMh, BDh = scan_blocks(M, D, N * H)
    raven_bwd_kernel_dh[(triton.cdiv(M, BMh), triton.cdiv(D, BDh), N * H)](
        q,
        do,
        ds,
        p,
        g,
        dht_k,
        dht_v,
        dhk,
        dhv,
        dh0[0],
        dh0[1],
        chunks["bos"],
        chunks["len"],
        chunks["seq_chunks"],
        H,
        G,
        M,
        D,
        BT,
        BMh,
        BDh,
        dht is not None,
        h0 is not None,
        num_warps=4,
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dlf = e.new_empty(T, H, M)
    dlf_sum = e.new_empty(NC, H, M)
    BMk, warps_k, stages_k = launch_config(D)["dkv"]
    raven_bwd_kernel_dkv[(NC, H)](
        q,
        k,
        v,
        do,
        g,
        w,
        dhk,
        dhv,
        p,
        ds,
        e,
        dk,
        dv,
        dlf,
        dlf_sum,
        chunks["bos"],
        chunks["len"],
        H,
        G,
        M,
        D,
        BT,
        BC,
        min(BMk, BM),
        BD,
        num_warps=warps_k,
        num_stages=stages_k,
    )
    # Carry each chunk's total into the earlier chunks of its sequence; the final states' own read comes last.
    suffix = torch.nn.functional.pad(dlf_sum.double().flip(0).cumsum(0).flip(0), (0, 0, 0, 0, 0, 1))  # [NC+1, H, M]
    seq = chunks["seq"]
    after = torch.arange(1, NC + 1, device=q.device)
    carry = suffix[after] - suffix[chunks["seq_chunks"][seq + 1].long()]  # [NC, H, M]
    if dht is not None:
        carry = carry + ((dht_k * ht[0]).sum(-1) + (dht_v * ht[1]).sum(-1))[seq].double()
    flat = (chunks["token_chunk"][:, None, None] * H + torch.arange(H, device=q.device)[None, :, None]) * M + idx
    dl = dlf.gather(-1, idx.long()) + carry.float().flatten()[flat.long()]  # [T, H, K] d loss / d log_f at idx
    da = (dl * r.float()).sum(-1)
    dr = dl * a.float()[..., None]
    return dq, dk, dv, da, dr, dh0


class ChunkRavenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, idx, r, scale, num_slots, h0k, h0v, output_final_state, cu_seqlens):
        B, T, H, G, D = q.shape
        K = idx.shape[-1]
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int64)
        chunks = prepare_chunks(cu_seqlens.long())
        flat = (
            q.reshape(B * T, H * G, D).contiguous(),
            k.reshape(B * T, H, D).contiguous(),
            v.reshape(B * T, H, D).contiguous(),
            a.reshape(B * T, H).float().contiguous(),
            idx.reshape(B * T, H, K).to(torch.int32).contiguous(),
            r.reshape(B * T, H, K).float().contiguous(),
        )
        h0 = None if h0k is None else (h0k.float().contiguous(), h0v.float().contiguous())
        o, lse, ht = chunk_raven_fwd(*flat, scale, num_slots, h0, output_final_state, chunks)
        ctx.save_for_backward(*flat, o, lse, *(h0 if h0 is not None else ()))
        ctx.meta = (scale, num_slots, chunks, (B, T, H, G, D, K), a.dtype, r.dtype, h0k is not None)
        ctx.h0_dtypes = (h0k.dtype, h0v.dtype) if h0k is not None else None
        o = o.view(B, T, H, G, D)
        return (o, *ht) if output_final_state else (o, None, None)

    @staticmethod
    def backward(ctx, do, dhtk, dhtv):
        scale, M, chunks, (B, T, H, G, D, K), a_dtype, r_dtype, has_h0 = ctx.meta
        q, k, v, a, idx, r, o, lse, *h0 = ctx.saved_tensors
        dht = None
        if dhtk is not None or dhtv is not None:
            z = torch.zeros(chunks["seq_chunks"].numel() - 1, H, M, D, device=q.device, dtype=torch.float32)
            dht = (z if dhtk is None else dhtk.float().contiguous(), z if dhtv is None else dhtv.float().contiguous())
        do = do.reshape(B * T, H * G, D).contiguous()
        dq, dk, dv, da, dr, dh0 = chunk_raven_bwd(
            q, k, v, a, idx, r, scale, M, tuple(h0) if has_h0 else None, o, lse, do, dht, chunks
        )
        dh0k, dh0v = (dh0[0].to(ctx.h0_dtypes[0]), dh0[1].to(ctx.h0_dtypes[1])) if has_h0 else (None, None)
        return (
            dq.view(B, T, H, G, D),
            dk.view(B, T, H, D),
            dv.view(B, T, H, D),
            da.view(B, T, H).to(a_dtype),
            None,
            dr.view(B, T, H, K).to(r_dtype),
            None,
            None,
            dh0k,
            dh0v,
            None,
            None,
        )


def chunk_raven(
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
    """Raven over whole sequences (training, prefill), differentiable in q, k, v, a, r and the initial state.

    Args:
        q: [B, T, H, G, d] queries, G per key/value head.
        k, v: [B, T, H, d].
        a: [B, T, H] log-decay per head and token (<= 0; 0 at padding, which then writes nothing).
        idx: [B, T, H, K] integer slots each token writes (distinct per token); r: [B, T, H, K] their weights.
        scale: logit scale of the slot softmax.
        num_slots: M.
        initial_state: (S^k, S^v), each [N, H, M, d] (N = B, or the number of sequences with cu_seqlens).
        output_final_state: also return the final states.
        cu_seqlens: [N + 1] offsets of sequences packed along T (B == 1); no chunk crosses a boundary.

    Returns:
        o [B, T, H, G, d] in q's dtype, and (S^k, S^v) each [N, H, M, d] float32 or None.
    """
    check_inputs(q, k, v, a, idx, r, num_slots, initial_state, cu_seqlens)
    h0k, h0v = initial_state if initial_state is not None else (None, None)
    o, htk, htv = ChunkRavenFunction.apply(
        q, k, v, a, idx, r, float(scale), num_slots, h0k, h0v, output_final_state, cu_seqlens
    )
    return o, ((htk, htv) if output_final_state else None)
