"""Softmax reads split over programs (flash-decoding), shared by the decode kernels whose readout is a softmax over
many entries (attention over cached tokens, Raven over its slots).

A kernel that splits its entries into NS ranges stores, per row (one key/value head of one sequence) and range,
the running max `m`, the sum `l` of exp(score - m), and the exp-weighted values `o`, padded to BG query heads and
BD channels; `merge_fwd_kernel` combines the ranges into o [rows, G, D], one program per row and query head, which
reads the ranges in blocks (at batch 1 a row has up to a few hundred), or the last range of a row to finish merges
the row itself (`merge_if_last`). A range with no entry stores m = -1e30 (finite, so no NaN) and l = 0, and weighs
nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import dependent_launch, wait_for_inputs


@triton.jit
def merge_ranges(
    m_part,
    l_part,
    o_part,
    o,
    i_r,
    g0,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    NS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
):
    """Combine the NS ranges of row i_r for its query heads g0 .. g0 + H - 1, reading the ranges BS at a time (not one
    after another): o[i_r * G + g, :D]. `merge_fwd_kernel` merges one head per program; a kernel that wrote the
    ranges can merge a whole row itself (H = BG) in its last program of the row."""
    o_s, o_g, o_d = tl.arange(0, NS), g0 + tl.arange(0, H), tl.arange(0, BD)
    p_m = (i_r * NS) * BG
    b_mx = tl.max(tl.load(m_part + p_m + o_s[:, None] * BG + o_g[None, :]), 0)  # [H]
    b_l = tl.zeros([H], dtype=tl.float32)
    b_o = tl.zeros([H, BD], dtype=tl.float32)
    for s0 in range(0, NS, BS):
        p_b = p_m + (s0 + tl.arange(0, BS))[:, None] * BG + o_g[None, :]  # [BS, H]
        b_w = tl.exp(tl.load(m_part + p_b) - b_mx[None, :])
        b_l += tl.sum(b_w * tl.load(l_part + p_b), 0)
        b_o += tl.sum(b_w[:, :, None] * tl.load(o_part + p_b[:, :, None] * BD + o_d[None, None, :]), 0)  # [H, BD]
    m_o = (o_g < G)[:, None] & (o_d < D)[None, :]  # padded heads' l may be 0: never stored
    tl.store(o + (i_r * G + o_g[:, None]) * D + o_d[None, :], (b_o / b_l[:, None]).to(o.dtype.element_ty), mask=m_o)


@triton.jit
def merge_if_last(m_part, l_part, o_part, o, counter, i_r, G: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                  BG: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    """Called by each range of row i_r once it stored its partials: the row's last range to finish merges the whole
    row into o, counted with an atomic on counter[i_r] (`row_counters`), which it sets back to zero for the next
    call. One launch instead of a second kernel. The merge reads the BH real query heads (`Partials.BH`), not the
    BG a tl.dot pads them to."""
    tl.debug_barrier()  # every thread's partials stored before the count says so
    if tl.atomic_add(counter + i_r, 1, sem="acq_rel", scope="gpu") == NS - 1:  # acquire: the others' partials
        merge_ranges(m_part, l_part, o_part, o, i_r, 0, BH, G, D, NS, BG, BD, BS)
        tl.store(counter + i_r, 0)


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
    PDL: tl.constexpr = False,
):
    # one program per (row, query head)
    wait_for_inputs(PDL)
    merge_ranges(m_part, l_part, o_part, o, tl.program_id(0), tl.program_id(1), 1, G, D, NS, BG, BD, BS)


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


_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def row_counters(rows: int, device: torch.device) -> torch.Tensor:
    """[rows] int32 zeros that `merge_if_last` counts finished ranges in, each row's set back to zero by the
    program that merges it: made once per device and row count (its first call runs outside any CUDA graph the
    step is captured in), so every call and graph replay reuses them. Calls that run at once on two streams must
    not share them."""
    key = (device, rows)
    if key not in _counters:
        _counters[key] = torch.zeros(rows, dtype=torch.int32, device=device)
    return _counters[key]


class Partials:
    """The per-range buffers of `rows` rows split `NS` ways, and the merge into o."""

    def __init__(self, rows: int, NS: int, G: int, D: int, device: torch.device, pad: int = 1):
        """`pad`: the least BG and BD (16 for kernels that multiply the tiles with tl.dot)."""
        self.rows, self.NS, self.G, self.D = rows, NS, G, D
        self.BG, self.BD = max(pad, triton.next_power_of_2(G)), max(pad, triton.next_power_of_2(D))
        self.BH = triton.next_power_of_2(G)  # the heads a merge of a whole row reads: the real ones, unpadded
        self.m = torch.empty(rows, NS, self.BG, dtype=torch.float32, device=device)  # [rows, NS, BG]
        self.l = torch.empty_like(self.m)
        self.o = torch.empty(rows, NS, self.BG, self.BD, dtype=torch.float32, device=device)  # [rows, NS, BG, BD]

    def ranges_per_load(self, heads: int) -> int:
        """`merge_ranges`' BS for `heads` query heads at once: [BS, heads, BD] floats in registers."""
        return min(self.NS, max(1, 4096 // (heads * self.BD)))

    def row_in_one_load(self) -> bool:
        """Whether one program merges a whole row's ranges in one load: `merge_if_last` reads the ranges one load
        after another, so where a row has more (batch 1, a long cache) a second kernel over (row, head) is faster."""
        return self.NS <= self.ranges_per_load(self.BH)

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """Write the merged readout into o (contiguous, rows * G * D elements)."""
        BS = self.ranges_per_load(1)
        merge_fwd_kernel[(self.rows, self.G)](
            self.m, self.l, self.o, o, self.G, self.D, self.NS, self.BG, self.BD, BS, **dependent_launch(o.device)
        )
        return o
