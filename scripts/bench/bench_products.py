"""Whether a decode step's norms and activations pay inside their products: each of SmolLM2-135M's products with
the work before it, as the default step runs it (Inductor's fused add + RMSNorm or silu(gate) * up, then cuBLAS)
against one kernel of raven_kernels.linear (`add_norm_linear`, `silu_mul_linear`), under each tiling.

    python scripts/bench/bench_products.py --out OUT --batches 1,32,128
    python scripts/bench/bench_products.py --out OUT --batches 1 --outputs 16,32,64 --warps 2,4

The products are those of a SmolLM2 decoder layer and its head, in bf16 with random values: q/k/v (576 -> 960),
gate/up (576 -> 3072), down (1536 -> 576, after the gated activation), the LM head (576 -> 49,152). The default
step's pair is `torch.compile` of the eager code (Inductor's kernel, then cuBLAS's product); both run inside a CUDA
graph of 20 calls, as a graphed decode step runs them, and a row's bandwidth is the weight's bytes over its time.
Each fused row's output is compared with the pair's (max abs difference; bf16, sums in another order). Writes
OUT/bench_products.json and prints, per product and batch, the pair's row and every tiling's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import graphed_us, numbers, parse_sizes, sweep_info, timing_fields  # noqa: E402

from raven_convert.evaluate.decode_bench import copy_bandwidth  # noqa: E402
from raven_convert.files import write_json  # noqa: E402
from raven_kernels.linear import add_norm_linear, silu_mul_linear  # noqa: E402
from raven_kernels.linear.decode import ProductTiles, product_tiles  # noqa: E402
from raven_layers.common import recompile_limits  # noqa: E402

# (name, K, N, gated): SmolLM2-135M's products; gated ones read silu(gate) * up, the others RMSNorm(x + residual)
PRODUCTS = (
    ("qkv", 576, 960, False),
    ("gate_up", 576, 3072, False),
    ("down", 1536, 576, True),
    ("head", 576, 49152, False),
)
EPS = 1e-5


def rms_linear(x, residual, norm_weight, weight):
    """The default step's code: the residual add and transformers' RMSNorm, then the product."""
    h = x + residual
    h32 = h.to(torch.float32)
    normed = norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    return F.linear(normed, weight)


def gated_linear(gate, up, weight):
    return F.linear(F.silu(gate) * up, weight)


def inputs(batch: int, K: int, N: int, gated: bool) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + K)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    weight = randn(N, K) / K**0.5
    if gated:
        gate, up = randn(batch, 1, 2 * K).split(K, dim=-1)  # the halves of the fused gate/up product
        return gate, up, weight
    return randn(batch, 1, K), randn(batch, 1, K), 1 + 0.1 * randn(K), weight


def measure(product: tuple, batch: int, pair, grid: list[ProductTiles], bandwidth: float) -> list[dict]:
    """The rows of one product at one batch: the default step's pair, then the fused kernel under each tiling."""
    name, K, N, gated = product
    x = inputs(batch, K, N, gated)
    weight_bytes = x[-1].numel() * x[-1].element_size()
    reference = pair(*x).float()
    base = {"product": name, "K": K, "N": N, "batch": batch}
    us = graphed_us(lambda: pair(*x))
    rows = [base | {"kernel": "Inductor + cuBLAS"} | timing_fields(weight_bytes, us, bandwidth, reference, reference)]
    fused = (lambda: silu_mul_linear(*x)) if gated else (lambda: add_norm_linear(*x[:3], x[3], EPS)[0])
    for tiles in grid:
        row = base | {"kernel": "fused", **asdict(tiles)}
        try:
            with product_tiles(tiles):
                out = fused().float()
                us = graphed_us(fused)
        except Exception as error:  # a tiling the GPU cannot hold
            rows.append(row | {"error": f"{error}"[:200]})
            continue
        rows.append(row | timing_fields(weight_bytes, us, bandwidth, out, reference))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--outputs", type=numbers, default=[16, 32, 64], help="outputs a program")
    parser.add_argument("--warps", type=numbers, default=[2, 4])
    args = parser.parse_args(argv)
    grid = [ProductTiles(None, None)] + [ProductTiles(*t) for t in itertools.product(args.outputs, args.warps)]
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; {len(grid)} tilings", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = sweep_info(bandwidth, eps=EPS)
    pair = {False: torch.compile(rms_linear, dynamic=False), True: torch.compile(gated_linear, dynamic=False)}
    rows = []
    with torch._dynamo.config.patch(**recompile_limits(64)):  # a compilation per shape, none run eager
        for product, batch in itertools.product(PRODUCTS, parse_sizes(args.batches)):
            rows += measure(product, batch, pair[product[3]], grid, bandwidth)
            write_json({"info": info, "rows": rows}, args.out / "bench_products.json")
    print(f"\n{info}")
    print("| product | batch | kernel | outputs a program | warps | us | weight TB/s | vs the pair | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for _, group in itertools.groupby(rows, key=lambda r: (r["product"], r["batch"])):
        group = list(group)
        pair_us = group[0]["us"]
        for r in group:
            if "us" not in r:
                print(f"| {r['product']} | {r['batch']} | {r['kernel']} | {r.get('outputs')} | {r.get('warps')} | "
                      f"failed: {r['error'][:40]} | | | |")  # fmt: skip
                continue
            tiling = f"{r.get('outputs') or '-'} | {r.get('warps') or '-'}"
            print(
                f"| {r['product']} | {r['batch']} | {r['kernel']} | {tiling} | {r['us']:.1f} | {r['tb_per_s']:.2f} | "
                f"{r['us'] / pair_us:.2f}x | {r['max_diff']:.2g} |"
            )


if __name__ == "__main__":
    main()
