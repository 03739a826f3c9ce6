"""Per-GPU memory of each stage of an 8B conversion: a Qwen3-8B-shaped teacher with random weights (the real shapes),
every stage run through the recipe pipeline (the same code path as a real run) for a few steps under
`accelerate launch`, torch.cuda.max_memory_allocated recorded per process and stage.

    python scripts/memory_plan.py --processes 2 --strategy fsdp --out runs/memory-plan    # on 2 GPUs
    python scripts/memory_plan.py --tiny --processes 2 --strategy fsdp --out /tmp/plan    # a smoke test on the CPU

Prints a Markdown table (GiB per GPU, the largest over the processes) and writes OUT/memory-<strategy>-<N>.json.
On the CPU (--tiny) the column is the processes' peak resident memory instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import string
import subprocess
import sys
from pathlib import Path

QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
TINY = QWEN3_8B | {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY |= {"head_dim": 16, "intermediate_size": 128, "vocab_size": 256}
STAGES = ["convert", "align", "weights", "train", "extend", "evaluate", "export"]  # extend and evaluate: off (skipped)


def recipe(teacher: Path, data: Path, tiny: bool, strategy: str) -> dict:
    seq = 64 if tiny else 2048
    steps = {"steps": 3, "batch_size": 1, "save_every": 3, "log_every": 1, "mixed_precision": "no" if tiny else "bf16"}
    return {
        "source": str(teacher),
        "layers": [{"mixer": "raven", "layers": "0-35:2" if not tiny else "0-3:2"}],
        "mixer_settings": {"raven": {"num_slots": 64, "top_k": 8}},
        "dtype": "float32" if tiny else "bfloat16",
        "data": {"source": str(data), "seq_len": seq, "validation_fraction": 0.1},
        "align": steps,
        "token_weights": {"enabled": True, "batch_size": 1},
        "train": steps | {"trainable": "mixers+lora", "gradient_checkpointing": not tiny},
        "export": {},
        "distributed": {"strategy": strategy},
    }


def make_inputs(out: Path, tiny: bool) -> tuple[Path, Path]:
    """A random teacher of the real shapes (bfloat16; float32 when tiny) with a character tokenizer, and a corpus."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    teacher, data = out / ("teacher-tiny" if tiny else "teacher-8b"), out / "corpus"
    if not (teacher / "config.json").is_file():
        config = Qwen3Config(**(TINY if tiny else QWEN3_8B))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else torch.bfloat16)
        model.save_pretrained(teacher)
        vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>", "<unk>", *sorted(set(string.printable))])}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        backend.decoder = decoders.Fuse()
        tokens = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
        PreTrainedTokenizerFast(tokenizer_object=backend, **tokens).save_pretrained(teacher)
    if not data.is_dir():
        data.mkdir(parents=True)
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly big mice".split()
        docs = [" ".join(words[i % 16 :] + words[: i % 16]) * 200 for i in range(64)]
        (data / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return teacher, data


def worker(args) -> None:
    """One process of the launch: each stage through run_recipe, its peak memory recorded."""
    import torch

    from raven_convert.train.recipe import parse_recipe
    from raven_convert.train.stages import run_recipe

    plan = parse_recipe(json.loads(Path(args.recipe).read_text()))
    peaks = {}
    for stage in STAGES:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        run_recipe(plan, args.run_dir, stages=[stage])
        if torch.cuda.is_available():
            peaks[stage] = torch.cuda.max_memory_allocated() / 2**30
        else:  # the process's peak resident memory so far (Linux: KiB)
            peaks[stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    rank = int(os.environ.get("RANK", "0"))
    Path(args.report).with_suffix(f".rank{rank}.json").write_text(json.dumps(peaks))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--out", default="runs/memory-plan")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of the script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    teacher, data = make_inputs(out, args.tiny)
    name = f"{args.strategy}-{args.processes}"
    path = out / f"recipe-{name}.json"
    path.write_text(json.dumps(recipe(teacher, data, args.tiny, args.strategy)))
    run_dir, report = out / f"run-{name}", out / f"memory-{name}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    if args.tiny:  # accelerate launch --cpu starts one process (several are its MPI path): torchrun, gloo
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes)]
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.processes)]
        launch += ["--multi_gpu"] if args.processes > 1 else []
    launch += [__file__, "--worker", "--recipe", str(path), "--run-dir", str(run_dir), "--report", str(report)]
    subprocess.run(launch, check=True)
    ranks = [json.loads(report.with_suffix(f".rank{r}.json").read_text()) for r in range(args.processes)]
    peaks = {stage: max(r[stage] for r in ranks) for stage in STAGES}
    unit = "peak resident GiB per process (CPU)" if args.tiny else "max GiB allocated per GPU"
    print(f"\n| stage | {args.strategy}, {args.processes} process(es): {unit} |\n| --- | --- |")
    for stage, peak in peaks.items():
        print(f"| {stage} | {peak:.2f} |")
    result = {"strategy": args.strategy, "processes": args.processes, "tiny": args.tiny, "unit": unit}
    (out / f"memory-{name}.json").write_text(json.dumps(result | {"peaks": peaks, "ranks": ranks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
