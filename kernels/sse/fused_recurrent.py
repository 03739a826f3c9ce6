"""SSE decode steps (Triton): each (batch row, kv head) gathers only the partitions its tokens select, updates them
in place and reads them, one token after another: S^i = diag(exp(log_g)) S^i + k^T v, o = scale sum_i q^i S^i.
`fused_recurrent_sse` takes the routed inputs; `fused_recurrent_sse_decode` a generation step from the layer's
products (every partition's first LoRA products among them), routing, the LoRA's second products, gate and
read-out included, in one kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..decode_checks import check_in_place, check_row_views, check_shapes
from ..launch import LaunchSetting, dependent_launch, wait_for_inputs
from ..rows import indices_by_score, rows_rms_norm, softplus
from ..split import programs_wanted
from .chunk import _new


@triton.jit
def sse_fwd_kernel_decode(
    q,
    k,
    v,
    g,
    idx,
    state,
    o,
    scale,
    T,
    H: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    P: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BG: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_g, o_k, o_v = tl.arange(0, BG), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_g, m_k, m_v = o_g < G, o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    for t in range(T):
        tok = i_b.to(tl.int64) * T + t
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_o = tl.zeros([BG, BV], dtype=tl.float32)
        for m in range(M):
            e = (tok * H + i_h) * M + m  # entry of this token
            i_p = tl.load(idx + e).to(tl.int64)
            b_k = tl.load(k + e * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            b_g = tl.load(g + e * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            p_s = state + ((i_bh.to(tl.int64) * P + i_p) * K + o_k[:, None]) * V + o_v[None, :]
            b_s = tl.load(p_s, mask=m_kv, other=0.0) * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]  # [BK, BV]
            tl.store(p_s, b_s, mask=m_kv)
            for i_g in range(G):
                b_q = tl.load(q + (((tok * H + i_h) * G + i_g) * M + m) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_o = tl.where((o_g == i_g)[:, None], b_o + tl.sum(b_q[:, None] * b_s, axis=0)[None, :], b_o)
        p_o = o + ((tok * H + i_h) * G + o_g[:, None]) * V + o_v[None, :]
        tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_g[:, None] & m_v[None, :])
        tl.debug_barrier()  # the next token reads what this one stored


def fused_recurrent_sse(q, k, v, log_g, idx, num_partitions: int, scale: float, initial_state=None):
    """SSE recurrence for decoding (forward only; same arguments and results as `sse_recurrent`).

    Only the partitions in `idx` are read or written. A float32 contiguous `initial_state` is updated in place and
    returned; any other is copied to float32 first, and None starts from zeros.

    Args:
        q: [B, T, H, G, M, c]; k, log_g: [B, T, H, M, c]; v: [B, T, H, d]; idx: [B, T, H, M] in [0, P), distinct
            within a token.
        num_partitions: P, partitions of the state (routed + shared).
        initial_state: [B, H, P, c, d]; zeros when None.

    Returns:
        o: [B, T, H, G, d] in q's dtype, and the state [B, H, P, c, d] float32.
    """
    B, T, H, G, M, K = q.shape
    V, P = v.shape[-1], num_partitions
    if initial_state is None:
        state = q.new_zeros(B, H, P, K, V, dtype=torch.float32)
    elif initial_state.shape != (B, H, P, K, V):
        raise ValueError(f"fused_recurrent_sse: initial_state {tuple(initial_state.shape)}; expected {(B, H, P, K, V)}")
    elif initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state
    else:
        state = initial_state.float().contiguous()
    q, k, v, log_g, idx = (x.contiguous() for x in (q, k, v, log_g, idx))
    return sse_decode(q, k, v, log_g, idx, state, float(scale)), state


@torch.library.custom_op("raven_hybrid::sse_decode", mutates_args=("state",))
def sse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    idx: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel launch of `fused_recurrent_sse` (checked, contiguous inputs) as a custom op that updates `state`
    [B, H, P, c, d] in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, T, H, G, M, K = q.shape
    V, P = v.shape[-1], state.shape[2]
    o = _new((B, T, H, G, V), q, q.dtype)
    BK, BV = max(16, triton.next_power_of_2(K)), min(64, max(16, triton.next_power_of_2(V)))
    if B * H and T:
        sse_fwd_kernel_decode[(B * H, triton.cdiv(V, BV))](
            q, k, v, log_g, idx, state, o, scale, T, H, G, M, P, K, V, triton.next_power_of_2(G), BK, BV, num_warps=4
        )
    return o


@sse_decode.register_fake
def _(q, k, v, log_g, idx, state, scale):
    return q.new_empty(*q.shape[:-2], v.shape[-1])


@triton.jit
def lora_up(b, i_p, ROWS, row0, b_y, C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """Rows row0 .. row0 + C of B^i y [BC]: partition i_p's second LoRA factor b [N, ROWS, R] times b_y [BR]."""
    o_c, o_r = tl.arange(0, BC), tl.arange(0, BR)
    p_b = b + (i_p * ROWS + row0 + o_c[:, None]).to(tl.int64) * R + o_r[None, :]
    b_b = tl.load(p_b, mask=(o_c < C)[:, None] & (o_r < R)[None, :], other=0.0).to(tl.float32)  # [BC, BR]
    return tl.sum(b_b * b_y[None, :], 1)


