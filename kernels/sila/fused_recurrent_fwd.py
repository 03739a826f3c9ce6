"""SILA forward: a sequential kernel for the memory and its gates, and a chunk-parallel kernel for the outputs.

`sila_fwd_kernel_recurrent` runs one program per (sequence, head) over time with the [V, K] memory in registers:
the gates need the full dot products w . (M_{t-1} k_t). It saves M_{t-1} k_t, the two gate dot products and a
checkpoint of the memory every CHUNK steps. `sila_fwd_kernel_output` then forms the outputs
o_t = M_{t-1} q_t + alpha_t (k_t . q_t) v_t for all chunks in parallel with the chunk form (utils.py), so the
sequential loop carries only what the recurrence needs. A decode step (T == 1, no gradients) reads on chip instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import wait_for_inputs
from . import utils
from .utils import (
    _add_pair,
    delta_write,
    load_chunk,
    load_step,
    memory_slot,
    recall,
    sequence_bounds,
    sila_gates,
    slot_start,
    sweep_offsets,
)


@triton.jit
def sila_fwd_kernel_recurrent(
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, vw, h0, mask, o, ht, states, r, s, cu_seqlens, state_offsets, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, CHUNK: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE: tl.constexpr, INLINE_OUTPUT: tl.constexpr, HAS_MASK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """M is held as [V, NB, KB], d_k in NB blocks of KB (utils.sweep_offsets)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos, T_n, state_base = sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK, IS_VARLEN)
    o_v = tl.arange(0, V)
    o_kb, o_mem = sweep_offsets(K, V, KB)  # [NB, KB], [V, NB, KB]
    b_wb = tl.load(w_beta + i_h * V + o_v).to(tl.float32)
    b_wg = tl.load(w_gamma + i_h * V + o_v).to(tl.float32)
    b_M = tl.load(h0 + (i_n * H + i_h).to(tl.int64) * V * K + o_mem)
    # step t's inputs are loaded during step t - 1, so their latency hides behind its arithmetic
    b_k, b_v, b_bx, b_gx, b_live = load_step(
        k, v, beta_x, gamma_x, mask, bos, 0, T_n, i_h, o_kb, o_v, H, K, V, HAS_MASK
    )
    # z = M^T w_beta, M^T w_gamma [NB, KB]: with them the gates' w . M k is a sum over K, within a warp, and no sum
    # over V (across warps) sits in the step's chain; made exact again from M at every checkpoint
    if SAVE:
        b_zb, b_zg = tl.reduce((b_M * b_wb[:, None, None], b_M * b_wg[:, None, None]), 0, _add_pair)
    for t in range(0, T_n):
        n_k, n_v, n_bx, n_gx, n_live = load_step(
            k, v, beta_x, gamma_x, mask, bos, t + 1, T_n, i_h, o_kb, o_v, H, K, V, HAS_MASK
        )
        row = (bos + t) * H + i_h
        if SAVE:
            if t % CHUNK == 0:
                tl.store(states + slot_start(state_base, t // CHUNK, i_h, H, K, V) + o_mem, b_M)
                b_zb, b_zg = tl.reduce((b_M * b_wb[:, None, None], b_M * b_wg[:, None, None]), 0, _add_pair)
        b_r = tl.sum(tl.sum(b_M * b_k[None, :, :], axis=1), axis=1)  # [V] M_{t-1} k_t
        if SAVE:
            b_sb, b_sg = tl.reduce(tl.reduce((b_zb * b_k, b_zg * b_k), 1, _add_pair), 0, _add_pair)
        else:  # a decode step: one step, no z
            b_sb, b_sg = tl.reduce((b_r * b_wb, b_r * b_wg), 0, _add_pair)
        b_beta, b_gamma, _, _ = sila_gates(b_sb, b_sg, b_bx, b_gx, b_live)
        if INLINE_OUTPUT:
            for i_g in tl.static_range(G):
                b_q = tl.load(q + (row * G + i_g) * K + o_kb).to(tl.float32)
                b_a = tl.load(alpha + row * G + i_g).to(tl.float32)
                b_o = recall(b_M, b_q, b_k, b_v, b_a)
                tl.store(o + (row * G + i_g) * V + o_v, b_o.to(o.dtype.element_ty))
        if SAVE:
            tl.store(r + row * V + o_v, b_r)
            tl.store(s + 2 * row, b_sb)
            tl.store(s + 2 * row + 1, b_sg)
        b_M = delta_write(b_M, b_k, b_v, b_r, b_beta, b_gamma)
        if SAVE:  # M_t^T w = gamma M_{t-1}^T w + (u . w) k, with u . w = beta (v . w - r . w): scalars only
            b_vwb = tl.load(vw + 2 * row)
            b_vwg = tl.load(vw + 2 * row + 1)
            b_zb = b_gamma * b_zb + (b_beta * (b_vwb - b_sb)) * b_k
            b_zg = b_gamma * b_zg + (b_beta * (b_vwg - b_sg)) * b_k
        b_k, b_v, b_bx, b_gx, b_live = n_k, n_v, n_bx, n_gx, n_live
    if SAVE:
        tl.store(states + slot_start(state_base, tl.cdiv(T_n, CHUNK), i_h, H, K, V) + o_mem, b_M)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * V * K + o_mem, b_M)


@triton.jit
def sila_fwd_kernel_output(
    q, k, v, alpha, beta_x, gamma_x, mask, r, s, states, o, cu_seqlens, state_offsets, chunk_indices, T,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_n, i_c, i_h = utils.chunk_program(chunk_indices, IS_VARLEN)
    bos, T_n, state_base = sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK, IS_VARLEN)
    if i_c * CHUNK >= T_n:  # a spare program past its sequence's last chunk (utils.varlen_layout)
        return
    b_k, b_v, _, b_u, _, b_start, b_D, _, rows, m_t = load_chunk(
        k, v, r, s, beta_x, gamma_x, mask, bos, T_n, i_c, i_h, H, K, V, CHUNK, HAS_MASK
    )
    b_S = tl.load(memory_slot(states, state_base, i_c, i_h, H, K, V))
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    m_tk, m_tv = m_t[:, None], m_t[:, None]
    for i_g in tl.static_range(G):
        b_q = tl.load(q + (rows[:, None] * G + i_g) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_a = tl.load(alpha + rows * G + i_g, mask=m_t, other=0.0).to(tl.float32)
        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_D  # [C, C] decayed q_t . k_s, s < t
        b_o = tl.dot(b_A, b_u, input_precision=PRECISION)
        b_o += b_start[:, None] * tl.dot(b_q, tl.trans(b_S), input_precision=PRECISION)
        b_o += (b_a * tl.sum(b_q * b_k, axis=1))[:, None] * b_v  # the current token's term
        tl.store(o + (rows[:, None] * G + i_g) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def conv_step(b_x, tail, conv_w, ch, b_live, C: tl.constexpr, TAPS: tl.constexpr, SILU: tl.constexpr):
    """The short convolution of x (channels ch, any shape) after a sequence's cached tail [TAPS - 1, C]: the
    convolved value, feature map applied, and the tail moved on by one with x, in place. A padded token enters
    neither. A channel's value may be held by several threads (a head has fewer values than the program has
    threads), so no thread writes a tail row before every thread has read it: a tail of up to 3 rows (the default
    4 taps) is read at once and written after one barrier; a longer one moves a row at a time, a barrier each."""
    b_x = tl.where(b_live, b_x, 0.0)
    b_y = b_x * tl.load(conv_w + ch * TAPS + TAPS - 1).to(tl.float32)
    if TAPS <= 4:
        if TAPS > 1:
            b_t0 = tl.load(tail + ch)
            b_y += b_t0.to(tl.float32) * tl.load(conv_w + ch * TAPS).to(tl.float32)
        if TAPS > 2:
            b_t1 = tl.load(tail + C + ch)
            b_y += b_t1.to(tl.float32) * tl.load(conv_w + ch * TAPS + 1).to(tl.float32)
        if TAPS > 3:
            b_t2 = tl.load(tail + 2 * C + ch)
            b_y += b_t2.to(tl.float32) * tl.load(conv_w + ch * TAPS + 2).to(tl.float32)
        if TAPS > 1:
            tl.debug_barrier()  # every thread has read the tail
        if TAPS > 2:
            tl.store(tail + ch, b_t1)
        if TAPS > 3:
            tl.store(tail + C + ch, b_t2)
    else:
        for j in tl.static_range(TAPS - 1):
            b_t = tl.load(tail + j * C + ch)
            b_y += b_t.to(tl.float32) * tl.load(conv_w + ch * TAPS + j).to(tl.float32)
            if j > 0:
                tl.debug_barrier()  # row j - 1 read by every thread
                tl.store(tail + (j - 1) * C + ch, b_t)
        tl.debug_barrier()  # row TAPS - 2 read by every thread
    if TAPS > 1:
        tl.store(tail + (TAPS - 2) * C + ch, b_x.to(tail.dtype.element_ty))
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    return b_y


@triton.jit
def head_norm(b_x, norm, o_kb, eps, K: tl.constexpr):
    """RMSNorm of one head's [NB, KB] vector with weight `norm` [K] (the teacher's q/k norm)."""
    b_ms = tl.sum(tl.sum(b_x * b_x, axis=1), axis=0) / K
    return b_x * tl.rsqrt(b_ms + eps) * tl.load(norm + o_kb).to(tl.float32)


@triton.jit
def l2_normalized(b_x):
    """x / sqrt(|x|^2 + 1e-6) for one head's [NB, KB] vector, as raven_layers.sila.l2_normalize."""
    return b_x * tl.rsqrt(tl.sum(tl.sum(b_x * b_x, axis=1), axis=0) + 1e-6)


@triton.jit
def sila_fwd_kernel_decode(
    q, k, v, beta_x, gamma_x, alpha_x, out_gate, stride_q, stride_k, stride_v, stride_bx, stride_gx, stride_ax,
    stride_og, beta_bias, gamma_bias, alpha_bias, conv_w, tail, q_norm, k_norm, norm_eps, w_beta, w_gamma, state,
    mask, o, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, TAPS: tl.constexpr,
    SILU: tl.constexpr, HAS_QK_NORM: tl.constexpr, HAS_MASK: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """One decode step of a SILA layer from its projections, one program per (sequence, kv head): the q/k norms,
    the short convolution after the cached tail (updated in place), the feature map, the L2 norms and the gates,
    then the recurrence on the memory `state` [N, H, K, K] (in place) and the G outputs, times the output gate
    2 sigmoid(out_gate) where GATED."""
    wait_for_inputs(PDL)
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = (G + 2) * H * K  # channels q, k, v
    o_kb, o_mem = sweep_offsets(K, K, KB)
    o_v = tl.arange(0, K)
    p_tail = tail + i_n.to(tl.int64) * (TAPS - 1) * C
    # the memory and the gate weights first: their loads then overlap the norms and the convolution (whose tail
    # stores would otherwise come before them in program order)
    b_M = tl.load(state + (i_n * H + i_h).to(tl.int64) * K * K + o_mem)
    b_wb = tl.load(w_beta + i_h * K + o_v).to(tl.float32)
    b_wg = tl.load(w_gamma + i_h * K + o_v).to(tl.float32)
    b_live = i_n >= 0  # a real token
    if HAS_MASK:
        b_live = tl.load(mask + i_n) != 0
    b_k = tl.load(k + i_n * stride_k + i_h * K + o_kb).to(tl.float32)
    if HAS_QK_NORM:
        b_k = head_norm(b_k, k_norm, o_kb, norm_eps, K)
    b_k = l2_normalized(conv_step(b_k, p_tail, conv_w, (G * H + i_h) * K + o_kb, b_live, C, TAPS, SILU))
    b_v = tl.load(v + i_n * stride_v + i_h * K + o_v).to(tl.float32)
    b_v = conv_step(b_v, p_tail, conv_w, (G * H + H + i_h) * K + o_v, b_live, C, TAPS, SILU)
    b_bx = tl.load(beta_x + i_n * stride_bx + i_h).to(tl.float32) + tl.load(beta_bias + i_h).to(tl.float32)
    b_gx = tl.load(gamma_x + i_n * stride_gx + i_h).to(tl.float32) + tl.load(gamma_bias + i_h).to(tl.float32)
    b_r = tl.sum(tl.sum(b_M * b_k[None, :, :], axis=1), axis=1)  # [V] M_{t-1} k_t
    b_sb, b_sg = tl.reduce((b_r * b_wb, b_r * b_wg), 0, _add_pair)
    b_beta, b_gamma, _, _ = sila_gates(b_sb, b_sg, b_bx, b_gx, b_live)
    for i_g in tl.static_range(G):
        head = i_h * G + i_g
        b_q = tl.load(q + i_n * stride_q + head * K + o_kb).to(tl.float32)
        if HAS_QK_NORM:
            b_q = head_norm(b_q, q_norm, o_kb, norm_eps, K)
        b_q = l2_normalized(conv_step(b_q, p_tail, conv_w, head * K + o_kb, b_live, C, TAPS, SILU))
        b_a = tl.sigmoid(
            tl.load(alpha_x + i_n * stride_ax + head).to(tl.float32) + tl.load(alpha_bias + head).to(tl.float32)
        )
        b_o = recall(b_M, b_q, b_k, b_v, b_a)
        if GATED:
            b_o *= 2 * tl.sigmoid(tl.load(out_gate + i_n * stride_og + head * K + o_v).to(tl.float32))
        tl.store(o + (i_n * H * G + head) * K + o_v, b_o.to(o.dtype.element_ty))
    b_M = delta_write(b_M, b_k, b_v, b_r, b_beta, b_gamma)
    tl.store(state + (i_n * H + i_h).to(tl.int64) * K * K + o_mem, b_M)


def fused_recurrent_sila_fwd(
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, output_final_state, cu_seqlens, chunk_size,
    save,
):  # fmt: skip
    """Outputs [B, T, H, G, V] (q's dtype), the final memory [N, H, V, K] or None, and what backward needs."""
    B, T, H, G, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cfg = utils.launch_settings(K, V)
    inline = not save and T == 1 and cu_seqlens is None  # a decode step: read on chip, nothing to save
    offsets, indices, n_states, n_chunks = utils.varlen_layout(cu_seqlens, N, T, chunk_size)
    o = utils.new_output((B, T, H, G, V), q)
    ht = utils.new_output((N, H, V, K), q, torch.float32) if output_final_state else None
    states = r = s = None
    if not inline:
        states = utils.new_output((n_states, H, V, K), q, torch.float32)
        r = utils.new_output((B, T, H, V), q, torch.float32)  # M_{t-1} k_t
        s = utils.new_output((B, T, H, 2), q, torch.float32)  # w_beta . M_{t-1} k_t and w_gamma . M_{t-1} k_t
    flags = dict(HAS_MASK=mask is not None, IS_VARLEN=cu_seqlens is not None)
    if initial_state is None:
        initial_state = torch.zeros(N, H, V, K, device=q.device)
    vw = None
    if not inline:  # v_t . w_beta, v_t . w_gamma [B, T, H, 2]
        vw = torch.einsum("bthv,hjv->bthj", v.float(), torch.stack((w_beta, w_gamma), 1).float()).contiguous()
    sila_fwd_kernel_recurrent[(N, H)](
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, vw, initial_state, mask, o, ht, states, r, s, cu_seqlens,
        offsets, T, H=H, G=G, K=K, V=V, KB=utils.sweep_block(K), CHUNK=chunk_size,
        STORE_HT=output_final_state, SAVE=not inline, INLINE_OUTPUT=inline, num_warps=cfg["sweep"], **flags,
    )  # fmt: skip
    if not inline and n_chunks > 0:
        grid = (n_chunks, H) if cu_seqlens is not None else (n_chunks, N, H)
        sila_fwd_kernel_output[grid](
            q, k, v, alpha, beta_x, gamma_x, mask, r, s, states, o, cu_seqlens, offsets, indices, T,
            H=H, G=G, K=K, V=V, CHUNK=chunk_size, PRECISION=utils.DOT_PRECISION,
            num_warps=cfg["chunk"], **flags,
        )  # fmt: skip
    return o, ht, (states, r, s, offsets, indices, n_chunks)
