"""How many warps SSE's one-kernel decode step should take: each choice timed at each batch, as the state's bytes
read and written per second against the GPU's copy bandwidth.

    python scripts/bench/sweep_sse_decode.py --out OUT --batches 1,32,128
    python scripts/bench/sweep_sse_decode.py --out OUT --batches 128 --warps 2,4,8

SmolLM2-135M's SSE layer at its recipe's settings (3 key/value heads of 3 query heads, 64 rows and channels a
partition, 4 routed partitions and the shared one, top-1, LoRA rank 64, the gate's rank 16, the read's norm and the
output gate), bf16 products as row views of one product, a float32 state, one token a row. Each choice runs the step
(`fused_recurrent_sse_decode`: the router's top-k, the LoRA's second products, the key softmax and gate, the state's
update and read, the norm and the output gate) inside a CUDA graph of 20 calls, as a graphed decode step runs it; a
row's bandwidth is the state's bytes the step moves over its time: the written partition and the shared one read
and written, the others untouched (`bytes_moved`). Each choice's output is compared with the default's on the same
state (max abs difference). Writes OUT/sweep_sse_decode.json and prints, per batch, the default's row and the
fastest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import warps_sweep  # noqa: E402

from raven_kernels.sse import fused_recurrent_sse_decode  # noqa: E402
from raven_kernels.sse.fused_recurrent import DECODE_WARPS, step_warps  # noqa: E402
from raven_layers.sse import step_state_share  # noqa: E402

H, G, C, D = 3, 3, 64, 64  # heads, query heads a head, rows and channels a partition
N, TOP_K, R, RA, TAU = 4, 1, 64, 16, 16.0  # routed partitions (and the shared one), written, LoRA rank, gate rank


def inputs(batch: int) -> tuple[tuple, dict]:
    """The step's arguments but the state, and the state."""
    g = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    sizes = [H * G * C, H * C, H * D, H * N, RA, N * R, N * R, H * G * D]  # q, k, v, scores, gate, LoRA x2, out gate
    q, k, v, scores, decay_x, qa, ka, og = randn(batch, 1, sum(sizes)).split(sizes, dim=-1)
    lora_b = (randn(N, H * G * C, R) * 0.05, randn(N, H * C, R) * 0.05)
    decay_up, decay_bias, norm = randn(H * C, RA) * 0.1, randn(H * C), 1 + 0.1 * randn(D)
    state = {"state": randn(batch, H, N + 1, C, D, dtype=torch.float32) * 0.1}
    return (q, k, v, scores, decay_x, (qa, ka), lora_b, decay_up, decay_bias, norm, og), state


def step(args: tuple, state: dict) -> torch.Tensor:
    """One decode step over `state`'s partitions (rewritten in place)."""
    q, k, v, scores, decay_x, lora_x, lora_b, decay_up, decay_bias, norm, og = args
    return fused_recurrent_sse_decode(
        q, k, v, scores, decay_x, lora_x, lora_b, decay_up, decay_bias, state["state"], C**-0.5, TOP_K, TOP_K, TAU,
        out_norm=norm, out_gate=og,
    )  # fmt: skip


def bytes_moved(state: dict) -> int:
    """The state's bytes a step moves: the written partition and the shared one read and written, the others left
    alone (raven_layers.sse.step_state_share, which the bandwidth floors of bench_generate.py count by)."""
    return round(2 * state["state"].numel() * 4 * step_state_share(TOP_K, TOP_K, N + 1, shared=True))


def main(argv=None) -> None:
    warps_sweep(
        argv, __doc__, "sweep_sse_decode", lambda batch: step_warps(C, D, batch * H, torch.device("cuda")),
        DECODE_WARPS.use, inputs, step, bytes_moved,
        heads=H, group=G, rows=C, head_dim=D, partitions=N, top_k=TOP_K, lora_rank=R,
    )  # fmt: skip


if __name__ == "__main__":
    main()