@triton.jit
def key_softmax(b_l, m_c):
    """softmax of key logits b_l [BC] over the partition's rows m_c."""
    b_l = tl.where(m_c, b_l, float("-inf"))
    b_p = tl.exp(b_l - tl.max(b_l, 0))
    return b_p / tl.sum(b_p, 0)


@triton.jit
def sse_fwd_kernel_step(
    q, k, v, e, dx, og, qa, ka, stride_q, stride_k, stride_v, stride_e, stride_dx, stride_og, stride_qa, stride_ka,
    q_lora_b, k_lora_b, decay_up, decay_bias, o_norm, norm_eps, mask, state, o, scale, inv_tau,
    H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, C: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    RA: tl.constexpr, WK: tl.constexpr, RK: tl.constexpr, SHARED: tl.constexpr, NORM: tl.constexpr,
    GATED: tl.constexpr, HAS_MASK: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
    BD: tl.constexpr, BR: tl.constexpr, BRA: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One decode step of an SSE layer from its products, one program per (sequence, kv head): the router's
    partitions best first, their LoRA'd keys (softmax over the C rows) and queries from every partition's first
    LoRA products qa, ka [B, N R], the GLA gate from its low-rank product, the writes and reads of the top
    partitions and the shared one in the state [B, H, P, C, D] (in place), then the read's per-head RMSNorm and
    output gate."""
    wait_for_inputs(PDL)
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    P: tl.constexpr = N + SHARED
    MM: tl.constexpr = WK if WK > RK else RK  # entries: the top max(k, k') partitions
    o_g, o_n, o_c, o_d, o_ra = tl.arange(0, BG), tl.arange(0, BN), tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BRA)
    o_r = tl.arange(0, BR)
    m_g, m_c, m_d = o_g < G, o_c < C, o_d < D
    m_cd = m_c[:, None] & m_d[None, :]
    b_live = i_b >= 0  # a real token
    if HAS_MASK:
        b_live = tl.load(mask + i_b) != 0
    b_e = tl.load(e + i_b * stride_e + i_h * N + o_n, mask=o_n < N, other=float("-inf")).to(tl.float32)  # [BN]
    b_top = indices_by_score(b_e[None, :], N, BN)  # [1, BN] partitions, best first
    b_dx = tl.load(dx + i_b * stride_dx + o_ra, mask=o_ra < RA, other=0.0).to(tl.float32)  # [BRA] W_a1 x
    p_up = decay_up + (i_h * C + o_c[:, None]) * RA + o_ra[None, :]
    b_up = tl.load(p_up, mask=m_c[:, None] & (o_ra < RA)[None, :], other=0.0).to(tl.float32)  # [BC, BRA]
    b_za = tl.sum(b_up * b_dx[None, :], 1) + tl.load(decay_bias + i_h * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_la = tl.where(b_live, -softplus(-b_za) * inv_tau, 0.0)  # [BC] log a = logsigmoid / tau; padding keeps S
    b_a = tl.exp(b_la)[:, None]  # [BC, 1]
    b_v = tl.load(v + i_b * stride_v + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_kb = tl.load(k + i_b * stride_k + i_h * C + o_c, mask=m_c, other=0.0).to(tl.float32)  # [BC] x W_k
    p_qb = q + i_b * stride_q + (i_h * G + o_g[:, None]) * C + o_c[None, :]
    b_qb = tl.load(p_qb, mask=m_g[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BG, BC] x W_q
    p_s0 = state + (i_b * H + i_h).to(tl.int64) * P * C * D + o_c[:, None] * D + o_d[None, :]
    b_o = tl.zeros([BG, BD], dtype=tl.float32)
    for m in tl.static_range(MM):
        i_p = tl.sum(tl.where(o_n[None, :] == m, b_top, 0))  # the m-th best partition
        p_s = p_s0 + i_p * C * D
        b_s = tl.load(p_s, mask=m_cd, other=0.0)  # [BC, BD]
        if m < WK:  # written: k = softmax(x (W_k + A_k^i B_k^i)) / k
            b_ak = tl.load(ka + i_b * stride_ka + i_p * R + o_r, mask=o_r < R, other=0.0).to(tl.float32)  # [BR]
            b_k = key_softmax(b_kb + lora_up(k_lora_b, i_p, H * C, i_h * C, b_ak, C, R, BC, BR), m_c) / WK
            b_s = b_a * b_s + tl.where(b_live, b_k, 0.0)[:, None] * b_v[None, :]
            tl.store(p_s, b_s, mask=m_cd)
        if m < RK:  # read, after the write: q = x (W_q + A_q^i B_q^i)
            b_aq = tl.load(qa + i_b * stride_qa + i_p * R + o_r, mask=o_r < R, other=0.0).to(tl.float32)  # [BR]
            for i_g in tl.static_range(G):
                b_qg = tl.sum(tl.where(o_g[:, None] == i_g, b_qb, 0.0), 0)  # [BC]
                b_qg += lora_up(q_lora_b, i_p, H * G * C, (i_h * G + i_g) * C, b_aq, C, R, BC, BR)
                b_o = tl.where(o_g[:, None] == i_g, b_o + tl.sum(b_qg[:, None] * b_s, 0)[None, :], b_o)
    if SHARED:  # the shared partition N: the base projections, a plain key softmax
        p_s = p_s0 + N * C * D
        b_s = tl.load(p_s, mask=m_cd, other=0.0)
        b_s = b_a * b_s + tl.where(b_live, key_softmax(b_kb, m_c), 0.0)[:, None] * b_v[None, :]
        tl.store(p_s, b_s, mask=m_cd)
        for i_g in tl.static_range(G):
            b_qg = tl.sum(tl.where(o_g[:, None] == i_g, b_qb, 0.0), 0)
            b_o = tl.where(o_g[:, None] == i_g, b_o + tl.sum(b_qg[:, None] * b_s, 0)[None, :], b_o)
    b_o *= scale
    if NORM:
        b_o = rows_rms_norm(b_o, o_norm, o_d, m_d, norm_eps, D)
    m_gd = m_g[:, None] & m_d[None, :]
    if GATED:
        p_og = og + i_b * stride_og + (i_h * G + o_g[:, None]) * D + o_d[None, :]
        b_o *= 2 * tl.sigmoid(tl.load(p_og, mask=m_gd, other=0.0).to(tl.float32))
    tl.store(o + (i_b * H * G + i_h * G + o_g[:, None]) * D + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_gd)


def fused_recurrent_sse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor,
    decay_x: torch.Tensor,
    lora_x: tuple[torch.Tensor, torch.Tensor],
    lora_b: tuple[torch.Tensor, torch.Tensor],
    decay_up: torch.Tensor,
    decay_bias: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    top_k: int,
    read_top_k: int,
    gate_normalizer: float,
    out_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    out_gate: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of an SSE layer from its products, in one kernel that updates the state in place: what
    `raven_layers.sse.SSEMixer.kernel_inputs`, `fused_recurrent_sse` and the read-out before o_proj compute at
    T == 1, with no launch for the router's top-k, the LoRA's second products, the key softmax, the gate, the norm or
    the output gate. No gradients.

    Args:
        q: [B, 1, H * G * c], k: [B, 1, H * c], v: [B, 1, H * d]: the base projections (rows may be strided views
            of one product, the last dim contiguous); H key/value heads of G query heads, c rows per partition.
        scores: [B, 1, H * N], the router's partition scores; decay_x: [B, 1, r_a], the gate's first product W_a1 x.
        lora_x: (A_q x, A_k x), each [B, 1, N * r]: every partition's first LoRA product of the layer's input
            (A [N, r, hidden] read as [N r, hidden]; row views like q's).
        lora_b: (B_q [N, H * G * c, r], B_k [N, H * c, r]), the partitions' second LoRA factors.
        decay_up: [H * c, r_a] and decay_bias: [H * c], the gate's second product and bias.
        state: [B, H, P, c, d] float32 contiguous, updated in place; P = N + 1 with the shared partition, else N.
        scale: the read's scale; top_k, read_top_k: partitions written and read per token; gate_normalizer: tau.
        out_norm: the per-head RMSNorm weight [d] of the read, with `norm_eps`; out_gate: [B, 1, H * G * d], the
            output gate's product (the read is multiplied by 2 sigmoid(out_gate)).
        mask: [B, 1] bool, False where the token is padding (it neither writes nor decays).

    Returns:
        o: [B, 1, H * G * d] in q's dtype, the input of o_proj.
    """
    B, H, P, C, D = state.shape
    (qa, ka), (qb, kb) = lora_x, lora_b
    N, R = qb.shape[0], qb.shape[-1]
    G = q.shape[-1] // (H * C) if H * C else 0
    RA = decay_x.shape[-1]
    expected = {
        "q": (q, (B, 1, H * G * C)),
        "k": (k, (B, 1, H * C)),
        "v": (v, (B, 1, H * D)),
        "scores": (scores, (B, 1, H * N)),
        "lora_x q": (qa, (B, 1, N * R)),
        "lora_x k": (ka, (B, 1, N * R)),
        "lora_b q": (qb, (N, H * G * C, R)),
        "lora_b k": (kb, (N, H * C, R)),
        "decay_up": (decay_up, (H * C, RA)),
        "decay_bias": (decay_bias, (H * C,)),
    }
    if out_norm is not None:
        expected["out_norm"] = (out_norm, (D,))
    if out_gate is not None:
        expected["out_gate"] = (out_gate, (B, 1, H * G * D))
    check_shapes(expected, f"the state {tuple(state.shape)}, lora_b q {tuple(qb.shape)} and q")
    products = {"q": q, "k": k, "v": v, "scores": scores, "decay_x": decay_x, "lora_x q": qa, "lora_x k": ka}
    products["out_gate"] = out_gate
    check_row_views(products)
    check_in_place({"the state": state})
    if P not in (N, N + 1):
        raise ValueError(f"the state holds P = {P} partitions; expected N = {N} or N + 1 (with the shared one)")
    for name, top in (("top_k", top_k), ("read_top_k", read_top_k)):
        if not 1 <= top <= N:
            raise ValueError(f"{name} = {top} must lie in [1, num_partitions = {N}]")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, 1)):
        raise ValueError(f"mask must be a bool tensor [B, 1] = {(B, 1)}, got {mask.dtype} {tuple(mask.shape)}")
    weights = (qb, kb, decay_up, decay_bias, *(() if out_norm is None else (out_norm,)))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*products.values(), *weights, state) if t is not None):
        raise ValueError("fused_recurrent_sse_decode computes no gradients; use chunk_gla under sse_masking to train")
    return sse_decode_step(
        q, k, v, scores, decay_x, out_gate, qa, ka, *(t.contiguous() for t in (qb, kb, decay_up, decay_bias)),
        out_norm, float(norm_eps), None if mask is None else mask.contiguous().view(torch.uint8), state,
        float(scale), int(top_k), int(read_top_k), 1.0 / float(gate_normalizer),
    )  # fmt: skip


