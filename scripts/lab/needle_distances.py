"""Add each prompt's `needle_distance` (how many tokens back its nearest answer ends, see needles.py) to a report's
per-prompt scores made before the evaluation recorded it. The prompts are deterministic (settings, tokenizer, seed):
they are rebuilt from the report's request, checked against the scores (every id, and its length in tokens), and the
files rewritten in place, each in the form it had (.json, or .json.gz as scripts/lab/archive_run.py keeps them).

    python scripts/lab/needle_distances.py docs/results/ablations/raven-far-windows --tokenizer /tmp/smollm2 \
        --haystack ../shared/data/pg_essays

--tokenizer: a folder with the evaluated model's tokenizer (the report's model path is the device's); --haystack:
the essays the request's `haystack_dir` named there. Then `raven-eval table ... --beyond W` reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from raven_convert.evaluate.retrieval import load_results, save_results
from raven_convert.evaluate.settings import EvaluateSettings


def add_needle_distances(report_dir: Path, tokenizer, haystack: str | None = None) -> dict[str, int]:
    """Rewrite the per-prompt score files beside `report_dir`/report.json with each prompt's `needle_distance`;
    returns {file name: prompts updated}. Raises when a score's prompt is not the rebuilt one."""
    request = json.loads((report_dir / "report.json").read_text())["request"]
    fields = {k: v for k, v in request.items() if k in EvaluateSettings.model_fields}
    if haystack is not None:
        fields["haystack_dir"] = haystack
    settings = EvaluateSettings(**fields)
    rewritten = {}  # every file checked before any is written
    for file in sorted(report_dir.glob("retrieval_*.json*")):
        payload = load_results(file)
        rows = payload["results"]
        prompts = {}
        for task, variant in dict.fromkeys((r["task"], r["variant"]) for r in rows):
            prompts |= {s.meta["id"]: s for s in settings.prompts(task, variant, tokenizer)}
        for row in rows:
            sample = prompts.get(row["id"])
            if sample is None or sample.meta["n_tokens"] != row["n_tokens"]:
                raise ValueError(
                    f"{file}: prompt {row['id']!r} ({row['n_tokens']} tokens) is not among the rebuilt prompts "
                    f"({'missing' if sample is None else sample.meta['n_tokens']} tokens): another tokenizer or "
                    "haystack than the evaluation's?"
                )
            row["needle_distance"] = sample.meta["needle_distance"]
        rewritten[file] = payload
    for file, payload in rewritten.items():
        save_results(payload["results"], payload["summary"], file)  # in the form it had
    return {file.name: len(payload["results"]) for file, payload in rewritten.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, metavar="REPORT_DIR", help="folders holding report.json")
    parser.add_argument("--tokenizer", required=True, help="the evaluated model's tokenizer (a folder)")
    parser.add_argument("--haystack", default=None, help="the essays in place of the request's haystack_dir")
    args = parser.parse_args(argv)
    for folder in args.reports:
        if not (folder / "report.json").is_file():
            parser.error(f"{folder} has no report.json")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for folder in args.reports:
        done = add_needle_distances(folder, tokenizer, args.haystack)
        print(f"{folder}: " + ", ".join(f"{name} {n} prompts" for name, n in done.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
