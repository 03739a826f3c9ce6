"""Forward kernels of chunk_gla (kernels/sse/chunk.py has the algorithm): the chunk-local cumulative gate (and each
chunk's contribution to the state), the states entering every chunk by a sequential scan, and the output of every
chunk (or, exactly under strong decay, of every sub-chunk).

Rows: the kernels walk packed positions p (chunks, sequences), and every buffer they make (gc, A, states) is
indexed by position. The inputs and their gradients are indexed by `r = sse_src(...)`: p H + i_h, or with GATHER
(SSE's entries, H = 1) src[p], a row of k and log_g laid out [R, M, K]; then v sits at row r // M, q at
`sse_qrow(r, g)`, and o at r G + g (one output per entry, summed over M by the host)."""

import triton
import triton.language as tl


@triton.jit
def sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT: tl.constexpr):
    """First packed position of chunk i_c and the rows left in its sequence from there (<= 0: a spare chunk)."""
    i_s = tl.load(chunk_seq + i_c)
    bos = tl.load(cu + i_s).to(tl.int64) + tl.load(chunk_pos + i_c).to(tl.int64) * BT
    return bos, tl.load(cu + i_s + 1).to(tl.int64) - bos


@triton.jit
def sse_seq(cu, chunk_off, i_s):
    """Sequence i_s of a per-sequence scan: its first and end packed positions, its first chunk and its chunk count."""
    seq_bos, eos = tl.load(cu + i_s).to(tl.int64), tl.load(cu + i_s + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_s).to(tl.int64)
    return seq_bos, eos, c0, tl.load(chunk_off + i_s + 1).to(tl.int64) - c0


