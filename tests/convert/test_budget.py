"""raven_convert.budget (`python -m raven_convert.depth budget`): runs of one recipe at several budgets against the
tokens they read, from a run directory's stage summaries or an archive's stages.json, and the fitted excess
perplexity's verdict on a target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raven_convert.budget import fit_excess, gpu_minutes, tokens_for, tokens_read
from raven_convert.depth import main
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.run_state import stage_inputs
from tests.convert.test_depth import report, write


def summaries(scale: int, processes: int = 1) -> dict[str, dict]:
    """Stage summaries as the stages write them (DONE), their inputs from run_state.stage_inputs (which records the
    global batch of the processes a stage ran on): align and train at 2,048 tokens a row, extend at 8,192."""
    recipe = parse_recipe(
        {
            "source": "teacher",
            "layers": [{"mixer": "sila", "layers": "1"}],
            "data": {"source": "x", "seq_len": 2048},
            "align": {"steps": 100, "batch_size": 16},
            "train": {"steps": 50, "batch_size": 16, "grad_accum": 2},
            "extend": {"steps": 10, "batch_size": 2, "seq_len": 8192},
        }
    )

    def stage(name: str, steps: int, seconds: float) -> dict:
        return {
            "steps": steps * scale,
            "seconds": seconds * scale,
            "processes": processes,
            "inputs": stage_inputs(recipe, name, processes),
        }

    return {
        "convert": {"seconds": 60.0}, "align": stage("align", 100, 120.0), "weights": {"seconds": 30.0},
        "train": stage("train", 50, 60.0), "extend": stage("extend", 10, 30.0) | {"seq_len": 8192},
        "evaluate": {"seconds": 999.0},
    }  # fmt: skip


def test_tokens_and_gpu_minutes_from_the_stage_summaries():
    one = 100 * 16 * 2048 + 50 * 16 * 2 * 2048 + 10 * 2 * 8192
    assert tokens_read(summaries(1)) == one
    assert tokens_read(summaries(2, processes=4)) == 2 * 4 * one  # rows per process, every process reads: 4x the rows
    assert gpu_minutes(summaries(1)) == (60 + 120 + 30 + 60 + 30) / 60  # evaluation left out
    assert gpu_minutes(summaries(1, processes=4)) == (60 + 4 * 120 + 30 + 4 * 60 + 4 * 30) / 60


def test_the_fit_through_log_log_points_and_its_target():
    points = [{"tokens": 25e6, "perplexity_ratio": 1.16}, {"tokens": 50e6, "perplexity_ratio": 1.08}]
    fit = fit_excess(points)
    assert fit["runs"] == 2 and fit["b"] == pytest.approx(-1.0)  # the excess halves with each doubling
    assert tokens_for(1.04, fit) == pytest.approx(100e6) and tokens_for(1.0, fit) is None
    assert (
        fit_excess(points[:1]) is None and fit_excess(points + [{"tokens": 80e6, "perplexity_ratio": 1.0}])["runs"] == 2
    )
    worse = fit_excess([{"tokens": 25e6, "perplexity_ratio": 1.05}, {"tokens": 50e6, "perplexity_ratio": 1.1}])
    assert worse["b"] > 0 and tokens_for(1.04, worse) is None


def test_budget_tabulates_plots_and_fits_runs_and_archives(tmp_path, capsys):
    cells = {"passkey": {1024: 1.0, 8192: 0.4}, "w": {1024: 0.6}}
    teacher = write(tmp_path / "teacher", report(None, 20.0, cells, 64))
    half = tmp_path / "half"  # a recipe run: STAGE/DONE and evaluate/report.json
    write(half / "evaluate", report(["sila"] * 3 + ["attention"], 23.2, cells, 16))
    for stage, summary in summaries(1).items():
        (half / stage).mkdir(exist_ok=True)
        (half / stage / "DONE").write_text(json.dumps(summary))
    whole = write(tmp_path / "whole", report(["sila"] * 3 + ["attention"], 21.6, cells | {"w": {1024: 0.4}}, 16))
    (whole / "stages.json").write_text(json.dumps(summaries(2)))  # an archive (scripts/lab/archive_run.py)
    out = tmp_path / "out"
    args = ["budget", "--teacher", str(teacher), str(whole), str(half), "--target-ppl", "1.04", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    mib = tokens_read(summaries(1)) / 1e6
    assert f"| half | {mib:.1f}M | 5.0 | 23.20 (1.16x) | 3 of 3 | 100% | 40% |" in text  # fewest tokens first
    assert f"| whole | {2 * mib:.1f}M | 8.5 | 21.60 (1.08x) | 2 of 3 | 100% | 40% |" in text
    assert "tokens^-1.00 (x0.50 per doubling, fitted to 2 runs): 1.04x at about" in text
    assert "2.0x the largest run's, about 17 GPU-minutes at its rate." in text
    record = json.loads((out / "budget.json").read_text())
    assert record["tokens_for_target"] == pytest.approx(4 * tokens_read(summaries(1)), rel=1e-6)
    assert math.isclose(record["fit"]["b"], -1.0) and (out / "budget.png").stat().st_size > 10_000
    assert (out / "budget.md").read_text().endswith(text.strip() + "\n")


def test_budget_names_what_it_cannot_read(tmp_path, capsys):
    teacher = write(tmp_path / "teacher", report(None, 20.0, {"passkey": {1024: 1.0}}, 64))
    bare = write(tmp_path / "bare", report(["sila"], 21.0, {"passkey": {1024: 1.0}}, 16))
    assert main(["budget", "--teacher", str(teacher), str(bare), str(bare), "--out", str(tmp_path / "o")]) == 2
    assert "no stages.json and no STAGE/DONE" in capsys.readouterr().err
    assert main(["budget", "--teacher", str(teacher), str(bare), "--out", str(tmp_path / "o")]) == 2
    assert "at least two runs" in capsys.readouterr().err
    assert not Path(tmp_path / "o" / "budget.json").exists()
