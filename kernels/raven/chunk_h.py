"""The states at chunk boundaries: the forward scan (S^k, S^v entering every chunk) and the backward scan (their
gradients leaving every chunk), plus the gate kernel that builds each chunk's per-slot gates from the router."""

import triton
import triton.language as tl


@triton.jit
def raven_fwd_kernel_gate(
    a,
    idx,
    r,
    g,
    w,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """g [T, H, M]: cumulative log-retention within the chunk; w [T, H, M]: 1 - exp(log_f), exact for tiny writes.
    log_f is scattered into g (zeros, then a_t r_t[j] at slot idx_t[j]), then read back a block of slots at a time."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    p_t = ((bos + o_t) * H + i_h) * M  # [BT] row starts in g and w
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        mask = m_t[:, None] & (o_m < M)[None, :]
        tl.store(g + p_t[:, None] + o_m[None, :], tl.zeros([BT, BM], dtype=tl.float32), mask=mask)
    tl.debug_barrier()
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_tk = ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    b_i = tl.load(idx + p_tk, mask=m_tk, other=0)
    b_a = tl.load(a + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_lfk = b_a[:, None] * tl.load(r + p_tk, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK]
    tl.store(g + p_t[:, None] + b_i, b_lfk, mask=m_tk)
    tl.debug_barrier()
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        mask = m_t[:, None] & (o_m < M)[None, :]
        b_lf = tl.load(g + p_t[:, None] + o_m[None, :], mask=mask, other=0.0)  # [BT, BM]
        series = -b_lf * (1.0 + b_lf * (0.5 + b_lf * (1.0 / 6.0 + b_lf * (1.0 / 24.0 + b_lf / 120.0))))
        tl.store(w + p_t[:, None] + o_m[None, :], tl.where(b_lf > -0.1, series, 1.0 - tl.exp(b_lf)), mask=mask)
        tl.store(g + p_t[:, None] + o_m[None, :], tl.cumsum(b_lf, axis=0), mask=mask)


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
        b_dec = tl.where(m_tm, b_w * tl.exp(b_gl[None, :] - b_g), 0.0)  # weight of each write at the chunk end
        p_td = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
        m_td = m_t[:, None] & m_d[None, :]
        b_k = tl.load(k + p_td, mask=m_td, other=0.0)  # [BT, BD]
        b_v = tl.load(v + p_td, mask=m_td, other=0.0)
        b_f = tl.exp(b_gl)[:, None]
        b_sk = b_sk * b_f + tl.dot(tl.trans(b_dec.to(b_k.dtype)), b_k)
        b_sv = b_sv * b_f + tl.dot(tl.trans(b_dec.to(b_v.dtype)), b_v)
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
        b_eg = tl.exp(b_g)  # [BT, BM] decay from the chunk start to each token
        b_dk *= tl.exp(b_gl)[:, None]
        b_dv *= tl.exp(b_gl)[:, None]
        for i_g in range(G):
            i_hg = i_h * G + i_g
            p_tm = ((bos + o_t[:, None]) * H * G + i_hg) * M + o_m[None, :]
            p_td = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
            b_ds = tl.load(ds + p_tm, mask=m_tm, other=0.0)
            b_p = tl.load(p + p_tm, mask=m_tm, other=0.0)
            b_q = tl.load(q + p_td, mask=m_td, other=0.0)  # [BT, BD]
            b_do = tl.load(do + p_td, mask=m_td, other=0.0)
            b_dk += tl.dot(tl.trans((b_ds * b_eg).to(b_q.dtype)), b_q)
            b_dv += tl.dot(tl.trans((b_p * b_eg).to(b_do.dtype)), b_do)
    if STORE_DH0:
        tl.store(dh0k + i_n * H * M * D + p_md, b_dk, mask=m_md)
        tl.store(dh0v + i_n * H * M * D + p_md, b_dv, mask=m_md)
