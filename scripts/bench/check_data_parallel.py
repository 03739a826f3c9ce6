"""Stage 2 on several GPUs equals stage 2 on one at the same global batch: the loss curves agree within noise.

    python scripts/bench/check_data_parallel.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --data ../shared/data/corpus --gpus 2 --steps 30 --out runs/data-parallel

Converts SmolLM2 once (Raven on every other layer, no Gumbel noise so that both runs are deterministic up to
reduction order), then runs the recipe's train stage twice through `accelerate launch`: on 1 process with
batch_size = gpus x rows, and on `gpus` processes with `rows` each. Both see the same rows at every step
(stage2 slices one global batch across processes). Prints the per-step losses and their largest relative gap.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml


def recipe(src: str, data: str, batch_size: int, steps: int, seq_len: int, cache: Path) -> dict:
    return {
        "source": src,
        "layers": [{"mixer": "raven", "layers": "1-29:2"}],
        "mixer_settings": {"raven": {"num_slots": 64, "top_k": 8, "gumbel": False}},
        "dtype": "float32",
        "data": {
            "source": data,
            "seq_len": seq_len,
            "validation_fraction": 0.01,
            "max_documents": 1500,
            "cache_dir": str(cache),  # tokenised once, by the first run
        },
        "train": {
            "steps": steps,
            "batch_size": batch_size,
            "lr": 3e-4,
            "warmup_steps": 5,
            "trainable": "mixers",
            "mixed_precision": "bf16",
            "save_every": steps,
            "log_every": 5,
        },
    }


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="rows per process in the multi-GPU run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default="runs/data-parallel")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    runs = {1: (out / "one", args.gpus * args.rows), args.gpus: (out / "many", args.rows)}
    for procs, (_, batch) in runs.items():
        path = out / f"recipe-{procs}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(recipe(args.src, args.data, batch, args.steps, args.seq_len, out / "cache")))
    first_dir = runs[1][0]
    run(
        [
            sys.executable,
            "-m",
            "raven_convert.train",
            str(out / "recipe-1.yaml"),
            "--run-dir",
            str(first_dir),
            "--stages",
            "convert,align,weights",
        ]
    )
    shutil.copytree(first_dir, runs[args.gpus][0])
    for procs, (run_dir, _) in runs.items():
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs)]
        launch += ["--multi_gpu"] if procs > 1 else []
        run(
            launch
            + [
                "--mixed_precision",
                "bf16",
                "-m",
                "raven_convert.train",
                str(out / f"recipe-{procs}.yaml"),
                "--run-dir",
                str(run_dir),
                "--stages",
                "train",
            ]
        )
    curves = {p: json.loads((d / "train" / "history.json").read_text())["history"] for p, (d, _) in runs.items()}
    one, many = curves[1], curves[args.gpus]
    gaps = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, many)]
    print(f"\n| step | loss, 1 GPU x {runs[1][1]} rows | loss, {args.gpus} GPUs x {args.rows} rows | rel. gap |")
    print("| --- | --- | --- | --- |")
    for a, b, gap in zip(one, many, gaps):
        print(f"| {a['step']} | {a['loss']:.4f} | {b['loss']:.4f} | {gap:.2e} |")
    rates = [c[-1]["tokens_per_second"] for c in (one, many)]
    print(f"\nlargest relative gap {max(gaps):.2e}; tokens/s: 1 GPU {rates[0]:,.0f}, {args.gpus} GPUs {rates[1]:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
