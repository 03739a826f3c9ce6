"""How many warps SILA's one-kernel decode step should take: each choice timed at each batch, as the memory's bytes
read and written per second against the GPU's copy bandwidth.

    python scripts/bench/sweep_sila_decode.py --out OUT --batches 1,32,128
    python scripts/bench/sweep_sila_decode.py --out OUT --batches 128 --warps 2,4,8
    python scripts/bench/sweep_sila_decode.py --out OUT --batches 1,32,128 --state-heads query

SmolLM2-135M's SILA layer (3 key/value heads of 3 query heads, 64 channels, a 4-tap convolution, the output gate;
with `--state-heads query` a memory per query head, `state_heads: query`: 9 memories of one query head each),
bf16 projections as row views of one product, a float32 memory, one token a row. Each choice runs the step
(`fused_recurrent_sila_decode`: the q/k norms, the convolution and its tail, the gates, the memory's update and the
reads, the output gate) inside a CUDA graph of 20 calls, as a graphed decode step runs it; a row's bandwidth is the
memory read and written over its time. Each choice's output is compared with the default's on the same memory (max
abs difference). Writes OUT/sweep_sila_decode.json and prints, per batch, the default's row and the fastest.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import warps_sweep  # noqa: E402

from raven_kernels.sila import fused_recurrent_sila_decode, utils  # noqa: E402
from raven_kernels.sila.fused_recurrent import decode_warps  # noqa: E402

D, TAPS = 64, 4
LAYOUTS = {"kv": (3, 3), "query": (9, 1)}  # state_heads -> (memories H, query heads a memory reads G)


def inputs(batch: int, H: int = 3, G: int = 3) -> tuple[tuple, dict]:
    """The step's arguments but the memory and the tail, and those two: H memories of G query heads each."""
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
    layout = argparse.ArgumentParser(add_help=False)
    layout.add_argument("--state-heads", choices=sorted(LAYOUTS), default="kv")
    known, rest = layout.parse_known_args(argv)
    H, G = LAYOUTS[known.state_heads]
    warps_sweep(
        rest, __doc__, "sweep_sila_decode", utils.step_warps(D, D), decode_warps, partial(inputs, H=H, G=G), step,
        lambda state: 2 * state["memory"].numel() * 4,  # the memory read and written
        heads=H, group=G, head_dim=D, taps=TAPS, state_heads=known.state_heads,
    )  # fmt: skip


if __name__ == "__main__":
    main()
