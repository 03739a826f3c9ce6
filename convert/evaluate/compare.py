"""Evaluation reports side by side: read a `report.json`, take its perplexity and retrieval cells, and count the
cells a model keeps within P points of a reference (`raven-eval table`, raven_convert.depth).

    cells = retrieval_cells(load_report("runs/sila"), "standard", [1024, 2048, 4096, 8192])  # {(task, length): %}
    shared, under = cells_under(cells, retrieval_cells(teacher, "standard", None), points=10)
"""

from __future__ import annotations

import json
from pathlib import Path


def report_path(path: str | Path) -> Path:
    """A report.json given as the file, its folder, or a recipe run directory (RUN_DIR/evaluate/report.json)."""
    p = Path(path)
    for candidate in (p, p / "report.json", p / "evaluate" / "report.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no report.json at {p}, {p / 'report.json'} or {p / 'evaluate' / 'report.json'}")


def load_report(path: str | Path) -> dict:
    return json.loads(report_path(path).read_text())


def perplexity_at(report: dict, length: int) -> float | None:
    """The report's perplexity at `length` tokens, or None where it was not measured."""
    for entry in report.get("perplexity", {}).get("results", []):
        if entry.get("context_length") == length and not entry.get("skipped"):
            return entry["perplexity"]
    return None


def retrieval_cells(report: dict, variant: str, lengths: list[int] | None) -> dict[tuple[str, int], float]:
    """{(task, length): accuracy in points} of one report's retrieval results of `variant` (at `lengths` only,
    unless None)."""
    cells = {}
    for label, summary in report.get("retrieval", {}).items():
        task, _, var = label.partition("/")
        if (var or "standard") != variant:
            continue
        for n, value in summary["by_length"].items():
            if lengths is None or int(n) in lengths:
                cells[task, int(n)] = round(100 * value, 6)  # 0.9 * 100 is 90.00000000000001
    return cells


def cells_under(cells: dict, reference: dict, points: float) -> tuple[list, list]:
    """(the cells both have, those more than `points` under the reference's) of two retrieval_cells results."""
    shared = [c for c in reference if c in cells]
    return shared, [c for c in shared if cells[c] < reference[c] - points]
