"""The per-chunk backward kernels of chunk_raven: dq with the softmax weights and logit gradients (dq), dk and dv
(dkv), and the gradient of the gates (dlf), one slot block per program. Every tl.dot takes its operands in the
input dtype (bf16 on the GPU) and accumulates in float32; gates, logits and their sums stay float32.

(*) The in-chunk score tiles q k^T and do v^T stay float32 (tf32 products): as bf16 register operands of the
products with the slot factors, Triton 3.6 reads past shared memory on sm_90 (compute-sanitizer; the pattern of
triton-lang/triton#11366)."""

import triton
import triton.language as tl

from .intra import PRECISION, raven_mix, raven_read_m, raven_slot_block, raven_write_m


@triton.jit
def raven_bwd_kernel_dq(
    q,
    k,
    v,
    do,
    o,
    g,
    w,
    hk,
    hv,
    lse,
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
    EXACT: tl.constexpr,
):
    """dq, and per token and slot the softmax weights p, the logit gradients ds and e = ds s + p dp (the gate
    gradient's read terms), each [T, H * G, M], for the kernels that follow."""
    i_c, i_hg = tl.program_id(0), tl.program_id(1)
    i_h = i_hg // G
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_q = tl.load(q + p_qd, mask=m_td, other=0.0)  # [BT, BD]
    b_do = tl.load(do + p_qd, mask=m_td, other=0.0)
    m_c = o_t[:, None] >= o_t[None, :]
    b_A = tl.dot(b_q, tl.trans(tl.load(k + p_kd, mask=m_td, other=0.0)), input_precision=PRECISION)  # [BT, BT] (*)
    b_C = tl.dot(b_do, tl.trans(tl.load(v + p_kd, mask=m_td, other=0.0)), input_precision=PRECISION)
    b_A, b_C = tl.where(m_c, b_A, 0.0), tl.where(m_c, b_C, 0.0)  # causal, float32
    b_lse = tl.load(lse + (bos + o_t) * H * G + i_hg, mask=m_t, other=0.0)
    b_delta = tl.sum(b_do.to(tl.float32) * tl.load(o + p_qd, mask=m_td, other=0.0).to(tl.float32), 1)  # sum_m p dp
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_dq = tl.zeros([BT, BD], dtype=tl.float32)
    b_B = tl.zeros([BT, BT], dtype=tl.float32)
    for i_m in range(tl.cdiv(M, BM)):
        o_m = i_m * BM + tl.arange(0, BM)
        m_m, m_tm, b_g, b_w, b_gl, fast, b_qg, b_kg = raven_slot_block(p_g, p_w, H * M, L, o_t, m_t, o_m, M, EXACT)
        m_md = m_m[:, None] & m_d[None, :]
        b_kg = (b_kg * b_w).to(b_q.dtype)
        b_eg = tl.exp(b_g)
        b_hk = tl.load(hk + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)  # [BM, BD]
        b_s = b_eg * tl.dot(b_q, tl.trans(b_hk), input_precision=PRECISION)
        b_s += raven_read_m(b_A, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_p = tl.where(m_tm, tl.exp(b_s * scale - b_lse[:, None]), 0.0)
        b_hv = tl.load(hv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_dp = b_eg * tl.dot(b_do, tl.trans(b_hv), input_precision=PRECISION)
        b_dp += raven_read_m(b_C, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_ds = scale * b_p * (b_dp - b_delta[:, None])
        p_tm = ((bos + o_t[:, None]) * H * G + i_hg) * M + o_m[None, :]
        tl.store(p + p_tm, b_p.to(p.dtype.element_ty), mask=m_tm)
        tl.store(ds + p_tm, b_ds.to(ds.dtype.element_ty), mask=m_tm)
        tl.store(e + p_tm, b_ds * b_s + b_p * b_dp, mask=m_tm)
        b_dq += tl.dot((b_ds * b_eg).to(b_hk.dtype), b_hk, input_precision=PRECISION)
        b_B += raven_mix(b_ds, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)
    b_dq += tl.dot(b_B.to(b_k.dtype), b_k, input_precision=PRECISION)
    tl.store(dq + p_qd, b_dq.to(dq.dtype.element_ty), mask=m_td)


@triton.jit
def raven_bwd_kernel_dkv(
    q,
    do,
    g,
    w,
    dhk,
    dhv,
    p,
    ds,
    dk,
    dv,
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
    EXACT: tl.constexpr,
):
    """dk and dv: what later chunks read through the state leaving this one (dhk, dhv), and the in-chunk reads,
    mixed over all slots per query head first (B [BT, BT]) so that each head costs one product with q or do."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_dk = tl.zeros([BT, BD], dtype=tl.float32)
    b_dv = tl.zeros([BT, BD], dtype=tl.float32)
    for i_g in range(G):
        i_hg = i_h * G + i_g
        p_P, p_S = p + (bos * H * G + i_hg) * M, ds + (bos * H * G + i_hg) * M
        b_Bp = tl.zeros([BT, BT], dtype=tl.float32)
        b_Bs = tl.zeros([BT, BT], dtype=tl.float32)
        for i_m in range(tl.cdiv(M, BM)):
            o_m = i_m * BM + tl.arange(0, BM)
            m_m, m_tm, b_g, b_w, b_gl, fast, b_qg, b_kg = raven_slot_block(p_g, p_w, H * M, L, o_t, m_t, o_m, M, EXACT)
            if i_g == 0:  # the state part, once
                m_md = m_m[:, None] & m_d[None, :]
                b_dhk = tl.load(dhk + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)  # [BM, BD]
                b_dhv = tl.load(dhv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
                b_wd = tl.where(m_tm, b_w * tl.exp(b_gl[None, :] - b_g), 0.0).to(b_dhk.dtype)  # weight at chunk end
                b_dk += tl.dot(b_wd, b_dhk, input_precision=PRECISION)
                b_dv += tl.dot(b_wd, b_dhv, input_precision=PRECISION)
            b_kg = (b_kg * b_w).to(dk.dtype.element_ty)
            p_tm = o_t[:, None] * H * G * M + o_m[None, :]
            b_p = tl.load(p_P + p_tm, mask=m_tm, other=0.0).to(tl.float32)
            b_ds = tl.load(p_S + p_tm, mask=m_tm, other=0.0).to(tl.float32)
            b_Bp += raven_mix(b_p, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
            b_Bs += raven_mix(b_ds, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
        b_q = tl.load(q + p_qd, mask=m_td, other=0.0)
        b_do = tl.load(do + p_qd, mask=m_td, other=0.0)
        b_dv += tl.dot(tl.trans(b_Bp.to(b_do.dtype)), b_do, input_precision=PRECISION)
        b_dk += tl.dot(tl.trans(b_Bs.to(b_q.dtype)), b_q, input_precision=PRECISION)
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    tl.store(dk + p_kd, b_dk.to(dk.dtype.element_ty), mask=m_td)
    tl.store(dv + p_kd, b_dv.to(dv.dtype.element_ty), mask=m_td)


@triton.jit
def raven_bwd_kernel_dlf(
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
    EXACT: tl.constexpr,
):
    """The gradient of log_f summed over the rest of the chunk (dlf [T, H, M]), one block of slots per program,
    with the chunk totals (dlf_sum [NC, H, M]) that carry it into earlier chunks."""
    i_cm, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_m = i_cm // tl.cdiv(M, BM), i_cm % tl.cdiv(M, BM)  # a chunk's slot blocks side by side: q, k, v, do in L2
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_d = tl.arange(0, BT), tl.arange(0, BD)
    o_m = i_m * BM + tl.arange(0, BM)
    m_t, m_d = o_t < L, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    p_kd = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)  # [BT, BD]
    b_v = tl.load(v + p_kd, mask=m_td, other=0.0)
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    m_m, m_tm, b_g, b_w, b_gl, fast, b_qg, b_ig = raven_slot_block(p_g, p_w, H * M, L, o_t, m_t, o_m, M, EXACT)
    m_md = m_m[:, None] & m_d[None, :]
    p_h = (i_c * H + i_h) * M * D + o_m[:, None] * D + o_d[None, :]
    b_dhk = tl.load(dhk + p_h, mask=m_md, other=0.0)  # [BM, BD]
    b_dhv = tl.load(dhv + p_h, mask=m_md, other=0.0)
    b_dec = tl.where(m_tm, tl.exp(b_gl[None, :] - b_g), 0.0)  # decay from each token to the chunk end
    b_dw = tl.dot(b_k, tl.trans(b_dhk), input_precision=PRECISION)  # [BT, BM]
    b_dw = b_dec * (b_dw + tl.dot(b_v, tl.trans(b_dhv), input_precision=PRECISION))
    b_e = tl.zeros([BT, BM], dtype=tl.float32)
    m_c = o_t[:, None] >= o_t[None, :]
    for i_g in range(G):
        i_hg = i_h * G + i_g
        p_qd = ((bos + o_t[:, None]) * H * G + i_hg) * D + o_d[None, :]
        b_q = tl.load(q + p_qd, mask=m_td, other=0.0)
        b_do = tl.load(do + p_qd, mask=m_td, other=0.0)
        b_A = tl.where(m_c, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION), 0.0)  # [BT, BT] causal q k^T (*)
        b_C = tl.where(m_c, tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION), 0.0)  # causal do v^T
        p_P, p_S = p + (bos * H * G + i_hg) * M, ds + (bos * H * G + i_hg) * M
        p_tm = o_t[:, None] * H * G * M + o_m[None, :]
        b_p = tl.load(p_P + p_tm, mask=m_tm, other=0.0).to(tl.float32)
        b_ds = tl.load(p_S + p_tm, mask=m_tm, other=0.0).to(tl.float32)
        b_e += tl.load(e + (bos * H * G + i_hg) * M + p_tm, mask=m_tm, other=0.0)
        b_dw += raven_write_m(b_C, b_p, b_g, b_qg, b_ig, fast, p_P, H * G * M, p_g, H * M, L, o_m, m_m, BT, BC)
        b_dw += raven_write_m(b_A, b_ds, b_g, b_qg, b_ig, fast, p_S, H * G * M, p_g, H * M, L, o_m, m_m, BT, BC)
    b_dgc = tl.where(m_tm, b_e - b_w * b_dw, 0.0)  # gradient of the cumulative log-retention
    b_tot = tl.sum(b_dgc, 0)
    b_dlf = b_tot[None, :] - tl.cumsum(b_dgc, 0) + b_dgc - (1.0 - b_w) * b_dw  # suffix sums, and through w
    tl.store(dlf + ((bos + o_t[:, None]) * H + i_h) * M + o_m[None, :], b_dlf, mask=m_tm)
    tl.store(dlf_sum + (i_c * H + i_h) * M + o_m, b_tot, mask=m_m)


@triton.jit
def raven_bwd_kernel_dar(
    a,
    idx,
    r,
    dlf,
    carry,
    da,
    dr,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    """One chunk and head: the router's gradients from d loss / d log_f at the written slots, dl = dlf (the chunk's
    own reads) + carry (every later chunk's, [NC, H, M]); log_f = a r gives da = sum_j dl_j r_j, dr_j = dl_j a."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, L = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    if L <= 0:  # a spare chunk past the packed sequences' last (prepare_chunks)
        return
    o_t, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m_t = o_t < L
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_tk = ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    b_i = tl.load(idx + p_tk, mask=m_tk, other=0)  # [BT, BK]
    b_dl = tl.load(dlf + ((bos + o_t[:, None]) * H + i_h) * M + b_i, mask=m_tk, other=0.0)
    b_dl += tl.load(carry + (i_c * H + i_h) * M + b_i, mask=m_tk, other=0.0)
    b_a = tl.load(a + (bos + o_t) * H + i_h, mask=m_t, other=0.0)  # [BT]
    b_r = tl.load(r + p_tk, mask=m_tk, other=0.0)
    tl.store(da + (bos + o_t) * H + i_h, tl.sum(b_dl * b_r, 1).to(da.dtype.element_ty), mask=m_t)
    tl.store(dr + p_tk, (b_dl * b_a[:, None]).to(dr.dtype.element_ty), mask=m_tk)
