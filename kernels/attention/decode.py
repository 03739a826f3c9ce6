"""One query token per row against a preallocated key/value buffer (flash-decoding).

Each program reads one key/value head of one row over a contiguous range of slots, for all the query heads of its
group at once, so every key and value is read once per step; only the slots written so far (`step + 1`, at most
the buffer) are read. The ranges' partial softmax results (running max, sum, weighted values) are merged by the
last program of each row to finish, or by a second kernel (kernels/split.py). The number of ranges grows until the
grid covers the GPU, so batch 1 reads a long cache with every SM and large batches need no split. How a program
tiles its reads (`DecodeTiles`) is one setting for every call; `scripts/bench/sweep_decode_attention.py` times the
choices on a GPU, and its fastest at batch 32 and 128 is the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import LaunchSetting, dependent_launch, wait_for_inputs
from ..split import Partials, merge_if_last, row_counters, split_count


@triton.jit
def attention_fwd_kernel_split(
    q,
    k,
    v,
    valid,
    step,
    m_part,
    l_part,
    o_part,
    scale,
    S,
    CHUNK,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    NS: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,
    out,
    counter,
    MERGE: tl.constexpr,
    BH: tl.constexpr,
    BS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HKV
    filled = tl.minimum(tl.load(step) + 1, S)
    start = i_s * CHUNK
    end = tl.minimum(start + CHUNK, filled)
    o_g, o_d = tl.arange(0, BG), tl.arange(0, BD)
    m_g, m_d = o_g < G, o_d < D
    p_q = q + (i_bh * G + o_g[:, None]) * D + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BG, BD]
    if not NATIVE:
        b_q = b_q.to(tl.float32)
    p_kv = i_bh.to(tl.int64) * S * D
    b_m = tl.full([BG], -1e30, dtype=tl.float32)  # finite: a range with no valid slot keeps l = 0, not NaN
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_o = tl.zeros([BG, BD], dtype=tl.float32)
    for n0 in range(start, end, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < end
        b_valid = tl.load(valid + i_b * S + o_n, mask=m_n, other=0) != 0  # [BN]
        m_nd = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k + p_kv + o_n[:, None] * D + o_d[None, :], mask=m_nd, other=0.0)  # [BN, BD]
        if NATIVE:  # products in the cache's dtype, float32 sums (as flash attention multiplies)
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [BG, BN]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision=PRECISION) * scale
        b_s = tl.where(b_valid[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_s - b_mn[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(v + p_kv + o_n[:, None] * D + o_d[None, :], mask=m_nd, other=0.0)  # [BN, BD]
        if NATIVE:
            b_o = b_o * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        else:
            b_o = b_o * b_alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision=PRECISION)
        b_m = b_mn
    if NS == 1:  # the whole row: no partials to merge
        p_o = out + (i_bh * G + o_g[:, None]) * D + o_d[None, :]
        tl.store(p_o, (b_o / b_l[:, None]).to(out.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
    else:
        p_part = (i_bh * NS + i_s) * BG + o_g
        tl.store(m_part + p_part, b_m)
        tl.store(l_part + p_part, b_l)
        tl.store(o_part + p_part[:, None] * BD + o_d[None, :], b_o)
        if MERGE:  # the row's last range to finish merges the row: no second launch
            merge_if_last(m_part, l_part, o_part, out, counter, i_bh, G, D, NS, BG, BD, BH, BS)


@dataclass(frozen=True)
class DecodeTiles:
    """How each program of `attention_decode` reads: `block` slots at a time with `warps` warps and `stages`
    pipeline stages (None: Triton's default), ranges split until there are `per_sm` programs per SM, bf16/fp16
    caches multiplied in their own dtype with float32 sums (`native`) or as float32 tiles (tf32 products), and the
    ranges merged by the last program of each row (`merge_in_kernel` True: one launch, counted with an atomic), by a
    second kernel (False), or by the last program where it reads a row's ranges in one load and by a second kernel
    where a row has more (None: batch 1 splits a long cache into a hundred ranges or so). `max_ranges` caps the
    ranges a row (fewer, longer programs whose merge may fit one load). The Triton interpreter's
    bf16 products are wrong, so on a CPU bf16 is read as float32 tiles."""

    block: int = 128
    warps: int = 4
    stages: int | None = 3
    per_sm: int = 2
    native: bool = True
    merge_in_kernel: bool | None = None
    max_ranges: int | None = None

    def __post_init__(self):
        if self.max_ranges is not None and (self.max_ranges < 1 or self.max_ranges & (self.max_ranges - 1)):
            raise ValueError(f"max_ranges={self.max_ranges}: expected a power of two >= 1, or None (no cap)")

    def merges_in_kernel(self, part: Partials) -> bool:
        """Whether the ranges of `part` are merged by the last program of each row."""
        return part.row_in_one_load() if self.merge_in_kernel is None else self.merge_in_kernel


TILES = LaunchSetting(DecodeTiles())


def decode_tiles(tiles: DecodeTiles):
    """Every `attention_decode` call within runs with `tiles` (the sweep's way to try them; not thread-safe)."""
    return TILES.use(tiles)


def split_config(
    rows: int, slots: int, device: torch.device, block: int = 64, per_sm: int = 2, max_ranges: int | None = None
) -> tuple[int, int, int]:
    """(ranges NS, slots per range, slots per block) for `rows` = B * Hkv programs over `slots` slots, at most
    `max_ranges` ranges a row where set."""
    NS = min(split_count(rows, triton.cdiv(slots, block), device, per_sm), max_ranges or slots)
    return NS, triton.cdiv(triton.cdiv(slots, block), NS) * block, block


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, step: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, 1, d], k and v [B, Hkv, S, d] contiguous, valid [B, S] bool, step [1] long (slots beyond
    step + 1 are not read) -> o [B, 1, Hq, d] in q's dtype. Query head h reads key/value head h // (Hq / Hkv)."""
    B, Hq, T, D = q.shape
    _, Hkv, S, _ = k.shape
    if T != 1 or Hq % Hkv or k.shape != v.shape or tuple(valid.shape) != (B, S):
        raise ValueError(
            f"decode_attention takes q [B, Hq, 1, d] with Hq a multiple of Hkv, k = v [B, Hkv, S, d], valid [B, S]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, valid {tuple(valid.shape)}"
        )
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("decode_attention reads the cache's buffers in place: k and v must be contiguous")
    q = q.reshape(B, Hkv, Hq // Hkv, D).contiguous()  # [B, Hkv, G, d]: a view of the projection [B, 1, Hq, d]
    return attention_decode(q, k, v, valid, step, float(scale))


@torch.library.custom_op("raven_hybrid::attention_decode", mutates_args=())
def attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, step: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernel launches of `decode_attention` (checked inputs, q as [B, Hkv, G, d]) as a custom op:
    torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, Hkv, G, D = q.shape
    S = k.shape[2]
    tiles = TILES.value
    NS, CHUNK, BN = split_config(B * Hkv, S, q.device, tiles.block, tiles.per_sm, tiles.max_ranges)
    part = Partials(B * Hkv, NS, G, D, q.device, pad=16)  # tl.dot wants 16 rows
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 holds bf16/fp16 inputs exactly
    launch = {"num_warps": tiles.warps} | ({"num_stages": tiles.stages} if tiles.stages else {})
    out = torch.empty(B, 1, Hkv * G, D, dtype=q.dtype, device=q.device)
    merge = tiles.merges_in_kernel(part) and NS > 1
    counter = row_counters(B * Hkv, q.device) if merge else part.m  # unread without the merge
    attention_fwd_kernel_split[(B * Hkv, NS)](
        q,
        k,
        v,
        valid,
        step,
        part.m,
        part.l,
        part.o,
        float(scale),
        S,
        CHUNK,
        Hkv,
        G,
        D,
        NS,
        part.BG,
        BN,
        part.BD,
        precision,
        tiles.native and q.dtype != torch.float32 and not (q.dtype == torch.bfloat16 and q.device.type == "cpu"),
        out,
        counter,
        merge,
        part.BH,
        part.ranges_per_load(part.BH),
        **launch,
        **dependent_launch(q.device),
    )
    return out if merge or NS == 1 else part.merge(out)


@attention_decode.register_fake
def _(q, k, v, valid, step, scale):
    B, Hkv, G, D = q.shape
    return q.new_empty(B, 1, Hkv * G, D)
