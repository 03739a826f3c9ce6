"""Reruns that must check before they change anything (issue 56): --redo refuses, deleting nothing, when a stage it
keeps no longer matches the recipe; a stage the recipe still turns off never goes stale; a damaged DONE marker is
named with the --redo that runs its stage again."""

import json

import pytest

from raven_convert.train.__main__ import main as train_main
from tests.convert.faults import one_line, prepare

pytestmark = pytest.mark.usefixtures("private_datasets_cache")
ALIGN = {"steps": 2, "batch_size": 2, "log_every": 1}
TRAIN = {"steps": 2, "batch_size": 2, "log_every": 1}


def _set(argv: list[str], *overrides: str) -> list[str]:
    return argv + [word for o in overrides for word in ("--set", o)]


def test_redo_checks_the_stages_it_keeps_before_deleting(converted, tmp_path, capsys):
    argv, run = prepare(converted, tmp_path, align=ALIGN, train=TRAIN)
    argv += ["--stages", "convert,align,weights,train"]
    assert train_main(argv) == 0
    assert json.loads((run / "weights" / "DONE").read_text())["skipped"] is True  # token weights are off
    # train.steps is among the weights stage's fields, but a stage the recipe still turns off computed nothing
    assert train_main(_set(argv, "train.steps=3") + ["--redo", "train"]) == 0
    assert json.loads((run / "train" / "DONE").read_text())["steps_this_run"] == 3
    capsys.readouterr()

    stamp = (run / "train" / "DONE").stat().st_mtime_ns
    changed = _set(argv, "train.steps=3", "align.lr=0.002")  # align, which --redo train keeps, no longer matches
    assert train_main(changed + ["--redo", "train"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: --redo train deleted nothing: stage 'align'") and "changed: align.lr" in line
    assert "--redo align" in line
    assert (run / "train" / "DONE").stat().st_mtime_ns == stamp and (run / "train" / "model").is_dir()
    assert train_main(changed + ["--redo", "align"]) == 0


def test_a_damaged_done_marker_names_the_file_and_the_redo(converted, tmp_path, capsys):
    argv, run = prepare(converted, tmp_path, align=ALIGN)
    argv += ["--stages", "convert,align"]
    assert train_main(argv) == 0
    marker = run / "align" / "DONE"
    marker.write_text(marker.read_text()[:40])  # truncated
    assert train_main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {marker} is damaged: not JSON (") and "rerun with --redo align" in line
    assert train_main(argv + ["--redo", "align"]) == 0
    assert "final_loss" in json.loads(marker.read_text())
