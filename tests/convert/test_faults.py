"""Bad inputs and faults: each is refused or survived with one clear line, and nothing is lost or left behind.

Non-finite numbers in every float setting (mixer settings, recipe fields, CLI flags), a diverging training step,
align and train stages killed midway and resumed, bad data files found before the first stage, damaged GGUF
sources, the `raven-convert` name, and Ctrl-C during a pipeline run.
"""

import builtins
import dataclasses
import errno
import gzip
import json
import os
import shlex
import shutil
import typing
from pathlib import Path

import pytest
import tomllib
import torch
import yaml
from pydantic import BaseModel
from safetensors.torch import load_file

import convert.export
import convert.files
import convert.train.align
import convert.train.stage2
from convert.cli import main as convert_main
from convert.sources import Source
from convert.train import data as train_data
from convert.train.__main__ import main as train_main
from convert.train.recipe import Recipe, parse_recipe
from convert.train.stages import run_recipe
from raven_layers import get_mixer, registered_mixers
from tests.conftest import tiny_tokenizer
from tests.helpers import corpus

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"source": "Qwen/Qwen3-0.6B", "layers": [{"mixer": "raven", "layers": "0"}], "data": {"source": "x"}}
BAD_FLOATS = [float("inf"), float("-inf"), float("nan")]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """datasets leaves lock files in its cache: keep them out of ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def one_line(text: str) -> str:
    """The single line a user error prints (no traceback)."""
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "nothing was printed"
    return lines[-1]


# ---- non-finite numbers


def float_settings() -> list[tuple[str, str]]:
    found = [
        (spec.name, f.name)
        for spec in registered_mixers()
        for f in dataclasses.fields(spec.settings)
        if isinstance(f.default, float)
    ]
    assert ("raven", "alpha") in found and len(found) >= 3
    return found


@pytest.mark.parametrize("mixer, name", float_settings())
@pytest.mark.parametrize("bad", BAD_FLOATS, ids=str)
def test_every_float_mixer_setting_refuses_non_finite(mixer, name, bad):
    with pytest.raises(ValueError) as info:
        get_mixer(mixer).settings.from_dict({name: bad})
    assert f"{mixer}.{name} = {bad!r} is not allowed (not a finite number); expected a number" in str(info.value)


@pytest.mark.parametrize("mixer, name", float_settings())
@pytest.mark.parametrize("text", ["inf", "-Infinity", "nan"])
def test_every_float_flag_refuses_non_finite(mixer, name, text, tmp_path, capsys):
    flag = f"--{mixer}-{name.replace('_', '-')}"
    with pytest.raises(SystemExit) as info:
        convert_main(["--layers", "0", "--out", str(tmp_path / "o"), f"{flag}={text}"])
    assert info.value.code == 2
    assert f"argument {flag}: expected a finite number, got '{text}'" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def recipe_float_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted path, is a list) of every float field of the recipe schema, nested sections included."""
    found = []
    for name, info in model.model_fields.items():
        if typing.get_origin(info.annotation) is list:
            if float in typing.get_args(info.annotation):
                found.append((prefix + name, True))
            continue
        kinds = typing.get_args(info.annotation) or (info.annotation,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += recipe_float_fields(kind, f"{prefix}{name}.")
        if float in kinds:
            found.append((prefix + name, False))
    return found


REQUIRED = {"extend": {"seq_len": 64, "steps": 1}, "data": {"source": "x"}, "export": {"dir": "x"}}


def test_every_float_recipe_field_refuses_non_finite():
    fields = recipe_float_fields()
    assert {"align.lr", "train.lr", "token_weights.lam", "extend.kd_weight", "evaluate.depths"} <= {
        f for f, _ in fields
    }
    for path, is_list in fields:
        section, name = path.split(".")
        for bad in BAD_FLOATS:
            data = MINIMAL | {section: REQUIRED.get(section, {}) | {name: [bad] if is_list else bad}}
            with pytest.raises(ValueError) as info:
                parse_recipe(data)
            line = [x for x in str(info.value).splitlines() if x.startswith(path)]
            assert line and "finite number" in line[0] and repr(bad) in line[0], (path, str(info.value))


def test_non_finite_mixer_setting_and_override_in_a_recipe(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"raven\.alpha = inf is not allowed \(not a finite number\)"):
        parse_recipe(MINIMAL | {"mixer_settings": {"raven": {"alpha": float("inf")}}})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    assert train_main([str(path), "--run-dir", str(tmp_path / "run"), "--set", "train.lr=.nan"]) == 2
    assert "train.lr: Input should be a finite number (got nan)" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


# ---- a tiny pipeline: convert once, then each fault test works on a copy


def recipe_data(source: Path, data: Path, **sections) -> dict:
    return {
        "source": str(source),
        "layers": [{"mixer": "raven", "layers": "1"}],
        "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
        "dtype": "float32",
        "data": {"source": str(data), "seq_len": 32, "validation_fraction": 0.1},
        **sections,
    }


@pytest.fixture(scope="module")
def converted(tiny_sources, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("converted")
    data = corpus(root / "corpus")
    run_recipe(parse_recipe(recipe_data(tiny_sources["llama"], data)), root / "run", stages=["convert"])
    return {"source": tiny_sources["llama"], "data": data, "run": root / "run"}


def prepare(converted, tmp_path, **sections) -> tuple[list[str], Path]:
    """A copy of the converted run and a recipe file with `sections`: (argv of convert.train, run dir)."""
    run = tmp_path / "run"
    shutil.copytree(converted["run"], run)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_data(converted["source"], converted["data"], **sections)))
    return [str(path), "--run-dir", str(run)], run


