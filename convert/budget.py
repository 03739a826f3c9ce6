"""What more training would buy: one recipe's quality against the tokens it trained on, from runs of it at several
budgets, and the tokens a perplexity target would take at the rate those runs show.

    python -m raven_convert.depth budget --teacher docs/results/ablations/teacher \
        docs/results/depth/sila-deep22-half docs/results/depth/sila-auto22 --target-ppl 1.05 \
        --lengths 1024,2048,4096,8192 --out docs/results/depth/budget22

Each run is a recipe's run directory or its archive (scripts/lab/archive_run.py: report.json and stages.json). Per
run: the tokens its align, train and extend stages read (steps x the global batch's rows x sequence length, from
the stages' summaries), the GPU-minutes of its stages before the evaluation, and its quality against the teacher as
the depth table counts it (perplexity ratio, retrieval cells within `--within` points, passkey). The perplexity's
excess over the teacher's, ratio - 1, is fitted as a power of the tokens read (a line through log-log points, least
squares), which gives the tokens at which it would reach `--target-ppl` and, at the largest run's GPU-minutes per
token, the time. Writes OUT/budget.json, budget.md and budget.png atomically.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from raven_convert.evaluate.compare import length_label, load_report, quality, report_path
from raven_convert.files import atomic_file, write_json, write_png
from raven_convert.train.recipe_schema import STAGES
from raven_convert.train.run_state import MARKER

TRAINING = ("align", "train", "extend")  # the stages that train on text; the token weights' pass only reads it


def stage_summaries(run: str | Path) -> dict[str, dict]:
    """{stage: its summary (DONE)} of a recipe run directory, or of its archive's stages.json."""
    run = Path(run)
    if (run / "stages.json").is_file():
        return json.loads((run / "stages.json").read_text())
    found = {s: json.loads((run / s / MARKER).read_text()) for s in STAGES if (run / s / MARKER).is_file()}
    if not found:
        raise FileNotFoundError(f"{run}: no stages.json and no STAGE/{MARKER}: is it a recipe run or its archive?")
    return found


def tokens_read(stages: dict[str, dict]) -> int:
    """Tokens the training stages read: steps x rows x sequence length, the rows those of the global batch (batch x
    accumulation) that the summaries' inputs record already counted over the processes (run_state.stage_inputs)."""
    total = 0
    for name in TRAINING:
        summary = stages.get(name)
        if summary is None:
            continue
        inputs = summary["inputs"]
        settings = inputs[name]
        length = summary.get("seq_len") or settings.get("seq_len") or inputs["data"]["seq_len"]
        rows = settings["batch_size"] * settings.get("grad_accum", 1)
        total += summary["steps"] * rows * length
    return total


def gpu_minutes(stages: dict[str, dict]) -> float:
    """GPU-minutes of the stages before the evaluation (each stage's seconds times its processes)."""
    spent = (s["seconds"] * s.get("processes", 1) for name, s in stages.items() if name not in ("evaluate", "export"))
    return sum(spent) / 60


def fit_excess(points: list[dict]) -> dict | None:
    """log(ratio - 1) = a + b log(tokens) through the points whose perplexity exceeds the teacher's, by least
    squares: {"a", "b", "runs"}, or None with fewer than two such points at two budgets."""
    pts = [(math.log(p["tokens"]), math.log(p["perplexity_ratio"] - 1)) for p in points if _excess(p)]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"a": my - b * mx, "b": b, "runs": len(pts)}


def _excess(point: dict) -> bool:
    return bool(point.get("perplexity_ratio")) and point["perplexity_ratio"] > 1 and point["tokens"] > 0


def tokens_for(target: float, fit: dict | None) -> float | None:
    """The tokens at which the fitted excess reaches target - 1, or None (no fit, or more tokens did not help)."""
    if fit is None or fit["b"] >= 0 or target <= 1:
        return None
    return math.exp((math.log(target - 1) - fit["a"]) / fit["b"])


def budget_points(teacher: dict, runs: list[str], lengths, within: float, ppl_length: int) -> list[dict]:
    """One point per run, fewest tokens first."""
    points = []
    for run in runs:
        stages = stage_summaries(run)
        point = {"run": str(run), "tokens": tokens_read(stages), "gpu_minutes": round(gpu_minutes(stages), 2)}
        point |= quality(load_report(run), teacher, lengths, within, ppl_length)
        points.append(point)
    return sorted(points, key=lambda p: p["tokens"])


