"""Stage-1 alignment throughput: tokens/s of `raven_convert.train.align` for each mixer on half of a model's layers.

    python scripts/bench_align.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --seq-len 2048 --batch 8

Random token batches (throughput does not depend on the text); bf16 on CUDA, float32 on CPU. Prints one row per
mixer: tokens/s after warm-up, peak memory, and the first and last alignment loss.
"""

from __future__ import annotations

import argparse
import time

import torch

from raven_convert import Source, build_hybrid, plan_layers
from raven_convert.train.align import align
from raven_layers import mixer_names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True)
    p.add_argument("--layers", default="0-29:2", help="--layers grammar (default: every other of 30 layers)")
    p.add_argument("--mixers", default=",".join(mixer_names()))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    teacher = Source.resolve(args.src).load_model("bfloat16" if cuda else "float32").to(device)
    vocab = teacher.config.vocab_size
    rows = []
    for mixer in args.mixers.split(","):
        kinds = plan_layers([(mixer, args.layers)], teacher.config.num_hidden_layers)
        hybrid = build_hybrid(teacher, kinds, {mixer: {}}).to(device, dtype)
        g = torch.Generator().manual_seed(0)
        batches = (
            {"input_ids": torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)} for _ in iter(int, 1)
        )
        align(teacher, hybrid, batches, steps=1, log_every=0)  # warm-up (allocator, kernels)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        history = align(teacher, hybrid, batches, steps=args.steps, log_every=0)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        rows.append(
            (mixer, args.steps * args.batch * args.seq_len / seconds, peak, history[0]["loss"], history[-1]["loss"])
        )
        del hybrid
    print(f"{'mixer':<6} {'tokens/s':>10} {'peak GiB':>9} {'loss first':>11} {'loss last':>10}")
    for mixer, rate, peak, first, last in rows:
        print(f"{mixer:<6} {rate:>10,.0f} {peak:>9.1f} {first:>11.4g} {last:>10.4g}")


if __name__ == "__main__":
    main()