def fail_at(monkeypatch, module, name: str, call: int, make, counted=lambda: True):
    """Replace module.name so that its `call`-th counted call returns make(result) (or raises what make raises)."""
    original, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        result = original(*args, **kwargs)
        if counted():
            calls.append(1)
            if len(calls) == call:
                return make(result)
        return result

    monkeypatch.setattr(module, name, patched)


TRAIN = {"steps": 4, "batch_size": 2, "save_every": 2, "log_every": 1, "lr": 1e-3}


def checkpoints(run: Path, stage: str) -> list[str]:
    folder = run / stage / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_non_finite_train_loss_stops_and_keeps_the_last_good_checkpoint(converted, tmp_path, monkeypatch, capsys):
    argv, run = prepare(converted, tmp_path, train=TRAIN)
    fail_at(monkeypatch, convert.train.stage2, "ce_loss", 3, lambda loss: loss * float("nan"))
    assert train_main(argv) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: the train stage stopped: loss not finite at step 3 (ce); nothing applied;")
    assert f"last good checkpoint {run / 'train' / 'checkpoints' / 'step_2'} is kept" in line
    assert "resumes after step 2" in line and "--set train.lr=" in line
    assert checkpoints(run, "train") == ["step_2"]  # no step 3, no half-written temporary
    weights = load_file(run / "train" / "checkpoints" / "step_2" / "model.safetensors")
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
    fail_at(monkeypatch, convert.train.align, "alignment_losses", 2, nan, counted=torch.is_grad_enabled)
    assert train_main(argv) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: the align stage stopped: alignment loss is not finite at step 2 in layer(s) [1];")
    assert "nothing of the align stage was saved, a rerun starts it afresh" in line
    assert sorted(p.name for p in (run / "align").iterdir()) == []
    assert (run / "convert" / "DONE").stat().st_mtime_ns == stamp


KILLED = {
    "align": (convert.train.align, "alignment_losses", {"steps": 4, "batch_size": 2, "save_every": 2, "log_every": 1}),
    "train": (convert.train.stage2, "ce_loss", TRAIN),
}


@pytest.mark.parametrize("stage", list(KILLED))
def test_a_stage_killed_midway_resumes_to_the_same_model(stage, converted, tmp_path, monkeypatch, capsys):
    module, function, settings = KILLED[stage]
    stages = ["--stages", "align,weights,train"]
    argv, whole = prepare(converted, tmp_path / "whole", **{stage: settings})
    assert train_main([*argv, *stages]) == 0
    argv, run = prepare(converted, tmp_path / "killed", **{stage: settings})

    def interrupt(result):
        raise KeyboardInterrupt

    fail_at(monkeypatch, module, function, 3, interrupt, counted=torch.is_grad_enabled)  # in step 3 of 4
    assert train_main([*argv, *stages]) == 130
    kept = run / stage / "checkpoints" / "step_2"
    assert f"the {stage} stage's last good checkpoint {kept} is kept, a rerun resumes after step 2" in one_line(
        capsys.readouterr().err
    )
    monkeypatch.undo()
    assert train_main([*argv, *stages]) == 0
    assert f"resumed from {kept} (step 2" in capsys.readouterr().err
    expected = load_file(whole / stage / "model" / "model.safetensors")
    weights = load_file(run / stage / "model" / "model.safetensors")
    assert set(weights) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)


# ---- data problems, found before any model is loaded