@triton.jit
def sse_state_block(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Block (i_k, i_v) of one [K, V] state: key and value channels, their masks, and the block's [BK, BV] offsets
    inside the state and mask."""
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    return o_k, o_v, m_k, m_v, o_k[:, None] * V + o_v[None, :], m_kv


@triton.jit
def sse_fwd_kernel_gate(
    g,
    gc,
    gl,
    k,
    v,
    x,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    CONTRIB: tl.constexpr,
    GATHER: tl.constexpr,
):
    """One chunk and state head (with CONTRIB, and block of value channels): the chunk-local cumulative gate gc
    [L, H, K] by position, its last row gl [Nc, H, K] (0 for a spare chunk), and with CONTRIB what the chunk writes
    into the state leaving it, x [Nc, H, K, V] = sum_t (k_t exp(gl - gc_t))^T v_t."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m_k = o_k < K
    p_gl = gl + (i_c.to(tl.int64) * H + i_h) * K + o_k
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout)
        if i_v == 0:
            tl.store(p_gl, tl.zeros([BK], dtype=tl.float32), mask=m_k)
        return
    last = tl.minimum(n, BT) - 1
    m_t = o_t < n
    mask = m_t[:, None] & m_k[None, :]
    r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
    b_g = tl.load(g + r_t[:, None] * K + o_k[None, :], mask=mask, other=0.0).to(tl.float32)  # [BT, BK]
    b_b = tl.cumsum(b_g, axis=0)  # rows past the end repeat the last
    b_bl = tl.sum(tl.where((o_t == last)[:, None], b_b, 0.0), 0)  # [BK]
    if i_v == 0:
        tl.store(gc + ((bos + o_t)[:, None] * H + i_h) * K + o_k[None, :], b_b, mask=mask)
        tl.store(p_gl, b_bl, mask=m_k)
    if CONTRIB:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=mask, other=0.0).to(tl.float32)
        b_v = tl.load(v + (r_t // M)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_kg = (b_k * tl.exp(b_bl[None, :] - b_b)).to(k.dtype.element_ty)
        b_x = tl.dot(tl.trans(b_kg), b_v.to(k.dtype.element_ty))  # [BK, BV]
        p_x = x + ((i_c.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(p_x, b_x.to(x.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


@triton.jit
def sse_src(src, pos, H, i_h, GATHER: tl.constexpr):
    """Input row of packed position pos (scalar or vector, < L) for state head i_h."""
    if GATHER:
        return tl.load(src + pos).to(tl.int64)
    else:
        return pos * H + i_h


@triton.jit
def sse_qrow(r, i_g, G: tl.constexpr, M: tl.constexpr):
    """Row of q (and dq) [R, G, M, K] for input row r and query head i_g of its group; r G + i_g when M = 1."""
    return ((r // M) * G + i_g) * M + r % M


@triton.jit
def sse_row(
    x,
    src,
    gc,
    bos,
    t,
    n,
    last,
    H,
    i_h,
    i_g,
    K: tl.constexpr,
    o_k,
    G: tl.constexpr,
    M: tl.constexpr,
    IS_Q: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Row t of a chunk: k (or q of head i_g with IS_Q) [BK] float32, zeros past the sequence's end, and the
    cumulative gate [BK] of state head i_h (read at the last token past the end)."""
    p = bos + tl.minimum(t, last)
    r = sse_src(src, p, H, i_h, GATHER)
    if IS_Q:
        r = sse_qrow(r, i_g, G, M)
    b_x = tl.load(x + r * K + o_k, mask=o_k < tl.where(t < n, K, 0), other=0.0)
    b_g = tl.load(gc + (p * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
    return b_x.to(tl.float32), b_g


@triton.jit
def sse_gate_tile(gc, bos, o_t, last, H, i_h, K: tl.constexpr, o_k, m_k):
    """The cumulative gate of the chunk's rows o_t [BT, BK] for state head i_h (rows past the end read the last)."""
    return tl.load(
        gc + ((bos + tl.minimum(o_t, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
    )


@triton.jit
def sse_fwd_kernel_h(
    k,
    v,
    gc,
    h0,
    hs,
    ht,
    src,
    cu,
    chunk_off,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    USE_H0: tl.constexpr,
    GATHER: tl.constexpr,
):
    i_sh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    seq_bos, eos, c0, n_chunks = sse_seq(cu, chunk_off, i_s)
    o_t = tl.arange(0, BT)
    o_k, o_v, m_k, m_v, offs_kv, m_kv = sse_state_block(i_k, i_v, K, V, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_sh.to(tl.int64) * K * V + offs_kv, mask=m_kv, other=0.0)
    for i in range(n_chunks):
        bos = seq_bos + i * BT
        last = tl.minimum(eos - bos, BT) - 1
        tl.store(hs + ((c0 + i) * H + i_h) * K * V + offs_kv, b_h.to(hs.dtype.element_ty), mask=m_kv)
        m_t = o_t < eos - bos
        r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
        b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
        b_bl = tl.load(gc + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
        b_v = tl.load(v + (r_t // M)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_kg = (b_k * tl.exp(b_bl[None, :] - b_b)).to(k.dtype.element_ty)
        b_h = b_h * tl.exp(b_bl)[:, None] + tl.dot(tl.trans(b_kg), b_v.to(k.dtype.element_ty))
    tl.store(ht + i_sh.to(tl.int64) * K * V + offs_kv, b_h, mask=m_kv)


@triton.jit
def sse_fwd_kernel_o(
    q,
    k,
    v,
    gc,
    gl,
    hs,
    o,
    A,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    exact,
    scale,
    H,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    M: tl.constexpr,
    STORE_A: tl.constexpr,
    GATHER: tl.constexpr,
    ON_DEVICE: tl.constexpr,
):
    """One chunk, state head and block of value channels, every query head of the group, on the fast path (no key
    channel decays by more than RANGE_NATS over the chunk, kernels/chunked.py): the in-chunk scores are one causal
    product through the reference ref = gl / 2, A = (q exp(gc - ref)) (k exp(ref - gc))^T, and
    o = scale (q exp(gc) h + A v). With STORE_A also A [L, H G, BT], as `sse_fwd_kernel_o_exact` stores it.
    ON_DEVICE: queued beside the exact kernel, this one runs only where exact [] (uint8, kernels/chunked.py
    exceeds_range) is 0."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if ON_DEVICE:
        n = tl.where(tl.load(exact) != 0, 0, n)  # the exact kernel serves this batch
    if n <= 0:  # a spare chunk past the packed sequences' last (_chunk_layout), or the other form's batch
        return
    last = tl.minimum(n, BT) - 1
    DT = q.dtype.element_ty
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_t, m_k, m_v = o_t < n, o_k < K, o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
    b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
    b_ref = 0.5 * tl.load(gl + (i_c.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK]
    b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_kg = (b_k * tl.exp(b_ref[None, :] - b_b)).to(DT)  # [BT, BK]
    b_v = tl.load(v + (r_t // M)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(DT)
    b_h = tl.load(
        hs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    ).to(DT)  # [BK, BV]
    causal = o_t[:, None] >= o_t[None, :]
    for i_g in range(G):
        b_q = tl.load(q + sse_qrow(r_t, i_g, G, M)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_A = tl.where(causal, tl.dot((b_q * tl.exp(b_b - b_ref[None, :])).to(DT), tl.trans(b_kg)), 0.0)  # [BT, BT]
        b_o = tl.dot((b_q * tl.exp(b_b)).to(DT), b_h) + tl.dot(b_A.to(DT), b_v)  # [BT, BV]
        if STORE_A:
            if i_v == 0:
                p_A = A + ((bos + o_t)[:, None] * (H * G) + i_h * G + i_g) * BT + o_t[None, :]
                tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_t[:, None])
        p_o = o + (r_t * G + i_g)[:, None] * V + o_v[None, :]
        tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def sse_fwd_kernel_o_exact(
    q,
    k,
    v,
    gc,
    hs,
    o,
    A,
    src,
    cu,
    chunk_seq,
    chunk_pos,
    exact,
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
    STORE_A: tl.constexpr,
    GATHER: tl.constexpr,
    ON_DEVICE: tl.constexpr,
):
    """One sub-chunk i of a chunk, and query head, exact however strong the decay: o of its rows, and with STORE_A
    their in-chunk scores A [L, H G, BT] (row t: A[t, s] over the chunk's columns s, zero for s > t) in q's dtype,
    which the backward's dv takes as they are. ON_DEVICE: queued beside the fast kernel, this one runs only where
    exact [] (uint8, kernels/chunked.py exceeds_range) is not 0."""
    i_c, i_hg, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, i_g = i_hg // G, i_hg % G
    bos, n = sse_chunk(cu, chunk_seq, chunk_pos, i_c, BT)
    if ON_DEVICE:
        n = tl.where(tl.load(exact) != 0, n, 0)  # the fast kernel serves this batch
    if n <= i * BC:  # a spare chunk, the other form's batch, or a sub-chunk past a short chunk's last row
        return
    last = tl.minimum(n, BT) - 1
    DT = q.dtype.element_ty
    o_t, o_r, o_k, o_v = tl.arange(0, BT), tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_t = o_t < n
    r_t = sse_src(src, bos + tl.minimum(o_t, last), H, i_h, GATHER)  # [BT]
    b_v = tl.load(v + (r_t // M)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(DT)
    b_h = tl.load(
        hs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    ).to(DT)  # [BK, BV]
    rows = i * BC + o_r
    m_r = rows < n
    r_r = sse_src(src, bos + tl.minimum(rows, last), H, i_h, GATHER)  # [BC]
    b_q = tl.load(
        q + sse_qrow(r_r, i_g, G, M)[:, None] * K + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0
    ).to(tl.float32)  # [BC, BK]
    b_bi = tl.load(
        gc + ((bos + tl.minimum(rows, last))[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
    )  # [BC, BK]
    b_o = tl.dot((b_q * tl.exp(b_bi)).to(DT), b_h)  # [BC, BV]
    b_A = tl.zeros([BC, BT], dtype=tl.float32)  # A[t, s] for the rows t of this sub-chunk
    if i > 0:  # earlier sub-chunks, split at the row before this one
        b_ref = tl.load(gc + ((bos + tl.minimum(i * BC - 1, last)) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_k = tl.load(k + r_t[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_b = sse_gate_tile(gc, bos, o_t, last, H, i_h, K, o_k, m_k)  # [BT, BK]
        b_kg = b_k * tl.exp(tl.where((o_t < i * BC)[:, None], b_ref[None, :] - b_b, float("-inf")))
        b_A += tl.dot((b_q * tl.exp(b_bi - b_ref[None, :])).to(DT), tl.trans(b_kg.to(DT)))
    b_kj, b_bj = sse_row(k, src, gc, bos, i * BC, n, last, H, i_h, i_g, K, o_k, G, M, False, GATHER)
    for j in range(BC):
        col = i * BC + j
        b_kn, b_bn = sse_row(k, src, gc, bos, col + 1, n, last, H, i_h, i_g, K, o_k, G, M, False, GATHER)
        b_e = tl.exp(tl.where((o_r >= j)[:, None], b_bi - b_bj[None, :], float("-inf")))  # [BC, BK]
        b_a = tl.sum(b_q * b_kj[None, :] * b_e, axis=1)  # [BC]
        b_A = tl.where((o_t == col)[None, :], b_a[:, None], b_A)
        b_kj, b_bj = b_kn, b_bn
    b_o += tl.dot(b_A.to(DT), b_v)
    if STORE_A:
        p_A = A + ((bos + rows)[:, None] * (H * G) + i_hg) * BT + o_t[None, :]
        tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_r[:, None])
    tl.store(
        o + (r_r * G + i_g)[:, None] * V + o_v[None, :],
        (b_o * scale).to(o.dtype.element_ty),
        mask=m_r[:, None] & m_v[None, :],
    )
