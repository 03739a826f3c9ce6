"""Keep a trained run's results in docs/results: its evaluation's report and pictures, its per-prompt scores
gzipped (a sixth of their size: the checkout travels to the GPU machine with every call; `raven-eval table` reads
them either way), the clean-load check, a Raven run's router occupancy, the memory trace, and every stage's summary
(DONE) in one stages.json.

    tar xzf runs.tar.gz -C /tmp/runs     # what `bash scripts/lab/gpu_jobs.sh collect` brought back
    python scripts/lab/archive_run.py /tmp/runs/raven-answers-windows docs/results/ablations/raven-answers-windows
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from raven_convert.evaluate.retrieval import gzip_scores
from raven_convert.train.recipe import STAGES


def archive_run(run: Path, out: Path) -> list[str]:
    """Copy what `run` (a recipe's run directory) holds of its results into `out`; returns the names written."""
    evaluate = run / "evaluate"
    if not (evaluate / "report.json").is_file():
        raise FileNotFoundError(f"{run} has no evaluate/report.json: is it a recipe run whose evaluation finished?")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("report.json", *sorted(p.name for p in evaluate.glob("*.png"))):
        shutil.copyfile(evaluate / name, out / name)
        written.append(name)
    for scores in sorted(evaluate.glob("retrieval_*.json")):
        (out / f"{scores.name}.gz").write_bytes(gzip_scores(scores.read_bytes()))
        written.append(f"{scores.name}.gz")
    for extra in (
        run / "load_check.json",
        run / "router_occupancy.json",
        run / "memory-reach" / "memory_reach.json",
        run / "memory-reach" / "memory_reach.png",
    ):
        if extra.is_file():
            shutil.copyfile(extra, out / extra.name)
            written.append(extra.name)
    stages = {s: json.loads((run / s / "DONE").read_text()) for s in STAGES if (run / s / "DONE").is_file()}
    (out / "stages.json").write_text(json.dumps(stages, indent=2) + "\n")
    return [*written, "stages.json"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path, help="a recipe's run directory (as runs.tar.gz unpacks it)")
    p.add_argument("out", type=Path, help="the folder under docs/results to write")
    args = p.parse_args(argv)
    try:
        written = archive_run(args.run, args.out)
    except FileNotFoundError as err:
        print(f"archive_run: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
