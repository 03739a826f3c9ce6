"""Long-context retrieval for any causal LM: batched greedy answers, RULER-style scoring, tables, heatmaps.

    samples = build_samples("niah_single_2", tokenizer, lengths=[1024, 4096], depths=[0, 0.5, 1],
                            samples_per_cell=10, seed=0, variant="no_inst", haystack_dir="pg_essays/")
    results = run_retrieval(model, tokenizer, samples, batch_size=8)
    summary = summarize(results); print(format_table(summary))
    plot_niah_heatmap(results, "niah.png", "niah_single_2"); save_results(results, summary, "niah.json")

Prompts come from needles.py (`build_samples`, re-exported here).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

from ..console import eta
from ..files import atomic_file, write_png
from .needles import (  # noqa: F401  (re-exported: the prompt side of the API)
    HAYSTACK_ENV,
    TASKS,
    VARIANTS,
    Sample,
    TaskSpec,
    build_samples,
    count_tokens,
    load_essay_paragraphs,
)
from .shares import OneProcess, spread


def score(prediction: str, answers: list[str]) -> float:
    """RULER's string_match_all: the fraction of answers found in the prediction, ignoring case.

    Word answers ("gentle harbor") must match whole words (any whitespace between them); numbers and UUIDs are
    plain substrings, as in RULER.
    """
    if not answers:
        return 0.0
    pred = prediction.lower()
    found = 0
    for answer in answers:
        a = answer.lower().strip()
        if re.fullmatch(r"[a-z]+(?: [a-z]+)*", a):
            found += bool(re.search(r"(?<![a-z])" + r"\s+".join(a.split()) + r"(?![a-z])", pred))
        else:
            found += a in pred
    return found / len(answers)


def _default_new_tokens(tokenizer, sample: Sample) -> int:
    answer_tokens = count_tokens(tokenizer, ", ".join(sample.answers), False)
    return answer_tokens + 4 * len(sample.answers) + (16 if sample.meta.get("prefilled", True) else 48)


def _progress(done, total, tokens, start, final=False):
    elapsed = max(time.perf_counter() - start, 1e-9)
    left = elapsed / max(done, 1) * (total - done)
    line = f"[retrieval] {done}/{total} samples | {tokens / elapsed:,.0f} tok/s | {eta(left)}"
    end = "\n" if final or not sys.stderr.isatty() else ""
    sys.stderr.write(("\r" if sys.stderr.isatty() else "") + line + end)
    sys.stderr.flush()


def run_retrieval(
    model,
    tokenizer,
    samples: list[Sample],
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    progress: bool = True,
    parallel=None,
) -> list[dict]:
    """Greedy answers to every sample, scored; results in the order of `samples`.

    Samples are sorted by length and batched (left padding, pad token falling back to EOS), so a batch pads little;
    the batches run longest first, so on CUDA the first batch's static cache, with its compiled and captured decode
    step, serves every later batch of its size (shortest first, every longer batch would make and compile anew).
    Only the generated tokens are decoded. `max_new_tokens=None` allows the longest answer of the batch plus a margin.
    Under a launch (`parallel`, see shares.py) each process answers every world-th batch, the batches one process
    would make, so the results are one process's; every process returns them all.
    """
    parallel = parallel or OneProcess()

    def flag(i: int) -> bool:  # chat prompts are tokenised without special tokens: never batched with others
        return samples[i].meta.get("add_special_tokens", True)

    order = sorted(range(len(samples)), key=lambda i: (flag(i), samples[i].meta.get("n_tokens", samples[i].length)))
    groups = [list(g) for _, g in itertools.groupby(order, key=flag)]
    batches = [g[j : j + batch_size] for g in groups for j in range(0, len(g), batch_size)][::-1]  # longest first
    saved_side, saved_pad = tokenizer.padding_side, tokenizer.pad_token
    device = getattr(model, "device", None) or torch.device("cpu")

    def answer(share: list[list[int]]) -> list[list[dict]]:  # this process's batches -> their results
        start, done, tokens, total = time.perf_counter(), 0, 0, sum(map(len, share))
        answered = []
        for batch in share:
            group = [samples[i] for i in batch]
            enc = tokenizer(
                [s.prompt for s in group], return_tensors="pt", padding=True, add_special_tokens=flag(batch[0])
            )
            input_ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)  # [b, T] left-padded
            n_new = max_new_tokens or max(_default_new_tokens(tokenizer, s) for s in group)
            greedy = dict(max_new_tokens=n_new, do_sample=False, num_beams=1, pad_token_id=tokenizer.pad_token_id)
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=mask, **greedy)
            new = out[:, input_ids.shape[1] :].cpu()  # [b, <= n_new] generated tokens only
            predictions = tokenizer.batch_decode(new, skip_special_tokens=True)
            tokens += int(mask.sum()) + int((new != tokenizer.pad_token_id).sum())
            answered.append([])
            for s, pred in zip(group, predictions):
                result = {k: s.meta.get(k) for k in ("id", "n_tokens", "depth_actual", "needle_distance", "chat")}
                result |= dict(task=s.task, variant=s.variant, length=s.length, depth=s.depth, answers=list(s.answers))
                answered[-1].append(result | dict(prediction=pred, score=score(pred, s.answers)))
            done += len(batch)
            if progress and parallel.is_main:  # the main process's share stands for the others'
                _progress(done, total, tokens, start, final=done == total)
        return answered

    try:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with")
            tokenizer.pad_token = tokenizer.eos_token
        answered = spread(batches, answer, parallel)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved_side, saved_pad
    results: list[dict | None] = [None] * len(samples)
    for batch, rows in zip(batches, answered):
        for i, row in zip(batch, rows):
            results[i] = row
    return results


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(results: list[dict]) -> dict:
    """Mean scores (0..1) overall and per task label "task/variant": overall, per length, per (length, depth).

    Lengths and depths are string keys (JSON): {"tasks": {"niah_single_2/no_inst": {"accuracy": .., "n": ..,
    "by_length": {"1024": ..}, "by_length_depth": {"1024": {"0.5": ..}}}}, "accuracy": .., "n": ..}.
    """
    tasks: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        tasks[f"{r['task']}/{r.get('variant', 'standard')}"].append(r)
    summary = {"accuracy": _mean(r["score"] for r in results), "n": len(results), "tasks": {}}
    for label, rows in sorted(tasks.items()):
        by_length, by_cell = defaultdict(list), defaultdict(lambda: defaultdict(list))
        for r in rows:
            by_length[r["length"]].append(r["score"])
            by_cell[r["length"]][r["depth"]].append(r["score"])
        summary["tasks"][label] = {
            "task": rows[0]["task"],
            "variant": rows[0].get("variant", "standard"),
            "accuracy": _mean(r["score"] for r in rows),
            "n": len(rows),
            "by_length": {str(n): _mean(v) for n, v in sorted(by_length.items())},
            "by_length_depth": {
                str(n): {f"{d:g}": _mean(v) for d, v in sorted(cells.items())} for n, cells in sorted(by_cell.items())
            },
        }
    return summary


def past_window(results: list[dict], window: int) -> dict:
    """Accuracy of the prompts whose answers all lie more than `window` tokens back (`needle_distance`, see
    needles.py), which attention with that window cannot read at the first answer token, and of the others:
    {"window": W, "past": {"accuracy": .., "n": ..}, "inside": {..}}. A hybrid whose kept attention is windowed
    answers the "past" prompts through its mixers (or through windows chained across layers) or not at all."""
    if window < 1:
        raise ValueError(f"window must be a number of tokens >= 1, got {window}")
    unknown = [r.get("id") for r in results if r.get("needle_distance") is None]
    if unknown:
        raise ValueError(
            f"{len(unknown)} results have no needle_distance (e.g. {unknown[0]!r}): scores from before it was "
            "recorded; scripts/lab/needle_distances.py adds it from the report's request"
        )
    split = {"past": [], "inside": []}
    for r in results:
        split["past" if r["needle_distance"] > window else "inside"].append(r["score"])
    return {"window": window} | {k: {"accuracy": _mean(v), "n": len(v)} for k, v in split.items()}


def format_past_window(split: dict) -> str:
    """One line of `past_window`'s split: accuracy past the window and inside it."""
    past, inside = split["past"], split["inside"]

    def cell(part):
        return f"{100 * part['accuracy']:.1f}% of {part['n']}" if part["n"] else "none"

    return f"needles past the {split['window']}-token attention window: {cell(past)}; inside it: {cell(inside)}"


