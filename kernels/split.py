"""Softmax reads split over programs (flash-decoding), shared by the decode kernels whose readout is a softmax over
many entries (attention over cached tokens, Raven over its slots).

A kernel that splits its entries into NS ranges stores, per row (one key/value head of one sequence) and range,
the running max `m`, the sum `l` of exp(score - m), and the exp-weighted values `o`, padded to BG query heads and
BD channels; `merge_fwd_kernel` combines the ranges into o [rows, G, D], one program per row and query head, which
reads the ranges in blocks (at batch 1 a row has up to a few hundred). A range with no entry stores m = -1e30
(finite, so no NaN) and l = 0, and weighs nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def merge_fwd_kernel(
    m_part,
    l_part,
    o_part,
    o,
    G: tl.constexpr,
    D: tl.constexpr,
    NS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
):
    # one program per (row, query head): the ranges are read BS at a time, not one after another
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_s, o_d = tl.arange(0, NS), tl.arange(0, BD)
    p_m = (i_r * NS) * BG + i_g
    b_mx = tl.max(tl.load(m_part + p_m + o_s * BG), 0)  # []
    b_l = tl.zeros([], dtype=tl.float32)
    b_o = tl.zeros([BD], dtype=tl.float32)
    for s0 in range(0, NS, BS):
        o_b = s0 + tl.arange(0, BS)
        b_w = tl.exp(tl.load(m_part + p_m + o_b * BG) - b_mx)  # [BS]
        b_l += tl.sum(b_w * tl.load(l_part + p_m + o_b * BG), 0)
        b_part = tl.load(o_part + (p_m + o_b[:, None] * BG) * BD + o_d[None, :])  # [BS, BD]
        b_o += tl.sum(b_w[:, None] * b_part, 0)
    tl.store(o + (i_r * G + i_g) * D + o_d, (b_o / b_l).to(o.dtype.element_ty), mask=o_d < D)


@triton.jit
def merge_ranges(
    m_part,
    l_part,
    o_part,
    o,
    i_r,
    G: tl.constexpr,
    D: tl.constexpr,
    NS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
):
    """`merge_fwd_kernel`'s work for every query head of row i_r at once, inside the kernel that wrote the ranges
    (its last program of the row): o[i_r * G + g, :D]."""
    o_s, o_g, o_d = tl.arange(0, NS), tl.arange(0, BG), tl.arange(0, BD)
    p_m = (i_r * NS) * BG
    b_mx = tl.max(tl.load(m_part + p_m + o_s[:, None] * BG + o_g[None, :]), 0)  # [BG]
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_o = tl.zeros([BG, BD], dtype=tl.float32)
    for s0 in range(0, NS, BS):
        p_b = p_m + (s0 + tl.arange(0, BS))[:, None] * BG + o_g[None, :]  # [BS, BG]
        b_w = tl.exp(tl.load(m_part + p_b) - b_mx[None, :])
        b_l += tl.sum(b_w * tl.load(l_part + p_b), 0)
        b_o += tl.sum(b_w[:, :, None] * tl.load(o_part + p_b[:, :, None] * BD + o_d[None, None, :]), 0)  # [BG, BD]
    m_o = (o_g < G)[:, None] & (o_d < D)[None, :]  # the padded heads' l may be 0: never stored
    tl.store(o + (i_r * G + o_g[:, None]) * D + o_d[None, :], (b_o / b_l[:, None]).to(o.dtype.element_ty), mask=m_o)


@functools.cache
def programs_wanted(device: torch.device, per_sm: int = 2) -> int:
    """About two programs per SM keep the memory system busy; the interpreter gets a handful."""
    if device.type != "cuda":
        return 8
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def split_count(rows: int, blocks: int, device: torch.device, per_sm: int = 2) -> int:
    """Ranges per row (a power of 2, at most `blocks`) so that rows x ranges covers the GPU with `per_sm` programs
    per SM."""
    wanted = programs_wanted(device, per_sm)
    return min(triton.next_power_of_2(triton.cdiv(wanted, rows)), triton.next_power_of_2(blocks))


class Partials:
    """The per-range buffers of `rows` rows split `NS` ways, and the merge into o."""

    def __init__(self, rows: int, NS: int, G: int, D: int, device: torch.device, pad: int = 1):
        """`pad`: the least BG and BD (16 for kernels that multiply the tiles with tl.dot)."""
        self.rows, self.NS, self.G, self.D = rows, NS, G, D
        self.BG, self.BD = max(pad, triton.next_power_of_2(G)), max(pad, triton.next_power_of_2(D))
        self.m = torch.empty(rows, NS, self.BG, dtype=torch.float32, device=device)  # [rows, NS, BG]
        self.l = torch.empty_like(self.m)
        self.o = torch.empty(rows, NS, self.BG, self.BD, dtype=torch.float32, device=device)  # [rows, NS, BG, BD]

    @property
    def BS_row(self) -> int:
        """Ranges per load of `merge_ranges`: [BS, BG, BD] floats in registers."""
        return min(self.NS, max(1, 4096 // (self.BG * self.BD)))

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """Write the merged readout into o (contiguous, rows * G * D elements)."""
        BS = min(self.NS, max(1, 4096 // self.BD))  # ranges per load: [BS, BD] floats in registers
        merge_fwd_kernel[(self.rows, self.G)](self.m, self.l, self.o, o, self.G, self.D, self.NS, self.BG, self.BD, BS)
        return o
