"""Chunked gated linear attention with a per-key-channel gate, variable-length segments and GQA (Triton).

    S_t = diag(exp(log_g_t)) S_{t-1} + k_t^T v_t,    o_t = scale q_t S_t

Every sequence (a batch row, or a segment of `cu_seqlens`) is cut into chunks of BT = 64 tokens that never cross
a sequence boundary; the chunk list is built on the device (no host sync).

Forward: the chunk-local cumulative gate b (`sse_fwd_kernel_gate`); the state entering every chunk, by a sequential
scan over each sequence's chunks (`sse_fwd_kernel_h`) or, for few long sequences, from every chunk's contribution
(the gate kernel) and the shared state scan (kernels/chunked.py); then all chunks in parallel (`sse_fwd_kernel_o`).
Backward: a reverse scan for the gradient of the state leaving every chunk (`sse_bwd_kernel_dh`), do v^T per chunk
(`sse_bwd_kernel_dA`), dq and dk of every sub-chunk and block of key channels (`BLOCK_K`) in parallel
(`sse_bwd_kernel_dqk`), dv of every chunk (`sse_bwd_kernel_dv`), and the gate gradient's reverse sums within each
chunk (`sse_bwd_kernel_dg`). The dq/dk kernel runs one program per sub-chunk (and key block): its 16-step loops over
a sub-chunk's rows are serial, so more programs share them. SSE's varlen form runs the same kernels on its (token,
partition) entries, read in place through their order (`src`). Empty sequences run no chunk: their state passes
through, and so does its gradient. The kernels live in chunk_fwd.py and chunk_bwd.py; this file launches them.

Inside a chunk token t reads token s <= t through exp(b_t - b_s). When no key channel decays by more than
RANGE_NATS over a chunk (kernels/chunked.py), the factor splits at half the chunk's decay, exp(b_t - ref)
exp(ref - b_s), both within e^60, and the forward's in-chunk scores are one causal matrix product. Otherwise
(`sse_fwd_kernel_o_exact`, and always in the backward) sub-chunks of BC = 16 rows split it: across sub-chunks the
factor is split at the boundary between them, two non-positive exponents, so a matrix product applies; inside a
sub-chunk it is formed element by element. Rows past the end of a sequence read b at its last token, so no
exponent there is positive and strong decay cannot overflow.

The gate's gradient uses d b_t = q_t dq_t - k_t dk_t (summed over query heads), reverse-summed within the chunk,
plus rowsum(dS ⊙ S) of the state leaving the chunk, obtained as exp(b_last) rowsum(dS ⊙ S_enter) + sum_s k_s dk_s
over the chunk-to-state part of dk.
"""

from __future__ import annotations

import torch
import triton

from ..chunked import choice_on_device, exceeds_range, needs_exact, scan_config, state_scan
from ..varlen import chunk_layout
from .chunk_bwd import sse_bwd_kernel_dA, sse_bwd_kernel_dg, sse_bwd_kernel_dh, sse_bwd_kernel_dqk, sse_bwd_kernel_dv
from .chunk_fwd import sse_fwd_kernel_gate, sse_fwd_kernel_h, sse_fwd_kernel_o, sse_fwd_kernel_o_exact

