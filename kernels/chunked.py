"""What the chunked forms of the mixers share: the long-sequence state scan and the range test of the in-chunk fast
path.

A chunked form cuts every sequence into chunks and needs the state entering each. For long sequences with few
(sequence, head) programs a sequential scan over the chunks is latency-bound, so the work is split: every chunk's
own contribution x_c (what it writes into the state leaving it) in parallel, then `scan_fwd_kernel` turns the
contributions into states, h_{c+1} = exp(gl_c) h_c + x_c, gl_c [.., M] the chunk's log-decay of each state row,
several chunks per step. Run forward it gives the states entering every chunk; reversed (last chunk first), from
what each chunk's reads add, the gradients of the states leaving it. Raven scans two states per head (keys and
values), SSE one.

In-chunk terms weigh token s as seen from t >= s by exp(g_t - g_s), g the cumulative log-decay within the chunk.
When no row decays by more than RANGE_NATS over a chunk, every pair factors through one reference at half the
chunk's decay, exp(g_t - ref) exp(ref - g_s), both factors within exp(RANGE_NATS / 2), and the in-chunk terms are
plain matrix products; otherwise the kernels take their exact forms (`needs_exact`). Inside a CUDA graph the host
cannot wait for that answer: both forms are queued and each program reads it on the device (`choice_on_device`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

RANGE_NATS = 120.0  # largest in-chunk decay (nats) of a state row on the fast path: factors within e^60


def exceeds_range(gl: torch.Tensor) -> torch.Tensor:
    """Whether any state row decays by more than RANGE_NATS within a chunk (gl: the log-decay of every chunk and
    row, any shape), as a bool [] on gl's device."""
    return gl.amin() < -RANGE_NATS if gl.numel() else torch.zeros((), dtype=torch.bool, device=gl.device)


def needs_exact(gl: torch.Tensor) -> Callable[[], bool]:
    """`exceeds_range`, so that the kernels must take their exact in-chunk forms, for the host to decide. On the GPU
    the answer travels to the host asynchronously: call the returned function after launching work that does not
    need it (the state scan), and the GPU stays busy while the host waits."""
    flag = exceeds_range(gl)
    if not flag.is_cuda:
        return lambda: bool(flag)
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def answer() -> bool:
        done.synchronize()
        return bool(host)

    return answer


FORCE_DEVICE_CHOICE = False  # choose on the device, as inside a CUDA graph, on any device (choosing_on_device)


@contextmanager
def choosing_on_device():
    """Within it the kernels choose their exact or fast forms on the device, as inside a CUDA graph capture: the
    eager steps before a capture take the capture's path, so the kernel variants it launches compile before it."""
    global FORCE_DEVICE_CHOICE
    before, FORCE_DEVICE_CHOICE = FORCE_DEVICE_CHOICE, True
    try:
        yield
    finally:
        FORCE_DEVICE_CHOICE = before


def choice_on_device(x: torch.Tensor) -> bool:
    """Whether a kernel's exact or fast form must be chosen on the device, by launching both and letting each
    program read `exceeds_range`: while a CUDA graph captures the work (nothing may be read back then), or when
    the tests force it."""
    return FORCE_DEVICE_CHOICE or (x.is_cuda and torch.cuda.is_current_stream_capturing())


