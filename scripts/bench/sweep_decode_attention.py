"""How the split-K decode attention should tile its reads: every `DecodeTiles` choice timed at each batch and
context (with the merge of the ranges: a second kernel, or the last program of each row), as bytes read per second
against the GPU's copy bandwidth.

    python scripts/bench/sweep_decode_attention.py --out OUT --batches 1,32,128 --contexts 4k,16k
    python scripts/bench/sweep_decode_attention.py --out OUT --batches 32 --contexts 16k --blocks 32,64,128 \\
        --warps 2,4,8 --stages 0,2,3,4 --per-sm 1,2,4

SmolLM2-135M's attention shape (9 query heads over 3 key/value heads of 64 channels), bf16, one layer's cache
filled to `context` slots for `batch` rows. Every choice of the grid (stages 0: Triton's default) is timed on the
same inputs inside a CUDA graph of 20 calls, as a graphed decode step runs it (timed eagerly, a call at batch 1
would be mostly its launch); a row's bandwidth is the keys and values it must read over its time,
its share that over a device-to-device copy's (bytes read plus written, measured in the run). Each choice's output
is compared with the current default's (max abs difference: bf16 products round differently, a wrong tiling
shows as a large one). Writes OUT/sweep_decode_attention.json and prints, per shape, the default's row and the
five fastest.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import graphed_us, numbers, parse_sizes, shown_rows, sweep_info, timing_fields  # noqa: E402

from raven_convert.evaluate.decode_bench import copy_bandwidth  # noqa: E402
from raven_convert.files import write_json  # noqa: E402
from raven_kernels.attention import decode_attention  # noqa: E402
from raven_kernels.attention.decode import TILES, DecodeTiles, decode_tiles  # noqa: E402

HQ, HKV, D = 9, 3, 64
MERGES = {True: "yes", False: "no", None: "where a row fits one load"}  # DecodeTiles.merge_in_kernel


def inputs(batch: int, context: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, HKV, context, D, device="cuda", dtype=torch.bfloat16, generator=g)  # [B, Hkv, S, d]
    v = torch.randn_like(k)
    valid = torch.ones(batch, context, dtype=torch.bool, device="cuda")
    step = torch.tensor([context - 1], device="cuda")
    return q, k, v, valid, step, D**-0.5


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="4k,16k")
    parser.add_argument("--blocks", type=numbers, default=[64, 128])
    parser.add_argument("--warps", type=numbers, default=[4, 8])
    parser.add_argument("--stages", type=numbers, default=[0, 3], help="0: Triton's default")
    parser.add_argument("--per-sm", type=numbers, default=[2, 4])
    parser.add_argument("--native", type=numbers, default=[0, 1], help="1: bf16 products, float32 sums")
    parser.add_argument("--merge", type=numbers, default=[0, 1], help="1: ranges merged in the kernel (one launch)")
    parser.add_argument("--max-ranges", type=numbers, default=[0], help="ranges a row at most (powers of 2; 0: no cap)")
    args = parser.parse_args(argv)
    try:
        grid = [
            DecodeTiles(block=b, warps=w, stages=s or None, per_sm=p, native=bool(n), merge_in_kernel=bool(m),
                        max_ranges=r or None)
            for b, w, s, p, n, m, r in itertools.product(
                args.blocks, args.warps, args.stages, args.per_sm, args.native, args.merge, args.max_ranges
            )
        ]  # fmt: skip
    except ValueError as error:
        parser.error(f"--max-ranges: {error}")
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; {len(grid)} tilings", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = sweep_info(bandwidth, default=asdict(TILES.value))
    rows = []
    for batch, context in itertools.product(parse_sizes(args.batches), parse_sizes(args.contexts)):
        tensors = inputs(batch, context)
        bytes_read = 2 * tensors[1].numel() * tensors[1].element_size()  # keys and values
        reference = decode_attention(*tensors).float()
        for tiles in [TILES.value, *(t for t in grid if t != TILES.value)]:
            try:
                with decode_tiles(tiles):
                    out = decode_attention(*tensors).float()
                    us = graphed_us(lambda t=tensors: decode_attention(*t))
            except Exception as error:  # a tiling the GPU cannot hold (shared memory, registers)
                rows.append({"batch": batch, "context": context, **asdict(tiles), "error": f"{error}"[:200]})
                continue
            row = {"batch": batch, "context": context, **asdict(tiles), "default": tiles == TILES.value}
            rows.append(row | timing_fields(bytes_read, us, bandwidth, out, reference))
        write_json({"info": info, "rows": rows}, args.out / "sweep_decode_attention.json")
        tensors = reference = out = None  # freed before the next shape's inputs
        torch.cuda.empty_cache()
    print(f"\n{info}")
    print(
        "| batch | context | block | warps | stages | per SM | ranges at most | bf16 products | merged in kernel | us "
        "| TB/s | of copy | max diff |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (batch, context), group in itertools.groupby(rows, key=lambda r: (r["batch"], r["context"])):
        for r in shown_rows(list(group)):
            print(
                f"| {batch} | {context} | {r['block']} | {r['warps']} | {r['stages'] or 'default'} | {r['per_sm']} | "
                f"{r['max_ranges'] or '-'} | {'yes' if r['native'] else 'no'} | {MERGES[r['merge_in_kernel']]}"
                f"{' (default)' if r['default'] else ''} | {r['us']:.1f} | "
                f"{r['tb_per_s']:.2f} | {r['of_copy']:.0%} | {r['max_diff']:.2g} |"
            )


if __name__ == "__main__":
    main()
