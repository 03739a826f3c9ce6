"""raven_convert.depth: a recipe run at several depths (tiny Llama, CPU, end to end: the teacher evaluated once,
one resumable run per depth) and the table, JSON and plot of runs made elsewhere, with decode speed from
bench_generate.py's rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from raven_convert.depth import main, parse_depths, quality, sweep_table, throughput
from tests.conftest import make_tiny_source
from tests.helpers import words_corpus


def report(mixers: list[str] | None, ppl: float, cells: dict[str, dict[int, float]], kv: int) -> dict:
    """A report.json as the evaluation writes it: perplexity at 2K, retrieval by task and length, speed at 16K."""
    run = {"layer_mixers": mixers} if mixers else {}
    retrieval = {f"{task}/standard": {"by_length": {str(n): v for n, v in by.items()}} for task, by in cells.items()}
    return {
        "run": run,
        "perplexity": {"results": [{"context_length": 2048, "perplexity": ppl}]},
        "retrieval": retrieval,
        "speed": [{"context_length": 16384, "cache_bytes_per_sequence": {"attention": kv * 16384, "mixer": 9}}],
    }


def write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(data))
    return folder


SPEED = [
    {"model": "teacher", "batch": 128, "context": 16384, "step_ms": 100.0},
    {"model": "teacher-engine", "batch": 128, "context": 16384, "step_ms": 17.0},
    {"model": "sila-2of4", "batch": 128, "context": 16384, "step_ms": 8.5},
    {"model": "sila-3of4", "batch": 128, "context": 16384, "oom": True},
]


def test_collect_tabulates_plots_and_checks_the_depths(tmp_path, capsys):
    teacher = write(tmp_path / "teacher", report(None, 20.0, {"passkey": {1024: 1.0, 8192: 0.4}, "w": {1024: 0.6}}, 64))
    two = write(
        tmp_path / "two",
        report(
            ["sila", "attention", "sila", "attention"], 21.0, {"passkey": {1024: 1.0, 8192: 0.8}, "w": {1024: 0.2}}, 32
        ),
    )
    speed = tmp_path / "bench_generate.json"
    speed.write_text(json.dumps({"results": SPEED}))
    out = tmp_path / "out"
    args = ["collect", "--teacher", str(teacher), f"2={two}", "--speed", str(speed), "--mixer", "sila"]
    assert main([*args, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 0 of 4 | 4 | 20.00 (1.00x) | 3 of 3 | 100% | 40% | 64 (1.00x) | 1.00x |" in table
    assert "| 2 of 4 | 2 | 21.00 (1.05x) | 2 of 3 | 100% | 80% | 32 (0.50x) | 2.00x |" in table  # w 1K: 20 vs 60
    record = json.loads((out / "depth.json").read_text())
    assert [p["depth"] for p in record["points"]] == [0, 2] and record["points"][1]["cells_under"] == [
        "w 1024: 20 vs teacher's"
    ]
    assert (out / "depth.png").stat().st_size > 10_000 and (out / "depth.md").read_text().endswith(table.strip() + "\n")
    assert (
        main(["collect", "--teacher", str(teacher), f"3={two}", "--mixer", "sila", "--out", str(tmp_path / "o2")]) == 2
    )
    assert "that model converts 2 of its 4 layers, not 3" in capsys.readouterr().err
    assert main(["collect", "--teacher", str(teacher), f"two={two}", "--mixer", "sila", "--out", str(out)]) == 2
    assert "'two=" in capsys.readouterr().err


def test_quality_and_throughput_parts():
    teacher = report(None, 10.0, {"passkey": {1024: 0.95}}, 100)
    q = quality(report(["sila"], 11.0, {"passkey": {1024: 0.85, 2048: 0.5}}, 25), teacher, None, 10, 2048)
    assert q["perplexity_ratio"] == 1.1 and (q["cells"], q["cells_within"]) == (1, 1)  # 85 is exactly 10 under 95
    assert q["passkey"] == {1024: 85.0, 2048: 50.0} and q["kv_bytes_per_token"] == 25
    assert throughput(SPEED, "sila-2of4") == {"128x16384": 2.0} and throughput(SPEED, "sila-3of4") == {}
    point = {"depth": 0, "layers": 4, **q, "speed": {}}
    assert "| 0 of 4 | 4 | 11.00 (1.10x) | 1 of 1 | 85% | 50% | 25 (1.00x) |" in sweep_table([point], 10)
    short = {**point, "passkey": {512: 100.0, 1024: 85.0}}  # a CPU-size run's lengths: 512 is not "0K"
    assert (
        sweep_table([short], 10).splitlines()[0].endswith("| passkey 512 | passkey 1K | KV bytes/token (x teacher) |")
    )
    for bad in ("0,2", "x", ""):
        with pytest.raises(ValueError, match="--depths"):
            parse_depths(bad)
    assert parse_depths("22,15,22") == [15, 22]


def test_run_converts_at_each_depth_once_and_resumes(tmp_path, capsys):
    teacher = make_tiny_source("llama", tmp_path / "llama", num_hidden_layers=4)
    corpus = words_corpus(tmp_path / "corpus", documents=30, words_per_document=120)
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "a.txt").write_text(" ".join(f"word{i % 50} sentence." for i in range(3000)))
    recipe = {
        "source": "HuggingFaceTB/SmolLM2-135M-Instruct",  # the --src flag replaces it, as a user's run would
        "layers": [{"mixer": "sila", "layers": "auto:1"}],
        "mixer_settings": {"sila": {"conv_size": 2}},
        "layer_choice": {"window": 8, "samples": 2, "text_rows": 1, "seq_len": 96, "rounds": 1},
        "dtype": "float32",
        "data": {"seq_len": 32, "validation_fraction": 0.1},
        "align": {"steps": 2, "batch_size": 2},
        "train": {"steps": 2, "batch_size": 2, "eval_batches": 1},
        "evaluate": {
            "tasks": ["passkey"],
            "lengths": [300],
            "depths": [0.5],
            "samples": 1,
            "batch_size": 1,
            "ppl_lengths": [64],
            "ppl_windows": 2,
            "speed_lengths": [64],
            "speed_batches": [1],
            "pictures": False,
        },
        "export": None,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    root = tmp_path / "sweep"
    args = ["run", str(path), "--depths", "1,4", "--run-root", str(root), "--src", str(teacher), "--data", str(corpus)]
    args += ["--ppl-data", str(essays), "--set", f"evaluate.haystack_dir={essays}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| 1 of 4 | 3 |" in out and "| 4 of 4 | 0 |" in out and "no CUDA device" in out
    # perplexity at the recipe's own length (64), with no --ppl-length given
    assert re.search(r"\| 4 of 4 \| 0 \| [0-9.]+ \([0-9.]+x\) \|", out), out
    for depth, run in ((1, "auto1"), (4, "all4")):  # every layer: converted as named, no layer choice
        config = json.loads((root / run / "convert" / "model" / "config.json").read_text())
        assert sum(kind == "sila" for kind in config["layer_mixers"]) == depth
        assert ("layer_choice" in config) == (depth < 4)
    points = json.loads((root / "depth.json").read_text())["points"]
    assert [p["kv_bytes_per_token"] / points[0]["kv_bytes_per_token"] for p in points] == [1.0, 0.75, 0.0]
    stamps = {p: p.stat().st_mtime_ns for p in root.glob("*/*/DONE")}
    assert len(stamps) == 2 * 7 and main(args) == 0  # again: every stage found done, nothing run
    assert {p: p.stat().st_mtime_ns for p in root.glob("*/*/DONE")} == stamps
    deep = [*args[:3], "5", "--run-root", str(tmp_path / "deep"), *args[6:]]  # the teacher has 4 layers
    assert main(deep) == 2
    assert "--depths: 5 is more layers than the model's 4" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()
    with pytest.raises(SystemExit):
        main([*args[:3], "0", *args[4:]])
    assert "--depths: '0': each depth is a number of layers converted, at least 1" in capsys.readouterr().err
