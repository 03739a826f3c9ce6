"""Raven step by step, for decoding: each step rewrites only the K selected slots of S^k and S^v in place and reads
every slot once, the softmax over slots done online while the slots stream by."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..decode_checks import check_in_place, check_row_views, check_shapes
from ..launch import LaunchSetting, dependent_launch, wait_for_inputs
from ..rows import indices_by_score, rows_rms_norm, softplus, top_indices_by_score
from ..split import Partials, merge_if_last, row_counters, split_count
from .utils import check_inputs, slot_indices


def decode_config(M: int, G: int, D: int) -> tuple[int, int]:
    """Slots per block of the streaming loop ([BM, D] float32 tiles of S^k and S^v) and warps per program: 8-slot
    blocks at one warp were the fastest of the sweeps over block sizes and warps, at 1 and at 3 query heads a key
    head (docs/KERNELS.md, Settings: Raven decode blocks)."""
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    return max(1, min(8, triton.next_power_of_2(M), 2048 // (BG * BD))), 1


RANGE_BLOCKS = (2, 8)  # the fewest and most blocks a range of slots streams where they split (`slot_ranges`)
LEAST_RANGES = 2  # a head's slots split in two at least, where it has the blocks: one program streaming a small state
# alone is slower than two halves and their merge (M = 64 at batch 128)


TOP_K_BY = ("rounds", "sort")  # how a program finds its head's top-K slots: K rounds of a max, or a sort of all M
DECODE_TOP_K_BY = "sort"  # the faster at batch 1, 32 and 128 (M = 256, top-32: docs/KERNELS.md)


@dataclass(frozen=True)
class StepSplit:
    """How `raven_decode_step` launches, where set: slots a block, warps a program, ranges a head, and how each
    program finds the top-K slots (None: its own choice, `decode_config`, `slot_ranges` and DECODE_TOP_K_BY).
    scripts/bench/sweep_raven_decode.py times the choices."""

    block: int | None = None
    warps: int | None = None
    ranges: int | None = None
    top_k_by: str | None = None

    def __post_init__(self):
        if self.top_k_by not in (None, *TOP_K_BY):
            raise ValueError(f"top_k_by={self.top_k_by!r}: expected one of {TOP_K_BY} or None")


STEP_SPLIT = LaunchSetting(StepSplit())


def step_split(split: StepSplit):
    """Every `raven_decode_step` call within launches as `split` says (the sweep's way to try them; not
    thread-safe)."""
    return STEP_SPLIT.use(split)


def slot_ranges(rows: int, blocks: int, warps: int, device: torch.device) -> int:
    """Ranges the slots of each of `rows` heads split into for one token: ranges of RANGE_BLOCKS[1] blocks (a
    longer stream costs a program more than merging a few ranges costs) and LEAST_RANGES of them at least, shorter,
    down to RANGE_BLOCKS[0], only where rows x ranges would leave an SM fewer than 2 one-warp programs (batch 1's
    few heads). The fastest of sweep_raven_decode.py's choices at batch 1, 32 and 128, at M = 256 and 64
    (docs/KERNELS.md)."""
    least, most = max(LEAST_RANGES, blocks // RANGE_BLOCKS[1]), blocks // RANGE_BLOCKS[0]
    wanted = split_count(rows, blocks, device, per_sm=max(1, 2 // warps))
    return max(1, min(max(wanted, triton.next_power_of_2(least)), most))


def values_shared(BM: int, BD: int, warps: int) -> bool:
    """Whether a [BM, BD] block of the state has fewer values than the program has threads, so that some values are
    held by two threads, whose in-place update must not race (`slot_pass`)."""
    return BM * BD < 32 * warps


@triton.jit
def slot_pass(sk, sv, p_s, b_q, b_k, b_v, b_i, b_lfk, first, MB, M: tl.constexpr, D: tl.constexpr,
              BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
    """One token over slot blocks [first, first + MB) of one head's state (S^k, S^v at offset p_s, [M, D] each):
    the K routed slots (b_i [BK], log-retention b_lfk) are rewritten in place, and every slot is read by the
    queries b_q [BG, BD] with an online softmax. Returns the running max [BG], sum [BG] and weighted values."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_mx = tl.full([BG], -1e30, dtype=tl.float32)  # finite: a range of padding slots weighs 0, not NaN
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_o = tl.zeros([BG, BD], dtype=tl.float32)
    for i_m in range(first, first + MB):  # this program's range of slot blocks
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < M
        m_md = m_m[:, None] & m_d[None, :]
        p_md = p_s + o_m[:, None] * D + o_d[None, :]
        b_lf = tl.sum(tl.where(b_i[None, :] == o_m[:, None], b_lfk[None, :], 0.0), 1)  # [BM]
        series = -b_lf * (1.0 + b_lf * (0.5 + b_lf * (1.0 / 6.0 + b_lf * (1.0 / 24.0 + b_lf / 120.0))))
        b_w = tl.where(b_lf > -0.1, series, 1.0 - tl.exp(b_lf))[:, None]  # 1 - exp(log_f), exact when tiny
        b_f = tl.exp(b_lf)[:, None]
        b_sk = b_f * tl.load(sk + p_md, mask=m_md, other=0.0) + b_w * b_k[None, :]  # [BM, BD]
        b_sv = b_f * tl.load(sv + p_md, mask=m_md, other=0.0) + b_w * b_v[None, :]
        m_w = m_md & (b_lf < 0.0)[:, None]  # only the written slots go back
        if SHARED:  # a block's values held by several threads: every one reads them before any writes them back
            tl.debug_barrier()
        tl.store(sk + p_md, b_sk, mask=m_w)
        tl.store(sv + p_md, b_sv, mask=m_w)
        b_s = tl.sum(b_q[:, None, :] * b_sk[None, :, :], 2)  # [BG, BM]
        b_s = tl.where(m_m[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_mx, tl.max(b_s, 1))
        b_alpha = tl.exp(b_mx - b_mn)
        b_p = tl.exp(b_s - b_mn[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_o = b_o * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_sv[None, :, :], 1)
        b_mx = b_mn
    return b_mx, b_l, b_o


@triton.jit
def store_read(o, m_part, l_part, o_part, counter, p_gd, b_mx, b_l, b_o, i_nh, i_sp, G: tl.constexpr,
               D: tl.constexpr, NS: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    """The read of `slot_pass` into o at p_gd [BG, BD] (one range), or as this range's partials, the row merged by
    its last range to finish."""
    o_g, o_d = tl.arange(0, BG), tl.arange(0, BD)
    if NS == 1:
        tl.store(o + p_gd, (b_o / b_l[:, None]).to(o.dtype.element_ty), mask=(o_g < G)[:, None] & (o_d < D)[None, :])
    else:  # one token (T == 1): the ranges' partial readouts
        p_part = (i_nh * NS + i_sp) * BG + o_g
        tl.store(m_part + p_part, b_mx)
        tl.store(l_part + p_part, b_l)
        tl.store(o_part + p_part[:, None] * BD + o_d[None, :], b_o)
        merge_if_last(m_part, l_part, o_part, o, counter, i_nh, G, D, NS, BG, BD, BG, BS)  # BG: no padding


@triton.jit
def raven_fwd_kernel_fused_recurrent(
    q,
    k,
    v,
    a,
    idx,
    r,
    sk,
    sv,
    o,
    m_part,
    l_part,
    o_part,
    counter,
    cu_seqlens,
    scale,
    T,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    K: tl.constexpr,
    BG: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    NS: tl.constexpr,
    MB: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BS: tl.constexpr,
    SHARED: tl.constexpr,
):
    i_nh, i_sp = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = i_n * T, i_n * T + T
    o_g, o_d, o_k = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BK)
    m_g, m_d, m_k = o_g < G, o_d < D, o_k < K
    p_s = (i_n * H + i_h) * M * D
    for t in range(bos, eos):
        p_gd = ((t * H + i_h) * G + o_g[:, None]) * D + o_d[None, :]
        b_q = tl.load(q + p_gd, mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale  # [BG, BD]
        b_k = tl.load(k + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_a = tl.load(a + t * H + i_h).to(tl.float32)
        b_i = tl.load(idx + (t * H + i_h) * K + o_k, mask=m_k, other=-1)
        b_lfk = b_a * tl.load(r + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_mx, b_l, b_o = slot_pass(sk, sv, p_s, b_q, b_k, b_v, b_i, b_lfk, i_sp * MB, MB, M, D, BG, BM, BD, SHARED)
        store_read(o, m_part, l_part, o_part, counter, p_gd, b_mx, b_l, b_o, i_nh, i_sp, G, D, NS, BG, BD, BS)
        tl.debug_barrier()  # this step's writes land before the next step reads the slots


@triton.jit
def raven_fwd_kernel_decode(
    q, k, v, logits, decay_x, stride_q, stride_k, stride_v, stride_l, stride_d, decay_bias, decay_log_scale, q_norm,
    k_norm, norm_eps, mask, sk, sv, o, m_part, l_part, o_part, counter, scale, alpha,
    H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr, K: tl.constexpr, BG: tl.constexpr,
    BM: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BMALL: tl.constexpr, NS: tl.constexpr, MB: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, SILU: tl.constexpr, HAS_MASK: tl.constexpr, BS: tl.constexpr,
    TOPK_SORT: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One decode step of a Raven layer from its projections, grid (N * H, NS): the q/k norms and feature map, the
    router's top-K of the slot logits [M] (K rounds of a max, or with TOPK_SORT a sort) and their weights, the
    write decay, then `slot_pass` over this program's range of slots (the state rewritten in place), the ranges
    merged by the last of each row to finish."""
    wait_for_inputs(PDL)
    i_nh, i_sp = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_g, o_d, o_k = tl.arange(0, BG), tl.arange(0, BD), tl.arange(0, BK)
    m_g, m_d = o_g < G, o_d < D
    b_q = tl.load(q + i_n * stride_q + (i_h * G + o_g[:, None]) * D + o_d[None, :],
                  mask=m_g[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # fmt: skip
    b_k = tl.load(k + i_n * stride_k + i_h * D + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)
    b_v = tl.load(v + i_n * stride_v + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        b_q = rows_rms_norm(b_q, q_norm, o_d, m_d, norm_eps, D)
        b_k = rows_rms_norm(b_k, k_norm, o_d, m_d, norm_eps, D)
    if SILU:
        b_q = b_q * tl.sigmoid(b_q)
        b_k = b_k * tl.sigmoid(b_k)
    b_k = tl.sum(b_k, 0)  # [BD]
    # the router: top-K slots of the logits (in the prefill topk_slots' order), weights sigmoid / (alpha sum)
    o_all = tl.arange(0, BMALL)
    b_logit = tl.load(logits + i_n * stride_l + i_h * M + o_all[None, :], mask=(o_all < M)[None, :],
                      other=float("-inf")).to(tl.float32)  # fmt: skip
    if TOPK_SORT:  # [BK] the best slots, best first (each range alike)
        b_sorted = indices_by_score(b_logit, M, BMALL)  # [1, BMALL]
        b_i = tl.sum(tl.where(o_all[None, :] == o_k[:, None], b_sorted, 0), 1)
    else:
        b_i = top_indices_by_score(b_logit, M, BMALL, BK)
    b_top = tl.max(tl.where(o_all[None, :] == b_i[:, None], b_logit, float("-inf")), 1)  # [BK] their logits
    b_sig = tl.where(o_k < K, tl.sigmoid(b_top), 0.0)  # the entries past K write nothing
    b_r = b_sig / (alpha * tl.sum(b_sig, 0))
    b_dx = tl.load(decay_x + i_n * stride_d + i_h).to(tl.float32) + tl.load(decay_bias + i_h).to(tl.float32)
    b_a = -softplus(b_dx) * tl.exp(tl.load(decay_log_scale + i_h).to(tl.float32))
    if HAS_MASK:
        b_a = tl.where(tl.load(mask + i_n) != 0, b_a, 0.0)  # padding neither writes nor decays
    b_lfk = b_a * b_r
    p_s = (i_n * H + i_h).to(tl.int64) * M * D
    b_mx, b_l, b_o = slot_pass(sk, sv, p_s, b_q * scale, b_k, b_v, b_i, b_lfk, i_sp * MB, MB, M, D, BG, BM, BD, SHARED)
    p_gd = ((i_n * H + i_h) * G + o_g[:, None]) * D + o_d[None, :]
    store_read(o, m_part, l_part, o_part, counter, p_gd, b_mx, b_l, b_o, i_nh, i_sp, G, D, NS, BG, BD, BS)


def fused_recurrent_raven(
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
    """Raven one token at a time (decoding), forward only. The initial state is updated IN PLACE (it must be
    float32 and contiguous) and returned as the final state; without one, zeros are used.

    Args:
        q: [B, T, H, G, d]; k, v: [B, T, H, d]; a: [B, T, H]; idx, r: [B, T, H, K] (as in `chunk_raven`).
        initial_state: (S^k, S^v), each [N, H, M, d] float32, overwritten with the final state.
        cu_seqlens: [N + 1] offsets of sequences packed along T (B == 1).

    Returns:
        o [B, T, H, G, d] in q's dtype, and (S^k, S^v) each [N, H, M, d] float32 or None.
    """
    check_inputs(q, k, v, a, idx, r, num_slots, initial_state, cu_seqlens)
    B, _, H, _, D = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = tuple(q.new_zeros(N, H, num_slots, D, dtype=torch.float32) for _ in range(2))
    for name, s in zip(("S^k", "S^v"), initial_state):
        if s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(
                f"initial state {name} is updated in place: it must be contiguous float32, "
                f"got {s.dtype}{'' if s.is_contiguous() else ', not contiguous'}"
            )
    q, k, v, a, r = (x.contiguous() for x in (q, k, v, a, r))
    o = raven_decode(q, k, v, a, slot_indices(idx), r, *initial_state, cu_seqlens, float(scale), num_slots)
    return o, (initial_state if output_final_state else None)


@torch.library.custom_op("raven_hybrid::raven_decode", mutates_args=("sk", "sv"))
def raven_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    idx: torch.Tensor,
    r: torch.Tensor,
    sk: torch.Tensor,
    sv: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    num_slots: int,
) -> torch.Tensor:
    """The kernel launch of `fused_recurrent_raven` (checked, contiguous inputs) as a custom op that updates the
    state (sk, sv) in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, T, H, G, D = q.shape
    K, M = idx.shape[-1], num_slots
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(q)
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    BM, warps = decode_config(M, G, D)
    blocks = triton.cdiv(M, BM)
    NS = slot_ranges(N * H, blocks, warps, q.device) if T == 1 and cu_seqlens is None else 1  # one token a sequence
    part = Partials(N * H, NS, G, D, q.device) if NS > 1 else None
    raven_fwd_kernel_fused_recurrent[(N * H, NS)](
        q,
        k,
        v,
        a,
        idx,
        r,
        sk,
        sv,
        o,
        part and part.m,
        part and part.l,
        part and part.o,
        part and row_counters(N * H, q.device),
        cu_seqlens,
        float(scale),
        T,
        H,
        G,
        M,
        D,
        K,
        BG,
        BM,
        BD,
        triton.next_power_of_2(K),
        NS,
        triton.cdiv(blocks, NS),
        cu_seqlens is not None,
        part.ranges_per_load(part.BG) if part else 1,
        values_shared(BM, BD, warps),
        num_warps=warps,
    )
    return o


@raven_decode.register_fake
def _(q, k, v, a, idx, r, sk, sv, cu_seqlens, scale, num_slots):
    return torch.empty_like(q)


def fused_recurrent_raven_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    logits: torch.Tensor,
    decay_x: torch.Tensor,
    decay_bias: torch.Tensor,
    decay_log_scale: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    top_k: int,
    alpha: float,
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_eps: float = 1e-6,
    feature_map: str = "silu",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of a Raven layer from its projections, in one kernel (the slots' ranges, where they split over
    several programs, merged by the last of each row) that rewrites the state (S^k, S^v) in place: what
    `raven_layers.raven.RavenMixer.projections` and `route` and then `fused_recurrent_raven` compute at T == 1,
    with no launch for the norms, the feature map or the router's top-K. No gradients.

    Args:
        q: [B, 1, H * G * d], k and v: [B, 1, H * d]: the projections of the new token (rows may be strided views of
            one product, the last dim contiguous).
        logits: [B, 1, H * M], the router's slot scores; decay_x: [B, 1, H], the write decay's product before its
            bias `decay_bias` [H]; decay_log_scale: [H].
        state: (S^k, S^v), each [B, H, M, d] float32 contiguous, rewritten in place.
        scale: the query scale; top_k, alpha: the router's K and its weights' normaliser (r = s / (alpha sum s)).
        qk_norms: the RMSNorm weights [d] of q and k, applied first, with `norm_eps`.
        feature_map: "silu" or "identity", on q and k after their norms.
        mask: [B, 1] bool, False where the token is padding (it neither writes nor decays).

    Returns:
        o: [B, 1, H, G, d] in q's dtype.
    """
    sk, sv = state
    B, H, M, D = sk.shape
    G = q.shape[-1] // (H * D) if H * D else 0
    expected = {
        "q": (q, (B, 1, H * G * D)),
        "k": (k, (B, 1, H * D)),
        "v": (v, (B, 1, H * D)),
        "logits": (logits, (B, 1, H * M)),
        "decay_x": (decay_x, (B, 1, H)),
        "decay_bias": (decay_bias, (H,)),
        "decay_log_scale": (decay_log_scale, (H,)),
        "S^v": (sv, (B, H, M, D)),
    }
    check_shapes(expected, f"S^k {tuple(sk.shape)} and q")
    check_row_views({"q": q, "k": k, "v": v, "logits": logits, "decay_x": decay_x})
    check_in_place({"S^k": sk, "S^v": sv})
    if not 1 <= top_k <= M:
        raise ValueError(f"top_k = {top_k} must lie in [1, num_slots = {M}]")
    if feature_map not in ("silu", "identity"):
        raise ValueError(f"feature_map must be 'silu' or 'identity', got {feature_map!r}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, 1)):
        raise ValueError(f"mask must be a bool tensor [B, 1] = {(B, 1)}, got {mask.dtype} {tuple(mask.shape)}")
    tensors = (q, k, v, logits, decay_x, decay_bias, decay_log_scale, *(qk_norms or ()))
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*tensors, sk, sv)):
        raise ValueError("fused_recurrent_raven_decode computes no gradients; use chunk_raven to train")
    q_norm, k_norm = qk_norms if qk_norms is not None else (None, None)
    return raven_decode_step(
        q, k, v, logits, decay_x, decay_bias.contiguous(), decay_log_scale.contiguous(), q_norm, k_norm,
        float(norm_eps), None if mask is None else mask.contiguous().view(torch.uint8), sk, sv, float(scale),
        int(top_k), float(alpha), feature_map == "silu",
    )  # fmt: skip


@torch.library.custom_op("raven_hybrid::raven_decode_step", mutates_args=("sk", "sv"))
def raven_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    logits: torch.Tensor,
    decay_x: torch.Tensor,
    decay_bias: torch.Tensor,
    decay_log_scale: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    norm_eps: float,
    mask: torch.Tensor | None,
    sk: torch.Tensor,
    sv: torch.Tensor,
    scale: float,
    top_k: int,
    alpha: float,
    silu: bool,
) -> torch.Tensor:
    """The launches of `fused_recurrent_raven_decode` (checked inputs) as a custom op that updates the state
    (sk, sv) in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, H, M, D = sk.shape
    G = q.shape[-1] // (H * D)
    o = q.new_empty(B, 1, H, G, D)
    BG, BD = triton.next_power_of_2(G), triton.next_power_of_2(D)
    BM, warps = decode_config(M, G, D)
    split = STEP_SPLIT.value
    BM, warps = split.block or BM, split.warps or warps
    blocks = triton.cdiv(M, BM)
    NS = split.ranges or slot_ranges(B * H, blocks, warps, q.device)
    part = Partials(B * H, NS, G, D, q.device) if NS > 1 else None
    if B * H:
        raven_fwd_kernel_decode[(B * H, NS)](
            q, k, v, logits, decay_x, q.stride(0), k.stride(0), v.stride(0), logits.stride(0), decay_x.stride(0),
            decay_bias, decay_log_scale, q_norm, k_norm, norm_eps, mask, sk, sv, o, part and part.m,
            part and part.l, part and part.o, part and row_counters(B * H, q.device), scale, alpha, H=H, G=G, M=M,
            D=D, K=top_k, BG=BG, BM=BM, BD=BD, BK=triton.next_power_of_2(top_k), BMALL=triton.next_power_of_2(M),
            NS=NS, MB=triton.cdiv(blocks, NS), HAS_QK_NORM=q_norm is not None, SILU=silu, HAS_MASK=mask is not None,
            BS=part.ranges_per_load(part.BG) if part else 1, TOPK_SORT=(split.top_k_by or DECODE_TOP_K_BY) == "sort",
            SHARED=values_shared(BM, BD, warps), num_warps=warps, **dependent_launch(q.device),
        )  # fmt: skip
    return o


@raven_decode_step.register_fake
def _(q, k, v, logits, decay_x, decay_bias, decay_log_scale, q_norm, k_norm, norm_eps, mask, sk, sv, scale, top_k,
      alpha, silu):  # fmt: skip
    B, H, M, D = sk.shape
    return q.new_empty(B, 1, H, q.shape[-1] // (H * D), D)
