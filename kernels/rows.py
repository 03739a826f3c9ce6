"""Helpers the one-kernel decode steps of several mixers share: the entries of each row ranked by score (Raven's
slots, SSE's partitions), an RMSNorm of each row of a tile (one head per row) and softplus (their decays)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def score_keys(b_x, M: tl.constexpr, BM: tl.constexpr):
    """int64 keys of float32 scores b_x [R, BM] (-inf past M) in the order `indices_by_score` ranks them: the score's
    order in the high 32 bits, M - 1 - its index in the low ones (the lower index wins a tie; padding ranks last)."""
    o_m = tl.arange(0, BM)
    b_bits = b_x.to(tl.int32, bitcast=True)
    b_ord = b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)  # signed integers in the floats' order
    b_low = tl.where(o_m < M, M - 1 - o_m, 0).to(tl.int64)  # [BM]
    return (b_ord.to(tl.int64) << 32) | b_low[None, :]


@triton.jit
def indices_by_score(b_x, M: tl.constexpr, BM: tl.constexpr):
    """The indices of each row of float32 scores b_x [R, BM] (-inf past M), best first, the lower index first among
    equal scores: [R, BM] int64, one bitonic sort of `score_keys`."""
    b_key = tl.sort(score_keys(b_x, M, BM), dim=1, descending=True)
    return (M - 1) - (b_key & (BM - 1))


@triton.jit
def top_indices_by_score(b_x, M: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The first BK of `indices_by_score` for one row of scores b_x [1, BM] (those past the M scores unspecified):
    [BK] int64, by BK rounds of a max over `score_keys` (a reduction a round, where sorting M keys moves every key
    log2(M) (log2(M) + 1) / 2 times)."""
    b_key = score_keys(b_x, M, BM)  # [1, BM]
    o_k = tl.arange(0, BK)
    b_top = tl.zeros([BK], dtype=tl.int64)
    for i in tl.static_range(BK):
        b_best = tl.max(b_key, 1)  # [1]
        b_top = tl.where(o_k == i, b_best, b_top)
        b_key = tl.where(b_key == b_best[:, None], -9223372036854775807, b_key)  # taken: below every other key
    return (M - 1) - (b_top & (BM - 1))


@triton.jit
def rows_rms_norm(b_x, norm, o_d, m_d, eps, D: tl.constexpr):
    """RMSNorm of each row of b_x [R, BD] (one head each) with weight `norm` [D]."""
    b_ms = tl.sum(b_x * b_x, 1) / D
    return b_x * tl.rsqrt(b_ms + eps)[:, None] * tl.load(norm + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]


@triton.jit
def softplus(b_x):
    """log(1 + exp(b_x)) in float32 without overflow, and without 1 + exp(b_x) rounding to 1 where exp is tiny."""
    b_e = tl.exp(tl.minimum(b_x, 20.0))
    return tl.where(b_x > 20.0, b_x, tl.where(b_e < 1e-4, b_e, tl.log(1.0 + b_e)))