def budget_table(points: list[dict], within: float, target: float, fit: dict | None) -> str:
    """Markdown: a row per run, then what the fit says of the target."""
    lengths = sorted({n for p in points for n in p["passkey"]})
    header = ["run", "tokens read", "GPU-min (training)", "ppl (x teacher)", f"cells within {within:g}"]
    header += [f"passkey {length_label(n)}" for n in lengths]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for p in points:
        ppl = "-" if p["perplexity"] is None else f"{p['perplexity']:.2f}"
        ppl += f" ({p['perplexity_ratio']:.2f}x)" if p.get("perplexity_ratio") else ""
        cells = [Path(p["run"]).name, f"{p['tokens'] / 1e6:.1f}M", f"{p['gpu_minutes']:.1f}", ppl]
        cells.append(f"{p['cells_within']} of {p['cells']}")
        cells += [f"{p['passkey'][n]:.0f}%" if n in p["passkey"] else "-" for n in lengths]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + fit_sentence(points, target, fit)


def fit_sentence(points: list[dict], target: float, fit: dict | None) -> str:
    """What the fitted excess says of `target`, in one sentence."""
    if fit is None:
        return f"No fit: it takes two budgets whose perplexity exceeds the teacher's (target {target:g}x)."
    if fit["b"] >= 0:
        return (f"The perplexity's excess does not fall with more tokens (exponent {fit['b']:.2f}): no budget "
                f"reaches {target:g}x.")  # fmt: skip
    needed, largest = tokens_for(target, fit), points[-1]
    rate = largest["gpu_minutes"] / largest["tokens"] if largest["tokens"] else 0.0
    minutes = f", about {needed * rate:.0f} GPU-minutes at its rate" if rate else ""
    return (
        f"The perplexity's excess over the teacher's goes as tokens^{fit['b']:.2f} (x{2 ** fit['b']:.2f} per "
        f"doubling, fitted to {fit['runs']} runs): {target:g}x at about {needed / 1e6:.0f}M tokens, "
        f"{needed / largest['tokens']:.1f}x the largest run's{minutes}."
    )


def plot_budget(points: list[dict], fit: dict | None, target: float, path: str | Path, title: str) -> Path:
    """Perplexity ratio (with the fit, out to the target) and retrieval (cells within, passkey at the longest length)
    against the tokens read, written atomically (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    keep = [p for p in points if p.get("perplexity_ratio")]
    left.plot([p["tokens"] / 1e6 for p in keep], [p["perplexity_ratio"] for p in keep], "o", label="runs")
    needed = tokens_for(target, fit)
    if fit is not None:
        top = max([p["tokens"] for p in points] + ([needed] if needed else []))
        xs = [points[0]["tokens"] * (top / points[0]["tokens"]) ** (i / 40) for i in range(41)]
        ys = [1 + math.exp(fit["a"] + fit["b"] * math.log(x)) for x in xs]
        left.plot([x / 1e6 for x in xs], ys, ":", color="tab:red", label=f"fit: excess ~ tokens^{fit['b']:.2f}")
    left.axhline(target, color="grey", linewidth=0.8, linestyle="--", label=f"target {target:g}x")
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens read in training (M)")
    left.set_ylabel("perplexity / teacher's")
    left.legend(fontsize=8)
    left.set_title("perplexity")
    tokens = [p["tokens"] / 1e6 for p in points]
    right.plot(tokens, [100 * p["cells_within"] / max(p["cells"], 1) for p in points], "o-", label="cells within")
    longest = max((n for p in points for n in p["passkey"]), default=None)
    if longest:
        keep = [p for p in points if longest in p["passkey"]]
        right.plot([p["tokens"] / 1e6 for p in keep], [p["passkey"][longest] for p in keep], "s--",
                   label=f"passkey {longest}")  # fmt: skip
    right.set_xscale("log", base=2)
    right.set_ylim(-5, 105)
    right.set_xlabel("tokens read in training (M)")
    right.set_ylabel("%")
    right.legend(fontsize=8)
    right.set_title("retrieval")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return write_png(fig, path)


def budget(args) -> str:
    """`python -m raven_convert.depth budget`: the table (printed), budget.json, budget.md and budget.png."""
    if len(args.runs) < 2:
        raise ValueError("budget: give at least two runs of one recipe at different budgets")
    teacher = load_report(args.teacher)
    points = budget_points(teacher, args.runs, args.lengths, args.within, args.ppl_length)
    fit = fit_excess(points)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = args.title or "quality against the tokens read"
    text = budget_table(points, args.within, args.target_ppl, fit)
    sources = {"teacher": str(report_path(args.teacher)), "runs": [str(r) for r in args.runs]}
    record = {"title": title, "sources": sources, "target_ppl": args.target_ppl, "fit": fit, "points": points}
    write_json(record | {"tokens_for_target": tokens_for(args.target_ppl, fit)}, out / "budget.json")
    with atomic_file(out / "budget.md", "w") as f:
        f.write(f"{title}\n\n{text}\n")
    plot_budget(points, fit, args.target_ppl, out / "budget.png", title)
    return text
