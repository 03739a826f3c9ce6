"""In-chunk terms of the Raven two-pass form, as Triton device functions shared by the forward and backward kernels.

Within a chunk of BT tokens, g_t is the cumulative log-retention since the chunk start (per slot, non-increasing in
t) and w_t = 1 - exp(log_f_t). Every in-chunk term weighs token s as seen from token t >= s by
exp(g_t - g_s) w_s. The chunk is cut into sub-chunks of BC tokens: a pair (t, s) in different sub-chunks factors
through a reference row r between them, exp(g_t - g_r) exp(g_r - g_s), both factors <= 1, so it becomes a matrix
product; a pair in the same sub-chunk is summed exactly, one source row s of every sub-chunk at a time. No
exponent is ever positive, however strong the decay.

That exact form is the slow path. When a block of slots decays by at most RANGE nats over the whole chunk (the
common case), every pair factors through one per-slot reference at half the chunk's decay,
exp(g_t - ref) exp(ref - g_s), both factors within exp(RANGE / 2), and each term is a single causal matrix product
(the fast path; `fast` below is that test, made per chunk and block of slots).

Tiles are [BT, BM]: rows are tokens of the chunk (the first L valid; terms of the others are masked to 0),
columns the slots o_m of one block of slots.
p_g / p_w point at row 0 of the chunk for this head and slot 0; `stride` is their distance between tokens.
"""

import triton
import triton.language as tl

from ..chunked import RANGE_NATS

RANGE = tl.constexpr(RANGE_NATS)
# the products of the input dtype's operands (bf16 and fp16 ignore it: float32 inputs get three tf32 products, about
# float32's accuracy; one loses whole digits of the state gradients under strong decay) and of the exact forms (rare);
# the fast path's float32 tiles keep one tf32 product, in every training step
PRECISION = tl.constexpr("tf32x3")


@triton.jit
def raven_slot_block(p_g, p_w, stride, L, o_t, m_t, o_m, M, EXACT: tl.constexpr):
    """One block of slots o_m of the chunk: its masks m_m [BM] and m_tm [BT, BM], g and w [BT, BM], g at the chunk's
    last row [BM], whether the fast path holds for it, and its factors exp(g - ref), exp(ref - g) [BT, BM] (0 at
    masked entries; clamped so that they stay finite on the slow path). Without EXACT (no slot of the batch decays
    by more than RANGE in a chunk) `fast` is constant true, and the compiler drops the exact forms: they hold most
    of the registers."""
    m_m = o_m < M
    m_tm = m_t[:, None] & m_m[None, :]
    b_g = tl.load(p_g + o_t[:, None] * stride + o_m[None, :], mask=m_tm, other=0.0)
    b_w = tl.load(p_w + o_t[:, None] * stride + o_m[None, :], mask=m_tm, other=0.0)
    b_gl = tl.load(p_g + (L - 1) * stride + o_m, mask=m_m, other=0.0)
    fast = (tl.min(b_gl, 0) >= -RANGE) | (not EXACT)
    b_ref = 0.5 * b_gl[None, :]
    b_qg = tl.where(m_tm, tl.exp(tl.minimum(b_g - b_ref, 80.0)), 0.0)
    b_ig = tl.where(m_tm, tl.exp(tl.minimum(b_ref - b_g, 80.0)), 0.0)
    return m_m, m_tm, b_g, b_w, b_gl, fast, b_qg, b_ig


