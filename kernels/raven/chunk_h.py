"""The states at chunk boundaries. The gates come first (raven_fwd_kernel_gate, per chunk, slot block and head,
from the router). Then, for batches with enough (sequence, head, slot block) programs, one sequential scan over the
chunks that reads the gates and inputs and writes the states as it goes (raven_fwd_kernel_h; its gradient
raven_bwd_kernel_dh). For long sequences with few programs that scan is latency-bound, so the work is split: each
chunk's own contribution in parallel (the gate kernel with CONTRIB, raven_bwd_kernel_dhc for the gradients), then
kernels/chunked.py's state scan turns contributions x_c into states, h_{c+1} = exp(gl_c) h_c + x_c: forward for the
states entering every chunk, reversed for the gradients of the states leaving it."""

import triton
import triton.language as tl

from .intra import PRECISION


@triton.jit
def raven_chunk_writes(b_g, b_w, b_gl, m_tm, b_k, b_v):
    """What one chunk writes into the state leaving it, for a block of slots: sum_t w_t exp(gl - g_t) k_t (and v_t),
    [BM, BD] float32 each, from g, w [BT, BM], gl [BM] and k, v [BT, BD]."""
    b_dec = tl.where(m_tm, b_w * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_k.dtype)  # weight of each write at the end
    return tl.dot(tl.trans(b_dec), b_k, input_precision=PRECISION), tl.dot(
        tl.trans(b_dec), b_v, input_precision=PRECISION
    )


@triton.jit
def raven_chunk_reads(q, do, ds, p, b_eg, bos, i_h, o_t, o_m, o_d, m_tm, m_td, H, G, M, D):
    """What one chunk's reads add to the gradients of the state entering it, for a block of slots: the logits read
    S^k with weights ds against q, the outputs read S^v with weights p against do, each decayed by
    b_eg = exp(g) [BT, BM] (0 at masked entries), summed over the G query heads. [BM, BD] float32 each."""
    b_xk = tl.zeros([o_m.shape[0], o_d.shape[0]], dtype=tl.float32)
    b_xv = tl.zeros([o_m.shape[0], o_d.shape[0]], dtype=tl.float32)
    for i_g in range(G):
        i_hg = i_h * G + i_g
        p_tm = ((bos + o_t[:, None]) * H * G + i_hg) * M + o_m[None, :]
        p_td = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
        b_ds = tl.load(ds + p_tm, mask=m_tm, other=0.0).to(tl.float32)
        b_p = tl.load(p + p_tm, mask=m_tm, other=0.0).to(tl.float32)
        b_q = tl.load(q + p_td, mask=m_td, other=0.0)  # [BT, BD]
        b_do = tl.load(do + p_td, mask=m_td, other=0.0)
        b_xk += tl.dot(tl.trans((b_ds * b_eg).to(b_q.dtype)), b_q, input_precision=PRECISION)
        b_xv += tl.dot(tl.trans((b_p * b_eg).to(b_do.dtype)), b_do, input_precision=PRECISION)
    return b_xk, b_xv


