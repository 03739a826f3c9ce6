"""`raven-eval table`: one results table from several evaluation reports, teacher and hybrids side by side.

    raven-eval table teacher=runs/teacher-eval raven=runs/smollm2-raven sse=runs/smollm2-sse \
        --reference teacher --ppl-length 2048 --speed-length 16384 > table.md

Each NAME=PATH names a `report.json` written by `raven-eval` or by a recipe's evaluate stage: the file itself, its
directory, or a recipe run directory (RUN_DIR/evaluate/report.json). Columns: perplexity at one context length
(and its ratio to the reference model's), accuracy per context length of every retrieval task found (standard
variant unless --variant; a task on a named haystack, TASK@NAME, beside TASK), and decoding tokens/s at batch 1
(the speed row's generate() path) with the per-sequence cache or state at one context length.

The issue's retrieval targets, checked on the same reports (cells: every task and length of the standard variant,
--lengths and --tasks to keep some):
    raven-eval table teacher=... sila=... sila-seed1=... --reference teacher \
        --within 10 --lengths 1024 2048 4096 8192 --agree sila:sila-seed1
    raven-eval table teacher=... raven=... --reference teacher --within 10 --lengths 1024 2048 4096 8192 \
        --tasks passkey niah_single_2 niah_word       # the core cells: passkey, the essay needle, NIAH-Word
--within P adds, for each model against --reference, how many cells are at most P points under it (or above it)
and which are not; --agree A:B (repeatable) how many cells two models (two seeds) score within P points of each
other (P of --within, 10 without it), their mean absolute difference, and the cells further apart. Where both
reports have their prompts' scores beside them (retrieval_TASK_VARIANT.json as the evaluation writes them, or
.json.gz as scripts/lab/archive_run.py keeps them), a cell further apart is marked * when the two differ beyond
chance on the same prompts: the exact two-sided McNemar test of the prompts one model gets right and the other
wrong (scores rounded to right/wrong), p < 0.05. The test counts prompts as independent: a passkey cell's 8 prompts
per depth share their filler and are answered all or none (docs/lab/2026-11-27-ablations-07-seed-spread.md), so
there a star says the models answer differently, not how sure that is.

How much a hybrid whose kept attention is windowed answers through its mixers alone:
    raven-eval table teacher=... raven-windows=... --beyond 4096 --lengths 8192 16384
Where in a prompt a task's answers are lost, by the needle's depth (0: at the prompt's start, the farthest back):
    raven-eval table teacher=... sila-22=... --by-depth passkey --lengths 4096 8192
Where a hybrid's perplexity loses, by position in the window (each model's mean loss over a span of positions,
minus --reference's, in nats per token: a rise with position is far context the mixers miss):
    raven-eval table teacher=... sila-22=... --reference teacher --positions 1,16,64,128,512,1024,2048
--beyond W counts, per model and task, the prompts answered among those whose answers all lie more than W tokens
before the prompt's end (each prompt's `needle_distance`; scripts/lab/needle_distances.py adds it to scores from before
the evaluation recorded it) and among the others.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from raven_layers.common import did_you_mean

from ..files import write_png
from .compare import (
    cells_under,
    length_label,
    load_report,
    loss_curve_at,
    perplexity_at,
    report_path,
    retrieval_cells,
)
from .retrieval import load_results, past_window


def prompt_results(path: str, variant: str) -> list[dict]:
    """Every prompt's result in the per-prompt files beside a report (empty when there are none)."""
    results = []
    folder = report_path(path).parent
    for pattern in (f"retrieval_*_{variant}.json", f"retrieval_*_{variant}.json.gz"):  # gz: archive_run.py's
        for file in sorted(folder.glob(pattern)):
            results += load_results(file)["results"]
    return results


def prompt_scores(path: str, variant: str) -> dict[str, float]:
    """{prompt id: score} of the per-prompt files beside a report (empty when there are none)."""
    return {r["id"]: r["score"] for r in prompt_results(path, variant)}


