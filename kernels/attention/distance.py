"""One layer's attention distance for SILA's token weights, fused: nothing of size T x T is ever stored.

For queries t and keys j of one row, with allowed[t, j] = j <= t, inside the window, both tokens real and of the
same document, each query head's float32 softmax over its allowed keys (no allowed key: all zeros) gives p; the
sink and pad columns are then zeroed (no renormalising), probabilities below tau dropped, and

    out[b, t] = sum over heads h and keys j of p[b, h, t, j] * (positions[b, t] - positions[b, j])

as `attention_distance_torch` (below) computes it block by block in PyTorch. One program takes BM queries of one
query head: a first sweep over the key blocks finds each query's softmax max and sum (online), a second recomputes
the scores and accumulates the thresholded, distance-weighted probabilities, forming them only in key blocks where
some score is high enough for a probability to reach tau. Each program writes its queries'
partial sums for its head; the heads are summed afterwards in PyTorch (deterministic, no atomics). Key blocks that
no query of the block may see are never read: those after its last query (causal), those before the window of its
first query, and those before the first key any of its real queries may see (`first_keys`: the start of a packed
document, or the first real token after left padding).

`attention_distance_torch` is the same sum in PyTorch, streamed over blocks of queries so that only
[B, H, query_block, T] scores exist at a time, each block eager or through torch.compile: the reference the kernel
is tested against (naive.py names it `naive_attention_distance`) and what token_weights runs with kernel "eager" or
"compiled". It lives here, not in naive.py, because the pipeline may not import a reference module
(tests/test_import_directions.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.0 / math.log(2.0)
# float32 inputs: products about as accurate as float32's, since the threshold p >= tau is discontinuous (plain tf32
# flips borderline probabilities; "ieee" avoids the tensor cores and spills registers at d = 128: tf32x3 is three
# tf32 products); bf16 and fp16 inputs are held exactly by tf32. Measured in docs/lab/TRAINING_SPEED.md.
FLOAT32_PRECISION = "tf32x3"
SKIP_MARGIN = tl.constexpr(1e-3)  # log2 units: skipped key blocks lie below tau by 0.07% of it, far above rounding


@triton.jit
def attention_distance_fwd_kernel(
    q,
    k,
    real,
    sinks,
    positions,
    documents,
    first,
    part,
    qk_scale,
    tau,
    window,
    T,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_kt,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    WINDOWED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m, o_d = i_m * BM + tl.arange(0, BM), tl.arange(0, BD)
    m_m, m_d = o_m < T, o_d < D
    p_row = i_b.to(tl.int64) * T
    b_rq = tl.load(real + p_row + o_m, mask=m_m, other=0) != 0  # [BM]
    b_dq = tl.load(documents + p_row + o_m, mask=m_m, other=0)  # [BM]
    b_xq = tl.load(positions + p_row + o_m, mask=m_m, other=0.0)  # [BM]
    # keys before the first one any real query of the block may see, or after its last query, are skipped
    lo = tl.min(tl.load(first + p_row + o_m, mask=m_m & b_rq, other=T), 0)
    if WINDOWED:
        lo = tl.maximum(lo, i_m * BM - window + 1)
    lo = lo // BN * BN
    hi = tl.minimum(i_m * BM + BM, T)

    p_q = q + i_b.to(tl.int64) * s_qb + i_h * s_qh + o_m[:, None] * s_qt + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
    p_k = k + i_b.to(tl.int64) * s_kb + (i_h // G) * s_kh  # query head h reads key head h // G (repeat_kv)

    b_m = tl.full([BM], -1e30, dtype=tl.float32)  # finite: a query with no allowed key keeps l = 0, not NaN
    b_l = tl.zeros([BM], dtype=tl.float32)
    for n0 in range(lo, hi, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < T
        b_k = tl.load(p_k + o_n[:, None] * s_kt + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision=PRECISION) * qk_scale  # [BM, BN], log2 units
        b_rk = tl.load(real + p_row + o_n, mask=m_n, other=0) != 0  # [BN]
        b_dk = tl.load(documents + p_row + o_n, mask=m_n, other=0)  # [BN]
        b_ok = (o_n[None, :] <= o_m[:, None]) & b_rq[:, None] & b_rk[None, :] & (b_dk[None, :] == b_dq[:, None])
        if WINDOWED:
            b_ok = b_ok & (o_n[None, :] > o_m[:, None] - window)
        b_s = tl.where(b_ok, b_s, float("-inf"))  # [BM, BN]
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_l = b_l * tl.exp2(b_m - b_mn) + tl.sum(tl.exp2(b_s - b_mn[:, None]), 1)
        b_m = b_mn
    # [BM]: l >= 1 where a key is allowed (the max counts 1), else p is 0 anyway; rounded as the reference divides,
    # so that p = 1/n from n equal scores meets tau = 1/n as it does there
    b_il = tl.math.div_rn(tl.full([BM], 1.0, dtype=tl.float32), tl.maximum(b_l, 1.0))
    # p >= tau needs s >= m + log2(tau l): a key block whose scores all fall below that, by far more than rounding,
    # adds nothing, and its masks and exponentials are not formed (tau = 0 or a query with no allowed key: -inf
    # and about -1e30, no block skipped)
    b_floor = b_m + tl.log2(tau * tl.maximum(b_l, 1.0)) - SKIP_MARGIN  # [BM]

    b_acc = tl.zeros([BM], dtype=tl.float32)
    for n0 in range(lo, hi, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < T
        b_k = tl.load(p_k + o_n[:, None] * s_kt + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision=PRECISION) * qk_scale  # [BM, BN]
        if SKIP:  # masked scores count in the max too: they can only keep a block
            b_hit = tl.max(tl.max(b_s - b_floor[:, None], 1), 0) >= 0
        else:
            b_hit = True
        if b_hit:
            b_rk = tl.load(real + p_row + o_n, mask=m_n, other=0) != 0  # [BN]
            b_dk = tl.load(documents + p_row + o_n, mask=m_n, other=0)  # [BN]
            b_sk = tl.load(sinks + p_row + o_n, mask=m_n, other=1) != 0  # [BN]
            b_xk = tl.load(positions + p_row + o_n, mask=m_n, other=0.0)  # [BN]
            b_ok = (o_n[None, :] <= o_m[:, None]) & b_rq[:, None] & b_rk[None, :] & (b_dk[None, :] == b_dq[:, None])
            if WINDOWED:
                b_ok = b_ok & (o_n[None, :] > o_m[:, None] - window)
            b_p = tl.exp2(tl.where(b_ok, b_s, float("-inf")) - b_m[:, None]) * b_il[:, None]  # [BM, BN] softmax
            # the sink column is zeroed after the softmax, then the threshold drops p < tau (no renormalising)
            b_keep = ~b_sk[None, :] & (b_p >= tau)
            b_acc += tl.sum(tl.where(b_keep, b_p * (b_xq[:, None] - b_xk[None, :]), 0.0), 1)
    tl.store(part + i_bh.to(tl.int64) * T + o_m, b_acc, mask=m_m)


def first_keys(real: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """[B, T] int32: for each query, no key before this one is allowed to it (a lower bound, exact for rows whose
    documents are contiguous runs, as padded rows and packed rows are). In a row whose document ids never decrease
    every document is one run, so query t sees no key before its run's first real token; in any other row, none
    before the row's first real token."""
    length = real.shape[1]
    idx = torch.arange(length, device=real.device)
    opens = torch.ones_like(real)
    opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
    run_start = torch.where(opens, idx, 0).cummax(dim=1).values  # [B, T]: first token of t's run of equal ids
    next_real = torch.where(real, idx, length).flip(1).cummin(dim=1).values.flip(1)  # [B, T]: first real at or after
    runs = (documents[:, 1:] >= documents[:, :-1]).all(dim=1, keepdim=True)  # [B, 1]: each document one run
    return torch.where(runs, next_real.gather(1, run_start), next_real[:, :1]).int()