@triton.jit
def raven_fwd_kernel_gate(
    a,
    idx,
    r,
    k,
    v,
    g,
    w,
    gl,
    xk,
    xv,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    CONTRIB: tl.constexpr,
):
    """One chunk, block of slots and head. g [T, H, M]: cumulative log-retention within the chunk; w [T, H, M]:
    1 - exp(log_f), exact for tiny writes; gl [NC, H, M]: g at the chunk's last token. The block's log_f is
    scattered into g (zeros, then a_t r_t[j] at each slot idx_t[j] inside the block) and read back: one block's
    [BT, BM] tile per program stays in L2 between the three steps. With CONTRIB also xk, xv [NC, H, M, D]:
    sum_t w_t exp(gl - g_t) k_t (and v_t), what the chunk writes into the state leaving it."""
    i_cm, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_m = i_cm // tl.cdiv(M, BM), i_cm % tl.cdiv(M, BM)  # a chunk's slot blocks side by side: idx, r in L2
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_d, o_k = tl.arange(0, BT), tl.arange(0, BD), tl.arange(0, BK)
    o_m = i_m * BM + tl.arange(0, BM)
    m_t, m_m, m_d = o_t < L, o_m < M, o_d < D
    m_tm = m_t[:, None] & m_m[None, :]
    p_tm = ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :]  # [BT, BM] in g and w
    tl.store(g + p_tm, tl.zeros([BT, BM], dtype=tl.float32), mask=m_tm)
    tl.debug_barrier()
    p_tk = ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_i = tl.load(idx + p_tk, mask=m_tk, other=0)  # [BT, BK]
    b_a = tl.load(a + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_lfk = b_a[:, None] * tl.load(r + p_tk, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK]
    m_in = m_tk & (b_i >= i_m * BM) & (b_i < i_m * BM + BM)
    tl.store(g + ((bos + o_t[:, None]) * H + i_h) * M + b_i, b_lfk, mask=m_in)
    tl.debug_barrier()
    b_lf = tl.load(g + p_tm, mask=m_tm, other=0.0)  # [BT, BM]
    series = -b_lf * (1.0 + b_lf * (0.5 + b_lf * (1.0 / 6.0 + b_lf * (1.0 / 24.0 + b_lf / 120.0))))
    b_w = tl.where(b_lf > -0.1, series, 1.0 - tl.exp(b_lf))
    b_g = tl.cumsum(b_lf, axis=0)
    b_gl = tl.sum(tl.where(o_t[:, None] == L - 1, b_g, 0.0), 0)  # [BM] the last row, bit for bit
    tl.store(w + p_tm, b_w, mask=m_tm)
    tl.store(g + p_tm, b_g, mask=m_tm)
    tl.store(gl + (i_c * H + i_h) * M + o_m, b_gl, mask=m_m)
    if CONTRIB:
        m_td = m_t[:, None] & m_d[None, :]
        p_td = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
        b_k = tl.load(k + p_td, mask=m_td, other=0.0)  # [BT, BD]
        b_v = tl.load(v + p_td, mask=m_td, other=0.0)
        b_xk, b_xv = raven_chunk_writes(b_g, b_w, b_gl, m_tm, b_k, b_v)
        p_md = ((i_c * H + i_h) * M + o_m[:, None]) * D + o_d[None, :]
        m_md = m_m[:, None] & m_d[None, :]
        tl.store(xk + p_md, b_xk.to(xk.dtype.element_ty), mask=m_md)
        tl.store(xv + p_md, b_xv.to(xv.dtype.element_ty), mask=m_md)


@triton.jit
def raven_fwd_kernel_h(
    k,
    v,
    g,
    w,
    h0k,
    h0v,
    hk,
    hv,
    htk,
    htv,
    chunk_bos,
    chunk_len,
    seq_chunks,
    H: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    """hk/hv [NC, H, M, D]: the states entering each chunk; htk/htv [N, H, M, D]: the final states."""
    i_m, i_d, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    o_t = tl.arange(0, BT)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_m, m_d = o_m < M, o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    p_md = (i_h * M + o_m[:, None]) * D + o_d[None, :]
    b_sk = tl.zeros([BM, BD], dtype=tl.float32)
    b_sv = tl.zeros([BM, BD], dtype=tl.float32)
    if USE_H0:
        b_sk += tl.load(h0k + i_n * H * M * D + p_md, mask=m_md, other=0.0)
        b_sv += tl.load(h0v + i_n * H * M * D + p_md, mask=m_md, other=0.0)
    c0, c1 = tl.load(seq_chunks + i_n), tl.load(seq_chunks + i_n + 1)
    for i_c in range(c0, c1):
        tl.store(hk + i_c * H * M * D + p_md, b_sk, mask=m_md)
        tl.store(hv + i_c * H * M * D + p_md, b_sv, mask=m_md)
        bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
        m_t = o_t < L
        p_tm = ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :]
        m_tm = m_t[:, None] & m_m[None, :]
        b_g = tl.load(g + p_tm, mask=m_tm, other=0.0)  # [BT, BM]
        b_w = tl.load(w + p_tm, mask=m_tm, other=0.0)
        b_gl = tl.load(g + ((bos + L - 1) * H + i_h) * M + o_m, mask=m_m, other=0.0)  # [BM]
        p_td = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
        m_td = m_t[:, None] & m_d[None, :]
        b_k = tl.load(k + p_td, mask=m_td, other=0.0)  # [BT, BD]
        b_v = tl.load(v + p_td, mask=m_td, other=0.0)
        b_xk, b_xv = raven_chunk_writes(b_g, b_w, b_gl, m_tm, b_k, b_v)
        b_f = tl.exp(b_gl)[:, None]
        b_sk = b_sk * b_f + b_xk
        b_sv = b_sv * b_f + b_xv
    if STORE_HT:
        tl.store(htk + i_n * H * M * D + p_md, b_sk, mask=m_md)
        tl.store(htv + i_n * H * M * D + p_md, b_sv, mask=m_md)


@triton.jit
def raven_bwd_kernel_dh(
    q,
    do,
    ds,
    p,
    g,
    dhtk,
    dhtv,
    dhk,
    dhv,
    dh0k,
    dh0v,
    chunk_bos,
    chunk_len,
    seq_chunks,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
):
    """dhk/dhv [NC, H, M, D]: gradients of the states leaving each chunk; dh0k/dh0v [N, H, M, D]: of the initial
    states. The logits read S^k with weights ds against q, the outputs read S^v with weights p against do."""
    i_m, i_d, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    o_t = tl.arange(0, BT)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_m, m_d = o_m < M, o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    p_md = (i_h * M + o_m[:, None]) * D + o_d[None, :]
    b_dk = tl.zeros([BM, BD], dtype=tl.float32)
    b_dv = tl.zeros([BM, BD], dtype=tl.float32)
    if USE_DHT:
        b_dk += tl.load(dhtk + i_n * H * M * D + p_md, mask=m_md, other=0.0)
        b_dv += tl.load(dhtv + i_n * H * M * D + p_md, mask=m_md, other=0.0)
    c0, c1 = tl.load(seq_chunks + i_n), tl.load(seq_chunks + i_n + 1)
    for i_r in range(c0, c1):
        i_c = c1 - 1 - (i_r - c0)
        tl.store(dhk + i_c * H * M * D + p_md, b_dk, mask=m_md)
        tl.store(dhv + i_c * H * M * D + p_md, b_dv, mask=m_md)
        bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
        m_t = o_t < L
        m_tm = m_t[:, None] & m_m[None, :]
        m_td = m_t[:, None] & m_d[None, :]
        b_g = tl.load(g + ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :], mask=m_tm, other=0.0)
        b_gl = tl.load(g + ((bos + L - 1) * H + i_h) * M + o_m, mask=m_m, other=0.0)
        b_eg = tl.where(m_tm, tl.exp(b_g), 0.0)  # [BT, BM] decay from the chunk start to each token
        b_xk, b_xv = raven_chunk_reads(q, do, ds, p, b_eg, bos, i_h, o_t, o_m, o_d, m_tm, m_td, H, G, M, D)
        b_dk = b_dk * tl.exp(b_gl)[:, None] + b_xk
        b_dv = b_dv * tl.exp(b_gl)[:, None] + b_xv
    if STORE_DH0:
        tl.store(dh0k + i_n * H * M * D + p_md, b_dk, mask=m_md)
        tl.store(dh0v + i_n * H * M * D + p_md, b_dv, mask=m_md)


