"""Where a training step makes the host wait for the GPU: every synchronising call of one step, by call site.

    python scripts/bench/host_syncs.py --mixer sse --layers 0-29:2 --stage align      # one CUDA GPU, no weights needed

Builds a randomly initialised teacher with SmolLM2-135M's shapes (or --config, a model directory or config.json),
converts --layers to --mixer, and runs steps on packed rows of random documents, as the recipes do: "align" (the
teacher's forward with its taps, every mixer's forward and the alignment loss's backward) or "student" (the
hybrid's whole forward and backward, stage 2's student). Under bf16 autocast, with the mixers' glue and the layers'
norms and MLPs compiled (--no-compile: eager). After --warmup steps, one step runs under
torch.cuda.set_sync_debug_mode("warn"): each synchronising call is reported with the toolkit's frames that led to
it. Then the mean time of --steps steps.
Prints a table of call sites and syncs per step last.
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings
from pathlib import Path

import torch
from common import SMOLLM2_135M
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.align import alignment_losses, step_inputs
from raven_convert.train.common import mixer_parameters
from raven_convert.train.compiling import compiled_parts

ROOT = str(Path(__file__).resolve().parents[2])


def packed_batch(rows: int, length: int, vocab: int, generator: torch.Generator) -> dict:
    """input_ids and position_ids [rows, length] of random documents (64 to 1,024 tokens) packed back to back, on
    the host as the data loader gives them."""
    positions = []
    for _ in range(rows):
        row, left = [], length
        while left:
            n = min(left, int(torch.randint(64, 1025, (), generator=generator)))
            row.append(torch.arange(n))
            left -= n
        positions.append(torch.cat(row))
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    return {"input_ids": ids, "position_ids": torch.stack(positions)}


def step(stage: str, teacher, hybrid, batch: dict) -> None:
    """One step's work as align and stage 2 run it, from a host batch (align finds its documents there)."""
    inputs, packed = step_inputs(batch, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if stage == "align":
            loss = sum(alignment_losses(teacher, hybrid, **inputs, packed=packed).values())
        else:
            loss = hybrid(**inputs, use_cache=False).logits[:, -1].float().square().mean()
    loss.backward()
    hybrid.zero_grad(set_to_none=True)


def toolkit_frames(stack) -> tuple[str, ...]:
    """The call path within this repository (scripts, the toolkit, its kernels), innermost last."""
    frames = [f for f in stack if f.filename.startswith(ROOT) and not f.filename.endswith("host_syncs.py")]
    return tuple(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in frames[-3:])


def sync_sites(stage: str, teacher, hybrid, batch: dict) -> collections.Counter:
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[toolkit_frames(traceback.extract_stack()) or (f"{filename}:{lineno}",)] += 1

    with warnings.catch_warnings():  # puts back the filters and showwarning
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(stage, teacher, hybrid, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixer", default="sse")
    parser.add_argument("--layers", default="0-29:2")
    parser.add_argument("--stage", choices=["align", "student"], default="align")
    parser.add_argument("--config", default=None, help="a model directory or config.json; default SmolLM2-135M's")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: host syncs are what a GPU step waits on")
    config = AutoConfig.from_pretrained(args.config) if args.config else LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config).cuda().eval().requires_grad_(False)
    kinds = plan_layers([(args.mixer, args.layers)], config.num_hidden_layers)
    hybrid = build_hybrid(teacher, kinds, {}).cuda().train().requires_grad_(args.stage == "student")
    for p in mixer_parameters(hybrid):  # what align trains
        p.requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    batches = [packed_batch(args.rows, args.length, config.vocab_size, generator) for _ in range(4)]
    with compiled_parts([teacher, hybrid], enabled=not args.no_compile):
        for i in range(args.warmup):
            step(args.stage, teacher, hybrid, batches[i % len(batches)])
        sites = sync_sites(args.stage, teacher, hybrid, batches[0])
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(args.steps):
            step(args.stage, teacher, hybrid, batches[i % len(batches)])
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
    tokens = args.rows * args.length
    print(
        f"{args.stage} of {args.mixer} {args.layers}, {'eager' if args.no_compile else 'compiled'}: "
        f"{seconds * 1e3:.1f} ms per step, {tokens / seconds:,.0f} tokens/s, {sum(sites.values())} host syncs"
    )
    print("| syncs per step | call site (innermost last) |")
    print("| --- | --- |")
    for frames, count in sites.most_common():
        print(f"| {count} | {' <- '.join(reversed(frames))} |")


if __name__ == "__main__":
    main()