def format_table(summary: dict) -> str:
    """One small table per task: rows are lengths, columns depths and "all", cells accuracy in percent."""
    lines = []
    for label, t in summary["tasks"].items():
        depths = sorted({float(d) for cells in t["by_length_depth"].values() for d in cells})
        lines.append(f"{label}: {100 * t['accuracy']:.1f}% over {t['n']} samples")
        lines.append(f"{'length':>8} |" + "".join(f"{f'{100 * d:g}%':>7}" for d in depths) + " |    all")
        for n, cells in t["by_length_depth"].items():
            row = "".join(f"{100 * cells[f'{d:g}']:7.1f}" if f"{d:g}" in cells else f"{'-':>7}" for d in depths)
            lines.append(f"{n:>8} |{row} | {100 * t['by_length'][n]:6.1f}")
        lines.append("")
    lines.append(f"overall: {100 * summary['accuracy']:.1f}% over {summary['n']} samples")
    return "\n".join(lines)


def plot_niah_heatmap(results: list[dict], path: str | Path, title: str = "") -> Path:
    """Heatmap of accuracy (%) over context length (x) and needle depth (y), every cell annotated; writes a PNG.

    All results given are pooled: pass one task's results for a per-task picture.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's global backend
    from matplotlib.figure import Figure

    lengths = sorted({r["length"] for r in results})
    depths = sorted({r["depth"] for r in results})
    cells = defaultdict(list)
    for r in results:
        cells[r["length"], r["depth"]].append(r["score"])
    grid = [[100 * _mean(cells[n, d]) if cells[n, d] else float("nan") for n in lengths] for d in depths]  # [D, L]
    fig = Figure(figsize=(1.1 * len(lengths) + 2.5, 0.5 * len(depths) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            if not math.isnan(value):
                color = "white" if value < 15 or value > 85 else "black"  # readable on the dark ends
                ax.text(x, y, f"{value:.0f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or "retrieval accuracy (%)")
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    return write_png(fig, path, dpi=120)


def load_results(path: str | Path) -> dict:
    """{"summary", "results"} of a file save_results wrote, or of its gzipped copy (FILE.json.gz, as
    scripts/lab/archive_run.py keeps them under docs/results)."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def gzip_scores(data: bytes) -> bytes:
    """A score file's bytes gzipped with no timestamp: the same scores, the same bytes."""
    return gzip.compress(data, 9, mtime=0)


def save_results(results: list[dict], summary: dict, path: str | Path) -> Path:
    """Write {"summary", "results"} as JSON atomically: a temporary file beside `path`, then os.replace; gzipped
    (gzip_scores) when `path` ends in .gz, the form load_results reads too."""
    path = Path(path)
    payload = {"summary": summary, "results": [asdict(r) if isinstance(r, Sample) else r for r in results]}
    data = json.dumps(payload, indent=1).encode()
    with atomic_file(path, "wb") as f:
        f.write(gzip_scores(data) if path.suffix == ".gz" else data)
    return path
