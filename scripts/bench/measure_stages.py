"""Per-stage throughput of the shipped recipes: a short run of each, then one table of tokens/s.

    python scripts/bench/measure_stages.py recipes/smollm2-raven.yaml recipes/smollm2-sse.yaml \
        recipes/smollm2-sila.yaml --align-steps 30 --train-steps 20 --max-documents 800 --run-root runs/measure \
        --set data.source=../shared/data/corpus [--set source=TEACHER]

Each recipe runs through `python -m raven_convert.train` (one process per recipe) with overrides that shorten it:
align and train get the given step counts, evaluation and export are off, and the data is cut to
`--max-documents` so that tokenising and the token-weight pass stay short. Extra `--set` overrides apply to every
recipe (e.g. --set data.seq_len=1024). Rates come from each stage's DONE summary (counted from the end of the first
step, which compiles the kernels). Prints one markdown table last; --json writes the summaries.

--baseline JSON (an earlier run's --json, e.g. of the previous version of the toolkit on the same GPU in the same
session) adds each rate's ratio to the baseline's for the same recipe:

    (cd OLD_CHECKOUT && python scripts/bench/measure_stages.py RECIPES ... --json old.json)
    python scripts/bench/measure_stages.py RECIPES ... --baseline old.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from raven_convert.files import write_json


def run(recipe: str, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "raven_convert.train", recipe, "--run-dir", str(run_dir), "--redo", "convert"]
    for item in overrides:
        cmd += ["--set", item]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    done = {}
    for stage in ("convert", "align", "weights", "train"):
        marker = run_dir / stage / "DONE"
        done[stage] = json.loads(marker.read_text()) if marker.is_file() else {}
    return done


def rate(done: dict, baseline: dict | None) -> str:
    """A stage's tokens/s and MFU, with its ratio to the baseline's rate for the same stage where there is one."""
    value = done.get("tokens_per_second") or 0
    text = f"{value:,.0f}" + (f" ({done['mfu']:.1%} MFU)" if done.get("mfu") else "")
    old = (baseline or {}).get("tokens_per_second")
    return text + (f", {value / old:.2f}x" if old else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--align-steps", type=int, default=30)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--max-documents", type=int, default=800)
    parser.add_argument("--run-root", default="runs/measure")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", default=None)
    parser.add_argument("--baseline", default=None, help="an earlier run's --json: rates as ratios to it")
    args = parser.parse_args()
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else {}
    common = [
        f"align.steps={args.align_steps}",
        f"train.steps={args.train_steps}",
        f"train.save_every={args.train_steps}",
        f"data.max_documents={args.max_documents}",
        "evaluate=null",
        "export=null",
        "extend=null",
        *args.overrides,
    ]
    results = {}
    for recipe in args.recipes:
        name = Path(recipe).stem
        try:
            results[name] = run(recipe, Path(args.run_root) / name, common)
        except subprocess.CalledProcessError as err:
            results[name] = {"error": f"exit {err.returncode}"}
    if args.json:
        write_json(results, args.json)

    print("\n| recipe | align tok/s | align val MSE (before -> after) | weights s | train tok/s | train val CE |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | | |")
            continue
        a, w, t = r["align"], r["weights"], r["train"]
        before, after = (a.get(k) or float("nan") for k in ("validation_before", "validation_after"))
        mse = f"{before:.4g} -> {after:.4g}"
        weights = "skipped" if w.get("skipped") else f"{w.get('seconds', 0):.0f}"
        val = t.get("val_ce")
        base = baseline.get(name, {})
        print(
            f"| {name} | {rate(a, base.get('align'))} | {mse} | {weights} | "
            f"{rate(t, base.get('train'))} | {'-' if val is None else f'{val:.3f}'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
