"""Evaluation reports side by side: read a `report.json`, take its perplexity and retrieval cells, and count the
cells a model keeps within P points of a reference (`raven-eval table`); `quality` sums a hybrid up against its
teacher for the depth and budget tables (raven_convert.depth, raven_convert.budget).

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


def loss_curve_at(report: dict, length: int) -> tuple[list[int], list[float]] | None:
    """The report's mean loss by position at `length` tokens (positions, nats), or None where it was not measured."""
    for entry in report.get("perplexity", {}).get("results", []):
        if entry.get("context_length") == length and not entry.get("skipped") and "curve" in entry:
            return entry["curve"]["positions"], entry["curve"]["loss"]
    return None


def retrieval_cells(
    report: dict, variant: str, lengths: list[int] | None, tasks: list[str] | None = None
) -> dict[tuple[str, int], float]:
    """{(task, length): accuracy in points} of one report's retrieval results of `variant` (at `lengths` and of
    `tasks` only, unless None)."""
    cells = {}
    for label, summary in report.get("retrieval", {}).items():
        task, _, var = label.partition("/")
        if (var or "standard") != variant or (tasks is not None and task not in tasks):
            continue
        for n, value in summary["by_length"].items():
            if lengths is None or int(n) in lengths:
                cells[task, int(n)] = round(100 * value, 6)  # 0.9 * 100 is 90.00000000000001
    return cells


def cells_under(cells: dict, reference: dict, points: float) -> tuple[list, list]:
    """(the cells both have, those more than `points` under the reference's) of two retrieval_cells results."""
    shared = [c for c in reference if c in cells]
    return shared, [c for c in shared if cells[c] < reference[c] - points]


def quality(report: dict, teacher: dict, lengths: list[int] | None, within: float, ppl_length: int) -> dict:
    """A hybrid's quality against its teacher's report, as the depth and budget tables count it: perplexity at
    `ppl_length` and its ratio, the retrieval cells (task x length, at `lengths` or all) within `within` points of
    the teacher's or above and those under, passkey per length, and the keys and values one token adds."""
    ppl, base = perplexity_at(report, ppl_length), perplexity_at(teacher, ppl_length)
    cells = retrieval_cells(report, "standard", lengths)
    shared, under = cells_under(cells, retrieval_cells(teacher, "standard", lengths), within)
    passkey = {n: v for (task, n), v in sorted(cells.items()) if task == "passkey"}
    return {
        "perplexity": ppl,
        "perplexity_ratio": None if ppl is None or not base else round(ppl / base, 4),
        "cells": len(shared),
        "cells_within": len(shared) - len(under),
        "cells_under": [f"{task} {n}: {cells[task, n]:.0f} vs teacher's" for task, n in under],
        "passkey": passkey,
        "kv_bytes_per_token": kv_per_token(report),
    }


def kv_per_token(report: dict) -> float | None:
    """Keys and values one token adds to the cache, from the evaluation's speed part (attention bytes per sequence
    over its context), or None where it did not measure speed."""
    for entry in report.get("speed") or []:
        cache = entry.get("cache_bytes_per_sequence")
        if cache and entry.get("context_length") and not entry.get("skipped"):
            return cache.get("attention", 0) / entry["context_length"]
    return None


def length_label(n: int) -> str:
    """A length in tokens as the tables write it: 2K for 2,048, the number itself where it is not a whole K."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