def block_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BM queries, BN keys, warps) of a program: 64 x 64 with 4 warps was the fastest tried at d = 64 and 128
    (docs/lab/TRAINING_SPEED.md); 128 x 64 needs more shared memory than an H100/H200 has at d = 128."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 4)  # larger heads (not measured): half the keys per block


def attention_distance(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    real: torch.Tensor,
    positions: torch.Tensor,
    documents: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    tau: float,
    *,
    blocks: tuple[int, int] | None = None,
    first: torch.Tensor | None = None,
    skip_blocks: bool = True,
) -> torch.Tensor:
    """One layer's sum over query heads and keys of thresholded attention times distance: [B, T] float32.

    q [B, H, T, d], k [B, Hkv, T, d] (H a multiple of Hkv; query head h reads key head h // (H / Hkv), as
    transformers' repeat_kv; any strides, copied only if the head dim is strided; float32, bf16 or fp16); real,
    sinks [B, T] bool; positions [B, T] float; documents [B, T] integer ids (queries see keys of their own document
    only); window: keys j > t - window only (None: all); tau: the threshold. The same as `attention_distance_torch`
    up to rounding. `blocks`: (queries, keys) per program instead of `block_sizes` (powers of two, at least 16).
    `first`: `first_keys(real, documents)` on q's device, for a caller that runs several layers on one layout.
    `skip_blocks`: key blocks whose scores are all too low for any probability to reach tau are not formed in the
    second sweep (False forms every one, as the kernel did before: for tests and benchmarks; the results are the same).
    """
    B, H, T, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    Hkv = k.shape[1] if k.dim() == 4 else 0
    if q.dim() != 4 or k.shape != (B, Hkv, T, D) or Hkv == 0 or H % Hkv:
        raise ValueError(
            f"attention_distance takes q [B, H, T, d] and k [B, Hkv, T, d] with H a multiple of Hkv; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}"
        )
    for name, x in (("real", real), ("positions", positions), ("documents", documents), ("sinks", sinks)):
        if tuple(x.shape) != (B, T):
            raise ValueError(f"attention_distance: {name} has shape {tuple(x.shape)}, expected [B, T] = {(B, T)}")
    if documents.is_floating_point() or documents.is_complex():
        raise ValueError(f"attention_distance: documents must hold integer ids, got {documents.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    device = q.device
    real = real.to(device=device, dtype=torch.bool).contiguous()
    documents = documents.to(device).contiguous()
    first = first_keys(real, documents) if first is None else first
    BM, BN, warps = block_sizes(D)
    if blocks is not None:
        BM, BN = blocks
    part = torch.empty(B, H, T, dtype=torch.float32, device=device)  # [B, H, T]: each head's sums
    half = q.dtype in (torch.bfloat16, torch.float16) and k.dtype in (torch.bfloat16, torch.float16)
    attention_distance_fwd_kernel[(triton.cdiv(T, BM), B * H)](
        q,
        k,
        real.view(torch.uint8),
        sinks.to(device=device, dtype=torch.bool).contiguous().view(torch.uint8),
        positions.to(device=device, dtype=torch.float32).contiguous(),
        documents,
        first,
        part,
        float(scaling) * LOG2E,
        float(tau),
        0 if window is None else int(window),
        T,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        H,
        H // Hkv,
        D,
        window is not None,
        BM,
        BN,
        max(16, triton.next_power_of_2(D)),
        "tf32" if half else FLOAT32_PRECISION,
        skip_blocks,
        num_warps=warps,
    )
    return part.sum(dim=1)


def block_distance(
    qb: Tensor,
    k_t: Tensor,
    scaling: float,
    rows: Tensor,
    window: int | None,
    real: Tensor,
    documents: Tensor,
    positions: Tensor,
    keys_ok: Tensor,
    tau: float,
) -> Tensor:
    """One block of queries `rows` [b]: sum over heads and keys of thresholded attention times distance, [B, b].

    qb [B, Hkv, G, b, d], k_t [B, Hkv, 1, d, T]; real, documents, positions [B, T] (real tokens, document ids,
    positions within documents); keys_ok [B, T] (real keys that are not a sink). The block's [B, H, b, T] scores
    and masks exist only here, so that the compiled block (`compiled_block_distance`) fuses them into a few
    kernels."""
    batch, n_kv, group, b, _ = qb.shape
    idx = torch.arange(k_t.shape[-1], device=qb.device)  # [T] keys
    allowed = idx[None, :] <= rows[:, None]  # [b, T] causal
    if window is not None:
        allowed = allowed & (idx[None, :] > rows[:, None] - window)
    at = (slice(None), rows)  # the block's queries of a [B, T] tensor
    allowed = allowed[None] & real[:, None, :] & real[at][:, :, None]  # [B, b, T]
    allowed = allowed & (documents[:, None, :] == documents[at][:, :, None])
    scores = (qb @ k_t).reshape(batch, n_kv * group, b, -1) * scaling  # [B, H, b, T]
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)  # rows with nothing allowed are zeroed next
    probs = probs * (allowed & keys_ok[:, None, :])[:, None]  # pads, future and sink column -> 0
    probs = probs * (probs >= tau)  # threshold, no renormalisation
    distance = positions[at][:, :, None] - positions[:, None, :]  # [B, b, T]: t - j
    return (probs.sum(dim=1) * distance).sum(dim=-1)  # over heads, then keys