@triton.jit
def raven_rows(p_g, p_w, stride, j, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """Row j of every sub-chunk, broadcast over that sub-chunk's rows: g and w [BT, BM] at row (t // BC) BC + j."""
    o_s = tl.arange(0, BT // BC) * BC + j  # [NS]
    mask = (o_s < L)[:, None] & m_m[None, :]
    b_g = tl.load(p_g + o_s[:, None] * stride + o_m[None, :], mask=mask, other=0.0)  # [NS, BM]
    b_w = tl.load(p_w + o_s[:, None] * stride + o_m[None, :], mask=mask, other=0.0)
    shape: tl.constexpr = [BT // BC, BC, b_g.shape[1]]
    b_g = tl.reshape(tl.broadcast_to(b_g[:, None, :], shape), [BT, b_g.shape[1]])
    b_w = tl.reshape(tl.broadcast_to(b_w[:, None, :], shape), [BT, b_w.shape[1]])
    return b_g, b_w


@triton.jit
def raven_read_m_exact(b_A, b_g, b_w, p_g, p_w, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """out[t, m] = sum_{s <= t} A[t, s] exp(g_t - g_s)[m] w_s[m]: the in-chunk slot logits (A = q k^T) or
    their gradient through the value pass (A = do v^T). b_A: [BT, BT]; returns [BT, BM] float32."""
    o_t = tl.arange(0, BT)
    b_A = b_A.to(tl.float32)
    b_o = tl.zeros(b_g.shape, dtype=tl.float32)
    for i in tl.static_range(1, BT // BC):
        b_gr = tl.load(p_g + (i * BC - 1) * stride + o_m, mask=m_m & (o_m * 0 + L > i * BC - 1), other=0.0)  # [BM]
        row = (o_t >= i * BC) & (o_t < i * BC + BC) & (o_t < L)
        col = (o_t < i * BC) & (o_t * 0 + L > i * BC)  # sources, when sub-chunk i has rows at all
        b_qd = tl.where(row[:, None], tl.exp(tl.where(row[:, None], b_g - b_gr[None, :], 0.0)), 0.0)
        b_kd = tl.where(col[:, None], b_w * tl.exp(tl.where(col[:, None], b_gr[None, :] - b_g, 0.0)), 0.0)
        b_o += b_qd * tl.dot(b_A, b_kd, input_precision=PRECISION)
    for j in range(BC):
        o_s = (o_t // BC) * BC + j  # [BT] the source row of each target row
        m_s = (o_s <= o_t) & (o_t < L)
        b_gs, b_ws = raven_rows(p_g, p_w, stride, j, L, o_m, m_m, BT, BC)
        b_a = tl.sum(tl.where(o_t[None, :] == o_s[:, None], b_A, 0.0), 1)  # [BT] A[t, s(t)]
        b_o += tl.where(m_s[:, None], b_a[:, None] * tl.exp(b_g - b_gs) * b_ws, 0.0)
    return b_o


@triton.jit
def raven_mix_exact(b_P, b_g, b_w, p_g, p_w, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """B[t, s] = sum_m P[t, m] exp(g_t - g_s)[m] w_s[m] for s <= t, over this block of slots: the in-chunk token
    mixing of the value pass (P = softmax weights) or of dq (P = logit gradients). Returns [BT, BT] float32."""
    o_t = tl.arange(0, BT)
    b_B = tl.zeros([BT, BT], dtype=tl.float32)
    for i in tl.static_range(1, BT // BC):
        b_gr = tl.load(p_g + (i * BC - 1) * stride + o_m, mask=m_m & (o_m * 0 + L > i * BC - 1), other=0.0)
        row = (o_t >= i * BC) & (o_t < i * BC + BC) & (o_t < L)
        col = (o_t < i * BC) & (o_t * 0 + L > i * BC)  # sources, when sub-chunk i has rows at all
        b_qd = tl.where(row[:, None], b_P * tl.exp(tl.where(row[:, None], b_g - b_gr[None, :], 0.0)), 0.0)
        b_kd = tl.where(col[:, None], b_w * tl.exp(tl.where(col[:, None], b_gr[None, :] - b_g, 0.0)), 0.0)
        b_B += tl.dot(b_qd, tl.trans(b_kd), input_precision=PRECISION)
    for j in range(BC):
        o_s = (o_t // BC) * BC + j
        m_s = (o_s <= o_t) & (o_t < L)
        b_gs, b_ws = raven_rows(p_g, p_w, stride, j, L, o_m, m_m, BT, BC)
        b_c = tl.sum(tl.where(m_s[:, None], b_P * tl.exp(b_g - b_gs) * b_ws, 0.0), 1)  # [BT]
        b_B += tl.where(o_t[None, :] == o_s[:, None], b_c[:, None], 0.0)
    return b_B


@triton.jit
def raven_write_m_exact(b_C, b_P, b_g, p_P, stride_P, p_g, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """dw[s, m] = sum_{t >= s} C[t, s] P[t, m] exp(g_t - g_s)[m]: the gradient of the written weights w_s from
    the in-chunk reads (C = q k^T with P = logit gradients, or C = do v^T with P = softmax weights).
    b_C: [BT, BT] indexed [t, s]; b_P: [BT, BM] indexed [t, m], also at p_P (row stride stride_P) for the
    same-sub-chunk rows. Returns [BT, BM] float32 indexed [s, m]."""
    o_t = tl.arange(0, BT)
    b_dw = tl.zeros(b_g.shape, dtype=tl.float32)
    b_Ct = tl.trans(b_C).to(tl.float32)  # [s, t]
    for i in tl.static_range(0, BT // BC - 1):
        r = i * BC + BC - 1  # last row of sub-chunk i: the reference for its sources
        b_gr = tl.load(p_g + r * stride + o_m, mask=m_m & (o_m * 0 + L > r), other=0.0)
        row = (o_t >= i * BC) & (o_t <= r) & (o_t * 0 + L > r + 1)  # sources, when later rows read them
        col = (o_t > r) & (o_t < L)
        b_sd = tl.where(row[:, None], tl.exp(tl.where(row[:, None], b_gr[None, :] - b_g, 0.0)), 0.0)
        b_td = tl.where(col[:, None], b_P * tl.exp(tl.where(col[:, None], b_g - b_gr[None, :], 0.0)), 0.0)
        b_dw += b_sd * tl.dot(b_Ct, b_td, input_precision=PRECISION)
    for j in range(BC):
        o_r = (o_t // BC) * BC + j  # [BT] the reading row of each source row
        m_r = (o_r >= o_t) & (o_r < L)
        b_gt = tl.load(p_g + o_r[:, None] * stride + o_m[None, :], mask=m_r[:, None] & m_m[None, :], other=0.0)
        b_Pt = tl.load(p_P + o_r[:, None] * stride_P + o_m[None, :], mask=m_r[:, None] & m_m[None, :], other=0.0)
        b_c = tl.sum(tl.where(o_t[None, :] == o_r[:, None], b_Ct, 0.0), 1)  # [BT] C[t(s), s]
        b_dw += tl.where(m_r[:, None], b_c[:, None] * b_Pt * tl.exp(b_gt - b_g), 0.0)
    return b_dw


@triton.jit
def raven_read_m(b_A, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """raven_read_m_exact, as one product on the fast path (b_A causal, b_kg = w exp(ref - g))."""
    if fast:
        b_o = b_qg * tl.dot(b_A, b_kg.to(b_A.dtype))
    else:
        b_o = raven_read_m_exact(b_A, b_g, b_w, p_g, p_w, stride, L, o_m, m_m, BT, BC)
    return b_o


@triton.jit
def raven_mix(b_P, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr):
    """raven_mix_exact, as one product on the fast path."""
    if fast:
        o_t = tl.arange(0, BT)
        b_B = tl.where(o_t[:, None] >= o_t[None, :], tl.dot((b_P * b_qg).to(b_kg.dtype), tl.trans(b_kg)), 0.0)
    else:
        b_B = raven_mix_exact(b_P, b_g, b_w, p_g, p_w, stride, L, o_m, m_m, BT, BC)
    return b_B


@triton.jit
def raven_write_m(
    b_C, b_P, b_g, b_qg, b_ig, fast, p_P, stride_P, p_g, stride, L, o_m, m_m, BT: tl.constexpr, BC: tl.constexpr
):
    """raven_write_m_exact, as one product on the fast path (b_C causal)."""
    if fast:
        b_dw = b_ig * tl.dot(tl.trans(b_C), (b_P * b_qg).to(b_C.dtype))
    else:
        b_dw = raven_write_m_exact(b_C, b_P, b_g, p_P, stride_P, p_g, stride, L, o_m, m_m, BT, BC)
    return b_dw