@triton.jit
def raven_bwd_kernel_dhc(
    q,
    do,
    ds,
    p,
    g,
    xk,
    xv,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    """xk, xv [NC, H, M, D]: what the chunk's reads add to the gradients of the state entering it. The logits read
    S^k with weights ds against q, the outputs read S^v with weights p against do, each decayed by exp(g)."""
    i_cm, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_m = i_cm // tl.cdiv(M, BM), i_cm % tl.cdiv(M, BM)  # a chunk's slot blocks side by side: q, k, v, do in L2
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    o_m = i_m * BM + tl.arange(0, BM)
    m_t, m_m, m_d = o_t < L, o_m < M, o_d < D
    m_tm = m_t[:, None] & m_m[None, :]
    m_td = m_t[:, None] & m_d[None, :]
    b_g = tl.load(g + ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :], mask=m_tm, other=0.0)
    b_eg = tl.where(m_tm, tl.exp(b_g), 0.0)  # [BT, BM] decay from the chunk start to each token
    b_xk, b_xv = raven_chunk_reads(q, do, ds, p, b_eg, bos, i_h, o_t, o_m, o_d, m_tm, m_td, H, G, M, D)
    p_md = ((i_c * H + i_h) * M + o_m[:, None]) * D + o_d[None, :]
    m_md = m_m[:, None] & m_d[None, :]
    tl.store(xk + p_md, b_xk.to(xk.dtype.element_ty), mask=m_md)
    tl.store(xv + p_md, b_xv.to(xv.dtype.element_ty), mask=m_md)
