"""Training steps with and without CUDA graphs, the whole loop (optimizer, bookkeeping and all), on one GPU, no
weights needed.

    cd scripts/bench && python3 bench_graphs.py --stage align --mixer sila --steps 60 [--rows 8 16]
    cd scripts/bench && python3 bench_graphs.py --stage train --mixer sila --steps 60      # stage 2, as the SILA recipe
    cd scripts/bench && python3 bench_graphs.py --stage extend --mixer sila --steps 30 --rows 2 --length 8192
    cd scripts/bench && python3 bench_graphs.py --stage train --mixer sila --steps 60 --whole-rows 2   # 2 of 16 batches

Builds a randomly initialised teacher with SmolLM2-135M's shapes, converts --layers to --mixer and runs the stage's
own loop as the recipes do (bf16 autocast, compiled parts) on packed rows of random documents (64 to 1,024 tokens,
as host_syncs.py draws them; with --whole-rows, some batches of one document per row), once per setting of
`cuda_graphs`, each from the same model: `align()` (stage 1), or `train()` with mixers and LoRA trained and a random
token-weight table (stage 2), or with each batch's weights from the teacher, computed as it is drawn (bf16 forward;
the extend stage); stage 2 also eagerly with its losses as PyTorch chunks (before raven_kernels.loss), the ratios'
base. Reports the stage's own tokens/s (from the end of its first step), the GPU memory it held at most
(torch.cuda.max_memory_reserved, the cache emptied before each run) and how far the graphed run's losses are from
the eager one's.
Prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from contextlib import nullcontext
from unittest import mock

import torch
from common import SMOLLM2_135M
from host_syncs import packed_batch
from transformers import AutoModelForCausalLM, LlamaConfig

from raven_convert import build_hybrid, plan_layers
from raven_convert.train import losses as losses_module
from raven_convert.train.align import align
from raven_convert.train.data import PackedDataset
from raven_convert.train.stage2 import train
from raven_convert.train.token_weights import token_weights


def run(stage: str, teacher, model, batches: list[dict], steps: int, graphs: bool) -> list[dict]:
    """The stage's history for `steps` steps over `batches` (cycled), with or without graphs."""
    if stage == "align":
        source = (batches[i % len(batches)] for i in range(steps))
        settings = dict(lr=1e-3, warmup_steps=10, log_every=0, mixed_precision="bf16", compile="auto")
        return align(teacher, model, source, steps=steps, cuda_graphs=graphs, **settings)
    tensors = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "position_ids")}
    tensors["document_ids"] = (tensors["position_ids"] == 0).cumsum(-1) - 1
    rows = PackedDataset(tensors)
    if stage == "extend":  # [B, T] from the teacher, batch by batch, as the recipe's extend stage weights its rows

        def weights(batch):
            return token_weights(teacher, batch["input_ids"], position_ids=batch["position_ids"], precision="bf16")

    else:
        weights = torch.rand(len(rows), rows.seq_len, generator=torch.Generator().manual_seed(1))
    config = dict(
        steps=steps, batch_size=len(batches[0]["input_ids"]), lr=3e-4, warmup_steps=10, trainable="mixers+lora",
        mixed_precision="bf16", log_every=0, save_every=10**6, token_weight_tau_fraction=0.34, cuda_graphs=graphs,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        return train(model, None, rows, config, out, token_weights=weights)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["align", "train", "extend"], default="align")
    parser.add_argument("--mixer", default="sila")
    parser.add_argument("--layers", default="0-29:2")
    parser.add_argument("--rows", type=int, nargs="+", default=[8])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", type=int, default=16, help="distinct batches, cycled")
    parser.add_argument(
        "--whole-rows",
        type=int,
        default=0,
        help="of those, how many have rows of one document each (as a corpus of "
        "long documents gives now and then: the graphed loop lays them out as the others)",
    )
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
        for batch in batches[len(batches) - args.whole_rows :] if args.whole_rows else []:
            batch["position_ids"] = torch.arange(args.length).expand(count, -1).clone()
        losses = {}
        # stage 2 also eagerly with the losses as PyTorch chunks (the step before raven_kernels.loss)
        settings = [("False", False, True), ("True", True, True)]
        settings = ([("False, PyTorch losses", False, False)] if args.stage != "align" else []) + settings
        for name, graphs, fused in settings:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            # a plain function, not a Mock's return_value: a Mock keeps every call's logits (and their graph) alive
            with nullcontext() if fused else mock.patch.object(losses_module, "fused_rows", lambda *logits: False):
                history = run(args.stage, teacher, copy.deepcopy(hybrid), batches, args.steps, graphs)
            losses[name] = [r["loss"] for r in history]
            held = torch.cuda.max_memory_reserved() / 2**30
            rows.append((count, name, history[-1]["tokens_per_second"], history[-1]["mfu"], held))
            layouts = f", {history[-1]['graph_layouts']} graph layouts" if graphs else ""
            print(f"rows {count}, cuda_graphs {name}: {rows[-1][2]:,.0f} tokens/s{layouts}", flush=True)
        gap = max(abs(a - b) / abs(a) for a, b in zip(losses["False"], losses["True"]))
        rows.append((count, "gap", gap, None, None))
    shape = f"{args.steps} steps of rows x {args.length} packed tokens, bf16"
    print(f"\n{args.stage} of {args.mixer} {args.layers}, {shape}")
    print("| rows | cuda_graphs | tokens/s | MFU | ratio | GPU memory held |")
    print("| --- | --- | --- | --- | --- | --- |")
    eager = None
    for count, graphs, value, mfu, held in rows:
        if graphs == "gap":
            print(f"| {count} | largest relative loss difference, graphs vs eager | {value:.2e} | | | |")
            eager = None
            continue
        eager = value if eager is None else eager  # the first row of each count: the ratios' base
        util = "-" if mfu is None else f"{100 * mfu:.1f}%"
        print(f"| {count} | {graphs} | {value:,.0f} | {util} | {value / eager:.2f}x | {held:.1f} GiB |")


if __name__ == "__main__":
    main()
