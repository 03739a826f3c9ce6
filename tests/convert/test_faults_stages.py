"""Faults in a pipeline run: every long stage killed midway resumes to the result of an uninterrupted run, a
diverging step keeps the last good checkpoint, Ctrl-C says what was saved and how to resume (under torchrun, as
accelerate launch runs several processes, from one process only), two runs with one seed agree whatever the process
drew before, and a finished run keeps one copy of each model and no checkpoint.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import raven_convert.evaluate.report
import raven_convert.train.align
import raven_convert.train.stage2
import raven_convert.train.token_weights
from raven_convert.console import eta
from raven_convert.train.__main__ import main as train_main
from raven_convert.train.recipe import STAGES, parse_recipe
from raven_convert.train.stages import run_recipe
from tests.convert.faults import checkpoints, fail_at, interrupt, left_behind, one_line, prepare, recipe_data
from tests.helpers import corpus, read_weights

pytestmark = pytest.mark.usefixtures("private_datasets_cache")
TRAIN = {"steps": 4, "batch_size": 2, "save_every": 2, "log_every": 1, "lr": 1e-3}


def test_non_finite_train_loss_stops_and_keeps_the_last_good_checkpoint(converted, tmp_path, monkeypatch, capsys):
    argv, run = prepare(converted, tmp_path, train=TRAIN)
    fail_at(monkeypatch, raven_convert.train.stage2, "ce_loss", 3, lambda loss: loss * float("nan"))
    assert train_main(argv) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: the train stage stopped: loss not finite at step 3 (ce); nothing applied;")
    assert f"last good checkpoint {run / 'train' / 'checkpoints' / 'step_2'} is kept" in line
    assert "resumes after step 2" in line and "--set train.lr=" in line
    assert checkpoints(run, "train") == ["step_2"]  # no step 3, no half-written temporary
    dcp_to_torch_save(run / "train" / "checkpoints" / "step_2", tmp_path / "step_2.pt")  # a sharded checkpoint
    weights = torch.load(tmp_path / "step_2.pt", weights_only=True)["model"]
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    assert not (run / "train" / "DONE").exists() and not (run / "train" / "model").exists()

    monkeypatch.undo()  # the fault is gone: the rerun resumes and finishes
    assert train_main(argv) == 0
    assert "resumed from" in capsys.readouterr().err
    assert json.loads((run / "train" / "DONE").read_text())["steps_this_run"] == 2


def test_non_finite_align_loss_stops_and_writes_nothing(converted, tmp_path, monkeypatch, capsys):
    argv, run = prepare(converted, tmp_path, align={"steps": 3, "batch_size": 2, "log_every": 1})
    stamp = (run / "convert" / "DONE").stat().st_mtime_ns
    nan = lambda losses: {i: v * float("nan") for i, v in losses.items()}  # noqa: E731
    fail_at(monkeypatch, raven_convert.train.align, "alignment_losses", 2, nan, counted=torch.is_grad_enabled)
    assert train_main(argv) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: the align stage stopped: alignment loss is not finite at step 2 in layer(s) [1];")
    assert "nothing of the align stage was saved, a rerun starts it afresh" in line
    assert sorted(p.name for p in (run / "align").iterdir()) == []
    assert (run / "convert" / "DONE").stat().st_mtime_ns == stamp


# stage: (module, function, its call to interrupt, recipe sections, output file, the step the kill falls back to)
KILLED = {
    "align": (raven_convert.train.align, "alignment_losses", 3, {"align": TRAIN}, "model", 2),
    "weights": (  # the 36 rows 9 train steps of 4 read, in 9 batches of 4, checkpoints every 2: killed in batch 5
        raven_convert.train.token_weights,
        "token_weights",
        5,
        {
            "token_weights": {"enabled": True, "batch_size": 4, "save_every": 2},
            "train": TRAIN | {"steps": 9, "batch_size": 4},
        },
        "weights.pt",
        4,
    ),
    "train": (raven_convert.train.stage2, "ce_loss", 3, {"train": TRAIN}, "model", 2),
    "extend": (
        raven_convert.train.stage2,
        "ce_loss",
        3,
        {"extend": TRAIN | {"seq_len": 48}},
        "model",
        2,
    ),
}


def outputs(path: Path) -> dict[str, torch.Tensor]:
    return read_weights(path) if path.is_dir() else {"weights": torch.load(path, weights_only=True)}


@pytest.mark.parametrize("stage", list(KILLED))
def test_a_stage_killed_midway_resumes_to_the_same_result(stage, converted, tmp_path, monkeypatch, capsys):
    module, function, call, sections, output, step = KILLED[stage]
    stages = ["--stages", "align,weights,train,extend"]
    argv, whole = prepare(converted, tmp_path / "whole", **sections)
    assert train_main([*argv, *stages]) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if "ETA" in line or line.endswith("| done")]
    assert progress and not [line for line in progress if re.search(r"ETA 0+(m0+)?s", line)]
    argv, run = prepare(converted, tmp_path / "killed", **sections)

    fail_at(monkeypatch, module, function, call, interrupt, counted=torch.is_grad_enabled)
    assert train_main([*argv, *stages]) == 130
    kept = run / stage / "checkpoints" / f"step_{step}"
    assert f"the {stage} stage's last good checkpoint {kept} is kept, a rerun resumes after step {step}" in one_line(
        capsys.readouterr().err
    )
    assert checkpoints(run, stage)[-1] == f"step_{step}" and not left_behind(run)
    monkeypatch.undo()
    assert train_main([*argv, *stages]) == 0
    assert f"resumed from {kept} (step {step}" in capsys.readouterr().err
    expected, result = outputs(whole / stage / output), outputs(run / stage / output)
    assert set(result) == set(expected)
    for name, value in expected.items():
        if stage == "weights":  # NaN for the rows train never reads
            torch.testing.assert_close(result[name], value, rtol=0, atol=0, equal_nan=True)
            assert value.isnan().any(dim=1).sum() == len(value) - 36
        else:
            torch.testing.assert_close(result[name], value, rtol=0, atol=1e-6, msg=name)
    assert checkpoints(run, stage) == [] and not left_behind(run)  # a finished stage keeps no checkpoint


EVALUATE = {
    "tasks": ["passkey"],
    "variants": ["standard", "no_inst"],
    "lengths": [300],
    "depths": [0.5],
    "samples": 1,
    "batch_size": 1,
    "pictures": False,
}


def test_evaluate_killed_midway_keeps_the_parts_it_finished(converted, tmp_path, monkeypatch, capsys):
    stages = ["--stages", "align,weights,train,extend,evaluate"]
    argv, whole = prepare(converted, tmp_path / "whole", evaluate=EVALUATE)
    assert train_main([*argv, *stages]) == 0
    argv, run = prepare(converted, tmp_path / "killed", evaluate=EVALUATE)
    fail_at(monkeypatch, raven_convert.evaluate.report, "run_retrieval", 2, interrupt)  # in the second part
    assert train_main([*argv, *stages]) == 130
    report = run / "evaluate" / "report.json"
    line = one_line(capsys.readouterr().err)
    assert f"the evaluate stage's finished parts (retrieval passkey (standard)) are kept in {report}" in line
    monkeypatch.undo()

    ran, original = [], raven_convert.evaluate.report.run_retrieval

    def spy(model, tokenizer, samples, **kwargs):
        ran.append(samples[0].variant)
        return original(model, tokenizer, samples, **kwargs)

    monkeypatch.setattr(raven_convert.evaluate.report, "run_retrieval", spy)
    assert train_main([*argv, *stages]) == 0
    assert ran == ["no_inst"] and "resuming: retrieval passkey (standard) done already" in capsys.readouterr().err
    expected, result = json.loads((whole / "evaluate" / "report.json").read_text()), json.loads(report.read_text())
    assert result["retrieval"] == expected["retrieval"] and result["finished"] == expected["finished"]
    assert (run / "evaluate" / "DONE").is_file() and not left_behind(run)


def test_ctrl_c_in_training_says_what_was_saved_and_how_to_resume(converted, tmp_path, monkeypatch, capsys):
    argv, run = prepare(converted, tmp_path, train=TRAIN)
    fail_at(monkeypatch, raven_convert.train.stage2, "ce_loss", 3, interrupt)
    assert train_main([*argv, "--redo", "train", "--set", "train.log_every=2"]) == 130
    line = one_line(capsys.readouterr().err)
    resume = shlex.join(["python", "-m", "raven_convert.train", *argv, "--set", "train.log_every=2"])
    assert line == (
        f"interrupted: stages done in {run}: convert, align, weights; the train stage's last good checkpoint "
        f"{run / 'train' / 'checkpoints' / 'step_2'} is kept, a rerun resumes after step 2. To resume: {resume}"
    )
    assert checkpoints(run, "train") == ["step_2"]

    monkeypatch.undo()
    assert train_main(shlex.split(resume)[3:]) == 0  # the printed command, without --redo, continues the run
    assert "resumed from" in capsys.readouterr().err
    assert json.loads((run / "train" / "DONE").read_text())["steps_this_run"] == 2


def test_ctrl_c_under_torchrun_is_reported_by_one_process(converted, tmp_path):
    argv, run = prepare(converted, tmp_path, train=TRAIN | {"steps": 1000, "save_every": 1000})
    assert train_main([*argv, "--stages", "align,weights"]) == 0  # the stages a launch leaves to one process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={port}"]
    paths = os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"PYTHONPATH": paths, "PYTHONUNBUFFERED": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        launch = subprocess.Popen(
            [*launcher, "-m", "raven_convert.train", *argv, "--stages", "train"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while log.read_text().count("[train] starting") < 2 or "step 3/" not in log.read_text():
            assert launch.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(launch.pid, signal.SIGINT)  # what Ctrl-C does in a terminal: every process gets it
        launch.wait(timeout=120)
    said = [line for line in log.read_text().splitlines() if "interrupted:" in line]
    assert len(said) == 1 and said[0].startswith(f"interrupted: stages done in {run}: convert"), log.read_text()


SECOND_CTRL_C = """
import os, signal, sys, time
from raven_convert.console import interrupted, reporting_interrupt
before = signal.getsignal(signal.SIGINT)
def saved_so_far():
    os.kill(os.getpid(), signal.SIGINT)  # the launcher's SIGINT, arriving while the report is made
    time.sleep(0.05)
    return "stages done in RUN: convert"
