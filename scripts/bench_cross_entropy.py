"""GPU timings of stage 2's cross-entropy: `python scripts/bench_cross_entropy.py` (needs CUDA). A train
step's rows by default: 8 x 2,048 tokens, SmolLM2's vocabulary (49,152), bf16 logits.

Prints the median time of ce_loss's forward and backward (the gradient is computed in the forward) through the
Triton kernel and through the PyTorch chunks it replaced, their ratio, and the kernel's share of the memory bound
(two reads of the logits and one write of the gradient at the GPU's measured copy bandwidth).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from raven_convert.train.losses import ce_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.rows, args.length, args.vocab)
    logits = (4 * torch.randn(shape, device="cuda", generator=g)).bfloat16().requires_grad_()
    ids = torch.randint(0, args.vocab, shape[:2], device="cuda", generator=g)
    mask = torch.ones(shape[:2], dtype=torch.long, device="cuda")
    weights = torch.rand(shape[:2], device="cuda", generator=g) + 0.5
    copy = torch.empty_like(logits)
    copy_ms = do_bench(lambda: copy.copy_(logits))  # one read and one write of the logits
    times = {}
    for fused in (False, True):

        def step(fused=fused):
            logits.grad = None
            ce_loss(logits, ids, mask, weights, fused=fused).backward()

        times[fused] = do_bench(step)
    print("| cross-entropy, forward + backward | ms | vs PyTorch chunks |")
    print("| --- | --- | --- |")
    print(f"| PyTorch chunks | {times[False]:.2f} | 1.00x |")
    print(f"| Triton kernel | {times[True]:.2f} | {times[False] / times[True]:.2f}x |")
    # the kernel reads the logits twice and writes the gradient; backward scales it (a read and a write more)
    print(f"memory bound (copy of the logits at {copy_ms:.2f} ms): {2 * copy_ms:.2f} ms, kernel and backward")


if __name__ == "__main__":
    main()
