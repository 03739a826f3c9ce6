"""memory_plan.py: its report is written after every run, with each stage's host peak and its anonymous and mapped
parts, and a second invocation keeps the runs already measured (a device job cut short loses only the run it was
in)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from memory_plan import earlier_runs, save  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "memory_plan.py"


def plan(out: Path, *args: str) -> str:
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout


def test_a_second_invocation_measures_only_the_runs_the_report_lacks(tmp_path):
    plan(tmp_path, "--processes", "1", "--strategy", "ddp")
    first = json.loads((tmp_path / "memory_plan.json").read_text())
    assert [(r["strategy"], r["processes"]) for r in first["runs"]] == [("-", 1), ("one process", 1)]

    out = plan(tmp_path, "--processes", "1,2", "--strategy", "ddp")
    assert "ddp-1: measured before" in out and "--nproc_per_node 1 " not in out and "--nproc_per_node 2 " in out
    second = json.loads((tmp_path / "memory_plan.json").read_text())
    assert second["runs"][:2] == first["runs"]  # kept as measured, the conversion's row too
    two = second["runs"][2]
    assert (two["strategy"], two["processes"], len(two["ranks"])) == ("ddp", 2, 2) and "failed" not in two
    assert two["tokens_per_second"]["align"] > 0 and "| 2 x ddp |" in out
    ratios = next(line for line in out.splitlines() if line.startswith("| host peak, x the model"))
    model = sum(f.stat().st_size for f in (tmp_path / "teacher-tiny").glob("*.safetensors")) / 2**30
    largest = max(v["host"] for v in [first["runs"][0]["stages"]["convert"], *two["stages"].values()])
    assert ratios.split(" | ")[-1].rstrip(" |") == f"{largest / model:.2f}x"  # the 2-process run's column
    for stage in ("align", "weights", "train"):  # the anonymous and mapped parts of the peak, sampled, are parts of it
        for part in ("host_anon", "host_file"):
            assert 0 < two["stages"][stage][part] <= two["stages"][stage]["host"], (stage, part)
        for rank in two["ranks"]:  # the code each part grew in: frames of the project's ("-": none running)
            for part, grew in (("host_anon", rank[stage]["grew_anon"]), ("host_file", rank[stage]["grew"])):
                assert len(grew) <= 3 and all(w == "-" or w.split(":")[0].endswith(".py") for w in grew), grew
                assert sum(grew.values()) <= rank[stage][part]
            assert rank[stage]["grew"] or stage != "align"  # align maps the teacher's file: its mapped part rises
    held, mapped = (line for line in out.splitlines() if line.startswith("- 2 x ddp: "))  # the held part's line first
    for line, part, after in ((held, "host_anon", ";"), (mapped, "host_file", " (")):  # the files with the mapped
        largest = max((rank[stage][part], stage) for rank in two["ranks"] for stage in rank)
        assert f"{largest[0]:.2f} GiB" in line and f" in {largest[1]}{after}" in line, (line, largest)

    out = plan(tmp_path, "--processes", "1", "--strategy", "ddp")  # a run not named this time stays in the report
    assert "--nproc_per_node" not in out and "| 2 x ddp |" in out
    assert json.loads((tmp_path / "memory_plan.json").read_text())["runs"] == second["runs"]


def test_a_report_of_another_model_or_step_count_is_measured_again(tmp_path, capsys):
    report = tmp_path / "memory_plan.json"
    assert earlier_runs(report, {"model": "tiny", "steps": 3}) == []
    runs = [{"strategy": "-", "processes": 1, "stages": {}}]
    save(report, {"model": "tiny", "steps": 3}, runs)
    assert earlier_runs(report, {"model": "tiny", "steps": 3}) == runs
    assert earlier_runs(report, {"model": "tiny", "steps": 6}) == []
    assert "measuring every run again" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["memory_plan.json"]  # no temporary file left beside it


def test_the_listing_of_mapped_files_that_found_most_is_kept(monkeypatch):
    """smaps is read after the sample that raised the peak: a listing read once the file was unmapped (the teacher's
    host tensors freed after moving to the GPU, round 26) must not replace the one that found it."""
    import threading

    import memory_plan

    samples = iter([1.0, 10.0, 10.5])  # RssFile GiB: the teacher's file read in, then gone by the second smaps
    teacher = {"/x/teacher.safetensors": 9.8, "/x/a": 0.1, "/x/b": 0.05, "/x/c": 0.01}
    listings = iter([teacher, {"/dev/nvidiactl": 0.07}])
    done = threading.Event()

    def status(field):
        if field == "RssAnon":
            return 1.0
        value = next(samples, None)
        if value is None:
            done.set()
            return 0.5
        return value

    monkeypatch.setattr(memory_plan, "status_gib", status)
    monkeypatch.setattr(memory_plan, "mapped_files_gib", lambda: next(listings))
    with memory_plan.HostPeak(interval=0.001) as host:
        done.wait(5)
    record = host.record()
    assert record["host_file"] == 10.5
    assert record["files"] == {"/x/teacher.safetensors": 9.8, "/x/a": 0.1, "/x/b": 0.05}
