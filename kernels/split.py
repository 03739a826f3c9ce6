"""Softmax reads split over programs (flash-decoding), shared by the decode kernels whose readout is a softmax over
many entries (attention over cached tokens, Raven over its slots).

A kernel that splits its entries into NS ranges stores, per row (one key/value head of one sequence) and range,
the running max `m`, the sum `l` of exp(score - m), and the exp-weighted values `o`, padded to BG query heads and
BD channels; `merge_fwd_kernel` combines the ranges into o [rows, G, D]. A range with no entry stores m = -1e30
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
):
    i_r = tl.program_id(0)
    o_s, o_g, o_d = tl.arange(0, NS), tl.arange(0, BG), tl.arange(0, BD)
    p_sg = (i_r * NS + o_s[:, None]) * BG + o_g[None, :]  # [NS, BG]
    b_mx = tl.max(tl.load(m_part + p_sg), 0)  # [BG]
    b_l = tl.sum(tl.exp(tl.load(m_part + p_sg) - b_mx[None, :]) * tl.load(l_part + p_sg), 0)
    b_o = tl.zeros([BG, BD], dtype=tl.float32)
    for i_s in range(NS):
        p_g = (i_r * NS + i_s) * BG + o_g
        b_w = tl.exp(tl.load(m_part + p_g) - b_mx)  # [BG]
        b_o += b_w[:, None] * tl.load(o_part + p_g[:, None] * BD + o_d[None, :])
    m_gd = (o_g < G)[:, None] & (o_d < D)[None, :]
    tl.store(o + (i_r * G + o_g[:, None]) * D + o_d[None, :], (b_o / b_l[:, None]).to(o.dtype.element_ty), mask=m_gd)


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """About two programs per SM keep the memory system busy; the interpreter gets a handful."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_count(rows: int, blocks: int, device: torch.device) -> int:
    """Ranges per row (a power of 2, at most `blocks`) so that rows x ranges covers the GPU."""
    return min(triton.next_power_of_2(triton.cdiv(programs_wanted(device), rows)), triton.next_power_of_2(blocks))


class Partials:
    """The per-range buffers of `rows` rows split `NS` ways, and the merge into o."""

    def __init__(self, rows: int, NS: int, G: int, D: int, device: torch.device, pad: int = 1):
        """`pad`: the least BG and BD (16 for kernels that multiply the tiles with tl.dot)."""
        self.rows, self.NS, self.G, self.D = rows, NS, G, D
        self.BG, self.BD = max(pad, triton.next_power_of_2(G)), max(pad, triton.next_power_of_2(D))
        self.m = torch.empty(rows, NS, self.BG, dtype=torch.float32, device=device)  # [rows, NS, BG]
        self.l = torch.empty_like(self.m)
        self.o = torch.empty(rows, NS, self.BG, self.BD, dtype=torch.float32, device=device)  # [rows, NS, BG, BD]

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """Write the merged readout into o (contiguous, rows * G * D elements)."""
        merge_fwd_kernel[(self.rows,)](self.m, self.l, self.o, o, self.G, self.D, self.NS, self.BG, self.BD)
        return o
