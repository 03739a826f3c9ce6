"""Chunked Raven for training and prefill: forward and backward Triton kernels behind one autograd Function.

Forward: gates from the router (chunk_h.raven_fwd_kernel_gate), states entering every chunk (one sequential scan,
or for long sequences per-chunk contributions and a grouped scan: chunk_h.py), then per chunk and query head the
two passes fused over blocks of slots with an online softmax: the key pass gives a block of slot logits, the value
pass reads that block at once, rescaled as the running maximum grows (raven_fwd_kernel_o). Only the inputs, the
output and its logsumexp are kept; backward recomputes the rest (gates, states) and runs the per-chunk kernels of
chunk_bwd.py. Nothing waits on the host for the chunk tables (arithmetic, or for packed sequences a bound on the
chunk count); needs_exact's answer is read after the scan is queued, and inside a CUDA graph not at all: the
kernels then take their exact forms, which choose the fast one per slot block (intra.raven_slot_block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunked import choice_on_device, needs_exact, scan_config, state_scan
from ..varlen import chunk_layout
from .chunk_bwd import raven_bwd_kernel_dar, raven_bwd_kernel_dkv, raven_bwd_kernel_dlf, raven_bwd_kernel_dq
from .chunk_h import (
    raven_bwd_kernel_dh,
    raven_bwd_kernel_dhc,
    raven_fwd_kernel_gate,
    raven_fwd_kernel_h,
)
from .intra import PRECISION, raven_mix, raven_read_m, raven_slot_block
from .utils import check_inputs, slot_indices

BT, BC = 64, 16  # chunk and sub-chunk lengths


@triton.jit
def raven_fwd_kernel_o(
    q,
    k,
    v,
    g,
    w,
    hk,
    hv,
    o,
    lse,
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
    b_q = tl.load(q + p_qd, mask=m_td, other=0.0)  # [BT, BD] in the input dtype: every tl.dot takes it
    b_k = tl.load(k + p_kd, mask=m_td, other=0.0)
    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BT, BT] float32: chunk_bwd.py
    b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.0)
    p_g, p_w = g + (bos * H + i_h) * M, w + (bos * H + i_h) * M
    p_h = (i_c * H + i_h) * M * D
    b_mx = tl.full([BT], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BD], dtype=tl.float32)
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
        b_s = tl.where(m_m[None, :], b_s * scale, float("-inf"))
        b_mn = tl.maximum(b_mx, tl.max(b_s, 1))
        b_alpha = tl.exp(b_mx - b_mn)
        b_p = tl.exp(b_s - b_mn[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_hv = tl.load(hv + p_h + o_m[:, None] * D + o_d[None, :], mask=m_md, other=0.0)
        b_o = b_o * b_alpha[:, None] + tl.dot((b_p * b_eg).to(b_hv.dtype), b_hv, input_precision=PRECISION)
        b_B = b_B * b_alpha[:, None] + raven_mix(b_p, b_g, b_w, b_qg, b_kg, fast, p_g, p_w, H * M, L, o_m, m_m, BT, BC)
        b_mx = b_mn
    b_v = tl.load(v + p_kd, mask=m_td, other=0.0)
    b_o = (b_o + tl.dot(b_B.to(b_v.dtype), b_v, input_precision=PRECISION)) / b_l[:, None]
    tl.store(o + p_qd, b_o.to(o.dtype.element_ty), mask=m_td)
    tl.store(lse + (bos + o_t) * H * G + i_hg, b_mx + tl.log(b_l), mask=m_t)


def prepare_chunks(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Chunks of BT tokens that never cross a sequence boundary: first token and length of each chunk [NC],
    the first chunk of each sequence [N + 1] and the sequence of each chunk [NC]. No host sync: for packed
    sequences NC is a bound (kernels/varlen.py), its spare chunks (after the last sequence's) have length 0, and
    every per-chunk kernel returns at once for them."""
    if cu_seqlens is None:
        per = triton.cdiv(T, BT)
        c = torch.arange(B * per, device=device)
        seq, j = c // per, c % per
        bos, length = seq * T + j * BT, (T - j * BT).clamp(max=BT)
        seq_chunks = torch.arange(B + 1, device=device) * per
    else:
        seq, within, seq_chunks, _ = chunk_layout(cu_seqlens, B * T, BT)
        seq = seq.long()
        bos = cu_seqlens[seq] + within.long() * BT
        length = (cu_seqlens[seq + 1] - bos).clamp(0, BT)
    return {
        "bos": bos.to(torch.int32),
        "len": length.to(torch.int32),
        "seq_chunks": seq_chunks.to(torch.int32),
        "seq": seq,
    }


