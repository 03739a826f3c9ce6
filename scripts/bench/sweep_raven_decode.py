"""How Raven's one-kernel decode step should split its slots: every `StepSplit` choice (slots a block, warps a
program, ranges a head, the top-K by rounds of a max or by a sort) timed at each batch, as state bytes read per
second against the GPU's copy bandwidth.

    python scripts/bench/sweep_raven_decode.py --out OUT --batches 1,32,128
    python scripts/bench/sweep_raven_decode.py --out OUT --batches 32 --blocks 4,8 --warps 1,2 --ranges 1,4,16 \
        --top-k-by rounds

SmolLM2-135M's Raven layer (3 key/value heads of 3 query heads, 64 channels) with RavenSettings' defaults, as the
benchmarks build it (`--slots` M = 256, `--top-k` 32; the SmolLM2 recipe's are 64 and 8), bf16 projections and a
float32 state, one token a row. Each choice runs the step
(`fused_recurrent_raven_decode`: the q/k map, the router's top-K, the decay, the slots' update and read, the ranges'
merge) inside a CUDA graph of 20 calls, as a graphed decode step runs it; a row's bandwidth is the state it must
read (S^k and S^v) over its time. Each choice's output is compared with the default's on the same state (max abs
difference; float32 sums in another order). Writes OUT/sweep_raven_decode.json and prints, per batch, the default's
row and the five fastest.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import graphed_us, numbers, parse_sizes, print_sweep, sweep_info, timing_fields  # noqa: E402

from raven_convert.evaluate.decode_bench import copy_bandwidth  # noqa: E402
from raven_convert.files import write_json  # noqa: E402
from raven_kernels.raven import fused_recurrent_raven_decode  # noqa: E402
from raven_kernels.raven.fused_recurrent import (  # noqa: E402
    DECODE_TOP_K_BY,
    TOP_K_BY,
    StepSplit,
    decode_config,
    slot_ranges,
    step_split,
)
from raven_layers import RavenSettings  # noqa: E402

H, G, D = 3, 3, 64


def methods(text: str) -> list[str]:
    """'rounds,sort' -> the top-K methods, each one of TOP_K_BY."""
    chosen = text.split(",")
    for method in chosen:
        if method not in TOP_K_BY:
            raise argparse.ArgumentTypeError(f"{method!r}: expected a comma-separated subset of {TOP_K_BY}")
    return chosen


def inputs(batch: int, M: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    return {
        "q": randn(batch, 1, H * G * D),
        "k": randn(batch, 1, H * D),
        "v": randn(batch, 1, H * D),
        "logits": randn(batch, 1, H * M),
        "decay_x": randn(batch, 1, H),
        "decay_bias": randn(H, dtype=torch.float32),
        "decay_log_scale": randn(H, dtype=torch.float32) * 0.1,
        "state": (randn(batch, H, M, D, dtype=torch.float32), randn(batch, H, M, D, dtype=torch.float32)),
    }


def step(x: dict, top_k: int, state=None) -> torch.Tensor:
    """One decode step over `state` (x's own where None, rewritten in place)."""
    return fused_recurrent_raven_decode(
        x["q"], x["k"], x["v"], x["logits"], x["decay_x"], x["decay_bias"], x["decay_log_scale"],
        state or x["state"], D**-0.5, top_k, 1.0, feature_map="silu",
    )  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--slots", type=int, default=RavenSettings().num_slots, help="M, the slots a head")
    parser.add_argument("--top-k", type=int, default=RavenSettings().top_k)
    parser.add_argument("--blocks", type=numbers, default=[2, 4, 8], help="slots a block")
    parser.add_argument("--warps", type=numbers, default=[1, 2, 4])
    parser.add_argument("--ranges", type=numbers, default=[1, 2, 4, 8, 16], help="ranges a head")
    parser.add_argument("--top-k-by", type=methods, default=list(TOP_K_BY), help=f"comma-separated {TOP_K_BY}")
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= args.slots:
        raise SystemExit(f"--top-k {args.top_k}: expected 1 <= top-k <= --slots ({args.slots})")
    grid = [StepSplit(*split) for split in itertools.product(args.blocks, args.warps, args.ranges, args.top_k_by)]
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; {len(grid)} splits", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = sweep_info(bandwidth, slots=args.slots, top_k=args.top_k)
    rows = []
    for batch in parse_sizes(args.batches):
        x = inputs(batch, args.slots)
        bytes_read = sum(s.numel() * s.element_size() for s in x["state"])  # S^k and S^v
        block, warps = decode_config(args.slots, G, D)
        ranges = slot_ranges(batch * H, triton.cdiv(args.slots, block), warps, x["q"].device)
        default = StepSplit(block, warps, ranges, DECODE_TOP_K_BY)
        reference = step(x, args.top_k, tuple(s.clone() for s in x["state"])).float()
        scratch = tuple(s.clone() for s in x["state"])  # the timed steps rewrite it; x's state stays the first
        for split in [default, *(s for s in grid if s != default)]:
            try:
                with step_split(split):
                    out = step(x, args.top_k, tuple(s.clone() for s in x["state"])).float()
                    us = graphed_us(lambda x=x, scratch=scratch: step(x, args.top_k, scratch))
            except Exception as error:  # a split the GPU cannot hold (registers, shared memory)
                rows.append({"batch": batch, **asdict(split), "error": f"{error}"[:200]})
                continue
            row = {"batch": batch, **asdict(split), "default": split == default}
            rows.append(row | timing_fields(bytes_read, us, bandwidth, out, reference))
        write_json({"info": info, "rows": rows}, args.out / "sweep_raven_decode.json")
        x = reference = out = scratch = None
        torch.cuda.empty_cache()
    columns = {
        "slots a block": lambda r: f"{r['block']}",
        "warps": lambda r: f"{r['warps']}",
        "ranges a head": lambda r: f"{r['ranges']}{' (default)' if r['default'] else ''}",
        "top-K by": lambda r: r["top_k_by"],
    }
    print_sweep(info, rows, columns)


if __name__ == "__main__":
    main()
