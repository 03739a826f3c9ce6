"""Decode throughput against batch size, one panel per context, from bench_generate.py's JSON.

    python scripts/bench/plot_generate.py docs/results/generate/grid_h200.json \
        --out docs/results/generate/throughput.png

One line per model (tokens/s, log axes); configurations that ran out of memory are left out. The title names the
GPU and library versions the JSON records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from raven_convert.files import write_png


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if not r.get("oom")]
    if not rows:
        raise SystemExit("no measured configuration in the JSON (all ran out of memory, or none ran)")
    contexts = sorted({r["context"] for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))  # in the order the bench ran them: teacher first
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for model in models:
            points = sorted(
                (r["batch"], r["tokens_per_s"]) for r in rows if r["model"] == model and r["context"] == context
            )
            if points:
                style = dict(color="black", linestyle="--") if model == "teacher" else {}
                ax.plot(*zip(*points), marker="o", label=model, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{context // 1024}K context")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{record.get('gpu', '?')}, torch {record.get('torch', '?')}, transformers {record.get('transformers', '?')}"
    )
    fig.tight_layout()
    write_png(fig, out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="bench_generate.py's output (bench_generate.json)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        record = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"{args.json}: cannot read a bench_generate JSON ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("results"), list):
        raise SystemExit(f"{args.json}: not a bench_generate JSON (no 'results' list)")
    plot(record, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
