"""GPU speed of SILA's token weights with each kernel (needs CUDA; no downloaded weights, about a minute):

    python scripts/bench/bench_token_weights.py [--shapes 8x2048 2x8192] [--reps 3]

(in a checkout that is not installed, `source scripts/device_env.sh` first). It times the pipeline's
`token_weights`, so it lives here rather than beside the kernel (raven_kernels may not import raven_convert).

A random teacher of SmolLM2-135M's shapes (Llama: hidden 576, 30 layers, 9 query and 3 key/value heads of 64,
float32, sdpa attention), its q_proj and k_proj weights scaled up (--qk-scale) so that its attention is peaked and
many probabilities pass tau = 0.2, weights rows of packed documents (position ids restarting at a few random
points) with `token_weights` for kernel eager (PyTorch blocks of queries), compiled (the blocks through
torch.compile) and triton (`attention_distance`), with the teacher's forward in float32 and under bf16 autocast
(token_weights.precision). Prints, per shape, precision and kernel, tokens per second (the mean of
--reps calls after a warm-up call, which also compiles), the share of nonzero weights, and the largest difference
from the eager weights relative to their largest value; a markdown table last.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import SMOLLM2_135M
from transformers import AutoModelForCausalLM, LlamaConfig

from raven_convert.train.token_weights import PRECISIONS, token_weights

KERNELS = ("eager", "compiled", "triton")


def teacher(layers: int, qk_scale: float, device):
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model


def packed_batch(batch: int, length: int, documents: int, device, seed: int = 0):
    """(input_ids, position_ids) [B, T]: each row `documents` documents cut at random points."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, length), generator=g)
    idx = torch.arange(length)
    starts = torch.zeros(batch, length, dtype=torch.bool)
    starts[:, 0] = True
    for row in starts:
        row[torch.randperm(length - 1, generator=g)[: documents - 1] + 1] = True
    positions = idx - torch.where(starts, idx, 0).cummax(dim=1).values
    return ids.to(device), positions.to(device)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(model, ids, positions, kernel: str, precision: str, reps: int) -> tuple[float, torch.Tensor]:
    """(tokens per second over `reps` calls after a warm-up, the weights)."""
    run = {"position_ids": positions, "kernel": kernel, "precision": precision}
    weights = token_weights(model, ids, **run)  # warm-up (and compilation)
    sync(ids.device)
    start = time.perf_counter()
    for _ in range(reps):
        weights = token_weights(model, ids, **run)
    sync(ids.device)
    return reps * ids.numel() / (time.perf_counter() - start), weights


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8x2048", "2x8192"], help="BATCHxLENGTH of each measurement")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--documents", type=int, default=4, help="packed documents per row")
    parser.add_argument("--qk-scale", type=float, default=4.0, help="factor on q_proj and k_proj (peaked attention)")
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke test (TRITON_INTERPRET=1)
    model = teacher(args.layers, args.qk_scale, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, random SmolLM2-sized teacher, {args.layers} layers, float32", flush=True)

    rows = []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        ids, positions = packed_batch(batch, length, args.documents, device)
        eager = None  # float32 eager: the reference of every other measurement
        for precision in args.precisions:
            for kernel in args.kernels:
                rate, weights = measure(model, ids, positions, kernel, precision, args.reps)
                nonzero = (weights > 0).float().mean().item()
                if (kernel, precision) == ("eager", "float32"):
                    eager = weights
                diff = float("nan") if eager is None else ((weights - eager).abs().max() / eager.abs().max()).item()
                rows.append((shape, precision, kernel, rate, nonzero, diff))
                print(f"{shape} {precision} {kernel}: {rate:,.0f} tokens/s, nonzero {nonzero:.3f}, vs eager {diff:.2e}")

    print("\n| batch x length | forward | kernel | tokens/s | nonzero weights | max abs diff / max (float32 eager) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape, precision, kernel, rate, nonzero, diff in rows:
        print(f"| {shape} | {precision} | {kernel} | {rate:,.0f} | {nonzero:.3f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
