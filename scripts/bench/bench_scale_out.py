"""Align and train of a recipe on one GPU and on N under ddp and fsdp, at one global batch: tokens/s and memory per GPU.

    python scripts/bench/bench_scale_out.py recipes/smollm2-raven.yaml --src /tmp/smollm2 --data ../shared/data/corpus \
        --gpus 2,4 --align-steps 20 --train-steps 20 --max-documents 400 --out runs/scale-out [--scaling strong,weak]

Each run goes through `python -m raven_convert.train` (convert, align, train; token weights, evaluate and export off),
the N-process ones under `accelerate launch` with the shipped configs (recipes/accelerate/). --scaling strong (default)
divides batch_size by N, so that every run sees the same global batches (and ends with the same parameters); weak keeps
the recipe's batch_size per GPU, so the global batch grows N-fold; strong,weak runs both (one single-GPU run is the
baseline of both); --gpus 2,4 runs them at each N, --strategy ddp (default ddp,fsdp) narrows them. --graphed
align,train adds a ddp run whose align and train steps are CUDA graphs holding their all-reduces (`cuda_graphs: true`
for those stages); the other runs take the recipe's `cuda_graphs: auto` (graphs on one GPU, and for train under ddp).
The data is tokenised once into OUT/cache. A run that fails is reported in the table and the others still run. Rates
come from the stages' DONE summaries (counted from the end of the first step); memory is the largest `nvidia-smi`
reading of each GPU while the run's align and train stages ran (the whole process: CUDA context and the allocator's
cache included), sampled every 0.2 s, of the GPUs CUDA_VISIBLE_DEVICES names (all by default). Prints one Markdown
table last and writes OUT/scale_out.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from raven_convert.files import write_json


def visible_gpus(count: int) -> list[int]:
    """nvidia-smi's indices of the first `count` GPUs the runs see (CUDA_VISIBLE_DEVICES as indices, else 0, 1, ...)."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return list(range(count))
    return [int(n) for n in names.split(",") if n.strip().isdigit()][:count]


