"""GPU timings of `attention_distance` (SILA's token weights, one layer) with and without skipping the key blocks
whose scores are all too low for a probability to reach tau (needs CUDA):

    python -m raven_kernels.attention.benchmark [--shapes 2x8192 16x2048] [--sharpness 1 3] [--dtype bf16]

Random queries and keys of SmolLM2-135M's heads (9 query, 3 key/value, d = 64), in one document a row; `--sharpness`
s draws each query as s times the key 5 back plus noise, so that the larger s, the more of a row's attention sits
on one key (s = 0: unrelated queries and keys, attention spread thin). Prints per shape and sharpness the median
ms of each (triton.testing.do_bench), their ratio, whether the sums agree bit for bit, and the share of queries with
a nonzero sum; a markdown table last. A teacher's real attention lies between: measure it in a recipe
(scripts/bench/profile_train.py).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from raven_kernels.attention import attention_distance

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(batch: int, length: int, sharpness: float, dtype, heads=9, kv_heads=3, d=64):
    """(q [B, H, T, d], k [B, Hkv, T, d], scaling, real, positions, documents, sinks) of one document a row."""
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(batch, kv_heads, length, d, device="cuda", generator=g)
    noise = torch.randn(batch, heads, length, d, device="cuda", generator=g)
    q = sharpness * k.roll(5, dims=2).repeat_interleave(heads // kv_heads, dim=1) + noise
    real = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    positions = torch.arange(length, device="cuda").float().expand(batch, -1).contiguous()
    documents = torch.zeros(batch, length, dtype=torch.long, device="cuda")
    sinks = torch.zeros_like(real)
    sinks[:, 0] = True
    return q.to(dtype), k.to(dtype), d**-0.5, real, positions, documents, sinks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["2x8192", "16x2048"], help="rows x tokens")
    parser.add_argument("--sharpness", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tau", type=float, default=0.2)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        for sharpness in args.sharpness:
            x = inputs(batch, length, sharpness, DTYPES[args.dtype])
            times, sums = {}, {}
            for skip in (False, True):

                def call(skip=skip, x=x):
                    return attention_distance(*x, None, args.tau, skip_blocks=skip)

                sums[skip] = call()
                times[skip] = do_bench(call, warmup=10, rep=50, return_mode="median")
            same = torch.equal(sums[False], sums[True])
            nonzero = (sums[True] > 0).float().mean().item()
            rows.append((shape, sharpness, times[False], times[True], times[False] / times[True], same, nonzero))
            print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {args.dtype}, tau {args.tau}, one layer (9/3 heads, d = 64)\n")
    print("| rows x tokens | sharpness | every block (ms) | skipping (ms) | ratio | same sums | queries > 0 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape, sharpness, formed, skipped, ratio, same, nonzero in rows:
        print(f"| {shape} | {sharpness:g} | {formed:.3f} | {skipped:.3f} | {ratio:.2f}x | {same} | {nonzero:.0%} |")


if __name__ == "__main__":
    main()