def block_sizes(M: int, D: int) -> tuple[int, int]:
    """Slots per block and the (padded) head dim; every tl.dot dimension >= 16."""
    return min(64, max(16, triton.next_power_of_2(M))), max(16, triton.next_power_of_2(D))


def launch_config(D: int) -> dict[str, tuple[int, int, int]]:
    """(slots per block, warps, pipeline stages) of the per-chunk kernels. Each kernel holds [BT, BT] and [BT, D]
    tiles across its slot loop, so at d = 128 one 8-warp program fills an SM's registers; at 4 warps two programs
    share it, which pays even where ptxas then spills; dk/dv stays at 8 warps, and three stages hide the slot loops'
    loads (docs/KERNELS.md, Settings: Raven per-chunk kernels)."""
    return {"o": (32, 4, 3), "dq": (16, 4, 3), "dkv": (32, 8, 3), "dlf": (32, 4, 1)}


def seq_blocks(M: int, D: int, NH: int) -> tuple[int, int]:
    """Slots and head-dim columns per program of the sequential scans (raven_fwd_kernel_h, raven_bwd_kernel_dh):
    small enough for ~2 programs per SM."""
    BM, BD = block_sizes(M, D)
    BM = min(BM, 32)
    BD = min(BD, 64 if triton.cdiv(M, BM) * triton.cdiv(D, 64) * NH >= 256 else 32)
    return BM, BD


def split_scan(M: int, D: int, NH: int) -> bool:
    """Whether to compute the states as per-chunk contributions and a scan (long sequences) rather than with one
    sequential kernel: when that kernel would run under 256 programs (about two per SM), its chunk-to-chunk latency
    dominates; with more programs the sequential kernel is faster, and the split form's contributions also cost a
    write and a read of every state (docs/KERNELS.md, Settings: Raven sequential or split state scan)."""
    BM, BD = seq_blocks(M, D, NH)
    return triton.cdiv(M, BM) * triton.cdiv(D, BD) * NH < 256


def scan(xk, xv, gl, h0, chunks, store_final, reverse=False):
    """The states (or, reversed, their gradients) hk, hv [NC, H, M, D] in xk's dtype from the chunk contributions
    xk, xv (kernels/chunked.py), and the final ones (initial ones, reversed) [N, H, M, D] float32, or None."""
    M, D = xk.shape[-2:]
    hs, ht = state_scan((xk, xv), gl, h0, chunks["seq_chunks"], store_final, scan_config(M, D), reverse)
    return *hs, ht


def sequential_states(k, v, g, w, h0, chunks, M, store_final):
    """raven_fwd_kernel_h: hk, hv [NC, H, M, D] in k's dtype and the final states [N, H, M, D] float32 or None."""
    T, H, D = k.shape
    N, NC = chunks["seq_chunks"].numel() - 1, chunks["bos"].numel()
    BM, BD = seq_blocks(M, D, N * H)
    hk, hv = k.new_empty(NC, H, M, D), k.new_empty(NC, H, M, D)
    ht = (k.new_empty(N, H, M, D, dtype=torch.float32), k.new_empty(N, H, M, D, dtype=torch.float32))
    h0 = h0 if h0 is not None else (None, None)
    raven_fwd_kernel_h[(triton.cdiv(M, BM), triton.cdiv(D, BD), N * H)](
        k, v, g, w, *h0, hk, hv, *ht, chunks["bos"], chunks["len"], chunks["seq_chunks"], H, M, D, BT, BM, BD,
        h0[0] is not None, store_final, num_warps=4,
    )  # fmt: skip
    return hk, hv, (ht if store_final else None)


def gates(k, v, a, idx, r, chunks, M, contributions=True):
    """g, w [T, H, M] float32 (per-slot cumulative log-retention within each chunk, and 1 - exp(log_f)), built from
    the router a r at idx; gl [NC, H, M] (g at each chunk's last token); and, with contributions where the states
    take the split form (split_scan), each chunk's contributions xk, xv [NC, H, M, D] in k's dtype, else None."""
    T, H, D = k.shape
    K = idx.shape[-1]
    N, NC = chunks["seq_chunks"].numel() - 1, chunks["bos"].numel()
    split = contributions and split_scan(M, D, N * H)
    BM, BD = block_sizes(M, D)
    BM = min(BM, 32) if split else BM  # the contributions' [BM, D] products: 32 slots at 8 warps
    g = a.new_empty(T, H, M, dtype=torch.float32)
    w = torch.empty_like(g)
    gl = a.new_zeros(NC, H, M, dtype=torch.float32)  # zeros in spare chunks, which the gate kernel skips
    xk, xv = (k.new_empty(NC, H, M, D) for _ in range(2)) if split else (None, None)
    raven_fwd_kernel_gate[(NC * triton.cdiv(M, BM), H)](
        a, idx, r, k, v, g, w, gl, xk, xv, chunks["bos"], chunks["len"], H, M, K, D, BT, BM,
        triton.next_power_of_2(K), BD, split, num_warps=8 if split else 4,
    )  # fmt: skip
    return g, w, gl, xk, xv


