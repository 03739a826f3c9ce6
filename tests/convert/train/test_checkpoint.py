"""Checkpoints: align resumes exactly, a damaged checkpoint is skipped with a warning, only the newest N are kept,
and --redo does not silently delete what an unfinished stage would resume from."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.align import align
from raven_convert.train.checkpoint import latest_checkpoint, save_checkpoint
from raven_convert.train.data import PackedDataset, batch_iterator
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stage2 import train
from raven_convert.train.stage2_config import TrainConfig
from raven_convert.train.stages import run_recipe

SETTINGS = {"raven": {"num_slots": 8, "top_k": 2}, "sse": {"lora_rank": 4}, "sila": {}}
ALIGN = dict(steps=6, lr=3e-3, warmup_steps=2, log_every=0, save_every=2, keep_checkpoints=3)


def rows(n: int = 12, T: int = 16) -> PackedDataset:
    ids = torch.randint(3, 100, (n, T), generator=torch.Generator().manual_seed(0)).int()
    return PackedDataset(
        {"input_ids": ids, "document_ids": torch.zeros_like(ids), "position_ids": torch.arange(T).expand(n, T).int()}
    )


def from_step(first: int):
    return batch_iterator(rows(), 4, seed=3, start_step=first)  # 3 batches an epoch: the run crosses epochs


@pytest.fixture(scope="module")
def teacher(tiny_sources):
    return AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()


def hybrid(teacher):
    return build_hybrid(teacher, plan_layers([("raven", "0"), ("sse", "1"), ("sila", "2")], 4), SETTINGS)


@pytest.fixture(scope="module")
def uninterrupted(teacher, tmp_path_factory):
    model = hybrid(teacher)
    history = align(teacher, model, from_step, out_dir=tmp_path_factory.mktemp("whole"), **ALIGN)
    return model, history


def interrupted_at(teacher, out_dir: Path, step: int) -> None:
    """An align run killed while fetching the batch of (1-based) step `step + 1`."""

    def batches(first):
        for i, batch in enumerate(from_step(first)):
            if i == step:
                raise KeyboardInterrupt
            yield batch

    with pytest.raises(KeyboardInterrupt):
        align(teacher, hybrid(teacher), batches, out_dir=out_dir, **ALIGN)


def assert_same(a, b) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def steps_kept(out_dir: Path) -> list[str]:
    return sorted(p.name for p in (out_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def killed(teacher, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("killed")
    interrupted_at(teacher, out_dir, 5)
    return out_dir


def copy_of(killed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(killed, tmp_path / "align"))


def test_align_resumes_exactly(teacher, uninterrupted, killed, tmp_path, capsys):
    out_dir = copy_of(killed, tmp_path)
    assert steps_kept(out_dir) == ["step_2", "step_4"]
    resumed = hybrid(teacher)  # a fresh process: everything comes from the checkpoint
    batches = from_step(0)  # an iterable, not a function: align skips the steps already done
    history = align(teacher, resumed, batches, out_dir=out_dir, **ALIGN)
    assert f"[align] resumed from {out_dir / 'checkpoints' / 'step_4'} (step 4)" in capsys.readouterr().err
    assert_same(uninterrupted[0], resumed)
    assert [r["step"] for r in history] == list(range(6))
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in uninterrupted[1]], rel=1e-6)
    assert steps_kept(out_dir) == ["step_2", "step_4", "step_6"]


def damage(folder: Path, how: str) -> None:
    if how == "truncate weights":
        (folder / "mixers.safetensors").write_bytes((folder / "mixers.safetensors").read_bytes()[:1000])
    elif how == "corrupt optimizer":
        data = bytearray((folder / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / "optimizer.pt").write_bytes(bytes(data))
    else:
        name = "checkpoint.json" if how == "truncate json" else "manifest.json"
        (folder / name).write_text((folder / name).read_text()[:10])


@pytest.mark.parametrize(
    "how, problem",
    [
        ("truncate weights", "mixers.safetensors has 1,000 bytes, the manifest says"),
        ("corrupt optimizer", "optimizer.pt does not match its sha256 in the manifest (damaged)"),
        ("truncate json", "checkpoint.json has 10 bytes, the manifest says"),
        ("truncate manifest", "manifest.json is not readable JSON"),
    ],
)
def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_it(how, problem, killed, tmp_path):
    out_dir = copy_of(killed, tmp_path)
    latest = out_dir / "checkpoints" / "step_4"
    damage(latest, how)
    warnings = []
    path, meta = latest_checkpoint(out_dir, warn=warnings.append)
    assert path == out_dir / "checkpoints" / "step_2" and meta["step"] == 2
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping damaged checkpoint {latest}: {problem}")


def test_align_resumes_exactly_from_the_checkpoint_before_a_damaged_one(
    teacher, uninterrupted, killed, tmp_path, capsys
):
    out_dir = copy_of(killed, tmp_path)
    damage(out_dir / "checkpoints" / "step_4", "truncate weights")
    resumed = hybrid(teacher)
    align(teacher, resumed, from_step, out_dir=out_dir, **ALIGN)
    err = capsys.readouterr().err
    assert f"[align] warning: skipping damaged checkpoint {out_dir / 'checkpoints' / 'step_4'}: mixers" in err
    assert f"resumed from {out_dir / 'checkpoints' / 'step_2'} (step 2)" in err
    assert_same(uninterrupted[0], resumed)
    assert steps_kept(out_dir) == ["step_2", "step_4", "step_6"]  # the damaged step_4 was written again
    assert latest_checkpoint(out_dir)[1]["step"] == 6


def fake(folder: Path) -> None:
    (folder / "weights.bin").write_bytes(b"w" * 100)


def test_checkpoints_are_pruned_verified_and_never_half_written(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, fake, {"step": step}, keep=2)
    assert steps_kept(tmp_path) == ["step_3", "step_4"]
    manifest = json.loads((tmp_path / "checkpoints" / "step_4" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"weights.bin", "checkpoint.json"}
    assert manifest["files"]["weights.bin"]["size"] == 100

    def broken(folder: Path) -> None:
        fake(folder)
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, 5, broken, {"step": 5}, keep=2)
    assert steps_kept(tmp_path) == ["step_3", "step_4"]  # no step_5, no temporary

    (tmp_path / "checkpoints" / "step_4" / "manifest.json").unlink()  # as if written by a run killed mid-save
    warnings = []
    assert latest_checkpoint(tmp_path, warn=warnings.append)[1] == {"step": 3}
    assert warnings == [
        f"warning: skipping damaged checkpoint {tmp_path / 'checkpoints' / 'step_4'}: manifest.json is missing "
        "(the checkpoint was not finished); trying the one before it"
    ]
    save_checkpoint(tmp_path, 4, fake, {"step": 4}, keep=1)  # a resumed run supersedes it
    assert steps_kept(tmp_path) == ["step_4"] and latest_checkpoint(tmp_path)[1] == {"step": 4}


def test_train_keeps_only_the_newest_checkpoints(teacher, tmp_path):
    config = TrainConfig(steps=3, batch_size=4, save_every=1, keep_checkpoints=2, log_every=0)
    train(hybrid(teacher), None, rows(), config, tmp_path)
    assert steps_kept(tmp_path) == ["step_2", "step_3"]
    assert latest_checkpoint(tmp_path)[1]["step"] == 3


def recipe(**sections):
    return parse_recipe(
        {"source": "src", "layers": [{"mixer": "sila", "layers": "1"}], "data": {"source": "data.jsonl"}, **sections}
    )


@pytest.mark.parametrize(
    "field, value", [("save_every", 0), ("keep_checkpoints", 0), ("keep_checkpoints", 1.5), ("save_every", "often")]
)
def test_checkpoint_fields_are_validated(field, value):
    for stage in ("align", "train"):
        with pytest.raises(ValueError, match=rf"{stage}\.{field}: .*\(got {value!r}\)"):
            recipe(**{stage: {field: value}})


def test_redo_keeps_the_checkpoints_of_an_unfinished_stage_unless_told(tmp_path, capsys):
    run = tmp_path / "run"
    save_checkpoint(run / "train", 300, fake, {"step": 300}, keep=2)
    with pytest.raises(ValueError) as err:
        run_recipe(recipe(), run, stages=["train"], redo="train")
    checkpoint = run / "train" / "checkpoints" / "step_300"
    assert str(err.value) == (
        f"--redo train would delete the checkpoint {checkpoint} (step 300) of the unfinished train stage, which a "
        "rerun without --redo resumes from; rerun without --redo to resume, or add --discard-checkpoints to delete "
        "it and start over"
    )
    assert checkpoint.is_dir()
    (run / "align").mkdir()
    save_checkpoint(run / "align", 5, fake, {"step": 5}, keep=2)
    (run / "align" / "DONE").write_text("{}")  # a finished stage's checkpoints go without asking
    with pytest.raises(ValueError, match="needs the outputs of stage 'convert'"):
        run_recipe(recipe(), run, stages=["train"], redo="align", discard_checkpoints=True)
    assert not (run / "train").exists() and not (run / "align").exists()
    err = capsys.readouterr().err
    assert f"[align] --redo align: deleting {run / 'align'}\n" in err
    assert f"[train] --redo align: deleting {run / 'train'}, with checkpoint {checkpoint} (step 300)" in err


def test_bookkeeping_fields_leave_the_results_valid():
    from raven_convert.train.run_state import fingerprints

    before = fingerprints(recipe())
    assert fingerprints(recipe(align={"save_every": 7, "keep_checkpoints": 5, "log_every": 1})) == before
    assert fingerprints(recipe(align={"compile": False}, token_weights={"kernel": "eager"})) == before
    assert fingerprints(recipe(align={"lr": 0.5}))["align"] != before["align"]


def test_discard_checkpoints_needs_redo(tmp_path, capsys):
    from raven_convert.train.__main__ import main

    with pytest.raises(SystemExit) as exit_code:
        main(["recipe.yaml", "--run-dir", str(tmp_path), "--discard-checkpoints"])
    assert exit_code.value.code == 2
    assert "--discard-checkpoints only applies with --redo STAGE" in capsys.readouterr().err


def test_checkpoint_files_get_the_umasks_modes(tmp_path):
    def private(folder: Path) -> None:  # as safetensors 0.8's save_file writes: 0600
        (folder / "weights.bin").write_bytes(b"w")
        (folder / "weights.bin").chmod(0o600)

    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, 1, private, {"step": 1}, keep=2)
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()} == {
        name: 0o644 for name in ("weights.bin", "checkpoint.json", "manifest.json")
    }
    assert path.stat().st_mode & 0o777 == 0o755