# a decode step's warps where set (else step_warps'): `DECODE_WARPS.use(w)`, as scripts/bench/sweep_sse_decode.py times
DECODE_WARPS: LaunchSetting[int | None] = LaunchSetting(None)


def step_warps(C: int, D: int, programs: int, device: torch.device) -> int:
    """Warps of sse_fwd_kernel_step's (row, head) programs over [C, D] partitions: 8 past 64 x 64 (at head dim 128
    fewer spill, scripts/bench/kernel_resources.py); at 64 x 64 and under, 4 while every program has an SM to
    itself and 2 once they queue (scripts/bench/sweep_sse_decode.py; docs/KERNELS.md)."""
    if C * D > 64 * 64:
        return 8
    return 4 if programs <= programs_wanted(device, per_sm=1) else 2


@torch.library.custom_op("raven_hybrid::sse_decode_step", mutates_args=("state",))
def sse_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor,
    decay_x: torch.Tensor,
    out_gate: torch.Tensor | None,
    q_lora_x: torch.Tensor,
    k_lora_x: torch.Tensor,
    q_lora_b: torch.Tensor,
    k_lora_b: torch.Tensor,
    decay_up: torch.Tensor,
    decay_bias: torch.Tensor,
    out_norm: torch.Tensor | None,
    norm_eps: float,
    mask: torch.Tensor | None,
    state: torch.Tensor,
    scale: float,
    top_k: int,
    read_top_k: int,
    inv_tau: float,
) -> torch.Tensor:
    """The launch of `fused_recurrent_sse_decode` (checked inputs) as a custom op that updates `state` in place:
    torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, H, P, C, D = state.shape
    N, R = q_lora_b.shape[0], q_lora_b.shape[-1]
    G = q.shape[-1] // (H * C)
    o = q.new_empty(B, 1, H * G * D)
    if B * H:
        sse_fwd_kernel_step[(B, H)](
            q, k, v, scores, decay_x, out_gate, q_lora_x, k_lora_x, q.stride(0), k.stride(0), v.stride(0),
            scores.stride(0), decay_x.stride(0), 0 if out_gate is None else out_gate.stride(0), q_lora_x.stride(0),
            k_lora_x.stride(0), q_lora_b, k_lora_b, decay_up, decay_bias, out_norm, norm_eps, mask, state, o, scale,
            inv_tau, H=H, G=G, N=N, C=C, D=D, R=R, RA=decay_x.shape[-1], WK=top_k, RK=read_top_k, SHARED=P - N,
            NORM=out_norm is not None, GATED=out_gate is not None, HAS_MASK=mask is not None,
            BG=triton.next_power_of_2(G), BN=triton.next_power_of_2(N), BC=triton.next_power_of_2(C),
            BD=triton.next_power_of_2(D), BR=triton.next_power_of_2(R), BRA=triton.next_power_of_2(decay_x.shape[-1]),
            num_warps=DECODE_WARPS.value or step_warps(C, D, B * H, q.device), **dependent_launch(q.device),
        )  # fmt: skip
    return o


@sse_decode_step.register_fake
def _(q, k, v, scores, decay_x, out_gate, q_lora_x, k_lora_x, q_lora_b, k_lora_b, decay_up, decay_bias, out_norm,
      norm_eps, mask, state, scale, top_k, read_top_k, inv_tau):  # fmt: skip
    B, H, P, C, D = state.shape
    return q.new_empty(B, 1, H * (q.shape[-1] // (H * C)) * D)
