"""GPU timings of stage 2's losses: `python scripts/bench/bench_losses.py` (needs CUDA). A train step's rows by default:
8 x 2,048 tokens, SmolLM2's vocabulary (49,152), bf16 logits.

Prints the median time of ce_loss's and kd_loss's forward and backward (the gradient is computed in the forward)
through their Triton kernels and through the PyTorch chunks they replaced, and the ratio, beside the time of one
copy of the logits (a read and a write: the kernels' floor is about two of them for cross-entropy, three for
distillation, which reads the teacher's logits too).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from raven_convert.train.losses import ce_loss, kd_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.rows, args.length, args.vocab)
    logits = (4 * torch.randn(shape, device="cuda", generator=g)).bfloat16().requires_grad_()
    teacher = (4 * torch.randn(shape, device="cuda", generator=g)).bfloat16()
    ids = torch.randint(0, args.vocab, shape[:2], device="cuda", generator=g)
    mask = torch.ones(shape[:2], dtype=torch.long, device="cuda")
    weights = torch.rand(shape[:2], device="cuda", generator=g) + 0.5
    losses = {
        "cross-entropy": lambda fused: ce_loss(logits, ids, mask, weights, fused=fused),
        "distillation": lambda fused: kd_loss(logits, teacher, 1.0, mask, fused=fused),
    }
    copy = torch.empty_like(logits)
    copy_ms = do_bench(lambda: copy.copy_(logits))
    print(f"| loss, forward + backward ({args.rows} x {args.length} x {args.vocab}, bf16) | PyTorch chunks, ms | "
          "Triton kernel, ms | ratio |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    for name, loss in losses.items():
        times = []
        for fused in (False, True):

            def step(loss=loss, fused=fused):
                logits.grad = None
                loss(fused).backward()

            times.append(do_bench(step))
        print(f"| {name} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}x |")
    print(f"| one copy of the logits | {copy_ms:.2f} | | |")


if __name__ == "__main__":
    main()