def states(k, v, g, w, gl, xk, xv, h0, chunks, M, store_final):
    """hk, hv [NC, H, M, D] in k's dtype, the states entering each chunk, and the final states [N, H, M, D] float32
    or None: scanned from the contributions when gates() gave them, else by the sequential kernel."""
    if xk is not None:
        return scan(xk, xv, gl, h0, chunks, store_final)
    return sequential_states(k, v, g, w, h0, chunks, M, store_final)


def state_grads(q, do, ds, p, g, gl, dht, chunks, H, M, store_dh0):
    """dhk, dhv [NC, H, M, D] in q's dtype: the gradients of the states leaving each chunk; and those of the initial
    states [N, H, M, D] float32, or None."""
    T, HG, D = q.shape
    N, NC = chunks["seq_chunks"].numel() - 1, chunks["bos"].numel()
    if split_scan(M, D, N * H):
        BM, BD = min(32, block_sizes(M, D)[0]), block_sizes(M, D)[1]
        xk, xv = (q.new_empty(NC, H, M, D) for _ in range(2))  # what each chunk's reads add
        raven_bwd_kernel_dhc[(NC * triton.cdiv(M, BM), H)](
            q, do, ds, p, g, xk, xv, chunks["bos"], chunks["len"], H, HG // H, M, D, BT, BM, BD, num_warps=4
        )
        return scan(xk, xv, gl, dht, chunks, store_dh0, reverse=True)
    BM, BD = seq_blocks(M, D, N * H)
    dhk, dhv = (q.new_empty(NC, H, M, D) for _ in range(2))
    dh0 = (q.new_empty(N, H, M, D, dtype=torch.float32), q.new_empty(N, H, M, D, dtype=torch.float32))
    dht = dht if dht is not None else (None, None)
    raven_bwd_kernel_dh[(triton.cdiv(M, BM), triton.cdiv(D, BD), N * H)](
        q, do, ds, p, g, *dht, dhk, dhv, *dh0, chunks["bos"], chunks["len"], chunks["seq_chunks"], H, HG // H, M, D,
        BT, BM, BD, dht[0] is not None, store_dh0, num_warps=4,
    )  # fmt: skip
    return dhk, dhv, (dh0 if store_dh0 else None)


def per_chunk(kernel, name, tensors, scalars, chunks, heads, shape, split_slots=False):
    """Launch a per-chunk kernel with its launch_config on (chunk, head) programs, or with split_slots on
    (chunk x slot block, head) programs, the slot block fastest: a chunk's slot blocks run side by side and share
    its q, k, v, do through L2. shape: H, G, M, D and exact."""
    H, G, M, D, exact = (shape[x] for x in ("H", "G", "M", "D", "exact"))
    BM, warps, stages = launch_config(D)[name]
    BM_max, BD = block_sizes(M, D)
    BM = min(BM, BM_max)
    grid = (chunks["bos"].numel() * (triton.cdiv(M, BM) if split_slots else 1), heads)
    kernel[grid](
        *tensors,
        chunks["bos"],
        chunks["len"],
        *scalars,
        H,
        G,
        M,
        D,
        BT,
        BC,
        BM,
        BD,
        exact,
        num_warps=warps,
        num_stages=stages,
    )