BT = 64  # chunk length
BC = 16  # sub-chunk length
POISON = False  # tests set it: outputs start as NaN
WARPS = {"h": 4, "o": 4, "o_exact": 4, "dh": 4, "dqk": 4, "dv": 4}  # fixed launch configs (kernels/sse/NOTES.md)
# key channels per dq/dk program: 32 when reading SSE's entries in place, whose live int64 row vectors cost registers
# (docs/KERNELS.md, Settings: SSE dq/dk block)
BLOCK_K = {"dqk": 64, "dqk_gather": 32}
# float32 inputs take the exact output kernel: the one-product kernel's tf32 products also round the diagonal scores,
# which an output norm magnifies on rows whose output nearly cancels (kernels/sse/NOTES.md, run 10)
FAST_FLOAT32 = False
LOW_PRECISION_STATES = True  # bf16/fp16 inputs: per-chunk states (and their grads) stored in that dtype, half the bytes


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _chunk_layout(B: int, T: int, cu_seqlens, device):
    """cu [S+1] int32, chunk_seq / chunk_pos [Nc] (sequence and index in it of each chunk), chunk_off [S+1], Nc.

    With cu_seqlens the chunk count is a bound, never a host sync (kernels/varlen.py): the kernels return at once
    for the chunks past the last real one."""
    if cu_seqlens is None:  # each batch row is one sequence of the packed [B * T] stream, with exactly its chunks
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        total = B * triton.cdiv(T, BT)
    else:
        cu, total = cu_seqlens.to(device=device, dtype=torch.int32), None
    chunk_seq, chunk_pos, chunk_off, total = chunk_layout(cu, B * T, BT, total)
    return cu, chunk_seq, chunk_pos, chunk_off, total


def split_scan(programs: int) -> bool:
    """Whether to build the states entering the chunks from per-chunk contributions and a scan (kernels/chunked.py)
    rather than with sse_fwd_kernel_h's sequential scan: when that kernel would run under 256 programs (about two
    per SM), its chunk-to-chunk latency dominates, as for Raven (docs/KERNELS.md, Settings: Raven sequential or
    split state scan)."""
    return programs < 256


def _state_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the per-chunk states kept between kernels; the scans themselves accumulate in float32."""
    return q.dtype if LOW_PRECISION_STATES and q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _new(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer; NaN-filled when POISON is set (tests), so an element a kernel fails to write shows."""
    out = torch.empty(shape, device=like.device, dtype=dtype)
    return out.fill_(float("nan")) if POISON else out


