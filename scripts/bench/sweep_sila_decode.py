"""How many warps SILA's one-kernel decode step should take: each choice timed at each batch, as the memory's bytes
read and written per second against the GPU's copy bandwidth.

    python scripts/bench/sweep_sila_decode.py --out OUT --batches 1,32,128
    python scripts/bench/sweep_sila_decode.py --out OUT --batches 128 --warps 2,4,8

SmolLM2-135M's SILA layer (3 key/value heads of 3 query heads, 64 channels, a 4-tap convolution, the output gate),
bf16 projections as row views of one product, a float32 memory, one token a row. Each choice runs the step
(`fused_recurrent_sila_decode`: the q/k norms, the convolution and its tail, the gates, the memory's update and the
reads, the output gate) inside a CUDA graph of 20 calls, as a graphed decode step runs it; a row's bandwidth is the
memory read and written over its time. Each choice's output is compared with the default's on the same memory (max
abs difference). Writes OUT/sweep_sila_decode.json and prints, per batch, the default's row and the fastest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import graphed_us, numbers, parse_sizes, print_sweep, sweep_info, timing_fields  # noqa: E402

from raven_convert.evaluate.decode_bench import copy_bandwidth  # noqa: E402
from raven_kernels.sila import fused_recurrent_sila_decode, utils  # noqa: E402
from raven_kernels.sila.fused_recurrent import decode_warps  # noqa: E402

H, G, D, TAPS = 3, 3, 64, 4


def inputs(batch: int) -> tuple[tuple, dict]:
    """The step's arguments but the memory and the tail, and those two."""
    g = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    C = (G + 2) * H * D
    product = randn(batch, 1, C + 2 * H + H * G + H * G * D)  # q, k, v, the three gates' inputs, the output gate
    q, k, v, bx, gx, ax, og = product.split([H * G * D, H * D, H * D, H, H, H * G, H * G * D], dim=-1)
    biases = tuple(randn(n) for n in (H, H, H * G))  # the layer's parameters, in the model's dtype
    conv = randn(C, TAPS) * 0.5
    w_beta, w_gamma = (randn(H, D) * 0.1 for _ in range(2))
    state = {"tail": randn(batch, TAPS - 1, C), "memory": randn(batch, H, D, D, dtype=torch.float32) * 0.1}
    return (q, k, v, bx, gx, ax, biases, conv, og, w_beta, w_gamma), state


def step(args: tuple, state: dict) -> torch.Tensor:
    """One decode step over `state`'s tail and memory (rewritten in place)."""
    q, k, v, bx, gx, ax, biases, conv, og, w_beta, w_gamma = args
    return fused_recurrent_sila_decode(
        q, k, v, bx, gx, ax, biases, conv, state["tail"], w_beta, w_gamma, state["memory"], out_gate=og
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--warps", type=numbers, default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    default = utils.step_warps(D, D)
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; warps {args.warps} (default {default})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = sweep_info(bandwidth, heads=H, group=G, head_dim=D, taps=TAPS)
    rows = []
    for batch in parse_sizes(args.batches):
        x, first = inputs(batch)
        bytes_moved = 2 * first["memory"].numel() * 4  # the memory read and written
        reference = step(x, {n: t.clone() for n, t in first.items()}).float()
        scratch = {n: t.clone() for n, t in first.items()}  # the timed steps rewrite it; `first` stays
        for warps in [default, *(w for w in args.warps if w != default)]:
            row = {"batch": batch, "warps": warps, "default": warps == default}
            try:
                with decode_warps(warps):
                    out = step(x, {n: t.clone() for n, t in first.items()}).float()
                    us = graphed_us(lambda x=x, scratch=scratch: step(x, scratch))
            except Exception as error:  # a choice the GPU cannot hold (registers)
                rows.append(row | {"error": f"{error}"[:200]})
                continue
            rows.append(row | timing_fields(bytes_moved, us, bandwidth, out, reference))
        (args.out / "sweep_sila_decode.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print_sweep(info, rows, {"warps": lambda r: f"{r['warps']}{' (default)' if r['default'] else ''}"})


if __name__ == "__main__":
    main()