@triton.jit
def scan_combine(a1, b1, a2, b2):
    """Two steps h <- a h + b of the scan, the first (a1, b1) applied first."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def scan_combine_pair(a1, bk1, bv1, a2, bk2, bv2):
    """scan_combine for two states that share their decay."""
    return a1 * a2, bk1 * a2 + bk2, bv1 * a2 + bv2


@triton.jit
def scan_fwd_kernel(
    xk,
    xv,
    gl,
    hk,
    hv,
    h0k,
    h0v,
    htk,
    htv,
    seq_chunks,
    H: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    BP: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    PAIR: tl.constexpr,
    REVERSE: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    """hk [NC, H, M, D] (the states' dtype) from the contributions xk (same shape), and with PAIR hv from xv under the
    same decay gl [NC, H, M]: for one sequence, head and block of rows and columns, step s of the scan stores the
    carry h at chunk c(s), then h <- exp(gl_c(s)) h + x_c(s). Forward c(s) = first chunk + s: the states entering
    every chunk, h0 [N, H, M, D] the initial states, ht the final ones. REVERSE (last chunk first): the gradients of
    the states leaving every chunk, h0 the final states' gradients, ht the initial states'. BP steps at a time: their
    loads in flight together, combined with an associative scan, float32 throughout."""
    i_md, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_m, i_d = i_md % tl.cdiv(M, BM), i_md // tl.cdiv(M, BM)
    o_p = tl.arange(0, BP)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_m, m_d = o_m < M, o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    p_hd = (i_h * M + o_m[:, None]) * D + o_d[None, :]  # [BM, BD]
    p_md = p_hd[None, :, :]
    b_ck = tl.zeros([BM, BD], dtype=tl.float32)  # the carry: h at the group's first step
    b_cv = tl.zeros([BM, BD], dtype=tl.float32)
    if USE_H0:
        b_ck += tl.load(h0k + i_n * H * M * D + p_hd, mask=m_md, other=0.0)
        if PAIR:
            b_cv += tl.load(h0v + i_n * H * M * D + p_hd, mask=m_md, other=0.0)
    c0, c1 = tl.load(seq_chunks + i_n), tl.load(seq_chunks + i_n + 1)
    n = c1 - c0
    for i0 in range(0, n + 1, BP):
        o_s = i0 + o_p  # [BP] steps; step n is the final state
        o_c = c1 - 1 - o_s if REVERSE else c0 + o_s  # [BP] chunk of each step
        o_e = o_c + 1 if REVERSE else o_c - 1  # the step before, whose update leads into step s (none at s = 0)
        m_e = (o_s >= 1) & (o_s <= n)
        m_em = m_e[:, None] & m_m[None, :]
        b_f = tl.exp(tl.load(gl + (o_e[:, None] * H + i_h) * M + o_m[None, :], mask=m_em, other=0.0))  # [BP, BM]
        p_e = o_e[:, None, None] * H * M * D + p_md
        m_x = m_e[:, None, None] & m_md[None, :, :]
        b_a = tl.broadcast_to(b_f[:, :, None], [BP, BM, BD])
        b_xk = tl.load(xk + p_e, mask=m_x, other=0.0).to(tl.float32)  # [BP, BM, BD]
        if PAIR:
            b_xv = tl.load(xv + p_e, mask=m_x, other=0.0).to(tl.float32)
            b_a, b_xk, b_xv = tl.associative_scan((b_a, b_xk, b_xv), 0, scan_combine_pair)
            b_hv = b_a * b_cv[None, :, :] + b_xv
        else:
            b_a, b_xk = tl.associative_scan((b_a, b_xk), 0, scan_combine)
        b_hk = b_a * b_ck[None, :, :] + b_xk  # [BP, BM, BD] h at each step
        p_s = o_c[:, None, None] * H * M * D + p_md
        m_s = (o_s < n)[:, None, None] & m_md[None, :, :]
        tl.store(hk + p_s, b_hk.to(hk.dtype.element_ty), mask=m_s)
        if PAIR:
            tl.store(hv + p_s, b_hv.to(hv.dtype.element_ty), mask=m_s)
        if STORE_HT:
            m_t = (o_s == n)[:, None, None] & m_md[None, :, :]
            p_t = tl.broadcast_to(i_n * H * M * D + p_md, [BP, BM, BD])  # only the row of step n is stored
            tl.store(htk + p_t, b_hk, mask=m_t)
            if PAIR:
                tl.store(htv + p_t, b_hv, mask=m_t)
        last = (o_p == BP - 1)[:, None, None]
        b_ck = tl.sum(tl.where(last, b_hk, 0.0), 0)
        if PAIR:
            b_cv = tl.sum(tl.where(last, b_hv, 0.0), 0)


def scan_config(M: int, D: int) -> tuple[int, int, int, int]:
    """Steps, state rows and columns per program of the scan of [M, D] states, and its warps: 4 steps of [BM, BD] = 256
    state entries in flight per program, rows of up to 64 columns (128-byte lines in bf16); more steps, fewer warps
    or larger tiles were slower (docs/KERNELS.md, Settings: Raven long-sequence scan)."""
    BD = min(64, triton.next_power_of_2(D))
    return 4, min(triton.next_power_of_2(M), max(1, 256 // BD)), BD, 4


def state_scan(xs, gl, h0, seq_chunks, store_final: bool, config, reverse: bool = False):
    """scan_fwd_kernel over one or two contributions xs ([NC, H, M, D] each, sharing the decay gl [NC, H, M]): the
    states (or, reversed, their gradients) in xs' dtype, and the final ones (initial ones, reversed) [N, H, M, D]
    float32, or None. h0: a tuple like xs or None; config: (steps, rows, columns, warps) per program; seq_chunks
    [N + 1] bounds each sequence's chunks."""
    NC, H, M, D = xs[0].shape
    N = seq_chunks.numel() - 1
    BP, BM, BD, warps = config
    hs = tuple(torch.empty_like(x) for x in xs)
    ht = tuple(xs[0].new_empty(N, H, M, D, dtype=torch.float32) for _ in xs)
    (xk, xv), (hk, hv), (h0k, h0v), (tk, tv) = ((*t, None)[:2] for t in (xs, hs, h0 or (None,), ht))
    grid = (triton.cdiv(M, BM) * triton.cdiv(D, BD), N * H)
    scan_fwd_kernel[grid](
        xk, xv, gl, hk, hv, h0k, h0v, tk, tv, seq_chunks, H, M, D, BP, BM, BD, xv is not None, reverse,
        h0k is not None, store_final, num_warps=warps,
    )  # fmt: skip
    return hs, (ht if store_final else None)
