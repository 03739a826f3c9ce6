"""SILA backward: a reverse sweep carrying dM on chip between two chunk-parallel kernels.

Per step (u_t = beta_t (v_t - r_t), r_t = M_{t-1} k_t, du_t = dM_t k_t):

    dM_{t-1} = gamma_t dM_t + sum_g do_{t,g} q_{t,g}^T + dr_t k_t^T,  dr_t = dpb_t w_beta + dpg_t w_gamma - beta_t du_t
    dpb_t = du_t . (v_t - r_t) sigmoid'(pb_t),        dpg_t = <dM_t, M_{t-1}> phi'(pg_t)

The sweep never rebuilds M_{t-1} (it is not invertible: gamma can be ~0). It only needs the scalar
<dM_t, M_{t-1}>, and gamma_t <dM_t, M_{t-1}> = h_t - u_t . du_t with h_t = <dM_t, M_t>, which obeys

    h_{t-1} = gamma_t <dM_t, M_{t-1}> + sum_g do_{t,g} . M_{t-1} q_{t,g} + dr_t . r_t;

since phi'(pg) = gamma (1 - e^2) / (1 + e^2), dpg_t needs no division by gamma. h is reset to <dM, checkpoint> at
every chunk end, so rounding cannot build up. The products with M_{t-1} itself (dq_t = M_{t-1}^T do_t + ...,
dk_t = M_{t-1}^T dr_t + ..., and do_t . M_{t-1} q_t) and with dM_t (dk_t's dM_t^T u_t, from dM at the chunk's end)
come from the chunk form in the parallel kernels: `sila_bwd_kernel_dq` before the sweep, `sila_bwd_kernel_dkv`
after it. So the sweep's only per-step outputs are du_t and the two gate gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import utils
from .utils import (
    _add_pair,
    load_chunk,
    load_step,
    memory_slot,
    memory_transposed_times,
    sequence_bounds,
    sila_gates,
    slot_start,
    sweep_offsets,
)


@triton.jit
def sila_bwd_kernel_dq(
    q, k, v, alpha, beta_x, gamma_x, mask, r, s, states, do, dq, dalpha, c, dE, duE, cu_seqlens, state_offsets,
    chunk_indices, T, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Everything the outputs' gradient gives before the sweep: dq, dalpha, c_t = sum_g do_{t,g} . M_{t-1} q_{t,g},
    and the outputs' share of dM, E_s = sum_g do_{s,g} q_{s,g}^T, taken out of the sweep chunk by chunk.

    Within a chunk, dM_t holds sum_{s > t} exp(G_{s-1} - G_t) E_s: the sweep gets its product with k_t as duE_t,
    and the whole chunk's share at the chunk start, dE = sum_s exp(G_{s-1}) E_s, once.
    """
    i_n, i_c, i_h = utils.chunk_program(chunk_indices, IS_VARLEN)
    bos, T_n, state_base = sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK, IS_VARLEN)
    if i_c * CHUNK >= T_n:  # a spare program past its sequence's last chunk (utils.varlen_layout)
        return
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    # the outputs' share first, stored before the checkpoint is loaded: [V, K] dE and S are never live together
    rows, m_t, b_live = utils.chunk_rows(mask, bos, T_n, i_c, i_h, H, CHUNK, HAS_MASK)
    m_tk, m_tv = m_t[:, None], m_t[:, None]
    b_start, b_D, _ = utils.chunk_decays(s, gamma_x, rows, m_t, b_live, CHUNK)
    b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_F = tl.trans(b_D)  # [C, C] exp(G_{s-1} - G_t) for s > t
    b_dE = tl.zeros([V, K], dtype=tl.float32)
    b_duE = tl.zeros([CHUNK, V], dtype=tl.float32)
    for i_g in tl.static_range(G):
        b_q = tl.load(q + (rows[:, None] * G + i_g) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_do = tl.load(do + (rows[:, None] * G + i_g) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_A = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION) * b_F  # [C, C] k_t . q_s, decayed
        b_duE += tl.dot(b_A, b_do, input_precision=PRECISION)
        b_dE += tl.dot(tl.trans(b_do * b_start[:, None]), b_q, input_precision=PRECISION)
    tl.store(duE + rows[:, None] * V + o_v[None, :], b_duE, mask=m_tv)
    tl.store(memory_slot(dE, state_base, i_c, i_h, H, K, V), b_dE)

    b_k, b_v, _, b_u, _, b_start, b_D, _, rows, m_t = load_chunk(
        k, v, r, s, beta_x, gamma_x, mask, bos, T_n, i_c, i_h, H, K, V, CHUNK, HAS_MASK
    )
    b_S = tl.load(memory_slot(states, state_base, i_c, i_h, H, K, V))
    b_c = tl.zeros([CHUNK], dtype=tl.float32)
    for i_g in tl.static_range(G):
        b_q = tl.load(q + (rows[:, None] * G + i_g) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_do = tl.load(do + (rows[:, None] * G + i_g) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_a = tl.load(alpha + rows * G + i_g, mask=m_t, other=0.0).to(tl.float32)
        b_dq = memory_transposed_times(b_do, b_S, b_u, b_k, b_start, b_D, PRECISION)  # [C, K] M_{t-1}^T do_t
        b_c += tl.sum(b_q * b_dq, axis=1)
        b_dov = tl.sum(b_do * b_v, axis=1)
        b_dq += (b_a * b_dov)[:, None] * b_k
        tl.store(dq + (rows[:, None] * G + i_g) * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        b_da = tl.sum(b_q * b_k, axis=1) * b_dov
        tl.store(dalpha + rows * G + i_g, b_da.to(dalpha.dtype.element_ty), mask=m_t)
    tl.store(c + rows, b_c, mask=m_t)


@triton.jit
def load_bwd_step(
    k, v, r, s, beta_x, gamma_x, mask, c, duE, bos, t, T_n, i_h, o_k, o_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Step t's inputs of the reverse sweep, k_t at offsets o_k (zeros and not live outside [0, T_n)): the forward
    sweep's (load_step), and what the forward saved for this step."""
    b_k, b_v, b_bx, b_gx, b_live = load_step(k, v, beta_x, gamma_x, mask, bos, t, T_n, i_h, o_k, o_v, H, K, V, HAS_MASK)
    valid = (t >= 0) & (t < T_n)
    t_v = t + 0 * o_v  # t per lane: the interpreter mistypes a scalar mask broadcast to a vector
    m_v = (t_v >= 0) & (t_v < T_n)
    row = (bos + t) * H + i_h
    b_r = tl.load(r + row * V + o_v, mask=m_v, other=0.0)
    b_duE = tl.load(duE + row * V + o_v, mask=m_v, other=0.0)
    b_sb = tl.load(s + 2 * row, mask=valid, other=0.0)
    b_sg = tl.load(s + 2 * row + 1, mask=valid, other=0.0)
    b_c = tl.load(c + row, mask=valid, other=0.0)
    return b_k, b_v, b_r, b_duE, b_sb, b_sg, b_bx, b_gx, b_c, b_live


@triton.jit
def sila_bwd_kernel_recurrent(
    k, v, beta_x, gamma_x, w_beta, w_gamma, mask, r, s, states, c, dE, duE, dht, dh0, du, dp, cu_seqlens,
    state_offsets, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, CHUNK: tl.constexpr,
    STORE_DH0: tl.constexpr, HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """The reverse sweep: du_t and the gate gradients per step, and dM at every chunk's end (into the dE slot
    after the chunk's, read by then), from which `sila_bwd_kernel_dkv` forms dM_t^T u_t by the chunk form.
    dM is held as [V, NB, KB], d_k in NB blocks of KB (utils.sweep_offsets)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos, T_n, state_base = sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK, IS_VARLEN)
    o_v = tl.arange(0, V)
    o_kb, o_mem = sweep_offsets(K, V, KB)  # [NB, KB], [V, NB, KB]
    b_wb = tl.load(w_beta + i_h * V + o_v).to(tl.float32)
    b_wg = tl.load(w_gamma + i_h * V + o_v).to(tl.float32)
    # dM_t without the outputs' share from later steps of its own chunk (added back through duE_t and dE)
    b_dM = tl.load(dht + (i_n * H + i_h).to(tl.int64) * V * K + o_mem)  # zeros when the final state has no grad
    b_h = tl.full([], 0.0, tl.float32)  # h_t = <dM_t, M_t>
    b_k, b_v, b_r, b_duE, b_sb, b_sg, b_bx, b_gx, b_c, b_live = load_bwd_step(
        k, v, r, s, beta_x, gamma_x, mask, c, duE, bos, T_n - 1, T_n, i_h, o_kb, o_v, H, K, V, HAS_MASK
    )
    for i in range(0, T_n):
        t = T_n - 1 - i
        n_k, n_v, n_r, n_duE, n_sb, n_sg, n_bx, n_gx, n_c, n_live = load_bwd_step(
            k, v, r, s, beta_x, gamma_x, mask, c, duE, bos, t - 1, T_n, i_h, o_kb, o_v, H, K, V, HAS_MASK
        )
        row = (bos + t) * H + i_h
        if ((t + 1) % CHUNK == 0) | (t == T_n - 1):  # the chunk's last step: M_t is the next checkpoint
            o_end = slot_start(state_base, t // CHUNK + 1, i_h, H, K, V) + o_mem
            b_h = tl.sum(tl.sum(tl.sum(b_dM * tl.load(states + o_end), axis=2), axis=1), axis=0)  # restart h
            tl.store(dE + o_end, b_dM)
        b_beta, b_gamma, b_sig, b_slope = sila_gates(b_sb, b_sg, b_bx, b_gx, b_live)
        b_du = tl.sum(tl.sum(b_dM * b_k[None, :, :], axis=1), axis=1) + b_duE  # [V] dM_t k_t
        b_dv_, b_dr_ = tl.reduce((b_du * b_v, b_du * b_r), 0, _add_pair)
        b_dbeta = b_dv_ - b_dr_
        b_gd = b_h - b_beta * b_dbeta  # gamma_t <dM_t, M_{t-1}>
        b_dpb = tl.where(b_live, b_dbeta * b_sig * (1 - b_sig), 0.0)
        b_dpg = b_gd * b_slope
        b_dr = b_dpb * b_wb + b_dpg * b_wg - b_beta * b_du
        b_h = b_gd + b_c - b_beta * b_dr_ + b_dpb * b_sb + b_dpg * b_sg
        b_dM = b_gamma * b_dM + b_dr[:, None, None] * b_k[None, :, :]
        if t % CHUNK == 0:  # leaving the chunk: its outputs' share joins dM
            b_dM += tl.load(dE + slot_start(state_base, t // CHUNK, i_h, H, K, V) + o_mem)
        tl.store(du + row * V + o_v, b_du)
        tl.store(dp + 2 * row, b_dpb)
        tl.store(dp + 2 * row + 1, b_dpg)
        b_k, b_v, b_r, b_duE, b_live = n_k, n_v, n_r, n_duE, n_live
        b_sb, b_sg, b_bx, b_gx, b_c = n_sb, n_sg, n_bx, n_gx, n_c
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * V * K + o_mem, b_dM)


@triton.jit
def sila_bwd_kernel_dkv(
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, mask, r, s, states, dM, do, du, dp, dk, dv, dbx, dgx, dw,
    cu_seqlens, state_offsets, chunk_indices, T, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr, HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """dk, dv, the gate inputs' gradients and the chunk's share of dw_beta, dw_gamma.

    With the sweep's dM (no outputs' share of the chunk) dM_t = exp(G_last - G_t) dM_last
    + sum_{s > t} exp(G_{s-1} - G_t) dr_s k_s^T, so dM_t^T u_t and M_{t-1}^T dr_t are chunk products.
    """
    i_n, i_c, i_h = utils.chunk_program(chunk_indices, IS_VARLEN)
    i_p = tl.program_id(0) if IS_VARLEN else tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    bos, T_n, state_base = sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK, IS_VARLEN)
    if i_c * CHUNK >= T_n:  # a spare program past its sequence's last chunk (utils.varlen_layout)
        return
    b_k, b_v, b_r, b_u, b_beta, b_start, b_D, b_tail, rows, m_t = load_chunk(
        k, v, r, s, beta_x, gamma_x, mask, bos, T_n, i_c, i_h, H, K, V, CHUNK, HAS_MASK
    )
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    m_tk, m_tv = m_t[:, None], m_t[:, None]
    b_du = tl.load(du + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_dpb = tl.load(dp + 2 * rows, mask=m_t, other=0.0)
    b_dpg = tl.load(dp + 2 * rows + 1, mask=m_t, other=0.0)
    b_wb = tl.load(w_beta + i_h * V + o_v).to(tl.float32)
    b_wg = tl.load(w_gamma + i_h * V + o_v).to(tl.float32)
    tl.store(dbx + rows, b_dpb.to(dbx.dtype.element_ty), mask=m_t)
    tl.store(dgx + rows, b_dpg.to(dgx.dtype.element_ty), mask=m_t)
    p_dw = dw + (i_p * H + i_h).to(tl.int64) * 2 * V + o_v
    tl.store(p_dw, tl.sum(b_dpb[:, None] * b_r, axis=0))
    tl.store(p_dw + V, tl.sum(b_dpg[:, None] * b_r, axis=0))
    b_dr = b_dpb[:, None] * b_wb[None, :] + b_dpg[:, None] * b_wg[None, :] - b_beta[:, None] * b_du  # [C, V]
    # [C, C] dr_t . u_s decayed for s < t (M_{t-1}^T dr_t), and its transpose for s > t (dM_t^T u_t)
    b_X = tl.dot(b_dr, tl.trans(b_u), input_precision=PRECISION) * b_D
    b_dk = tl.dot(b_X + tl.trans(b_X), b_k, input_precision=PRECISION)
    b_S = tl.load(memory_slot(states, state_base, i_c, i_h, H, K, V))
    b_dk += b_start[:, None] * tl.dot(b_dr, b_S, input_precision=PRECISION)
    b_dMl = tl.load(memory_slot(dM, state_base, i_c + 1, i_h, H, K, V))  # dM at the chunk's end
    b_dk += b_tail[:, None] * tl.dot(b_u, b_dMl, input_precision=PRECISION)
    b_dv = b_beta[:, None] * b_du
    b_F = tl.trans(b_D)  # [C, C] exp(G_{s-1} - G_t) for s > t
    for i_g in tl.static_range(G):
        b_q = tl.load(q + (rows[:, None] * G + i_g) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_do = tl.load(do + (rows[:, None] * G + i_g) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_a = tl.load(alpha + rows * G + i_g, mask=m_t, other=0.0).to(tl.float32)
        b_A = tl.dot(b_u, tl.trans(b_do), input_precision=PRECISION) * b_F  # [C, C] u_t . do_s, decayed, s > t
        b_dk += tl.dot(b_A, b_q, input_precision=PRECISION)  # the outputs' share of dM_t^T u_t
        b_dk += (b_a * tl.sum(b_do * b_v, axis=1))[:, None] * b_q
        b_dv += (b_a * tl.sum(b_q * b_k, axis=1))[:, None] * b_do
    tl.store(dk + rows[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dv + rows[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


def fused_recurrent_sila_bwd(
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, cu_seqlens, chunk_size, saved, do, dht
):
    """Gradients of q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma and the initial state (None if it was None)."""
    B, T, H, G, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    states, r, s, offsets, indices, n_chunks = saved
    cfg = utils.launch_settings(K, V)
    blocks = dict(H=H, G=G, K=K, V=V, CHUNK=chunk_size)
    flags = dict(HAS_MASK=mask is not None, IS_VARLEN=cu_seqlens is not None)
    grid = (n_chunks, H) if cu_seqlens is not None else (n_chunks, N, H)
    parallel = dict(PRECISION=utils.DOT_PRECISION, num_warps=cfg["chunk"], **blocks, **flags)

    dq, dalpha = utils.new_output(q.shape, q), utils.new_output(alpha.shape, alpha)
    c = utils.new_output((B, T, H), q, torch.float32)  # sum_g do_{t,g} . M_{t-1} q_{t,g}
    # slot c: chunk c's outputs' share, sum_s exp(G_{s-1}) sum_g do q^T; the sweep then leaves dM at chunk c's end
    # in slot c + 1, once it has read that slot
    dE = utils.new_output(states.shape, q, torch.float32)
    duE = utils.new_output((B, T, H, V), q, torch.float32)
    if n_chunks > 0:
        sila_bwd_kernel_dq[grid](
            q, k, v, alpha, beta_x, gamma_x, mask, r, s, states, do, dq, dalpha, c, dE, duE, cu_seqlens, offsets,
            indices, T, **parallel,
        )  # fmt: skip
    du = utils.new_output((B, T, H, V), q, torch.float32)  # dM_t k_t
    dp = utils.new_output((B, T, H, 2), q, torch.float32)  # gradients of the gate pre-activations
    dh0 = utils.new_output((N, H, V, K), q, torch.float32) if initial_state is not None else None
    if dht is None:
        dht = torch.zeros(N, H, V, K, device=q.device)
    sila_bwd_kernel_recurrent[(N, H)](
        k, v, beta_x, gamma_x, w_beta, w_gamma, mask, r, s, states, c, dE, duE, dht, dh0, du, dp, cu_seqlens,
        offsets, T, H=H, K=K, V=V, KB=utils.sweep_block(K), CHUNK=chunk_size, STORE_DH0=dh0 is not None,
        num_warps=cfg["sweep"], **flags,
    )  # fmt: skip
    del duE  # only the sweep reads it: dk, dv and dw take its place at the peak
    dk, dv = utils.new_output(k.shape, k), utils.new_output(v.shape, v)
    dbx, dgx = utils.new_output(beta_x.shape, beta_x), utils.new_output(gamma_x.shape, gamma_x)
    n_programs = n_chunks if cu_seqlens is not None else N * n_chunks
    dw = utils.new_output((n_programs, H, 2, V), q, torch.float32)  # per chunk
    if cu_seqlens is not None:
        dw.zero_()  # the spare programs past the last real chunk return without writing theirs
    if n_chunks > 0:
        sila_bwd_kernel_dkv[grid](
            q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, mask, r, s, states, dE, do, du, dp, dk, dv, dbx, dgx,
            dw, cu_seqlens, offsets, indices, T, **parallel,
        )  # fmt: skip
    dw = dw.sum(0)  # [H, 2, V]
    dh0 = dh0.to(initial_state.dtype) if dh0 is not None else None
    return dq, dk, dv, dalpha, dbx, dgx, dw[:, 0].to(w_beta.dtype), dw[:, 1].to(w_gamma.dtype), dh0
