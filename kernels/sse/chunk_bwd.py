"""Backward kernels of chunk_gla (kernels/sse/chunk.py has the algorithm): the gradients of the states leaving
every chunk, do v^T per chunk, dq and dk of every sub-chunk, dv of every chunk, and the gate gradient's in-chunk
reverse sums."""

import triton
import triton.language as tl

from .chunk_fwd import sse_chunk, sse_gate_tile, sse_qrow, sse_row, sse_seq, sse_src, sse_state_block


@triton.jit
def sse_bwd_kernel_dh(
    q,
    do,
    gc,
    dht,
    dhs,
    dh0,
    src,
    cu,
    chunk_off,
    scale,
    H,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    USE_DHT: tl.constexpr,
    USE_H0: tl.constexpr,
    GATHER: tl.constexpr,
):
    i_sh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    seq_bos, eos, c0, n_chunks = sse_seq(cu, chunk_off, i_s)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k, o_v, m_k, m_v, offs_kv, m_kv = sse_state_block(i_k, i_v, K, V, BK, BV)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_sh.to(tl.int64) * K * V + offs_kv, mask=m_kv, other=0.0)
    for ii in range(n_chunks):
        i = n_chunks - 1 - ii
        bos = seq_bos + i * BT
        last = tl.minimum(eos - bos, BT) - 1
        tl.store(dhs + ((c0 + i) * H + i_h) * K * V + offs_kv, b_dh.to(dhs.dtype.element_ty), mask=m_kv)
        m_t = o_t < eos - bos
        b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
        b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_dh *= tl.exp(b_bl)[:, None]
        r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
        for i_g in range(G):
            b_q = tl.load(
                q + sse_qrow(r_t, i_g, G, M)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
            ).to(tl.float32)  # [BT, BK]
            b_do = tl.load(
                do + ((r_t // M) * G + i_g)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
            ).to(DT)  # [BT, BV]
            b_dh += tl.dot(tl.trans((b_q * tl.exp(b_b) * scale).to(DT)), b_do)
    if USE_H0:
        tl.store(dh0 + i_sh.to(tl.int64) * K * V + offs_kv, b_dh, mask=m_kv)


@triton.jit
def sse_bwd_kernel_dA(
    v,
    do,
    dA,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    scale,
    H,
    G: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    GATHER: tl.constexpr,
):
    """One chunk and query head: dA [Nc, H G, BT, BT] float32, dA[t, s] = scale do_t v_s, unmasked."""
    i_c, i_hg = tl.program_id(0), tl.program_id(1)
    i_h, i_g = i_hg // G, i_hg % G
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout)
        return
    o_t, o_v = tl.arange(0, BT), tl.arange(0, BV)
    m_tv = (o_t < n)[:, None] & (o_v < V)[None, :]
    r_v = sse_src(src, bos + tl.minimum(o_t, n - 1), H, i_h, GATHER) // M  # [BT] rows of v
    b_do = tl.load(do + (r_v * G + i_g)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_v = tl.load(v + r_v[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(b_do.dtype)
    p_dA = dA + (i_c.to(tl.int64) * H * G + i_hg) * BT * BT + o_t[:, None] * BT + o_t[None, :]
    tl.store(p_dA, tl.dot(b_do, tl.trans(b_v)) * scale)


@triton.jit
def sse_bwd_kernel_dqk(
    q,
    k,
    v,
    gc,
    hs,
    do,
    dhs,
    A,
    dA,
    dq,
    dk,
    db,
    run,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    scale,
    H,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    GATHER: tl.constexpr,
):
    """One sub-chunk i of a chunk, state head and block of BK key channels (dq and dk are separable in K): dq, dk
    of its rows, and for the gate gradient (finished by sse_bwd_kernel_dg) db = sum_g q dq - k dk of its rows
    [L, H, K] and its share of the chunk-wide term, run [Nc, H, BT // BC, K]."""
    i_c, i_h, i_ik = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, i_k = i_ik // tl.cdiv(K, BK), i_ik % tl.cdiv(K, BK)
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout)
        return
    last = tl.minimum(n, BT) - 1
    DT = q.dtype.element_ty
    o_t, o_r, o_k, o_v = tl.arange(0, BT), tl.arange(0, BC), i_k * BK + tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_run = run + ((i_c.to(tl.int64) * H + i_h) * (BT // BC) + i) * K + o_k
    if i * BC >= n:  # a sub-chunk past a short chunk's last row: no rows to write, no share of the gate term
        tl.store(p_run, tl.zeros([BK], dtype=tl.float32), mask=m_k)
        return
    m_t = o_t < n
    rows = i * BC + o_r
    m_r = rows < n
    m_rk = m_r[:, None] & m_k[None, :]
    m_rv = m_r[:, None] & m_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    offs_kv = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT] input rows of the chunk
    r_r = sse_src(src, bos + tl.minimum(rows, last), H, i_h, GATHER)  # [BC] and of this sub-chunk
    offs_rk = r_r[:, None] * K + o_k[None, :]
    b_dh = tl.load(dhs + offs_kv, mask=m_kv, other=0.0).to(DT)  # [BK, BV] grad of the state leaving the chunk
    b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
    b_ki = tl.load(k + offs_rk, mask=m_rk, other=0.0).to(tl.float32)  # [BC, BK]
    b_bi = tl.load(
        gc + ((bos + tl.minimum(rows, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
    )  # [BC, BK]
    b_vi = tl.load(v + (r_r // M)[:, None] * V + o_v[None, :], mask=m_rv, other=0.0).to(DT)  # [BC, BV]
    b_ei = tl.exp(b_bl[None, :] - b_bi)
    b_dk = tl.dot(b_vi, tl.trans(b_dh)) * b_ei  # [BC, BK] from the state leaving the chunk
    # The gate's chunk-wide term: sum over the chunk of k dk_state, and once per chunk rowsum(dS ⊙ S).
    b_run = tl.sum(b_ki * b_dk, axis=0)  # [BK]
    if i == 0:
        b_h = tl.load(hs + offs_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_run += tl.exp(b_bl) * tl.sum(b_dh.to(tl.float32) * b_h, axis=1)
    tl.store(p_run, b_run, mask=m_k)
    b_qdq = tl.zeros([BC, BK], dtype=tl.float32)
    b_ref_k = tl.load(gc + ((bos + tl.minimum(i * BC + BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    for i_g in range(G):
        i_hg = i_h * G + i_g
        p_dAg = dA + (i_c.to(tl.int64) * H * G + i_hg) * BT * BT  # [BT, BT] do v^T (sse_bwd_kernel_dA)
        offs_rqk = sse_qrow(r_r, i_g, G, M)[:, None] * K + o_k[None, :]
        b_qi = tl.load(q + offs_rqk, mask=m_rk, other=0.0).to(tl.float32)  # [BC, BK]
        b_doi = tl.load(do + ((r_r // M) * G + i_g)[:, None] * V + o_v[None, :], mask=m_rv, other=0.0).to(DT)
        # dq of the rows of this sub-chunk: from the entering state, then from earlier tokens
        b_hT = tl.trans(tl.load(hs + offs_kv, mask=m_kv, other=0.0).to(DT))  # [BV, BK]
        b_dq = tl.dot(b_doi, b_hT) * tl.exp(b_bi) * scale  # [BC, BK]
        if i > 0:  # earlier sub-chunks, split at the row before this one
            b_dA = tl.load(p_dAg + rows[:, None] * BT + o_t[None, :])  # [BC, BT] dA[t, s], t in this sub-chunk
            b_ref = tl.load(gc + ((bos + tl.minimum(i * BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
            b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
            b_kg = b_k * tl.exp(tl.where((o_t < i * BC)[:, None], b_ref[None, :] - b_b, float("-inf")))
            b_dq += tl.dot(b_dA.to(DT), b_kg.to(DT)) * tl.exp(b_bi - b_ref[None, :])
        b_kj, b_bj = sse_row(k, src, gc, bos, i * BC, n, last, H, i_h, i_g, K, o_k, G, M, False, GATHER)
        b_a = tl.load(p_dAg + rows * BT + i * BC)  # [BC] dA[t, col]
        for j in range(BC):
            col = i * BC + j
            b_kn, b_bn = sse_row(k, src, gc, bos, col + 1, n, last, H, i_h, i_g, K, o_k, G, M, False, GATHER)
            b_an = tl.load(p_dAg + rows * BT + col + 1, mask=(o_r * 0 + j) < BC - 1, other=0.0)
            b_e = tl.exp(tl.where((o_r >= j)[:, None], b_bi - b_bj[None, :], float("-inf")))
            b_dq += b_a[:, None] * b_kj[None, :] * b_e
            b_kj, b_bj, b_a = b_kn, b_bn, b_an
        tl.store(dq + offs_rqk, b_dq.to(dq.dtype.element_ty), mask=m_rk)
        b_qdq += b_qi * b_dq
        # dk of the columns of this sub-chunk: from later tokens t of the chunk
        if i < BT // BC - 1:  # later sub-chunks, split at the last row of this one
            b_dAT = tl.load(p_dAg + o_t[None, :] * BT + rows[:, None])  # [BC, BT] dA[t, s], s in this sub-chunk
            b_qf = tl.load(
                q + sse_qrow(r_t, i_g, G, M)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
            )  # [BT, BK]
            b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
            b_qg = b_qf * tl.exp(tl.where((o_t >= i * BC + BC)[:, None], b_b - b_ref_k[None, :], float("-inf")))
            b_dk += tl.dot(b_dAT.to(DT), b_qg.to(DT)) * tl.exp(b_ref_k[None, :] - b_bi)
        b_qj, b_bj = sse_row(q, src, gc, bos, i * BC, n, last, H, i_h, i_g, K, o_k, G, M, True, GATHER)
        b_a = tl.load(p_dAg + i * BC * BT + rows)  # [BC] dA[row, s]
        for j in range(BC):
            row = i * BC + j
            b_qn, b_bn = sse_row(q, src, gc, bos, row + 1, n, last, H, i_h, i_g, K, o_k, G, M, True, GATHER)
            b_an = tl.load(p_dAg + (row + 1) * BT + rows, mask=(o_r * 0 + j) < BC - 1, other=0.0)
            b_qe = b_qj[None, :] * tl.exp(tl.where((o_r <= j)[:, None], b_bj[None, :] - b_bi, float("-inf")))
            b_dk += b_a[:, None] * b_qe
            b_qj, b_bj, b_a = b_qn, b_bn, b_an
    tl.store(dk + offs_rk, b_dk.to(dk.dtype.element_ty), mask=m_rk)
    p_db = db + ((bos + rows)[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(p_db, b_qdq - b_ki * b_dk, mask=m_rk)


@triton.jit
def sse_bwd_kernel_dv(
    k,
    gc,
    do,
    dhs,
    A,
    dv,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    scale,
    H,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    GATHER: tl.constexpr,
):
    """One chunk, state head and block of BV value channels: dv_s = sum_g sum_{t >= s} A[t, s] do_t (scale) plus
    the state-gradient term (k_s decayed to the chunk's end) dS; per input row of k (the host sums it over M)."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout)
        return
    last = tl.minimum(n, BT) - 1
    DT = k.dtype.element_ty
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_t, m_k, m_v = o_t < n, o_k < K, o_v < V
    r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
    b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
    b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
    b_dh = tl.load(
        dhs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    ).to(DT)  # [BK, BV]
    b_dv = tl.dot((b_k * tl.exp(b_bl[None, :] - b_b)).to(DT), b_dh)  # [BT, BV]
    for i_g in range(G):
        i_hg = i_h * G + i_g
        b_AT = tl.load(
            A + ((bos + o_t)[None, :] * (H * G) + i_hg) * BT + o_t[:, None], mask=m_t[None, :], other=0.0
        )  # [BT, BT] A[t, s] at [s, t], as the forward stored it
        b_do = tl.load(
            do + ((r_t // M) * G + i_g)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
        ).to(DT)  # [BT, BV]
        b_dv += tl.dot(b_AT, b_do) * scale
    tl.store(dv + r_t[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def sse_bwd_kernel_dg(
    db,
    run,
    dg,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    H,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    GATHER: tl.constexpr,
):
    """One chunk and state head: dg_t = sum_{s >= t in the chunk} db_s + the chunk-wide term (its sub-chunks'
    shares in run summed)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout)
        return
    o_t, o_i, o_k = tl.arange(0, BT), tl.arange(0, BT // BC), tl.arange(0, BK)
    m_tk = (o_t < n)[:, None] & (o_k < K)[None, :]
    offs = ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :]
    b_db = tl.load(db + offs, mask=m_tk, other=0.0)  # [BT, BK]
    p_run = run + ((i_c.to(tl.int64) * H + i_h) * (BT // BC) + o_i[:, None]) * K + o_k[None, :]
    b_run = tl.sum(tl.load(p_run, mask=(o_k < K)[None, :], other=0.0), axis=0)  # [BK]
    b_dg = tl.sum(b_db, axis=0)[None, :] - tl.cumsum(b_db, axis=0) + b_db + b_run[None, :]
    r_t = sse_src(src, bos + tl.minimum(o_t, n - 1), H, i_h, GATHER)  # [BT]
    tl.store(dg + r_t[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty), mask=m_tk)
