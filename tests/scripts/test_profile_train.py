"""profile_train.py: a stage's steps under the profiler, through the recipe pipeline. Extend's profile skips align and
train before it, and shows the token weights its teacher computes for each batch as a phase of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from raven_convert.train.graphs import StepInputs
from tests.conftest import make_tiny_source
from tests.helpers import words_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from profile_train import main  # noqa: E402

RECIPE = {
    "source": "m",
    "layers": [{"mixer": "sila", "layers": "0,2"}],
    "dtype": "float32",
    "data": {"seq_len": 32, "validation_fraction": 0.1},
    "align": {"steps": 50, "batch_size": 2},
    "token_weights": {"enabled": True, "batch_size": 4},
    "train": {"steps": 50, "batch_size": 2, "trainable": "mixers+lora"},
    "extend": {"seq_len": 64, "steps": 50, "batch_size": 2, "trainable": "mixers+lora"},
    "export": None,
}


@pytest.mark.parametrize("in_place", [False, True], ids=["beside", "in-place"])
def test_extend_is_profiled_after_a_conversion_alone_with_its_token_weights_as_a_phase(
    tmp_path, capsys, monkeypatch, in_place
):
    teacher = make_tiny_source("llama", tmp_path / "llama", num_hidden_layers=4)
    corpus = words_corpus(tmp_path / "corpus", documents=30, words_per_document=120)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "out"
    args = [str(recipe), "--src", str(teacher), "--data", str(corpus), "--stage", "extend", "--out", str(out)]
    asked, made = [], StepInputs.__init__

    def recorded(self, *given, beside=True, **named):  # what the step's inputs were asked to do
        asked.append(beside)
        made(self, *given, beside=beside, **named)

    monkeypatch.setattr(StepInputs, "__init__", recorded)
    assert main([*args, "--warmup", "1", "--active", "2", "--timed", "3", *(["--inputs-in-place"] * in_place)]) == 0
    assert StepInputs.__init__ is recorded  # put back after the run
    # on CUDA extend's steps are graphed, their inputs made beside the step unless in place; elsewhere eager
    assert asked == ([not in_place] if torch.cuda.is_available() else [])

    result = json.loads((out / "profile-extend.json").read_text())
    assert result["inputs_in_place"] is in_place
    assert result["stage"] == "extend" and result["step_ms"] > 0 and result["profiled_step_ms"] > 0
    assert result["timed_steps"] == 2  # the first timed step's end starts the clock
    # on CUDA the student's step is a replayed graph, whose ranges ran only at its capture
    student = set() if torch.cuda.is_available() else {"train.student_forward", "train.backward"}
    assert {"train.token_weights", *student} <= set(result["phases"])
    run = out / "run-extend"
    done = {stage: json.loads((run / stage / "DONE").read_text()) for stage in ("align", "weights", "train", "extend")}
    assert all(done[stage].get("skipped") for stage in ("align", "weights", "train"))  # only extend's steps ran
    # warm-up, the profiler's own warm-up step, the recorded ones, the timed ones
    assert done["extend"]["steps"] == 1 + 1 + 2 + 3
    printed = capsys.readouterr().out
    assert "| train.token_weights |" in printed and "ms per step as the recipe runs it (2 steps" in printed


def test_timed_steps_below_two_are_refused_before_anything_runs(tmp_path, capsys):
    args = ["recipe.yaml", "--src", "m", "--data", "d", "--out", str(tmp_path / "out"), "--timed", "1"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert "--timed 1: must be >= 2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
