"""One results table from several evaluation reports: teacher and hybrids side by side (docs/RESULTS.md).

    python scripts/results_table.py teacher=runs/teacher-eval raven=runs/smollm2-raven sse=runs/smollm2-sse \
        --reference teacher --ppl-length 2048 --speed-length 16384 > table.md

Each NAME=PATH names a `report.json` written by `raven-eval` or by a recipe's evaluate stage: the file itself, its
directory, or a recipe run directory (RUN_DIR/evaluate/report.json). Columns: perplexity at one context length
(and its ratio to the reference model's), accuracy per context length of every retrieval task found (standard
variant unless --variant; a task on a named haystack, TASK@NAME, beside TASK), and decoding tokens/s with the
per-sequence cache or state at one context length.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_report(path: str) -> dict:
    p = Path(path)
    for candidate in (p, p / "report.json", p / "evaluate" / "report.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise FileNotFoundError(f"no report.json at {p}, {p / 'report.json'} or {p / 'evaluate' / 'report.json'}")


def perplexity_at(report: dict, length: int) -> float | None:
    for entry in report.get("perplexity", {}).get("results", []):
        if entry.get("context_length") == length and not entry.get("skipped"):
            return entry["perplexity"]
    return None


def speed_at(report: dict, length: int) -> dict | None:
    for entry in report.get("speed") or []:
        if entry.get("context_length") == length and not entry.get("skipped"):
            return entry
    return None


def short(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


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
    header = ["model", f"ppl @{short(ppl_length)}"]
    header += [f"{task} {short(n)}" for task, lengths in tasks.items() for n in sorted(lengths)]
    header += [f"decode tok/s @{short(speed_length)}", f"cache/state per sequence @{short(speed_length)}"]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--reference", default=None, help="the NAME whose perplexity the others are divided by")
    parser.add_argument("--ppl-length", type=int, default=2048)
    parser.add_argument("--speed-length", type=int, default=16384)
    parser.add_argument("--variant", default="standard")
    args = parser.parse_args(argv)
    reports = {}
    for item in args.reports:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"{item!r} is not NAME=PATH")
        reports[name] = load_report(path)
    if args.reference is not None and args.reference not in reports:
        parser.error(f"--reference {args.reference!r} is none of {list(reports)}")
    print(table(reports, args.reference, args.ppl_length, args.speed_length, args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