class GpuMemory:
    """The largest memory.used (MiB) of each GPU while running, read with nvidia-smi."""

    def __init__(self, period: float = 0.2):
        self.period, self.peak, self._stop = period, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines():
                index, used = (int(x) for x in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(args, name: str, processes: int, strategy: str, scaling: str = "strong", extra: dict | None = None) -> dict:
    """One run of convert, align and train into OUT/name (`extra`: more recipe overrides); its stages' summaries and
    the GPUs' peak memory."""
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    run_dir = Path(args.out) / name
    share = processes if scaling == "strong" else 1
    overrides = {
        "align.steps": args.align_steps,
        "train.steps": args.train_steps,
        "align.batch_size": recipe["align"]["batch_size"] // share,
        "train.batch_size": recipe["train"]["batch_size"] // share,
        "train.save_every": 10**6,
        "data.max_documents": args.max_documents,
        "data.cache_dir": str(Path(args.out) / "cache"),
        "token_weights.enabled": False,
        "evaluate": None,
        "export": None,
        "distributed.strategy": strategy,
    } | (extra or {})
    words = [args.recipe, "--run-dir", str(run_dir), "--src", args.src, "--data", args.data]
    for key, value in overrides.items():
        words += ["--set", f"{key}={json.dumps(value)}"]
    module = [sys.executable, "-m", "raven_convert.train"]
    # convert runs in one process first, so that the measured launch spends its time in align and train
    subprocess.run(module + words + ["--stages", "convert"], check=True)
    if processes > 1:
        config = Path("recipes/accelerate") / f"{strategy}.yaml"
        launch = ["accelerate", "launch", "--config_file", str(config), "--num_processes", str(processes), "-m"]
        command = launch + ["raven_convert.train"] + words + ["--stages", "align,weights,train"]
    else:
        command = module + words + ["--stages", "align,weights,train"]
    print("$", " ".join(command), flush=True)
    with GpuMemory() as memory:
        failed = subprocess.run(command).returncode != 0
    done = {s: json.loads(p.read_text()) if (p := run_dir / s / "DONE").is_file() else {} for s in ("align", "train")}
    return {
        "run": name + (" (failed)" if failed else ""),
        "processes": processes,
        "strategy": strategy,
        "scaling": scaling,
        "rows_per_gpu": recipe["train"]["batch_size"] // share,
        "align_tokens_per_second": done["align"].get("tokens_per_second"),
        "train_tokens_per_second": done["train"].get("tokens_per_second"),
        "gpu_memory_mib": [memory.peak.get(i, 0) for i in visible_gpus(processes)],
    }


def listed(parser: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, str]) -> list[str]:
    """`text`'s comma-separated values, each one of `allowed`; else the parser's error naming the first that is not."""
    from raven_layers.common import did_you_mean

    values = text.split(",")
    if unknown := [v for v in values if v not in allowed]:
        hint = did_you_mean(unknown[0], allowed)
        parser.error(f"{flag} {unknown[0]!r}: {hint}allowed {allowed[0]}, {allowed[1]} or both, comma-separated")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--src", required=True, help="the teacher (a model directory or GGUF)")
    parser.add_argument("--data", required=True, help="the training text")
    parser.add_argument("--gpus", default="2", help="N of the multi-GPU runs, comma-separated: 2,4")
    parser.add_argument("--strategy", default="ddp,fsdp", help="the multi-GPU runs' strategies: ddp, fsdp or both")
    parser.add_argument("--align-steps", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--max-documents", type=int, default=400)
    parser.add_argument("--scaling", default="strong", help="strong, weak or strong,weak: see above")
    parser.add_argument(
        "--graphed", default="",
        help="also a ddp run with these stages' steps (align, train: comma-separated) as CUDA graphs holding their "
        "all-reduces (STAGE.cuda_graphs: true)",
    )  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if bad := [n for n in args.gpus.split(",") if not n.isdigit() or int(n) < 2]:
        parser.error(f"--gpus {bad[0]!r}: the multi-GPU runs need a whole number of at least 2 GPUs")
    counts = [int(n) for n in args.gpus.split(",")]
    scalings = listed(parser, "--scaling", args.scaling, ("strong", "weak"))
    strategies = listed(parser, "--strategy", args.strategy, ("ddp", "fsdp"))
    graphed = listed(parser, "--graphed", args.graphed, ("align", "train")) if args.graphed else []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [run(args, "gpu1", 1, "ddp")]
    for n in counts:
        for scaling in scalings:
            for strategy in strategies:
                rows.append(run(args, f"gpu{n}-{strategy}-{scaling}", n, strategy, scaling))
            if graphed:
                name = f"gpu{n}-ddp-{scaling}-graphed-{'-'.join(graphed)}"
                rows.append(run(args, name, n, "ddp", scaling, {f"{stage}.cuda_graphs": True for stage in graphed}))
    write_json(rows, Path(args.out) / "scale_out.json")
    base = rows[0]
    columns = ["run", "processes", "rows per GPU", "align tok/s", "vs 1 GPU", "train tok/s", "vs 1 GPU"]
    print("| " + " | ".join(columns + ["peak memory per GPU (GiB)"]) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for row in rows:
        cells = []
        for key in ("align_tokens_per_second", "train_tokens_per_second"):
            rate, ratio = row[key], row[key] / base[key] if row[key] and base[key] else None
            cells += [f"{rate:,.0f}" if rate else "-", f"{ratio:.2f}x" if ratio else "-"]
        memory = ", ".join(f"{m / 1024:.1f}" for m in row["gpu_memory_mib"])
        print(f"| {row['run']} | {row['processes']} | {row['rows_per_gpu']} | {' | '.join(cells)} | {memory} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