class ChunkGLAFunction(torch.autograd.Function):
    """Dense: q [B, T, H, G, K], k and log_g [B, T, H, K], v [B, T, H, V]; the packed positions are the B T rows.
    Gather (SSE's entries, src given): q [R, G, M, K], k and log_g [R M, K], v [R, V]; packed position p (one head)
    reads k row src[p] and that row's token r // M; o comes back [R, G, V], summed over each token's M entries."""

    @staticmethod
    def forward(ctx, q, k, v, log_g, scale, initial_state, cu_seqlens, src=None):
        dev, gather = q.device, src is not None
        if gather:
            R, G, M, K = q.shape
            B, T, H, L = 1, src.numel(), 1, src.numel()
        else:
            B, T, H, G, K = q.shape
            M, L = 1, B * T
        V, BK, BV = v.shape[-1], _block(K), _block(v.shape[-1])
        q, k, v, log_g = (x.contiguous() for x in (q, k, v, log_g))
        cu, chunk_seq, chunk_pos, chunk_off, Nc = _chunk_layout(B, T, cu_seqlens, dev)
        S = cu.numel() - 1
        h0 = None if initial_state is None else initial_state.float().reshape(S, H, K, V).contiguous()
        gc = torch.empty(L, H, K, device=dev, dtype=torch.float32)  # chunk-local cumulative log-gate, by position
        gl = torch.empty(Nc, H, K, device=dev, dtype=torch.float32)  # gc at each chunk's last row
        o = _new((k.numel() // K, G, V), q, q.dtype)  # one row per input row of k (per entry with a gather)
        store_A = any(ctx.needs_input_grad[:4])
        A = _new((L, H * G, BT), q, q.dtype) if store_A else None  # in-chunk scores, for the backward's dv
        hk, hv = min(BK, 64), min(BV, 64)
        split = split_scan(S * H * (BK // hk) * (BV // hv))
        x = torch.empty(Nc, H, K, V, device=dev, dtype=_state_dtype(q)) if split else None  # chunk contributions
        if Nc:
            sse_fwd_kernel_gate[(Nc, H, BV // hv if split else 1)](
                log_g, gc, gl, k, v, x, src, cu, chunk_seq, chunk_pos, H, K, V, BT, BK, hv, M, split, gather,
            )  # fmt: skip
        float32 = q.dtype == torch.float32 and not FAST_FLOAT32  # the exact kernel always (FAST_FLOAT32)
        on_device = not float32 and choice_on_device(q)  # both output kernels, each program reading the flag
        flag = exceeds_range(gl).view(torch.uint8) if on_device else None  # [] (kernels/chunked.py)
        answer = None if float32 or on_device else needs_exact(gl)
        if split and S:
            (hs,), (ht,) = state_scan((x,), gl, None if h0 is None else (h0,), chunk_off, True, scan_config(K, V))
        else:
            hs = torch.empty(Nc, H, K, V, device=dev, dtype=_state_dtype(q))  # state entering each chunk
            ht = torch.empty(S, H, K, V, device=dev, dtype=torch.float32)
            if S:
                sse_fwd_kernel_h[(S * H, BK // hk, BV // hv)](
                    k, v, gc, h0, hs, ht, src, cu, chunk_off, H, K, V, BT, hk, hv, M, h0 is not None, gather,
                    num_warps=WARPS["h"],
                )  # fmt: skip
        del x
        exact = float32 or on_device or bool(Nc and answer())  # read once the scan is queued: the GPU stays busy
        fast = on_device or not exact  # on the device both kernels run, each program reading the flag
        if Nc and exact:
            sse_fwd_kernel_o_exact[(Nc, H * G, BT // BC)](
                q, k, v, gc, hs, o, A, src, cu, chunk_seq, chunk_pos, flag, scale, H, G, K, V, BT, BC, BK, BV, M,
                store_A, gather, on_device, num_warps=WARPS["o_exact"],
            )  # fmt: skip
        if Nc and fast:
            sse_fwd_kernel_o[(Nc, H, BV // hv)](
                q, k, v, gc, gl, hs, o, A, src, cu, chunk_seq, chunk_pos, flag, scale, H, G, K, V, BT, BK, hv, M,
                store_A, gather, on_device, num_warps=WARPS["o"] if BK <= 64 else 2 * WARPS["o"],
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, gc, hs, A, src, cu, chunk_seq, chunk_pos, chunk_off)
        h0_dtype = None if h0 is None else initial_state.dtype
        o_shape = (q.shape[0], G, V) if gather else (B, T, H, G, V)
        ctx.meta = (o_shape, k.shape, v.shape, M, scale, initial_state is not None, log_g.dtype, h0_dtype)
        return (o.view(-1, M, G, V).sum(1) if gather else o.view(o_shape)), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, hs, A, src, cu, chunk_seq, chunk_pos, chunk_off = ctx.saved_tensors
        o_shape, k_shape, v_shape, M, scale, use_h0, g_dtype, h0_dtype = ctx.meta
        (L, H, K), (G, V), gather = gc.shape, o_shape[-2:], src is not None
        S, Nc, dev = cu.numel() - 1, hs.shape[0], q.device
        BK, BV = _block(K), _block(V)
        do = torch.zeros(o_shape, device=dev, dtype=q.dtype) if do is None else do.contiguous()
        dht = None if dht is None else dht.float().reshape(S, H, K, V).contiguous()
        dhs = torch.empty_like(hs)
        dh0 = torch.empty(S, H, K, V, device=dev, dtype=torch.float32) if use_h0 else None
        hk, hv = min(BK, 64), min(BV, 64)
        if S:
            sse_bwd_kernel_dh[(S * H, BK // hk, BV // hv)](
                q, do, gc, dht, dhs, dh0, src, cu, chunk_off, scale, H, G, K, V, BT, hk, hv, M, dht is not None,
                use_h0, gather, num_warps=WARPS["dh"],
            )  # fmt: skip
        dq, dk = _new(q.shape, q, q.dtype), _new(k.shape, k, k.dtype)
        dv = _new((k.numel() // K, V), v, v.dtype)  # per input row of k: summed over M below
        dg = _new(k.shape, q, g_dtype)
        if Nc:
            NS = BT // BC
            dA = torch.empty(Nc, H * G, BT, BT, device=dev, dtype=torch.float32)  # do v^T per chunk
            # sum_g q dq - k dk by position; without a gather sse_bwd_kernel_dg turns it into dg in place
            in_place = dg.dtype == torch.float32 and not gather
            db = dg if in_place else torch.empty(L, H, K, device=dev, dtype=torch.float32)
            run = _new((Nc, H, NS, K), q, torch.float32)  # chunk-wide gate term, per sub-chunk
            layout = (src, cu, chunk_seq, chunk_pos, scale, H)
            sse_bwd_kernel_dA[(Nc, H * G)](v, do, dA, *layout, G, V, BT, BV, M, gather)
            bk = min(BK, BLOCK_K["dqk_gather" if gather else "dqk"])
            sse_bwd_kernel_dqk[(Nc, H, NS * (BK // bk))](
                q, k, v, gc, hs, do, dhs, A, dA, dq, dk, db, run, *layout, G, K, V, BT, BC, bk, BV, M, gather,
                num_warps=WARPS["dqk"],
            )  # fmt: skip
            bv = min(BV, 64)
            sse_bwd_kernel_dv[(Nc, H, BV // bv)](
                k, gc, do, dhs, A, dv, *layout, G, K, V, BT, BK, bv, M, gather, num_warps=WARPS["dv"]
            )
            sse_bwd_kernel_dg[(Nc, H)](db, run, dg, src, cu, chunk_seq, chunk_pos, H, K, BT, BC, BK, gather)
        dv = dv.view(-1, M, V).sum(1).view(v_shape) if gather else dv.view(v_shape)
        dh0 = None if dh0 is None else dh0.to(h0_dtype)
        return dq, dk.view(k_shape), dv, dg.view(k_shape), None, dh0, None, None


def _check(op: str, q, k, v) -> None:
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    if q.dtype not in allowed:
        raise ValueError(f"{op}: q.dtype = {q.dtype} is not supported; allowed: {list(allowed)}")
    if max(k.shape[-1], v.shape[-1]) > 256:
        raise ValueError(f"{op}: K = {k.shape[-1]}, V = {v.shape[-1]}; allowed: at most 256 each")


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
    _check("chunk_gla", q, k, v)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got batch {q.shape[0]}")
    o, final = ChunkGLAFunction.apply(q, k, v, log_g, float(scale), initial_state, cu_seqlens)
    return o, final if output_final_state else None


def chunk_gla_entries(q, k, v, log_g, order, cu_seqlens, scale: float, initial_state=None):
    """`chunk_gla` over the (token, partition) entries of SSE's varlen form, read in place (`sse_varlen` passes it
    as `gla_entries`; reference `chunk_gla_entries_reference`): no gathered copies, and o and the gradients come
    back in the inputs' layout.

    Args:
        q: [B, T, H, G, M, K]; k, log_g: [B, T, H, M, K]; v: [B, T, H, V]: the M entries of every token.
        order: [E] the E = B T H M flat (b, t, h, m) entries, segment by segment (`varlen_entries`).
        cu_seqlens: [S' + 1] the segments' bounds in `order`; empty segments allowed.
        initial_state: [S', 1, K, V]; zeros when None. Differentiable.

    Returns:
        o: [B, T, H, G, V] in q's dtype, each token's M entries summed, and the final state [S', 1, K, V] float32.
    """
    B, T, H, G, M, K = q.shape
    _check("chunk_gla_entries", q, k, v)
    rows = (q.reshape(-1, G, M, K), k.reshape(-1, K), v.reshape(-1, v.shape[-1]), log_g.reshape(-1, K))
    o, final = ChunkGLAFunction.apply(*rows, float(scale), initial_state, cu_seqlens, order.to(torch.int32))
    return o.view(B, T, H, G, -1), final
