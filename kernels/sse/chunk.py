"""Chunked gated linear attention with a per-key-channel gate, variable-length segments and GQA (Triton).

    S_t = diag(exp(log_g_t)) S_{t-1} + k_t^T v_t,    o_t = scale q_t S_t

Every sequence (a batch row, or a segment of `cu_seqlens`) is cut into chunks of BT = 64 tokens that never cross
a sequence boundary; the chunk list is built on the device (one host sync reads its length). Forward: the
chunk-local cumulative gate b (`sse_fwd_kernel_cumsum`), the state entering every chunk by a scan over each
sequence's chunks (`sse_fwd_kernel_h`), then all chunks in parallel (`sse_fwd_kernel_o`). Backward: a reverse scan
for the gradient of the state leaving every chunk (`sse_bwd_kernel_dh`), do v^T per chunk (`sse_bwd_kernel_dA`),
then all sub-chunks in parallel (`sse_bwd_kernel_dqkvg`), and the gate gradient's reverse sums within each chunk
(`sse_bwd_kernel_dg`). The output and gradient kernels run one program per sub-chunk: their 16-step loops over a
sub-chunk's rows are serial, so more programs share them. Empty sequences run no chunk: their state passes
through, and so does its gradient.

Inside a chunk token t reads token s <= t through exp(b_t - b_s). Sub-chunks of BC = 16 rows split this: across
sub-chunks the factor is split at the boundary between them, exp(b_t - b_ref) exp(b_ref - b_s), two non-positive
exponents, so a matrix product applies; inside a sub-chunk it is formed element by element. Rows past the end of a
sequence read b at its last token, so no exponent anywhere is positive and strong decay cannot overflow.

The gate's gradient uses d b_t = q_t dq_t - k_t dk_t (summed over query heads), reverse-summed within the chunk,
plus rowsum(dS ⊙ S) of the state leaving the chunk, obtained as exp(b_last) rowsum(dS ⊙ S_enter) + sum_s k_s dk_s
over the chunk-to-state part of dk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raven_layers.sse import sse_masking, sse_varlen

BT = 64  # chunk length
BC = 16  # sub-chunk length
POISON = False  # tests set it: outputs start as NaN
WARPS = {"h": 4, "o": 4, "dh": 4, "dqkvg": 4}  # fixed launch configs (kernels/sse/NOTES.md)
LOW_PRECISION_STATES = True  # bf16/fp16 inputs: per-chunk states (and their grads) stored in that dtype, half the bytes


@triton.jit
def sse_fwd_kernel_cumsum(g, gc, cu, chunk_seq, chunk_pos, H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    n = tl.load(cu + i_s + 1).to(tl.int64) - bos
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    mask = (o_t < n)[:, None] & (o_k < K)[None, :]
    offs = ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :]
    b_g = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)  # [BT, BK]
    tl.store(gc + offs, tl.cumsum(b_g, axis=0), mask=mask)


@triton.jit
def sse_row(x, gc, bos, t, n, last, HX, i_hx, K: tl.constexpr, o_k, G: tl.constexpr = 1):
    """Row t of a chunk: x [BK] float32 (x has HX heads; zeros past the sequence's end) and the cumulative gate
    [BK] of its state head i_hx // G (read at the last token past the end)."""
    b_x = tl.load(x + ((bos + t) * HX + i_hx) * K + o_k, mask=o_k < tl.where(t < n, K, 0), other=0.0)
    b_g = tl.load(gc + ((bos + tl.minimum(t, last)) * (HX // G) + i_hx // G) * K + o_k, mask=o_k < K, other=0.0)
    return b_x.to(tl.float32), b_g


@triton.jit
def sse_fwd_kernel_h(
    k,
    v,
    gc,
    h0,
    hs,
    ht,
    cu,
    chunk_off,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
):
    i_sh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    seq_bos = tl.load(cu + i_s).to(tl.int64)
    eos = tl.load(cu + i_s + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_s).to(tl.int64)
    n_chunks = tl.load(chunk_off + i_s + 1).to(tl.int64) - c0
    o_t = tl.arange(0, BT)
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    offs_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one [K, V] state
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_sh.to(tl.int64) * K * V + offs_kv, mask=m_kv, other=0.0)
    for i in range(n_chunks):
        bos = seq_bos + i * BT
        last = tl.minimum(eos - bos, BT) - 1
        tl.store(hs + ((c0 + i) * H + i_h) * K * V + offs_kv, b_h.to(hs.dtype.element_ty), mask=m_kv)
        m_t = o_t < eos - bos
        b_k = tl.load(
            k + ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
        ).to(tl.float32)  # [BT, BK]
        b_b = tl.load(
            gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
        )  # [BT, BK]
        b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
        b_v = tl.load(
            v + ((bos + o_t)[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
        )  # [BT, BV]
        b_kg = (b_k * tl.exp(b_bl[None, :] - b_b)).to(k.dtype.element_ty)
        b_h = b_h * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_kg), b_v.to(k.dtype.element_ty))
    tl.store(ht + i_sh.to(tl.int64) * K * V + offs_kv, b_h, mask=m_kv)


@triton.jit
def sse_fwd_kernel_o(
    q,
    k,
    v,
    gc,
    hs,
    o,
    A,
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
    STORE_A: tl.constexpr,
):
    """One sub-chunk i of a chunk, and query head: o of its rows, and with STORE_A their in-chunk scores
    A [L, H G, BT] (row t: A[t, s] over the chunk's columns s, zero for s > t) in q's dtype, which the backward's
    dv takes as they are."""
    i_c, i_hg, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hg // G
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    n = tl.load(cu + i_s + 1).to(tl.int64) - bos
    last = tl.minimum(n, BT) - 1
    DT = q.dtype.element_ty
    o_t, o_r, o_k, o_v = tl.arange(0, BT), tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_t = o_t < n
    b_v = tl.load(
        v + ((bos + o_t)[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
    ).to(DT)  # [BT, BV]
    b_h = tl.load(
        hs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    ).to(DT)  # [BK, BV]
    rows = i * BC + o_r
    m_r = rows < n
    b_q = tl.load(
        q + ((bos + rows)[:, None] * (H * G) + i_hg) * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0
    ).to(tl.float32)  # [BC, BK]
    b_bi = tl.load(
        gc + ((bos + tl.minimum(rows, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
    )  # [BC, BK]
    b_o = tl.dot((b_q * tl.exp(b_bi)).to(DT), b_h)  # [BC, BV]
    b_A = tl.zeros([BC, BT], dtype=tl.float32)  # A[t, s] for the rows t of this sub-chunk
    if i > 0:  # earlier sub-chunks, split at the row before this one
        b_ref = tl.load(gc + ((bos + tl.minimum(i * BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_k = tl.load(
            k + ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
        ).to(tl.float32)  # [BT, BK]
        b_b = tl.load(
            gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
        )  # [BT, BK]
        b_kg = b_k * tl.exp(tl.where((o_t < i * BC)[:, None], b_ref[None, :] - b_b, float("-inf")))
        b_A += tl.dot((b_q * tl.exp(b_bi - b_ref[None, :])).to(DT), tl.trans(b_kg.to(DT)))
    b_kj, b_bj = sse_row(k, gc, bos, i * BC, n, last, H, i_h, K, o_k)
    for j in range(BC):
        col = i * BC + j
        b_kn, b_bn = sse_row(k, gc, bos, col + 1, n, last, H, i_h, K, o_k)  # in flight during this step
        b_e = tl.exp(tl.where((o_r >= j)[:, None], b_bi - b_bj[None, :], float("-inf")))  # [BC, BK]
        b_a = tl.sum(b_q * b_kj[None, :] * b_e, axis=1)  # [BC]
        b_A = tl.where((o_t == col)[None, :], b_a[:, None], b_A)
        b_kj, b_bj = b_kn, b_bn
    b_o += tl.dot(b_A.to(DT), b_v)
    if STORE_A:
        p_A = A + ((bos + rows)[:, None] * (H * G) + i_hg) * BT + o_t[None, :]
        tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_r[:, None])
    tl.store(
        o + ((bos + rows)[:, None] * (H * G) + i_hg) * V + o_v[None, :],
        (b_o * scale).to(o.dtype.element_ty),
        mask=m_r[:, None] & m_v[None, :],
    )


@triton.jit
def sse_bwd_kernel_dh(
    q,
    do,
    gc,
    dht,
    dhs,
    dh0,
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
    USE_DHT: tl.constexpr,
    USE_H0: tl.constexpr,
):
    i_sh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    seq_bos = tl.load(cu + i_s).to(tl.int64)
    eos = tl.load(cu + i_s + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_s).to(tl.int64)
    n_chunks = tl.load(chunk_off + i_s + 1).to(tl.int64) - c0
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    offs_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_sh.to(tl.int64) * K * V + offs_kv, mask=m_kv, other=0.0)
    for ii in range(n_chunks):
        i = n_chunks - 1 - ii
        bos = seq_bos + i * BT
        last = tl.minimum(eos - bos, BT) - 1
        tl.store(dhs + ((c0 + i) * H + i_h) * K * V + offs_kv, b_dh.to(dhs.dtype.element_ty), mask=m_kv)
        m_t = o_t < eos - bos
        b_b = tl.load(
            gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
        )  # [BT, BK]
        b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_dh *= tl.exp(b_bl)[:, None]
        for i_g in range(G):
            i_hg = i_h * G + i_g
            b_q = tl.load(
                q + ((bos + o_t)[:, None] * (H * G) + i_hg) * K + o_k[None, :],
                mask=m_t[:, None] & m_k[None, :],
                other=0.0,
            ).to(tl.float32)  # [BT, BK]
            b_do = tl.load(
                do + ((bos + o_t)[:, None] * (H * G) + i_hg) * V + o_v[None, :],
                mask=m_t[:, None] & m_v[None, :],
                other=0.0,
            ).to(DT)  # [BT, BV]
            b_dh += tl.dot(tl.trans((b_q * tl.exp(b_b) * scale).to(DT)), b_do)
    if USE_H0:
        tl.store(dh0 + i_sh.to(tl.int64) * K * V + offs_kv, b_dh, mask=m_kv)


@triton.jit
def sse_bwd_kernel_dA(
    v, do, dA, cu, chunk_seq, chunk_pos, scale, H, G: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr
):
    """One chunk and query head: dA [Nc, H G, BT, BT] float32, dA[t, s] = scale do_t v_s, unmasked."""
    i_c, i_hg = tl.program_id(0), tl.program_id(1)
    i_h = i_hg // G
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    n = tl.load(cu + i_s + 1).to(tl.int64) - bos
    o_t, o_v = tl.arange(0, BT), tl.arange(0, BV)
    m_tv = (o_t < n)[:, None] & (o_v < V)[None, :]
    b_do = tl.load(do + ((bos + o_t)[:, None] * (H * G) + i_hg) * V + o_v[None, :], mask=m_tv, other=0.0)
    b_v = tl.load(v + ((bos + o_t)[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(b_do.dtype)
    p_dA = dA + (i_c.to(tl.int64) * H * G + i_hg) * BT * BT + o_t[:, None] * BT + o_t[None, :]
    tl.store(p_dA, tl.dot(b_do, tl.trans(b_v)) * scale)


@triton.jit
def sse_bwd_kernel_dqkvg(
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
    dv,
    db,
    run,
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
):
    """One sub-chunk i of a chunk, and state head: dq, dk, dv of its rows, and for the gate gradient (finished by
    sse_bwd_kernel_dg) db = sum_g q dq - k dk of its rows [L, H, K] and its share of the chunk-wide term,
    run [Nc, H, BT // BC, K]."""
    i_c, i_h, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    n = tl.load(cu + i_s + 1).to(tl.int64) - bos
    last = tl.minimum(n, BT) - 1
    DT = q.dtype.element_ty
    o_t, o_r, o_k, o_v = tl.arange(0, BT), tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_t = o_t < n
    rows = i * BC + o_r
    m_r = rows < n
    m_rk = m_r[:, None] & m_k[None, :]
    m_rv = m_r[:, None] & m_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    offs_kv = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    offs_rk = ((bos + rows)[:, None] * H + i_h) * K + o_k[None, :]
    offs_rv = ((bos + rows)[:, None] * H + i_h) * V + o_v[None, :]
    b_dh = tl.load(dhs + offs_kv, mask=m_kv, other=0.0).to(DT)  # [BK, BV] grad of the state leaving the chunk
    b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
    b_ki = tl.load(k + offs_rk, mask=m_rk, other=0.0).to(tl.float32)  # [BC, BK]
    b_bi = tl.load(
        gc + ((bos + tl.minimum(rows, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
    )  # [BC, BK]
    b_vi = tl.load(v + offs_rv, mask=m_rv, other=0.0).to(DT)  # [BC, BV]
    b_ei = tl.exp(b_bl[None, :] - b_bi)
    b_dk = tl.dot(b_vi, tl.trans(b_dh)) * b_ei  # [BC, BK] from the state leaving the chunk
    # The gate's chunk-wide term: sum over the chunk of k dk_state, and once per chunk rowsum(dS ⊙ S).
    b_run = tl.sum(b_ki * b_dk, axis=0)  # [BK]
    if i == 0:
        b_h = tl.load(hs + offs_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_run += tl.exp(b_bl) * tl.sum(b_dh.to(tl.float32) * b_h, axis=1)
    tl.store(run + ((i_c.to(tl.int64) * H + i_h) * (BT // BC) + i) * K + o_k, b_run, mask=m_k)
    b_dv = tl.dot((b_ki * b_ei).to(DT), b_dh)  # [BC, BV]
    b_qdq = tl.zeros([BC, BK], dtype=tl.float32)
    b_ref_k = tl.load(gc + ((bos + tl.minimum(i * BC + BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    for i_g in range(G):
        i_hg = i_h * G + i_g
        p_dAg = dA + (i_c.to(tl.int64) * H * G + i_hg) * BT * BT  # [BT, BT] do v^T (sse_bwd_kernel_dA)
        offs_rqk = ((bos + rows)[:, None] * (H * G) + i_hg) * K + o_k[None, :]
        b_qi = tl.load(q + offs_rqk, mask=m_rk, other=0.0).to(tl.float32)  # [BC, BK]
        b_doi = tl.load(do + ((bos + rows)[:, None] * (H * G) + i_hg) * V + o_v[None, :], mask=m_rv, other=0.0).to(
            DT
        )  # [BC, BV]
        # dq of the rows of this sub-chunk: from the entering state, then from earlier tokens
        b_hT = tl.trans(tl.load(hs + offs_kv, mask=m_kv, other=0.0).to(DT))  # [BV, BK]
        b_dq = tl.dot(b_doi, b_hT) * tl.exp(b_bi) * scale  # [BC, BK]
        if i > 0:  # earlier sub-chunks, split at the row before this one
            b_dA = tl.load(p_dAg + rows[:, None] * BT + o_t[None, :])  # [BC, BT] dA[t, s], t in this sub-chunk
            b_ref = tl.load(gc + ((bos + tl.minimum(i * BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
            b_k = tl.load(
                k + ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
            )  # [BT, BK]
            b_b = tl.load(
                gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
            )  # [BT, BK]
            b_kg = b_k * tl.exp(tl.where((o_t < i * BC)[:, None], b_ref[None, :] - b_b, float("-inf")))
            b_dq += tl.dot(b_dA.to(DT), b_kg.to(DT)) * tl.exp(b_bi - b_ref[None, :])
        b_kj, b_bj = sse_row(k, gc, bos, i * BC, n, last, H, i_h, K, o_k)
        b_a = tl.load(p_dAg + rows * BT + i * BC)  # [BC] dA[t, col]
        for j in range(BC):
            col = i * BC + j
            b_kn, b_bn = sse_row(k, gc, bos, col + 1, n, last, H, i_h, K, o_k)  # in flight during this step
            b_an = tl.load(p_dAg + rows * BT + col + 1, mask=(o_r * 0 + j) < BC - 1, other=0.0)
            b_e = tl.exp(tl.where((o_r >= j)[:, None], b_bi - b_bj[None, :], float("-inf")))
            b_dq += b_a[:, None] * b_kj[None, :] * b_e
            b_kj, b_bj, b_a = b_kn, b_bn, b_an
        tl.store(dq + offs_rqk, b_dq.to(dq.dtype.element_ty), mask=m_rk)
        b_qdq += b_qi * b_dq
        # dk, dv of the columns of this sub-chunk: from later tokens t of the chunk
        b_dof = tl.load(
            do + ((bos + o_t)[:, None] * (H * G) + i_hg) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
        ).to(DT)  # [BT, BV]
        if i < BT // BC - 1:  # later sub-chunks, split at the last row of this one
            b_dAT = tl.load(p_dAg + o_t[None, :] * BT + rows[:, None])  # [BC, BT] dA[t, s], s in this sub-chunk
            b_qf = tl.load(
                q + ((bos + o_t)[:, None] * (H * G) + i_hg) * K + o_k[None, :],
                mask=m_t[:, None] & m_k[None, :],
                other=0.0,
            )  # [BT, BK]
            b_b = tl.load(
                gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
            )  # [BT, BK]
            b_qg = b_qf * tl.exp(tl.where((o_t >= i * BC + BC)[:, None], b_b - b_ref_k[None, :], float("-inf")))
            b_dk += tl.dot(b_dAT.to(DT), b_qg.to(DT)) * tl.exp(b_ref_k[None, :] - b_bi)
        b_qj, b_bj = sse_row(q, gc, bos, i * BC, n, last, H * G, i_hg, K, o_k, G)
        b_a = tl.load(p_dAg + i * BC * BT + rows)  # [BC] dA[row, s]
        for j in range(BC):
            row = i * BC + j
            b_qn, b_bn = sse_row(q, gc, bos, row + 1, n, last, H * G, i_hg, K, o_k, G)  # in flight meanwhile
            b_an = tl.load(p_dAg + (row + 1) * BT + rows, mask=(o_r * 0 + j) < BC - 1, other=0.0)
            b_qe = b_qj[None, :] * tl.exp(tl.where((o_r <= j)[:, None], b_bj[None, :] - b_bi, float("-inf")))
            b_dk += b_a[:, None] * b_qe
            b_qj, b_bj, b_a = b_qn, b_bn, b_an
        b_AT = tl.load(
            A + ((bos + o_t)[None, :] * (H * G) + i_hg) * BT + rows[:, None], mask=m_t[None, :], other=0.0
        )  # [BC, BT] A[t, s], s in this sub-chunk, as the forward stored it
        b_dv += tl.dot(b_AT, b_dof) * scale
    tl.store(dk + offs_rk, b_dk.to(dk.dtype.element_ty), mask=m_rk)
    tl.store(dv + offs_rv, b_dv.to(dv.dtype.element_ty), mask=m_rv)
    tl.store(db + offs_rk, b_qdq - b_ki * b_dk, mask=m_rk)


@triton.jit
def sse_bwd_kernel_dg(
    db, run, dg, cu, chunk_seq, chunk_pos, H, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr
):
    """One chunk and state head: dg_t = sum_{s >= t in the chunk} db_s + the chunk-wide term (its sub-chunks'
    shares in run summed)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    n = tl.load(cu + i_s + 1).to(tl.int64) - bos
    o_t, o_i, o_k = tl.arange(0, BT), tl.arange(0, BT // BC), tl.arange(0, BK)
    m_tk = (o_t < n)[:, None] & (o_k < K)[None, :]
    offs = ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :]
    b_db = tl.load(db + offs, mask=m_tk, other=0.0)  # [BT, BK]
    p_run = run + ((i_c.to(tl.int64) * H + i_h) * (BT // BC) + o_i[:, None]) * K + o_k[None, :]
    b_run = tl.sum(tl.load(p_run, mask=(o_k < K)[None, :], other=0.0), axis=0)  # [BK]
    b_dg = tl.sum(b_db, axis=0)[None, :] - tl.cumsum(b_db, axis=0) + b_db + b_run[None, :]
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _chunk_layout(B: int, T: int, cu_seqlens, device):
    """cu [S+1] int32, chunk_seq / chunk_pos [Nc] (sequence and index in it of each chunk), chunk_off [S+1], Nc."""
    if cu_seqlens is None:  # each batch row is one sequence of the packed [B * T] stream
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        n_chunks = torch.full((B,), triton.cdiv(T, BT), device=device, dtype=torch.int32)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        n_chunks = (cu.diff() + BT - 1) // BT
    chunk_off = torch.nn.functional.pad(n_chunks.cumsum(0, dtype=torch.int32), (1, 0))
    total = B * triton.cdiv(T, BT) if cu_seqlens is None else int(chunk_off[-1])  # the one host sync
    seqs = torch.arange(cu.numel() - 1, device=device, dtype=torch.int32)
    chunk_seq = torch.repeat_interleave(seqs, n_chunks.long(), output_size=total)
    chunk_pos = torch.arange(total, device=device, dtype=torch.int32) - chunk_off[chunk_seq.long()]
    return cu, chunk_seq, chunk_pos, chunk_off, total


def _state_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the per-chunk states kept between kernels; the scans themselves accumulate in float32."""
    return q.dtype if LOW_PRECISION_STATES and q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _new(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer; NaN-filled when POISON is set (tests), so an element a kernel fails to write shows."""
    out = torch.empty(shape, device=like.device, dtype=dtype)
    return out.fill_(float("nan")) if POISON else out


class ChunkGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_g, scale, initial_state, cu_seqlens):
        B, T, H, G, K = q.shape
        V, L, dev = v.shape[-1], B * T, q.device
        BK, BV = _block(K), _block(V)
        q, k, v, log_g = (x.reshape(L, *x.shape[2:]).contiguous() for x in (q, k, v, log_g))
        cu, chunk_seq, chunk_pos, chunk_off, Nc = _chunk_layout(B, T, cu_seqlens, dev)
        S = cu.numel() - 1
        h0 = None if initial_state is None else initial_state.float().reshape(S, H, K, V).contiguous()
        gc = torch.empty(L, H, K, device=dev, dtype=torch.float32)  # chunk-local cumulative log-gate
        hs = torch.empty(Nc, H, K, V, device=dev, dtype=_state_dtype(q))  # state entering each chunk
        ht = torch.empty(S, H, K, V, device=dev, dtype=torch.float32)
        o = _new((L, H, G, V), q, q.dtype)
        store_A = any(ctx.needs_input_grad[:4])
        A = _new((L, H * G, BT), q, q.dtype) if store_A else None  # in-chunk scores, for the backward's dv
        if Nc:
            sse_fwd_kernel_cumsum[(Nc, H)](log_g, gc, cu, chunk_seq, chunk_pos, H, K, BT, BK)
        hk, hv = min(BK, 64), min(BV, 64)
        if S:
            sse_fwd_kernel_h[(S * H, BK // hk, BV // hv)](
                k, v, gc, h0, hs, ht, cu, chunk_off, H, K, V, BT, hk, hv, h0 is not None, num_warps=WARPS["h"]
            )
        if Nc:
            sse_fwd_kernel_o[(Nc, H * G, BT // BC)](
                q,
                k,
                v,
                gc,
                hs,
                o,
                A,
                cu,
                chunk_seq,
                chunk_pos,
                scale,
                H,
                G,
                K,
                V,
                BT,
                BC,
                BK,
                BV,
                store_A,
                num_warps=WARPS["o"],
            )
        ctx.save_for_backward(q, k, v, gc, hs, A, cu, chunk_seq, chunk_pos, chunk_off)
        ctx.meta = (B, T, scale, initial_state is not None, log_g.dtype, None if h0 is None else initial_state.dtype)
        return o.view(B, T, H, G, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, hs, A, cu, chunk_seq, chunk_pos, chunk_off = ctx.saved_tensors
        B, T, scale, use_h0, g_dtype, h0_dtype = ctx.meta
        L, H, G, K = q.shape
        V, S, Nc, dev = v.shape[-1], cu.numel() - 1, hs.shape[0], q.device
        BK, BV = _block(K), _block(V)
        do = torch.zeros(L, H, G, V, device=dev, dtype=q.dtype) if do is None else do.reshape(L, H, G, V).contiguous()
        dht = None if dht is None else dht.float().reshape(S, H, K, V).contiguous()
        dhs = torch.empty_like(hs)
        dh0 = torch.empty(S, H, K, V, device=dev, dtype=torch.float32) if use_h0 else None
        hk, hv = min(BK, 64), min(BV, 64)
        if S:
            sse_bwd_kernel_dh[(S * H, BK // hk, BV // hv)](
                q,
                do,
                gc,
                dht,
                dhs,
                dh0,
                cu,
                chunk_off,
                scale,
                H,
                G,
                K,
                V,
                BT,
                hk,
                hv,
                dht is not None,
                use_h0,
                num_warps=WARPS["dh"],
            )
        dq, dk, dv = (_new(x.shape, x, x.dtype) for x in (q, k, v))
        dg = _new((L, H, K), q, g_dtype)
        if Nc:
            NS = BT // BC
            dA = torch.empty(Nc, H * G, BT, BT, device=dev, dtype=torch.float32)  # do v^T per chunk
            # sum_g q dq - k dk; sse_bwd_kernel_dg turns it into dg in place when dg is float32
            db = dg if dg.dtype == torch.float32 else torch.empty(L, H, K, device=dev, dtype=torch.float32)
            run = torch.empty(Nc, H, NS, K, device=dev, dtype=torch.float32)  # chunk-wide gate term, per sub-chunk
            layout = (cu, chunk_seq, chunk_pos, scale, H)
            sse_bwd_kernel_dA[(Nc, H * G)](v, do, dA, *layout, G, V, BT, BV)
            sse_bwd_kernel_dqkvg[(Nc, H, NS)](
                q, k, v, gc, hs, do, dhs, A, dA, dq, dk, dv, db, run, *layout, G, K, V, BT, BC, BK, BV,
                num_warps=WARPS["dqkvg"],
            )  # fmt: skip
            sse_bwd_kernel_dg[(Nc, H)](db, run, dg, cu, chunk_seq, chunk_pos, H, K, BT, BC, BK)
        shape = (B, T, H)
        dh0 = None if dh0 is None else dh0.to(h0_dtype)
        return dq.view(*shape, G, K), dk.view(*shape, K), dv.view(*shape, V), dg.view(*shape, K), None, dh0, None


def chunk_gla(q, k, v, log_g, scale: float, initial_state=None, output_final_state: bool = False, cu_seqlens=None):
    """Chunked gated linear attention with a per-key-channel gate (the kernel of `gla_recurrent`).

    Args:
        q: [B, T, H, G, K], G query heads per state head; k, log_g: [B, T, H, K] (log_g <= 0); v: [B, T, H, V].
            float32, bfloat16 or float16; matrix products run in q's dtype (tf32 for float32 on GPUs).
        scale: factor of the read, o_t = scale q_t S_t.
        initial_state: [B, H, K, V] ([S, H, K, V] with cu_seqlens); zeros when None. Differentiable.
        output_final_state: also return the final state.
        cu_seqlens: [S + 1] offsets of S sequences packed along T (then B == 1); empty sequences allowed.

    Returns:
        o: [B, T, H, G, V] in q's dtype, and the final state [B, H, K, V] ([S, H, K, V]) float32, or None.
    """
    if q.dim() != 5 or k.dim() != 4 or q.shape[:3] != k.shape[:3] or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"chunk_gla expects q [B, T, H, G, K], k and log_g [B, T, H, K], v [B, T, H, V]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if log_g.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"chunk_gla: log_g {tuple(log_g.shape)} and q's last dim must match k {tuple(k.shape)}")
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    if q.dtype not in allowed:
        raise ValueError(f"chunk_gla: q.dtype = {q.dtype} is not supported; allowed: {list(allowed)}")
    if max(k.shape[-1], v.shape[-1]) > 256:
        raise ValueError(f"chunk_gla: K = {k.shape[-1]}, V = {v.shape[-1]}; allowed: at most 256 each")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got batch {q.shape[0]}")
    o, final = ChunkGLAFunction.apply(q, k, v, log_g, float(scale), initial_state, cu_seqlens)
    return o, final if output_final_state else None


def _gla(q, k, v, log_g, scale: float, initial_state=None, cu_seqlens=None):
    return chunk_gla(q, k, v, log_g, scale, initial_state, True, cu_seqlens)


IMPLEMENTATIONS = {"varlen": sse_varlen, "masking": sse_masking}


def chunk_sse(
    q, k, v, log_g, idx, num_partitions: int, scale: float, initial_state=None, implementation="varlen", cu_seqlens=None
):
    """SSE's parallel forms on `chunk_gla`: the regrouping of `sse_varlen` (paper Algorithm 2: every (batch row,
    kv head, partition) one segment of a single packed sequence) or `sse_masking` (Algorithm 1: every partition a
    head), same arguments and results as those.

    Args:
        q: [B, T, H, G, M, c]; k, log_g: [B, T, H, M, c]; v: [B, T, H, d]; idx: [B, T, H, M] in [0, P), the M
            distinct partitions each token touches (see `sse_recurrent`).
        num_partitions: P, partitions of the state (routed + shared).
        initial_state: [B, H, P, c, d]; zeros when None. Differentiable.
        implementation: "varlen" or "masking".
        cu_seqlens: [S + 1] offsets of S documents packed along T (B == 1); each starts from its own state
            (initial_state [S, H, P, c, d]), and the final state is [S, H, P, c, d].

    Returns:
        o: [B, T, H, G, d] in q's dtype and the final state [B, H, P, c, d] float32.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"chunk_sse: implementation = {implementation!r} is not allowed; allowed: {list(IMPLEMENTATIONS)}"
        )
    form = IMPLEMENTATIONS[implementation]
    return form(q, k, v, log_g, idx, num_partitions, scale, initial_state, gla=_gla, cu_seqlens=cu_seqlens)
