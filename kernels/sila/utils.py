"""Pieces shared by the SILA kernels: the gates, sequence bounds, the chunk form of the memory, host-side layout.

The sequential kernels keep the [V, K] memory on chip and also save, every CHUNK steps, the memory entering the
chunk (a checkpoint S). Inside a chunk that starts from S, with u_s = beta_s (v_s - M_{s-1} k_s) and
G_t = sum_{r <= t} log gamma_r counted from the chunk start,

    M_{t-1} = exp(G_{t-1}) S + sum_{s < t} exp(G_{t-1} - G_s) u_s k_s^T,

so every product of M_{t-1} with a per-step vector (the reads M_{t-1} q_t, and M_{t-1}^T x_t in the backward
pass) is a few chunk-sized matrix products, computed in parallel over chunks once the sequential kernel has saved
M_{t-1} k_t and the gate pre-activations.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..varlen import chunk_layout

LOG2 = math.log(2.0)
DOT_PRECISION = "tf32"  # tensor cores; "tf32x3" is fp32-accurate but spills registers at d = 128


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def sila_gates(b_sb, b_sg, b_bx, b_gx, b_live):
    """beta = sigmoid(pb), gamma = phi(pg) (1 and 0 at padding), with phi as raven_layers.sila.sila_phi.

    Also returns sigmoid(pb) and (1 - e^2) / (1 + e^2), e = exp(min(pg, 0)): phi'(pg) = gamma times the latter.
    """
    b_sig = tl.sigmoid(b_sb + b_bx)
    b_e = tl.exp(tl.minimum(b_sg + b_gx, 0.0))
    b_e2 = b_e * b_e
    b_beta = tl.where(b_live, b_sig, 0.0)
    b_gamma = tl.where(b_live, 2 * b_e / (1 + b_e2), 1.0)
    b_slope = tl.where(b_live, (1 - b_e2) / (1 + b_e2), 0.0)
    return b_beta, b_gamma, b_sig, b_slope


@triton.jit
def recall(b_M, b_q, b_k, b_v, b_a):
    """One query head's read at a step: M_{t-1} q + alpha (k . q) v [V], M [V, NB, KB], q and k [NB, KB]."""
    b_qk = tl.sum(tl.sum(b_k * b_q, axis=1), axis=0)
    return tl.sum(tl.sum(b_M * b_q[None, :, :], axis=1), axis=1) + b_a * b_qk * b_v


@triton.jit
def delta_write(b_M, b_k, b_v, b_r, b_beta, b_gamma):
    """M_t = gamma M_{t-1} + beta (v - M_{t-1} k) k^T, with r = M_{t-1} k."""
    b_u = b_beta * (b_v - b_r)
    return b_gamma * b_M + b_u[:, None, None] * b_k[None, :, :]


@triton.jit
def sila_log_gamma(b_pg, b_live):
    """log phi(pg) = log 2 + x - log(1 + e^{2x}) on x = min(pg, 0); 0 at padding. Finite wherever pg is."""
    b_x = tl.minimum(b_pg, 0.0)
    b_lg = 0.6931471805599453 + b_x - tl.log(1 + tl.exp(2 * b_x))
    return tl.where(b_live & (b_pg < 0), b_lg, 0.0)