def chunk_raven_fwd(q, k, v, a, idx, r, scale, M, h0, output_final_state, chunks):
    """o [T, HG, d], its logsumexp over slots [T, HG], the final states or None, whether the exact in-chunk forms
    ran, and what the backward can reuse: the gates (g, w, gl) and the states entering each chunk (hk, hv)."""
    T, HG, D = q.shape
    H = k.shape[1]
    g, w, gl, xk, xv = gates(k, v, a, idx, r, chunks, M)
    on_device = choice_on_device(q)  # in a CUDA graph: the kernels with the exact forms, which pick per slot block
    answer = None if on_device else needs_exact(gl)
    hk, hv, ht = states(k, v, g, w, gl, xk, xv, h0, chunks, M, output_final_state)
    del xk, xv
    exact = on_device or answer()  # read once the scan is queued: the GPU stays busy while the host waits
    o = torch.empty_like(q)
    lse = q.new_empty(T, HG, dtype=torch.float32)
    shape = dict(H=H, G=HG // H, M=M, D=D, exact=exact)
    per_chunk(raven_fwd_kernel_o, "o", (q, k, v, g, w, hk, hv, o, lse), (scale,), chunks, HG, shape)
    return o, lse, ht, exact, (g, w, gl), (hk, hv)


def chunk_raven_bwd(q, k, v, a, idx, r, scale, M, h0, o, lse, do, dht, chunks, exact, kept_gates, kept_states):
    """kept_gates (g, w, gl) and kept_states (hk, hv) as the forward gave them, or None to recompute them. The
    final states' own gradient (dht) reads the final states, which are not kept: with dht the states are rebuilt."""
    T, HG, D = q.shape
    H, NC = k.shape[1], chunks["bos"].numel()
    shape = dict(H=H, G=HG // H, M=M, D=D, exact=exact)
    rebuild = kept_states is None or dht is not None
    if kept_gates is None:
        g, w, gl, xk, xv = gates(k, v, a, idx, r, chunks, M, contributions=rebuild)
    else:
        (g, w, gl), xk, xv = kept_gates, None, None
    if rebuild:
        hk, hv, ht = states(k, v, g, w, gl, xk, xv, h0, chunks, M, dht is not None)
    else:
        (hk, hv), ht = kept_states, None
    del xk, xv
    dq = torch.empty_like(q)
    p, ds = (q.new_empty(T, HG, M) for _ in range(2))  # only ever tl.dot operands: the input dtype
    e = q.new_empty(T, HG, M, dtype=torch.float32)
    per_chunk(raven_bwd_kernel_dq, "dq", (q, k, v, do, o, g, w, hk, hv, lse, dq, p, ds, e), (scale,), chunks, HG, shape)
    del hk, hv
    dhk, dhv, dh0 = state_grads(q, do, ds, p, g, gl, dht, chunks, H, M, h0 is not None)
    dh0 = dh0 if dh0 is not None else (None, None)
    dht_k, dht_v = dht if dht is not None else (None, None)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    per_chunk(raven_bwd_kernel_dkv, "dkv", (q, do, g, w, dhk, dhv, p, ds, dk, dv), (), chunks, H, shape)
    dlf = e.new_empty(T, H, M)
    dlf_sum = e.new_zeros(NC, H, M)  # zeros in spare chunks: the carries below sum past them
    tensors = (q, k, v, do, g, w, dhk, dhv, p, ds, e, dlf, dlf_sum)
    per_chunk(raven_bwd_kernel_dlf, "dlf", tensors, (), chunks, H, shape, split_slots=True)
    # Carry each chunk's total into the earlier chunks of its sequence; the final states' own read comes last.
    suffix = torch.nn.functional.pad(dlf_sum.double().flip(0).cumsum(0).flip(0), (0, 0, 0, 0, 0, 1))  # [NC+1, H, M]
    seq = chunks["seq"]
    after = torch.arange(1, NC + 1, device=q.device)
    carry = suffix[after] - suffix[chunks["seq_chunks"][seq + 1].long()]  # [NC, H, M]
    if dht is not None:
        carry = carry + ((dht_k * ht[0]).sum(-1) + (dht_v * ht[1]).sum(-1))[seq].double()
    da, dr = torch.empty_like(a), torch.empty_like(r)
    K = idx.shape[-1]
    raven_bwd_kernel_dar[(NC, H)](
        a, idx, r, dlf, carry.float(), da, dr, chunks["bos"], chunks["len"], H, M, K, BT, triton.next_power_of_2(K)
    )
    return dq, dk, dv, da, dr, dh0


class ChunkRavenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, idx, r, scale, num_slots, h0k, h0v, output_final_state, cu_seqlens, level):
        B, T, H, G, D = q.shape
        K = idx.shape[-1]
        chunks = prepare_chunks(None if cu_seqlens is None else cu_seqlens.long(), B, T, q.device)
        flat = (
            q.reshape(B * T, H * G, D).contiguous(),
            k.reshape(B * T, H, D).contiguous(),
            v.reshape(B * T, H, D).contiguous(),
            a.reshape(B * T, H).float().contiguous(),
            slot_indices(idx.reshape(B * T, H, K)),
            r.reshape(B * T, H, K).float().contiguous(),
        )
        h0 = None if h0k is None else (h0k.float().contiguous(), h0v.float().contiguous())
        o, lse, ht, exact, kept_gates, kept_states = chunk_raven_fwd(
            *flat, scale, num_slots, h0, output_final_state, chunks
        )
        kept_gates = kept_gates if level == 0 else ()
        kept_states = kept_states if level <= 1 else ()
        ctx.save_for_backward(*flat, o, lse, *(h0 or ()), *kept_gates, *kept_states)
        ctx.meta = (scale, num_slots, chunks, exact, (B, T, H, G, D, K), a.dtype, r.dtype, h0k is not None, level)
        ctx.h0_dtypes = (h0k.dtype, h0v.dtype) if h0k is not None else None
        o = o.view(B, T, H, G, D)
        return (o, *ht) if output_final_state else (o, None, None)

    @staticmethod
    def backward(ctx, do, dhtk, dhtv):
        scale, M, chunks, exact, (B, T, H, G, D, K), a_dtype, r_dtype, has_h0, level = ctx.meta
        q, k, v, a, idx, r, o, lse, *rest = ctx.saved_tensors
        h0, rest = (tuple(rest[:2]), rest[2:]) if has_h0 else (None, rest)
        kept_gates, rest = (tuple(rest[:3]), rest[3:]) if level == 0 else (None, rest)
        dht = None
        if dhtk is not None or dhtv is not None:
            z = torch.zeros(chunks["seq_chunks"].numel() - 1, H, M, D, device=q.device, dtype=torch.float32)
            dht = (z if dhtk is None else dhtk.float().contiguous(), z if dhtv is None else dhtv.float().contiguous())
        kept_states = tuple(rest[:2]) if level <= 1 else None
        do = do.reshape(B * T, H * G, D).contiguous()
        dq, dk, dv, da, dr, dh0 = chunk_raven_bwd(
            q, k, v, a, idx, r, scale, M, h0, o, lse, do, dht, chunks, exact, kept_gates, kept_states
        )
        dh0k, dh0v = (dh0[0].to(ctx.h0_dtypes[0]), dh0[1].to(ctx.h0_dtypes[1])) if has_h0 else (None, None)
        return (
            dq.view(B, T, H, G, D),
            dk.view(B, T, H, D),
            dv.view(B, T, H, D),
            da.view(B, T, H).to(a_dtype),
            None,
            dr.view(B, T, H, K).to(r_dtype),
            None,
            None,
            dh0k,
            dh0v,
            None,
            None,
            None,
        )


CHECKPOINT_LEVELS = {
    0: "keep the gates and the chunk states for the backward",
    1: "keep the chunk states, recompute the gates",
    2: "recompute the gates and the chunk states",
}


def chunk_raven(
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
    checkpoint_level: int = 2,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Raven over whole sequences (training, prefill), differentiable in q, k, v, a, r and the initial state.

    Args:
        q: [B, T, H, G, d] queries, G per key/value head.
        k, v: [B, T, H, d].
        a: [B, T, H] log-decay per head and token (<= 0; 0 at padding, which then writes nothing).
        idx: [B, T, H, K] integer slots each token writes (distinct per token); r: [B, T, H, K] their weights.
        scale: logit scale of the slot softmax.
        num_slots: M.
        initial_state: (S^k, S^v), each [N, H, M, d] (N = B, or the number of sequences with cu_seqlens).
        output_final_state: also return the final states.
        cu_seqlens: [N + 1] offsets of sequences packed along T (B == 1); no chunk crosses a boundary.
        checkpoint_level: what the backward recomputes, as fla's chunk_gsa: 2 the gates and the chunk states (least
            memory), 1 the gates only (keeps the states, 2 x [NC, H, M, d] in k's dtype), 0 nothing (also keeps
            g and w, 2 x [B T, H, M] float32). At M = 256, B = 4, T = 4096, H = 16, d = 128 each kept pair is
            512 MiB per layer, held until its backward (docs/KERNELS.md has what each level saves in time).

    Returns:
        o [B, T, H, G, d] in q's dtype, and (S^k, S^v) each [N, H, M, d] float32 or None.
    """
    check_inputs(q, k, v, a, idx, r, num_slots, initial_state, cu_seqlens)
    if checkpoint_level not in CHECKPOINT_LEVELS:
        raise ValueError(f"checkpoint_level = {checkpoint_level!r} is not allowed; allowed: {CHECKPOINT_LEVELS}")
    h0k, h0v = initial_state if initial_state is not None else (None, None)
    o, htk, htv = ChunkRavenFunction.apply(
        q, k, v, a, idx, r, float(scale), num_slots, h0k, h0v, output_final_state, cu_seqlens, checkpoint_level
    )
    return o, ((htk, htv) if output_final_state else None)
