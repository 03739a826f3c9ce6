"""RMSNorm and the product that reads it, and SiLU(gate) * up and the product that reads it, as one kernel each for
a decode step's few rows.

In a decode step (1-128 rows) the norm before each product is a kernel of its own: a row of a few hundred values,
whose launch and latency cost about what the product's do. `norm_linear` computes

    linear(norm_weight * RMSNorm(x), weight)         x [..., K], norm_weight [K], weight [N, K] -> [..., N]

in one launch, and `add_norm_linear` also adds the residual first and returns the sum h = x + residual, which the
next residual add reads: the step's `residual + output` is then no kernel either. The rounding is transformers'
RMSNorm's (statistics in float32, the normalized rows cast back to x's dtype, the weight's product rounded in it),
so only the product's order of summation differs from the eager step's.

Each program takes BM rows and BN outputs: a first pass over the rows' K values gives their mean squares (and the
program of the first output block writes h), the second normalizes each block of K as it is read and multiplies it
with the weight's block (tl.dot; float32 accumulation).

`silu_mul_linear` is an MLP's down projection, linear(silu(gate) * up, weight), with the gated activation computed
as each block of K is read (rounded as the eager step rounds it: silu's result, then the product with up): the
activation is then no kernel of its own either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import LaunchSetting

BK = 64  # values of K a step of either pass reads


@dataclass(frozen=True)
class ProductTiles:
    """Outputs a program takes and its warps, where set (None: `_blocks`' choice, 4 warps);
    scripts/bench/bench_products.py times the choices."""

    outputs: int | None = None
    warps: int | None = None


TILES = LaunchSetting(ProductTiles())


def product_tiles(tiles: ProductTiles):
    """Every product kernel launched within takes `tiles` (the benchmark's way to try them; not thread-safe)."""
    return TILES.use(tiles)


@triton.jit
def weight_product(b_acc, b_a, w, o_n, o_k, m_n, m_k, stride_w, NATIVE: tl.constexpr, PRECISION: tl.constexpr):
    """b_acc [BM, BN] plus the rows b_a [BM, BK] times the weight's block [BN, BK] (rows o_n, columns o_k)."""
    b_w = tl.load(w + o_n[:, None] * stride_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    if NATIVE:
        return b_acc + tl.dot(b_a, tl.trans(b_w), input_precision=PRECISION)
    # bfloat16 under the CPU interpreter: its dot is float32's
    return b_acc + tl.dot(b_a.to(tl.float32), tl.trans(b_w.to(tl.float32)), input_precision="ieee")


@triton.jit
def norm_linear_fwd_kernel(
    x, res, g, w, y, h, M, N, K, stride_x, stride_r, stride_w, stride_y, stride_h, eps, HAS_RES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    b_ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):  # the rows' sums of squares; h written once, by the first block of outputs
        o_k = k0 + tl.arange(0, BK)
        m_mk = m_m[:, None] & (o_k < K)[None, :]
        b_x = tl.load(x + o_m[:, None] * stride_x + o_k[None, :], mask=m_mk, other=0.0)
        if HAS_RES:  # rounded to x's dtype, as the eager add is
            b_r = tl.load(res + o_m[:, None] * stride_r + o_k[None, :], mask=m_mk, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(x.dtype.element_ty)
            if i_n == 0:
                tl.store(h + o_m[:, None] * stride_h + o_k[None, :], b_x, mask=m_mk)
        b_xf = b_x.to(tl.float32)
        b_ss += tl.sum(b_xf * b_xf, 1)
    b_rs = tl.rsqrt(b_ss / K + eps)  # [BM]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        m_mk = m_m[:, None] & m_k[None, :]
        b_x = tl.load(x + o_m[:, None] * stride_x + o_k[None, :], mask=m_mk, other=0.0)
        if HAS_RES:
            b_r = tl.load(res + o_m[:, None] * stride_r + o_k[None, :], mask=m_mk, other=0.0)
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(x.dtype.element_ty)
        b_a = (b_x.to(tl.float32) * b_rs[:, None]).to(x.dtype.element_ty)  # the normalized rows, in x's dtype
        b_gk = tl.load(g + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = (b_gk[None, :] * b_a.to(tl.float32)).to(x.dtype.element_ty)  # times the norm's weight, rounded once
        b_acc = weight_product(b_acc, b_a, w, o_n, o_k, m_n, m_k, stride_w, NATIVE, PRECISION)
    tl.store(y + o_m[:, None] * stride_y + o_n[None, :], b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight, weight, eps: float):
    """x [..., K] (+ residual [..., K]) -> y [..., N], and h = x + residual [..., K] where residual is given."""
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[-1] != K or weight.stride(-1) != 1 or norm_weight.shape != (K,):
        raise ValueError(
            f"norm_linear takes x [..., K], norm_weight [K] and weight [N, K] with unit stride along K; got x "
            f"{tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)}, weight {tuple(weight.shape)} strides "
            f"{weight.stride()}"
        )
    rows = x.reshape(-1, K)  # [M, K]
    res = residual.reshape(-1, K) if residual is not None else rows
    rows, res = (t if t.stride(-1) == 1 else t.contiguous() for t in (rows, res))
    M = rows.shape[0]
    out = x.new_empty(*x.shape[:-1], N)
    h = x.new_empty(x.shape) if residual is not None else None
    BM, BN = _blocks(M, N)
    if M:
        norm_linear_fwd_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
            rows, res, norm_weight.contiguous(), weight, out, h if h is not None else out, M, N, K, rows.stride(0),
            res.stride(0), weight.stride(0), N, K, float(eps), HAS_RES=residual is not None, BM=BM, BN=BN, BK=BK,
            NATIVE=_native(x), PRECISION=_precision(x), num_warps=TILES.value.warps or 4,
        )  # fmt: skip
    return out, h


def _blocks(M: int, N: int) -> tuple[int, int]:
    """Rows and outputs a program takes (TILES.outputs where set): tl.dot wants 16 rows at least; at up to 16 rows,
    32 outputs a program, so that a product of a few hundred KB of weights spreads over more programs (a row's
    product is latency-bound)."""
    BM = 16 if M <= 16 else 32 if M <= 32 else 64
    return BM, TILES.value.outputs or (32 if M <= 16 or N < 64 else 64)


def _native(x: torch.Tensor) -> bool:
    """Whether tl.dot multiplies in x's dtype: not bfloat16 under the CPU interpreter, whose bf16 dot is wrong."""
    return not (x.dtype == torch.bfloat16 and x.device.type == "cpu")


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exactly; tf32 holds bf16/fp16 inputs exactly


@torch.library.custom_op("raven_hybrid::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """linear(norm_weight * RMSNorm(x), weight): x [..., K], norm_weight [K], weight [N, K] -> [..., N] in x's
    dtype, one launch; a custom op, which torch.compile keeps whole."""
    return _launch(x, None, norm_weight, weight, eps)[0]


@norm_linear.register_fake
def _(x, norm_weight, weight, eps):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("raven_hybrid::add_norm_linear", mutates_args=())
def add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear` of h = x + residual, and h itself [..., K] (rounded to x's dtype, as the eager add is)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be like x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, norm_weight, weight, eps)


@add_norm_linear.register_fake
def _(x, residual, norm_weight, weight, eps):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(x.shape)


@triton.jit
def silu_mul_linear_fwd_kernel(
    gate, up, w, y, M, N, K, stride_g, stride_u, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        m_mk = m_m[:, None] & m_k[None, :]
        b_g = tl.load(gate + o_m[:, None] * stride_g + o_k[None, :], mask=m_mk, other=0.0).to(tl.float32)
        b_u = tl.load(up + o_m[:, None] * stride_u + o_k[None, :], mask=m_mk, other=0.0).to(tl.float32)
        b_a = (b_g * tl.sigmoid(b_g)).to(gate.dtype.element_ty)  # silu, rounded as F.silu's result is
        b_a = (b_a.to(tl.float32) * b_u).to(gate.dtype.element_ty)
        b_acc = weight_product(b_acc, b_a, w, o_n, o_k, m_n, m_k, stride_w, NATIVE, PRECISION)
    tl.store(y + o_m[:, None] * stride_y + o_n[None, :], b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@torch.library.custom_op("raven_hybrid::silu_mul_linear", mutates_args=())
def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up, weight): gate and up [..., K] (row views of one product allowed), weight [N, K] ->
    [..., N] in gate's dtype, one launch; a custom op, which torch.compile keeps whole."""
    K, N = gate.shape[-1], weight.shape[0]
    if up.shape != gate.shape or up.dtype != gate.dtype or weight.shape[-1] != K or weight.stride(-1) != 1:
        raise ValueError(
            f"silu_mul_linear takes gate and up [..., K] alike and weight [N, K] with unit stride along K; got gate "
            f"{tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}, weight {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    g, u = (t.reshape(-1, K) for t in (gate, up))  # [M, K] each
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    M = g.shape[0]
    out = gate.new_empty(*gate.shape[:-1], N)
    BM, BN = _blocks(M, N)
    if M:
        silu_mul_linear_fwd_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
            g, u, weight, out, M, N, K, g.stride(0), u.stride(0), weight.stride(0), N, BM=BM, BN=BN, BK=BK,
            NATIVE=_native(gate), PRECISION=_precision(gate), num_warps=TILES.value.warps or 4,
        )  # fmt: skip
    return out


@silu_mul_linear.register_fake
def _(gate, up, weight):
    return gate.new_empty(*gate.shape[:-1], weight.shape[0])