@functools.cache
def compiled_block_distance() -> Callable[..., Tensor]:
    """`block_distance` through torch.compile, one per process (its graphs are kept across calls)."""
    return torch.compile(block_distance)  # a new shape (the last block or batch) compiles once more


def attention_distance_torch(
    q: Tensor,
    k: Tensor,
    scaling: float,
    real: Tensor,
    positions: Tensor,
    documents: Tensor,
    sinks: Tensor,
    window: int | None,
    tau: float,
    query_block: int = 256,
    compiled: bool = False,
) -> Tensor:
    """One layer: sum over query heads and keys of thresholded attention times distance, [B, T] float32.

    q [B, H, T, d], k [B, Hkv, T, d] (H a multiple of Hkv; query head h reads key head h // (H / Hkv), as
    transformers' repeat_kv); real, sinks [B, T] bool; positions [B, T] float; documents [B, T] (queries see keys of
    their own document only); window: keys j > t - window only (None: all). Query t's softmax runs in float32 over
    its allowed keys (j <= t, inside the window, real, same document; none allowed: all zeros), then the sink and
    pad columns are zeroed, probabilities below tau dropped, and p * (positions[t] - positions[j]) summed.
    Streams over blocks of `query_block` queries, each `block_distance` or, with `compiled`, its
    torch.compile'd form: peak extra memory O(B * H * query_block * T).
    """
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    block = compiled_block_distance() if compiled else block_distance
    q, k = q.float(), k.float()
    batch, n_heads, length, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    idx = torch.arange(length, device=q.device)
    keys_ok = real & ~sinks  # [B, T]: real keys that are not a sink
    k_t = k.transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, d, T]
    out = torch.zeros(batch, length, dtype=torch.float32, device=q.device)
    for start in range(0, length, query_block):
        stop = min(start + query_block, length)
        # query head h uses kv head h // group (transformers' repeat_kv)
        qb = q[:, :, start:stop].reshape(batch, n_kv, group, stop - start, head_dim)  # [B, Hkv, G, b, d]
        out[:, start:stop] += block(qb, k_t, scaling, idx[start:stop], window, real, documents, positions, keys_ok, tau)
    return out
