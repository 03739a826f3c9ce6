"""norm_linear, add_norm_linear and silu_mul_linear (Triton, interpreted on CPU) against transformers' RMSNorm,
Llama's gated activation and F.linear: rows and outputs that fill no block, widths that are no multiple of the step
over K, 3-D inputs, row views of one product, the residual's sum, bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

from raven_kernels.linear import add_norm_linear, norm_linear, silu_mul_linear
from raven_kernels.linear.decode import ProductTiles, product_tiles
from raven_kernels.linear.naive import naive_norm_linear, naive_silu_mul_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(M, K, N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 1, K, generator=g)  # [B, 1, hidden], as a decode step holds it
    residual = torch.randn(M, 1, K, generator=g)
    norm_weight = 1 + 0.1 * torch.randn(K, generator=g)
    weight = torch.randn(N, K, generator=g) / K**0.5
    return (t.to(dtype).to(DEVICE) for t in (x, residual, norm_weight, weight))


@pytest.mark.parametrize(
    "M, K, N",
    [
        (1, 576, 960),  # SmolLM2's q/k/v product at batch 1
        (3, 100, 70),  # K two steps and a part, N a block and a part
        (37, 130, 33),  # rows over two blocks of 32, N under one block
        (130, 64, 200),  # rows over three blocks of 64
    ],
)
def test_the_product_of_the_norm_equals_the_reference(M, K, N):
    x, residual, norm_weight, weight = make(M, K, N)
    out = norm_linear(x, norm_weight, weight, 1e-6)
    ref, _ = naive_norm_linear(x, None, norm_weight, weight, 1e-6)
    assert out.shape == (M, 1, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out, total = add_norm_linear(x, residual, norm_weight, weight, 1e-6)
    ref, ref_total = naive_norm_linear(x, residual, norm_weight, weight, 1e-6)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(total, ref_total)  # the sum is exact, as the eager add's


@pytest.mark.parametrize("M, K, N", [(1, 1536, 576), (5, 100, 70), (70, 64, 33)])
def test_the_product_of_the_gated_activation_equals_the_reference(M, K, N):
    """gate and up as the MLP's fused product gives them: the two halves of one [..., 2K] output."""
    g = torch.Generator().manual_seed(M)
    both = torch.randn(M, 1, 2 * K, generator=g).to(DEVICE)
    gate, up = both.split(K, dim=-1)
    weight = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE)
    out = silu_mul_linear(gate, up, weight)
    assert out.shape == (M, 1, N)
    torch.testing.assert_close(out, naive_silu_mul_linear(gate, up, weight), atol=1e-5, rtol=1e-5)


def test_a_weight_read_as_a_view_of_a_larger_buffer():
    """The fused products read a group's weights as one view of their shared storage (decode_fusion.py)."""
    x, residual, norm_weight, _ = make(2, 96, 1)
    joint = torch.randn(80, 96, device=DEVICE) / 96**0.5
    weight = torch.as_strided(joint, (72, 96), (96, 1), 96 * 8)  # rows 8-79
    out, _ = add_norm_linear(x, residual, norm_weight, weight, 1e-5)
    torch.testing.assert_close(out, naive_norm_linear(x, residual, norm_weight, weight, 1e-5)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [ProductTiles(16, 2), ProductTiles(64, 4), ProductTiles(32, None)])
def test_every_tiling_the_benchmark_tries_gives_the_product(tiles):
    x, residual, norm_weight, weight = make(20, 100, 90)
    with product_tiles(tiles):
        out, _ = add_norm_linear(x, residual, norm_weight, weight, 1e-6)
        gated = silu_mul_linear(x, residual, weight)
    torch.testing.assert_close(out, naive_norm_linear(x, residual, norm_weight, weight, 1e-6)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gated, naive_silu_mul_linear(x, residual, weight), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_named():
    x, residual, norm_weight, weight = make(2, 64, 32)
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        norm_linear(x, norm_weight, weight[:, :32], 1e-6)
    with pytest.raises(ValueError, match=r"weight \[N, K\] with unit stride"):
        norm_linear(x, norm_weight, weight.t().contiguous().t(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_norm_linear(x, residual[:1], norm_weight, weight, 1e-6)
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul_linear(x, residual[..., :32], weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 32, 128])
def test_bf16_at_smollm2_sizes(M):
    """The rounding is the eager step's but for the product's order of summation (the interpreter's bf16 on CPU is
    not a GPU's, so this runs on the device)."""
    x, residual, norm_weight, weight = make(M, 576, 3072, dtype=torch.bfloat16, seed=M)
    out, total = add_norm_linear(x, residual, norm_weight, weight, 1e-5)
    ref, ref_total = naive_norm_linear(x, residual, norm_weight, weight, 1e-5)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.Generator().manual_seed(M)
    gate, up = torch.randn(M, 1, 2 * 3072, generator=g).to(torch.bfloat16).cuda().split(3072, dim=-1)
    down = (torch.randn(576, 3072, generator=g) / 3072**0.5).to(torch.bfloat16).cuda()  # the MLP's down projection
    out = silu_mul_linear(gate, up, down)
    torch.testing.assert_close(out.float(), naive_silu_mul_linear(gate, up, down).float(), atol=2e-2, rtol=2e-2)