try:
    raise KeyboardInterrupt  # the first Ctrl-C
except KeyboardInterrupt:
    with reporting_interrupt():
        status = interrupted(saved_so_far(), "RESUME")
print(status, signal.getsignal(signal.SIGINT) is before)
"""


def test_a_second_ctrl_c_while_the_first_is_reported_does_not_break_the_report():
    """torchrun sends its workers a second SIGINT as it stops them (under load the torchrun test above saw it break
    into the report with a traceback): while one Ctrl-C is reported, another is ignored, and the handler is back
    afterwards. In a fresh interpreter, so that a regression fails this test, not the test process."""
    result = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "interrupted: stages done in RUN: convert. To resume: RESUME\n"
    assert result.stdout == "130 True\n"


def test_an_eta_never_reads_zero_seconds():
    shown = [eta(s) for s in (0, 1e-4, 0.49, 0.51, 59.6, 61, 3725, float("nan"))]
    assert shown == ["done", "ETA <1s", "ETA <1s", "ETA <1s", "ETA 1m00s", "ETA 1m01s", "ETA 1h02m05s", "ETA ?"]


# ---- two runs of one recipe from scratch, each stage after a different use of torch's global generator

SEEDED = {  # Raven's router noise, LoRA's initial weights and the data order all draw random numbers
    "dtype": "bfloat16",
    "align": TRAIN,
    "token_weights": {"enabled": True, "batch_size": 16},
    "train": TRAIN | {"trainable": "mixers+lora", "lora_rank": 2},
    "export": {},
}


@pytest.fixture(scope="module")
def two_runs(tiny_sources, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("seeded")
    recipe = parse_recipe(recipe_data(tiny_sources["llama"], corpus(root / "corpus"), **SEEDED))
    runs = [root / "first", root / "second"]
    for i, run in enumerate(runs):
        for j, stages in enumerate([["convert", "align", "weights"], ["train", "extend", "evaluate", "export"]]):
            torch.manual_seed(100 * i + j)  # whatever the process drew before must not matter
            run_recipe(recipe, run, stages=stages)
    return runs


def test_two_cpu_runs_with_one_seed_give_the_same_model(two_runs):
    for output in ("convert/model", "align/model", "model"):
        first, second = (read_weights(run / output) for run in two_runs)
        assert set(first) == set(second)
        assert all(torch.equal(first[name], second[name]) for name in first), output
    first, second = (torch.load(run / "weights" / "weights.pt", weights_only=True) for run in two_runs)
    torch.testing.assert_close(first, second, rtol=0, atol=0, equal_nan=True)  # NaN: rows train never reads


def test_a_finished_run_keeps_one_copy_of_each_model_and_no_checkpoint(two_runs):
    run = two_runs[0]
    assert not list(run.rglob("checkpoints")) and not left_behind(run)
    exported = sorted((run / "model").glob("*.safetensors"))
    assert [f.name for f in exported] == ["model-base.safetensors", "model-mixers.safetensors"]
    for file in exported:
        assert file.samefile(run / "train" / "model" / file.name)  # a hard link: no second copy
        with safe_open(file, "pt") as f:  # in the recipe's dtype
            assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert (run / "align" / "model" / "model-base.safetensors").samefile(run / "convert" / "model" / exported[0].name)
    weights = {(f.stat().st_dev, f.stat().st_ino) for f in run.rglob("*.safetensors")}
    assert len(weights) == 5  # convert's 2 files, align's mixers (the rest linked), train's 2 (LoRA merged in)
    done = {stage: json.loads((run / stage / "DONE").read_text()) for stage in STAGES}
    unlinked = [f for f in (run / "model").rglob("*") if f.is_file() and f.suffix != ".safetensors"]
    assert done["export"]["disk_bytes"] == sum(f.stat().st_size for f in unlinked)  # code, config and tokenizer
    bookkeeping = {run / "recipe.json", *(run / stage / "DONE" for stage in STAGES)}
    files = {(f.stat().st_dev, f.stat().st_ino): f.stat().st_size for f in run.rglob("*") if f.is_file()}
    files = {k: v for k, v in files.items() if k not in {(f.stat().st_dev, f.stat().st_ino) for f in bookkeeping}}
    cache = sum(f.stat().st_size for f in (run / "cache").rglob("*") if f.is_file())
    assert sum(d["disk_bytes"] for d in done.values()) == sum(files.values()) - cache