@triton.jit
def sequence_bounds(cu_seqlens, state_offsets, i_n, T, CHUNK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First row of sequence i_n in the flattened [N * T] time axis, its length, and its first checkpoint."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
        state_base = tl.load(state_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T + 0 * i_n  # a tensor even where T == 1 is specialised to a constant
        state_base = i_n.to(tl.int64) * (tl.cdiv(T, CHUNK) + 1)
    return bos, T_n, state_base


@triton.jit
def chunk_program(chunk_indices, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, head) for this program of a chunk-parallel grid (chunks, H) or (chunks, N, H)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * tl.program_id(0))
        i_c = tl.load(chunk_indices + 2 * tl.program_id(0) + 1)
        i_h = tl.program_id(1)
    else:
        i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    return i_n, i_c, i_h


@triton.jit
def chunk_rows(mask, bos, T_n, i_c, i_h, H: tl.constexpr, CHUNK: tl.constexpr, HAS_MASK: tl.constexpr):
    """Rows of chunk i_c in the [N * T, H] layout [C], which are in the sequence, and which are real tokens."""
    o_t = i_c * CHUNK + tl.arange(0, CHUNK)
    m_t = o_t < T_n
    b_live = m_t
    if HAS_MASK:
        b_live = b_live & (tl.load(mask + bos + o_t, mask=m_t, other=0) != 0)
    return (bos + o_t) * H + i_h, m_t, b_live


@triton.jit
def chunk_decays(s, gamma_x, rows, m_t, b_live, CHUNK: tl.constexpr):
    """exp(G_{t-1}) [C], the decay of the chunk's entering memory up to step t, D [C, C] = exp(G_{t-1} - G_s)
    for s < t (0 elsewhere), and exp(G_last - G_t) [C], the decay from step t to the chunk's end, with
    G_t = sum_{r <= t} log gamma_r from the chunk start."""
    b_sg = tl.load(s + 2 * rows + 1, mask=m_t, other=0.0)
    b_gx = tl.load(gamma_x + rows, mask=m_t, other=0.0).to(tl.float32)
    b_lg = sila_log_gamma(b_sg + b_gx, b_live)
    # G_t in float64: differences of long cumulative sums would lose |G| * eps in float32
    b_G = tl.cumsum(b_lg.to(tl.float64), 0)
    b_Gp = b_G - b_lg.to(tl.float64)  # G_{t-1}
    o_s = tl.arange(0, CHUNK)
    strict = o_s[None, :] < o_s[:, None]  # s < t
    b_D = tl.exp(tl.where(strict, (b_Gp[:, None] - b_G[None, :]).to(tl.float32), float("-inf")))
    b_tail = tl.exp((tl.sum(b_lg.to(tl.float64), 0) - b_G).to(tl.float32))
    return tl.exp(b_Gp.to(tl.float32)), b_D, b_tail


@triton.jit
def sweep_offsets(K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """Offsets of d_k in blocks of KB, [K // KB, KB], and of one [V, K] memory held as [V, K // KB, KB].

    The sequential kernels hold M so: with KB-wide rows a warp's lanes span both V (4) and K (8), so a [V] vector is
    4 values per thread (16 with whole rows) and a sum over K takes 3 shuffle steps (5 with whole rows).
    """
    o_kb = tl.arange(0, K // KB)[:, None] * KB + tl.arange(0, KB)[None, :]
    return o_kb, tl.arange(0, V)[:, None, None] * K + o_kb[None, :, :]


@triton.jit
def slot_start(state_base, i_c, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Offset of slot i_c, head i_h in a per-chunk memory buffer [slots, H, V, K] (checkpoints, dE)."""
    return ((state_base + i_c) * H + i_h) * V * K


@triton.jit
def memory_slot(base, state_base, i_c, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointers [V, K] to slot i_c of a per-chunk memory buffer [slots, H, V, K], head i_h."""
    o_mem = tl.arange(0, V)[:, None] * K + tl.arange(0, K)[None, :]
    return base + slot_start(state_base, i_c, i_h, H, K, V) + o_mem


@triton.jit
def load_chunk(
    k, v, r, s, beta_x, gamma_x, mask, bos, T_n, i_c, i_h,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """What the chunk form needs besides the checkpoint: k [C, K], v, r and u [C, V], beta [C], the decays."""
    rows, m_t, b_live = chunk_rows(mask, bos, T_n, i_c, i_h, H, CHUNK, HAS_MASK)
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
    b_r = tl.load(r + rows[:, None] * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_sb = tl.load(s + 2 * rows, mask=m_t, other=0.0)
    b_bx = tl.load(beta_x + rows, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.where(b_live, tl.sigmoid(b_sb + b_bx), 0.0)
    b_u = b_beta[:, None] * (b_v - b_r)  # [C, V]
    b_start, b_D, b_tail = chunk_decays(s, gamma_x, rows, m_t, b_live, CHUNK)
    return b_k, b_v, b_r, b_u, b_beta, b_start, b_D, b_tail, rows, m_t


@triton.jit
def memory_transposed_times(b_x, b_S, b_u, b_k, b_start, b_D, PRECISION: tl.constexpr):
    """Rows M_{t-1}^T x_t [C, K] for rows x_t [C, V], by the chunk form."""
    b_A = tl.dot(b_x, tl.trans(b_u), input_precision=PRECISION) * b_D  # [C, C] decayed x_t . u_s
    b_y = tl.dot(b_A, b_k, input_precision=PRECISION)
    return b_y + b_start[:, None] * tl.dot(b_x, b_S, input_precision=PRECISION)


def sweep_block(K: int) -> int:
    """KB of `sweep_offsets` for head dim K."""
    return min(K, 32)


def launch_settings(K: int, V: int) -> dict:
    """Warps of the sequential kernels ("sweep", one program holds a whole [V, K] memory in registers) and of the
    chunk-parallel ones ("chunk"), by head dim."""
    warps = 8 if K * V >= 128 * 128 else 4
    return {"sweep": warps, "chunk": warps}


def step_warps(K: int, V: int) -> int:
    """Warps of a decode step's program: one up to a 64 x 64 memory (SmolLM2's heads: the fastest on an H200 at
    batch 1-128, docs/KERNELS.md), else the sequential kernels' ("sweep"), since a larger memory would spill from
    one warp's registers."""
    return 1 if K * V <= 64 * 64 else launch_settings(K, V)["sweep"]


def varlen_layout(cu_seqlens: torch.Tensor | None, N: int, T: int, chunk: int):
    """Checkpoint offsets per sequence [N], (sequence, chunk) per chunk program [C, 2] and the counts of checkpoint
    slots and chunk programs. With cu_seqlens both counts are bounds, never a host sync (kernels/varlen.py): the
    chunk kernels return at once for programs past their sequence's last chunk, and no kernel touches the spare
    slots."""
    if cu_seqlens is None:
        n_chunks = triton.cdiv(T, chunk)
        return None, None, N * (n_chunks + 1), n_chunks
    seq, within, first, n_chunks = chunk_layout(cu_seqlens, T, chunk)
    offsets = first[:-1] + torch.arange(N, device=first.device, dtype=torch.int32)  # each sequence's chunks + 1
    return offsets, torch.stack([seq, within], dim=1).contiguous(), n_chunks + N, n_chunks


def new_output(shape: tuple, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every buffer a kernel writes; the tests replace this to poison them."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


@triton.jit
def load_step(
    k, v, beta_x, gamma_x, mask, bos, t, T_n, i_h, o_k, o_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """k_t (at offsets o_k), v_t [V], the gate inputs and whether step t is a real token (False past the end)."""
    valid = (t >= 0) & (t < T_n)
    t_k, t_v = t + 0 * o_k, t + 0 * o_v  # t per lane: the interpreter mistypes a scalar mask broadcast to a vector
    m_k = (t_k >= 0) & (t_k < T_n)
    m_v = (t_v >= 0) & (t_v < T_n)
    row = (bos + t) * H + i_h
    b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_bx = tl.load(beta_x + row, mask=valid, other=0.0).to(tl.float32)
    b_gx = tl.load(gamma_x + row, mask=valid, other=0.0).to(tl.float32)
    b_live = valid
    if HAS_MASK:
        b_live = tl.load(mask + bos + t, mask=valid, other=0) != 0
    return b_k, b_v, b_bx, b_gx, b_live