def write_gz(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def texts(n: int, missing: int) -> list[dict]:
    return [{"body": f"no text {i}"} if i < missing else {"text": f"document {i}"} for i in range(n)]


DAMAGED = "the file is damaged, truncated or not in the format its extension says"


def bad_data(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A bad data file of `kind` and the message it must produce."""
    if kind == "empty":
        (path := tmp_path / "empty.jsonl").write_text("")
        return path, f"data.source {path}: the file is empty; expected records with a 'text' field"
    if kind == "not gzip":
        (path := tmp_path / "docs.jsonl.gz").write_text('{"text": "plain json, misnamed"}\n')
        return path, f"data.source {path}: cannot read it, {DAMAGED} (BadGzipFile: Not a gzipped file"
    if kind == "truncated gzip":
        whole = write_gz(tmp_path / "whole.jsonl.gz", texts(200, 0)).read_bytes()
        (path := tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
        return path, f"data.source {path}: cannot read it, {DAMAGED} (EOFError: Compressed file ended"
    if kind == "mostly without text":
        path = write_gz(tmp_path / "docs.jsonl.gz", texts(10, 6))
        return path, f"data.text_field 'text': 6 of 10 sampled records (60%) of {path} have no such field; at most 50%"
    if kind == "no text at all":
        (path := tmp_path / "docs.jsonl").write_text('{"body": "x"}\n')
        return path, f"data.text_field 'text': no record of {path} has this field; fields found: ['body']"
    if kind == "missing":
        return tmp_path / "nowhere.jsonl", f"data.source: no such file or directory: {tmp_path / 'nowhere.jsonl'}"
    raise AssertionError(kind)


DATA_FAULTS = ["empty", "not gzip", "truncated gzip", "mostly without text", "no text at all", "missing"]


@pytest.fixture
def no_model_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was validated")

    monkeypatch.setattr(Source, "load_model", refuse)
    monkeypatch.setattr(Source, "load_config", refuse)


def run_on_data(tiny_sources, tmp_path, data: Path) -> tuple[list[str], Path]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_data(tiny_sources["llama"], data, align={"steps": 2})))
    return [str(path), "--run-dir", str(tmp_path / "run")], tmp_path / "run"


@pytest.mark.parametrize("kind", DATA_FAULTS)
def test_bad_data_is_refused_before_the_first_stage(kind, tiny_sources, tmp_path, capsys, no_model_loaded):
    data, message = bad_data(tmp_path, kind)
    argv, run = run_on_data(tiny_sources, tmp_path, data)
    assert train_main(argv) == 2
    assert message in one_line(capsys.readouterr().err)
    assert not run.exists()  # nothing created, nothing to clean up


def test_unreadable_data_file_is_named(tiny_sources, tmp_path, capsys, monkeypatch, no_model_loaded):
    data = write_gz(tmp_path / "docs.jsonl.gz", texts(4, 0))
    real_open = builtins.open

    def guarded(file, *args, **kwargs):  # as a non-root user with chmod 000 would see it
        if str(file) == str(data):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    argv, run = run_on_data(tiny_sources, tmp_path, data)
    assert train_main(argv) == 2
    assert f"data.source {data}: cannot read it (Permission denied)" in one_line(capsys.readouterr().err)
    assert not run.exists()


def test_a_few_records_without_text_are_reported_not_hidden(tmp_path, capsys):
    path = write_gz(tmp_path / "docs.jsonl.gz", texts(10, 2))
    assert train_data.check_data_source(path) == 1
    assert f"[data] skipping 2 of 10 sampled records (20%) of {path}: no field 'text'" in capsys.readouterr().err
    assert list(train_data.load_documents(path)) == [f"document {i}" for i in range(2, 10)]
    assert f"[data] skipping 2 of 10 records (20%) of {path}: no field 'text'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"7 of 10 records \(70%\) .* have no such field"):
        list(train_data.load_documents(write_gz(tmp_path / "worse.jsonl.gz", [{"text": "first"}, *texts(9, 7)])))


def test_a_damaged_data_cache_is_rebuilt(tmp_path, capsys):
    data = corpus(tmp_path / "corpus")
    first, _ = train_data.build_dataset(data, tiny_tokenizer(), 32, tmp_path / "cache", validation_fraction=0)
    (cached,) = (tmp_path / "cache").glob("*.pt")
    cached.write_bytes(cached.read_bytes()[:100])
    again, _ = train_data.build_dataset(data, tiny_tokenizer(), 32, tmp_path / "cache", validation_fraction=0)
    assert f"the data cache {cached} is damaged" in capsys.readouterr().err
    assert torch.equal(again.tensors["input_ids"], first.tensors["input_ids"])
    assert torch.load(cached, weights_only=True)["input_ids"].shape == first.tensors["input_ids"].shape


# ---- the program's name


def test_raven_convert_is_installed_next_to_convert():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["raven-convert"] == scripts["convert"] == "convert.cli:main"


def test_help_says_which_program_this_is(capsys):
    with pytest.raises(SystemExit) as info:
        convert_main(["--help"])
    assert info.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.startswith("raven-convert (also installed as `convert`, not ImageMagick's), of the raven-hybrid")


# ---- Ctrl-C


def test_ctrl_c_in_training_says_what_was_saved_and_how_to_resume(converted, tmp_path, monkeypatch, capsys):
    argv, run = prepare(converted, tmp_path, train=TRAIN)

    def interrupt(loss):
        raise KeyboardInterrupt

    fail_at(monkeypatch, convert.train.stage2, "ce_loss", 3, interrupt)
    assert train_main([*argv, "--redo", "train", "--set", "train.log_every=2"]) == 130
    line = one_line(capsys.readouterr().err)
    resume = shlex.join(["python", "-m", "convert.train", *argv, "--set", "train.log_every=2"])
    assert line == (
        f"interrupted: stages done in {run}: convert, align, weights; the train stage's last good checkpoint "
        f"{run / 'train' / 'checkpoints' / 'step_2'} is kept, a rerun resumes after step 2. To resume: {resume}"
    )
    assert checkpoints(run, "train") == ["step_2"]

    monkeypatch.undo()
    assert train_main(shlex.split(resume)[3:]) == 0  # the printed command, without --redo, continues the run
    assert "resumed from" in capsys.readouterr().err
    assert json.loads((run / "train" / "DONE").read_text())["steps_this_run"] == 2


def test_ctrl_c_in_convert_leaves_nothing_behind(tiny_sources, tmp_path, monkeypatch, capsys):
    out = tmp_path / "work" / "out"
    argv = [
        "--src",
        str(tiny_sources["llama"]),
        "--layers",
        "1",
        "--raven-num-slots",
        "8",
        "--raven-top-k",
        "2",
        "--out",
        str(out),
    ]

    def interrupt(*args, **kwargs):  # while the weights are being written
        raise KeyboardInterrupt

    monkeypatch.setattr(convert.export, "model_card", interrupt)
    assert convert_main(argv) == 130
    line = one_line(capsys.readouterr().err)
    assert line == f"interrupted: nothing was written to --out {out}. To resume: python -m convert {shlex.join(argv)}"
    assert not out.exists() and list(out.parent.glob(".*")) == []  # no hidden partial directory either

    monkeypatch.undo()
    assert convert_main(shlex.split(line.split("To resume: ")[1])[3:]) == 0
    assert (out / "config.json").is_file()


def test_a_file_that_is_not_gguf_is_refused_before_loading(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>not found</html>")  # what a failed download often leaves
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(fake), "--mixer", "raven", "--layers", "0", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and "does not start like a GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [1000, 20_000_000])  # cut in the header, cut in the tensor data
def test_a_truncated_gguf_is_named_as_such(tmp_path, capsys, keep):
    real = os.environ.get("RAVEN_SMOLLM2_GGUF")
    if not real or not Path(real).is_file():
        pytest.skip("needs the real SmolLM2 GGUF (RAVEN_SMOLLM2_GGUF)")
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as f:
        cut.write_bytes(f.read(keep))
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(cut), "--mixer", "raven", "--layers", "0", "--out", str(out)])
    assert exit_info.value.code == 2 and not out.exists()
    assert f"the GGUF file ({keep:,} bytes) is truncated or damaged" in capsys.readouterr().err


def test_too_little_free_space_is_refused_before_writing(tiny_sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(convert.files, "free_bytes", lambda folder: 1_000_000)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(tiny_sources["llama"]), "--mixer", "raven", "--layers", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "the model out needs about" in err and "only 1.0 MB is free there" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_midway_leaves_nothing_and_says_what_was_needed(tiny_sources, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert.export.shutil, "copy2", full)  # while the modeling code is copied in
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(tiny_sources["llama"]), "--mixer", "raven", "--layers", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "no space left on the device while writing the model out" in err
    assert "it needs about" in err and "nothing partial was kept" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no out, no hidden .out.partial


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    from convert.files import DiskSpaceError
    from convert.train.checkpoint import latest_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, 1, lambda folder: (folder / "w.bin").write_bytes(b"x" * 2_000_000), {"step": 1}, keep=2)

    def full(folder):
        (folder / "w.bin").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskSpaceError, match=r"writing the step-2 checkpoint .* it needs about 2\.0 MB"):
        save_checkpoint(tmp_path, 2, full, {"step": 2}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert latest_checkpoint(tmp_path)[1] == {"step": 1}