def mcnemar(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: of the prompts the two models disagree on, `only_a` went to A."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def significant(scores_a: dict, scores_b: dict, cell: tuple[str, int], variant: str) -> bool | None:
    """Whether two models' right/wrong answers on a cell's shared prompts differ beyond chance (None: no prompts)."""
    prefix = f"{cell[0]}/{variant}/{cell[1]}/"
    shared = [i for i in scores_a if i.startswith(prefix) and i in scores_b]
    if not shared:
        return None
    right_a = {i: scores_a[i] >= 0.5 for i in shared}
    right_b = {i: scores_b[i] >= 0.5 for i in shared}
    only_a = sum(right_a[i] and not right_b[i] for i in shared)
    only_b = sum(right_b[i] and not right_a[i] for i in shared)
    return mcnemar(only_a, only_b) < 0.05


def speed_at(report: dict, length: int) -> dict | None:
    """The report's speed row at `length` and batch 1 (None where it has none that ran)."""
    for entry in report.get("speed") or []:
        if entry.get("context_length") == length and entry.get("batch_size", 1) == 1 and not entry.get("skipped"):
            return entry
    return None


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def table(reports: dict[str, dict], reference: str | None, ppl_length: int, speed_length: int, variant: str) -> str:
    tasks: dict[str, list[int]] = {}
    for report in reports.values():
        for label, summary in report.get("retrieval", {}).items():
            task, _, var = label.partition("/")
            if (var or "standard") == variant:
                lengths = tasks.setdefault(task, [])
                lengths += [int(n) for n in summary["by_length"] if int(n) not in lengths]
    bases = list(dict.fromkeys(task.partition("@")[0] for task in tasks))
    tasks = {t: tasks[t] for t in sorted(tasks, key=lambda t: bases.index(t.partition("@")[0]))}  # TASK@NAME by TASK
    header = ["model", f"ppl @{length_label(ppl_length)}"]
    header += [f"{task} {length_label(n)}" for task, lengths in tasks.items() for n in sorted(lengths)]
    header += [
        f"decode tok/s @{length_label(speed_length)}, batch 1",
        f"cache/state per sequence @{length_label(speed_length)}",
    ]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    base = perplexity_at(reports[reference], ppl_length) if reference else None
    for name, report in reports.items():
        ppl = perplexity_at(report, ppl_length)
        cells = [
            name,
            "-" if ppl is None else f"{ppl:.2f}" + (f" ({ppl / base:.2f}x)" if base and name != reference else ""),
        ]
        for task, lengths in tasks.items():
            by_length = report.get("retrieval", {}).get(f"{task}/{variant}", {}).get("by_length", {})
            for n in sorted(lengths):
                value = by_length.get(str(n))
                cells.append("-" if value is None else f"{100 * value:.0f}%")
        speed = speed_at(report, speed_length)
        if speed is None:
            cells += ["-", "-"]
        else:
            cells.append(f"{speed['decode_tokens_per_second']:,.0f}" if speed.get("decode_tokens_per_second") else "-")
            cache = speed.get("cache_bytes_per_sequence") or {}
            cells.append(", ".join(f"{k} {mib(v)}" for k, v in cache.items() if v) or "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cell_name(cell: tuple[str, int]) -> str:
    return f"{cell[0]} {length_label(cell[1])}"


def within_reference(reports: dict[str, dict], reference: str, points: float, variant: str, lengths, tasks=None) -> str:
    """Per model: the cells at most `points` under the reference's (or above it), and the misses."""
    ref = retrieval_cells(reports[reference], variant, lengths, tasks)
    rows = [f"| model | cells within {points:g} points of {reference} (or above) | cells under |"]
    rows.append("| --- | --- | --- |")
    for name, report in reports.items():
        if name == reference:
            continue
        cells = retrieval_cells(report, variant, lengths, tasks)
        shared, under = cells_under(cells, ref, points)
        misses = ", ".join(f"{cell_name(c)} {cells[c]:.0f} vs {ref[c]:.0f}" for c in under) or "none"
        rows.append(f"| {name} | {len(shared) - len(under)} of {len(shared)} | {misses} |")
    return "\n".join(rows)


def agreement(
    reports: dict[str, dict],
    pairs: list[tuple[str, str]],
    points: float,
    variant: str,
    lengths,
    paths=None,
    tasks=None,
) -> str:
    """Per pair of models (two seeds of a recipe): the cells within `points` of each other and the mean distance;
    with `paths` ({name: report path}), the cells further apart that differ beyond chance marked * (McNemar)."""
    rows = [f"| pair | cells within {points:g} points | mean difference | cells further apart (* beyond chance) |"]
    rows.append("| --- | --- | --- | --- |")
    for a, b in pairs:
        cells_a = retrieval_cells(reports[a], variant, lengths, tasks)
        cells_b = retrieval_cells(reports[b], variant, lengths, tasks)
        scores = [prompt_scores(paths[n], variant) if paths else {} for n in (a, b)]
        shared = [c for c in cells_a if c in cells_b]
        diffs = {c: abs(cells_a[c] - cells_b[c]) for c in shared}
        apart = []
        for c in (c for c in shared if diffs[c] > points):
            mark = "*" if significant(*scores, c, variant) else ""
            apart.append(f"{cell_name(c)} {cells_a[c]:.0f} vs {cells_b[c]:.0f}{mark}")
        mean = sum(diffs.values()) / len(diffs) if diffs else float("nan")
        close = sum(d <= points for d in diffs.values())
        rows.append(f"| {a} vs {b} | {close} of {len(shared)} | {mean:.1f} | {', '.join(apart) or 'none'} |")
    return "\n".join(rows)


def beyond_window(paths: dict[str, str], window: int, variant: str, lengths, tasks=None) -> str:
    """Per model and task: the prompts answered right (score >= 0.5) among those whose answers all lie more than
    `window` tokens back, and among the others (retrieval.past_window)."""

    def kept(r: dict) -> bool:
        return (lengths is None or r["length"] in lengths) and (tasks is None or r["task"] in tasks)

    results = {name: [r for r in prompt_results(path, variant) if kept(r)] for name, path in paths.items()}
    shown = list(dict.fromkeys(r["task"] for rs in results.values() for r in rs))
    header = ["model", *(f"{task} past / inside" for task in shown), "all past / inside"]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, rs in results.items():
        if not rs:
            raise SystemExit(f"{name}: no per-prompt scores beside {report_path(paths[name])} (retrieval_*.json)")
        right = [r | {"score": float(r["score"] >= 0.5)} for r in rs]
        cells = [name]
        for task in [*shown, None]:
            mine = [r for r in right if task is None or r["task"] == task]
            try:
                split = past_window(mine, window)
            except ValueError as err:
                raise SystemExit(f"{name}: {err}") from None
            cells.append(" / ".join(answered(split[part]) for part in ("past", "inside")) if mine else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def by_depth(reports: dict[str, dict], task: str, variant: str, lengths=None) -> str:
    """Markdown: `task`'s accuracy by the needle's depth in the prompt (0: its start), a row per model and length
    (`lengths`, or every length a report has); a model without the task is left out."""
    key = f"{task}/{variant}"
    parts = {name: r["retrieval"][key] for name, r in reports.items() if key in r.get("retrieval", {})}
    depths = sorted(
        {float(d) for p in parts.values() for cells in p.get("by_length_depth", {}).values() for d in cells}
    )
    if not depths:
        raise SystemExit(f"--by-depth {task}: no report has its accuracy by depth ({variant} variant)")
    header = ["model", "length", *(f"depth {d:g}" for d in depths)]
    rows = [header, ["---"] * len(header)]
    for name, part in parts.items():
        for n, cells in sorted(part.get("by_length_depth", {}).items(), key=lambda item: int(item[0])):
            if lengths and int(n) not in lengths:
                continue
            at = {float(d): value for d, value in cells.items()}
            rows.append([name, length_label(int(n)), *(f"{100 * at[d]:.0f}%" if d in at else "-" for d in depths)])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def position_excess(
    reports: dict[str, dict], reference: str, length: int, edges: list[int]
) -> dict[str, list[float | None]]:
    """{model: its mean loss minus the reference's over each span of positions [edges[i], edges[i + 1]) of the
    perplexity windows of `length` tokens} (nats per token; None where the model has no curve there; a bucketed
    curve is read at its buckets' positions). The reference itself is left out."""
    curves = {name: loss_curve_at(report, length) for name, report in reports.items()}
    if curves[reference] is None:
        raise SystemExit(f"--positions: {reference} has no loss curve at {length} tokens (--ppl-length)")
    base = dict(zip(*curves[reference]))
    out = {}
    for name, curve in curves.items():
        if name == reference:
            continue
        points = list(zip(*curve)) if curve else []  # (position, loss)
        spans = [[loss - base[p] for p, loss in points if a <= p < b and p in base] for a, b in zip(edges, edges[1:])]
        out[name] = [sum(span) / len(span) if span else None for span in spans]
    return out


def loss_by_position(reports: dict[str, dict], excess_by_model: dict, length: int, edges: list[int]) -> str:
    """`position_excess`'s result as a table, with each model's perplexity."""
    header = ["model", f"ppl @{length_label(length)}", *(f"positions {a}-{b - 1}" for a, b in zip(edges, edges[1:]))]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, excess in excess_by_model.items():
        ppl = perplexity_at(reports[name], length)
        cells = [name, "-" if ppl is None else f"{ppl:.2f}", *("-" if e is None else f"{e:+.3f}" for e in excess)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_position_excess(
    reports: dict[str, dict], excess_by_model: dict, reference: str, length: int, edges: list[int], path
) -> Path:
    """PNG of `position_excess`'s result: each model's excess loss per span of positions (log scale), a step per
    span."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, excess in excess_by_model.items():
        ppl = perplexity_at(reports[name], length)
        label = name if ppl is None else f"{name} (ppl {ppl:.2f})"
        ax.stairs([math.nan if e is None else e for e in excess], edges, label=label, linewidth=1.6)
    ax.axhline(0, color="grey", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel(f"position in a {length}-token window (tokens of context)")
    ax.set_ylabel(f"mean loss - {reference}'s (nats per token)")
    ax.set_title(f"Where the loss goes, against {reference}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return write_png(fig, path, dpi=120)


def answered(part: dict) -> str:
    return f"{round(part['accuracy'] * part['n'])} of {part['n']}" if part["n"] else "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="raven-eval table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--reference", default=None, help="the NAME whose perplexity the others are divided by")
    parser.add_argument("--ppl-length", type=int, default=2048)
    parser.add_argument("--speed-length", type=int, default=16384)
    parser.add_argument("--variant", default="standard")
    parser.add_argument("--within", type=float, default=None, metavar="P", help="check cells against --reference")
    parser.add_argument("--agree", action="append", default=[], metavar="A:B", help="compare two models' cells")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="the lengths --within/--agree check")
    parser.add_argument("--tasks", nargs="+", default=None, help="the tasks --within/--agree/--beyond check")
    parser.add_argument(
        "--beyond", type=int, default=None, metavar="W", help="count the prompts answered past a W-token window"
    )
    parser.add_argument(
        "--positions",
        default=None,
        metavar="EDGES",
        help="the loss against --reference by span of positions, e.g. 1,64,512,2048 (spans 1-63, 64-511, 512-2047)",
    )
    parser.add_argument("--positions-plot", default=None, metavar="PNG", help="--positions as a picture, into PNG")
    parser.add_argument(
        "--by-depth", default=None, metavar="TASK", help="TASK's accuracy by the needle's depth, per model and length"
    )
    args = parser.parse_args(argv)
    edges = None
    if args.positions is not None:
        try:
            edges = [int(p) for p in args.positions.split(",")]
        except ValueError:
            edges = []
        if len(edges) < 2 or edges != sorted(set(edges)) or edges[0] < 1:
            parser.error(f"--positions {args.positions!r}: at least two increasing positions >= 1, e.g. 1,64,512,2048")
        if args.reference is None:
            parser.error("--positions needs --reference, the model whose loss the others' is compared with")
    if args.positions_plot is not None and edges is None:
        parser.error("--positions-plot draws --positions: give both")
    paths = {}
    for item in args.reports:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"{item!r} is not NAME=PATH")
        paths[name] = path
    if args.reference is not None and args.reference not in paths:
        parser.error(f"--reference {args.reference!r} is none of {list(paths)}")
    pairs = []
    for item in args.agree:
        a, sep, b = item.partition(":")
        if not sep or a not in paths or b not in paths:
            parser.error(f"--agree {item!r} is not A:B with A and B among {list(paths)}")
        pairs.append((a, b))
    counted = args.within is not None or pairs or args.beyond is not None
    if args.tasks and not counted:
        parser.error("--tasks applies to --within, --agree and --beyond only")
    if args.lengths and not counted and args.by_depth is None:
        parser.error("--lengths applies to --within, --agree, --beyond and --by-depth only")
    if args.beyond is not None and args.beyond < 1:
        parser.error(f"--beyond {args.beyond}: a window is a number of tokens >= 1")
    if args.within is not None and args.reference is None:
        parser.error("--within needs --reference, the model the cells are checked against")
    reports = {name: load_report(path) for name, path in paths.items()}
    found = sorted({t for r in reports.values() for t, _ in retrieval_cells(r, args.variant, None)})
    for flag, task in [*(("--tasks", t) for t in args.tasks or ()), ("--by-depth", args.by_depth)]:
        if task is not None and task not in found:
            hint = did_you_mean(task, found)
            parser.error(f"{flag} {task!r} is in none of the reports; {hint}found ({args.variant}): {found}")
    print(table(reports, args.reference, args.ppl_length, args.speed_length, args.variant))
    points = 10.0 if args.within is None else args.within
    if args.within is not None:
        print("\n" + within_reference(reports, args.reference, points, args.variant, args.lengths, args.tasks))
    if pairs:
        print("\n" + agreement(reports, pairs, points, args.variant, args.lengths, paths, args.tasks))
    if args.beyond is not None:
        print("\n" + beyond_window(paths, args.beyond, args.variant, args.lengths, args.tasks))
    if args.by_depth is not None:
        print("\n" + by_depth(reports, args.by_depth, args.variant, args.lengths))
    if edges is not None:
        excess = position_excess(reports, args.reference, args.ppl_length, edges)
        print("\n" + loss_by_position(reports, excess, args.ppl_length, edges))
        if args.positions_plot is not None:
            plot_position_excess(reports, excess, args.reference, args.ppl_length, edges, args.positions_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
