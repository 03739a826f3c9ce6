"""Align's whole loop (optimizer, bookkeeping and all) with and without CUDA graphs, on one GPU, no weights needed.

    cd scripts && python3 bench_align.py --mixer sila --layers 0-29:2 --steps 60 [--rows 8 16]

Builds a randomly initialised teacher with SmolLM2-135M's shapes, converts --layers to --mixer and runs
`align()` as the recipes do (bf16 autocast, compiled parts) on packed rows of random documents (64 to 1,024 tokens,
as host_syncs.py draws them), once per setting of `cuda_graphs`, each from the same mixers. Reports align's own
tokens/s (from the end of its first step) and how far the graphed run's losses are from the eager one's.
Prints a table last.
"""

from __future__ import annotations

import argparse
import copy

import torch
from bench_generate import SMOLLM2_135M  # scripts/: SmolLM2-135M's config
from host_syncs import packed_batch
from transformers import AutoModelForCausalLM, LlamaConfig

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.align import align


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixer", default="sila")
    parser.add_argument("--layers", default="0-29:2")
    parser.add_argument("--rows", type=int, nargs="+", default=[8])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", type=int, default=16, help="distinct batches, cycled")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    config = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config).cuda().eval().requires_grad_(False)
    kinds = plan_layers([(args.mixer, args.layers)], config.num_hidden_layers)
    hybrid = build_hybrid(teacher, kinds, {}).cuda()
    rows = []
    for count in args.rows:
        generator = torch.Generator().manual_seed(0)
        batches = [packed_batch(count, args.length, config.vocab_size, generator) for _ in range(args.batches)]
        losses = {}
        for graphs in (False, True):
            model = copy.deepcopy(hybrid)
            history = align(
                teacher,
                model,
                (batches[i % len(batches)] for i in range(args.steps)),
                steps=args.steps,
                lr=1e-3,
                warmup_steps=10,
                log_every=0,
                mixed_precision="bf16",
                compile="auto",
                cuda_graphs=graphs,
            )
            losses[graphs] = [r["loss"] for r in history]
            rate = history[-1]["tokens_per_second"]
            mfu = history[-1]["mfu"]
            rows.append((count, graphs, rate, mfu))
            print(f"rows {count}, cuda_graphs {graphs}: {rate:,.0f} tokens/s", flush=True)
        gap = max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True]))
        rows.append((count, "gap", gap, None))
    print(f"\nalign of {args.mixer} {args.layers}, {args.steps} steps of rows x {args.length} packed tokens, bf16")
    print("| rows | cuda_graphs | tokens/s | MFU | ratio |")
    print("| --- | --- | --- | --- | --- |")
    eager = None
    for count, graphs, value, mfu in rows:
        if graphs == "gap":
            print(f"| {count} | largest relative loss difference, graphs vs eager | {value:.2e} | | |")
            continue
        eager = value if graphs is False else eager
        util = "-" if mfu is None else f"{100 * mfu:.1f}%"
        print(f"| {count} | {graphs} | {value:,.0f} | {util} | {value / eager:.2f}x |")


if __name__ == "__main__":
    main()
