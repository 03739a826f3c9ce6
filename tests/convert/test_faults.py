"""Bad inputs and faults: each is refused or survived with one clear line, and nothing is lost or left behind.

Non-finite numbers in every float setting (mixer settings, recipe fields, CLI flags), bad data files found before
the first stage, outputs that cannot be written and bad shard sizes found before the source is loaded, damaged GGUF
sources, full disks, the `raven-convert` name, and Ctrl-C during a conversion. Faults in a pipeline run (stages
killed and resumed, diverging steps, reproducibility, disk use) are in test_faults_stages.py.
"""

import builtins
import dataclasses
import errno
import gzip
import json
import os
import shlex
import typing
from pathlib import Path

import pytest
import tomllib
import torch
import yaml
from pydantic import BaseModel

import raven_convert.export
import raven_convert.files
from raven_convert.cli import main as convert_main
from raven_convert.evaluate.__main__ import main as eval_main
from raven_convert.sources import Source
from raven_convert.train import data as train_data
from raven_convert.train.__main__ import main as train_main
from raven_convert.train.recipe import Recipe, parse_recipe
from raven_layers import get_mixer, registered_mixers
from tests.conftest import tiny_tokenizer
from tests.convert.faults import interrupt, one_line, recipe_data
from tests.helpers import corpus

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"source": "Qwen/Qwen3-0.6B", "layers": [{"mixer": "raven", "layers": "0"}], "data": {"source": "x"}}
BAD_FLOATS = [float("inf"), float("-inf"), float("nan")]
pytestmark = pytest.mark.usefixtures("private_datasets_cache")


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
    """(dotted path, is a list or tuple) of every float field of the recipe schema, nested sections included."""
    found = []
    for name, info in model.model_fields.items():
        if typing.get_origin(info.annotation) in (list, tuple):  # tuples: ranges such as data.retrieval.depth
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
        section, *inner = path.split(".")
        for bad in BAD_FLOATS:
            value = [bad, bad] if is_list else bad  # two: a range's both ends
            for name in reversed(inner):  # data.retrieval.ratio -> {"retrieval": {"ratio": bad}}
                value = {name: value}
            data = MINIMAL | {section: REQUIRED.get(section, {}) | value}
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
    if kind == "half without text":  # a user who loses half the corpus must say so (data.max_skipped)
        path = write_gz(tmp_path / "docs.jsonl.gz", texts(48, 24))
        return path, (
            f"data.text_field 'text': 24 of 48 sampled records (50%) of {path} have no such field, and "
            "data.max_skipped allows 5%. Set data.text_field to the field that holds the text, or data.max_skipped "
            "to the share you accept to lose (e.g. --set data.max_skipped=0.51)"
        )
    if kind == "no text at all":
        (path := tmp_path / "docs.jsonl").write_text('{"body": "x"}\n')
        return path, f"data.text_field 'text': no record of {path} has this field; fields found: ['body']"
    if kind == "missing":
        return tmp_path / "nowhere.jsonl", f"data.source: no such file or directory: {tmp_path / 'nowhere.jsonl'}"
    raise AssertionError(kind)


DATA_FAULTS = ["empty", "not gzip", "truncated gzip", "half without text", "no text at all", "missing"]


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
    path = write_gz(tmp_path / "docs.jsonl.gz", texts(20, 1))
    assert train_data.check_data_source(path) == 1
    assert f"[data] skipping 1 of 20 sampled records (5%) of {path}: no field 'text'" in capsys.readouterr().err
    assert list(train_data.load_documents(path)) == [f"document {i}" for i in range(1, 20)]
    assert f"[data] skipping 1 of 20 records (5%) of {path}: no field 'text'" in capsys.readouterr().err
    worse = write_gz(tmp_path / "worse.jsonl.gz", [{"text": "first"}, *texts(9, 2)])
    with pytest.raises(ValueError, match=r"2 of 10 records \(20%\) .* have no such field, and data.max_skipped allows"):
        list(train_data.load_documents(worse))
    assert len(list(train_data.load_documents(worse, max_skipped=0.2))) == 8  # allowed when asked for


def test_a_run_that_would_lose_half_its_corpus_needs_max_skipped(tiny_sources, tmp_path, capsys):
    data, message = bad_data(tmp_path, "half without text")
    argv, run = run_on_data(tiny_sources, tmp_path, data)
    argv += ["--stages", "convert,align"]
    assert train_main(argv) == 2 and message in one_line(capsys.readouterr().err) and not run.exists()
    assert train_main(argv + ["--set", "data.max_skipped=0.5"]) == 0  # the user said so
    assert "[data] skipping 24 of 48 sampled records (50%)" in capsys.readouterr().err


def test_a_damaged_data_cache_is_rebuilt(tmp_path, capsys):
    data = corpus(tmp_path / "corpus")
    first, _ = train_data.build_dataset(data, tiny_tokenizer(), 32, tmp_path / "cache", validation_fraction=0)
    (cached,) = (tmp_path / "cache").glob("*.pt")
    cached.write_bytes(cached.read_bytes()[:100])
    again, _ = train_data.build_dataset(data, tiny_tokenizer(), 32, tmp_path / "cache", validation_fraction=0)
    assert f"the data cache {cached} is damaged" in capsys.readouterr().err
    assert torch.equal(again.tensors["input_ids"], first.tensors["input_ids"])
    assert torch.load(cached, weights_only=True)["input_ids"].shape == first.tensors["input_ids"].shape


# ---- raven-eval's bad inputs, refused before a model is loaded or anything is written


def test_raven_eval_names_a_negative_length(tiny_sources, tmp_path, capsys, no_model_loaded):
    with pytest.raises(SystemExit):  # argparse alone would read -1k as a flag: 'expected one argument'
        eval_main([str(tiny_sources["llama"]), "--out", str(tmp_path / "out"), "--lengths", "-1k"])
    assert "argument --lengths: '-1k' is not a length; expected integers >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_raven_eval_names_its_model_argument_and_writes_nothing(tmp_path, capsys, no_model_loaded):
    with pytest.raises(SystemExit):
        eval_main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--tasks", "passkey"])
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"raven-eval: error: model '{tmp_path / 'nowhere'}' is neither an existing directory")
    assert not (tmp_path / "out").exists()


def test_raven_eval_asks_for_a_haystack_before_loading_once(
    tiny_sources, tmp_path, capsys, monkeypatch, no_model_loaded
):
    monkeypatch.delenv("RAVEN_HAYSTACK_DIR", raising=False)
    with pytest.raises(SystemExit):
        eval_main([str(tiny_sources["llama"]), "--out", str(tmp_path / "out"), "--tasks", "passkey,niah_single_2"])
    err = capsys.readouterr().err
    assert one_line(err) == (
        "raven-eval: error: task 'niah_single_2' needs an essay haystack: pass --haystack-dir=DIR or set "
        "$RAVEN_HAYSTACK_DIR to a folder of *.txt files (RULER's Paul Graham essays, e.g. ../shared/data/pg_essays)"
    )
    assert err.count("needs an essay haystack") == 1 and not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        eval_main(
            [
                str(tiny_sources["llama"]),
                "--out",
                str(tmp_path / "out"),
                "--tasks",
                "niah_single_2",
                "--haystack-dir",
                str(empty),
            ]
        )
    assert f"haystack_dir {empty}: no *.txt files in it" in one_line(capsys.readouterr().err)


# ---- outputs that cannot be written and bad shard sizes, found before the source is loaded


@pytest.fixture(params=["chmod", "simulated"])
def read_only(request, tmp_path, monkeypatch) -> Path:
    """A folder this process may not write in: chmod 555, or (for root, who writes anywhere, and always in the
    "simulated" case) a folder that os.access reports as not writable, as it does on a read-only file system."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if request.param == "chmod" and os.access(folder, os.W_OK):
        folder.chmod(0o755)
        pytest.skip("running as root: a chmod 555 folder is still writable")
    if request.param == "simulated":
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != folder and real(p, mode, **kw))
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("kind", ["convert --out", "raven-eval --out", "--run-dir", "export.dir", "data.cache_dir"])
def test_an_output_that_cannot_be_written_is_refused_before_loading(
    kind, read_only, tiny_sources, tmp_path, capsys, no_model_loaded
):
    source, out = str(tiny_sources["llama"]), read_only / "out"
    if kind == "convert --out":
        with pytest.raises(SystemExit) as info:
            convert_main(["--src", source, "--layers", "1", "--out", str(out)])
        status, name = info.value.code, "--out"
    elif kind == "raven-eval --out":
        with pytest.raises(SystemExit) as info:
            eval_main([source, "--out", str(out)])
        status, name = info.value.code, "--out"
    else:
        recipe = recipe_data(tiny_sources["llama"], corpus(tmp_path / "corpus"))
        recipe |= {"export": {"dir": str(out)}} if kind == "export.dir" else {}
        if kind == "data.cache_dir":
            recipe |= {"data": recipe["data"] | {"cache_dir": str(out)}, "align": {"steps": 1}}
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        run = out if kind == "--run-dir" else tmp_path / "run"
        status, name = train_main([str(tmp_path / "recipe.yaml"), "--run-dir", str(run)]), kind
    assert status == 2
    assert f"{name} {out}: cannot write in {read_only} (read-only, or no permission to write there); choose a " in (
        one_line(capsys.readouterr().err)
    )
    assert list(read_only.iterdir()) == [] and not (tmp_path / "run").exists()


def test_an_output_under_a_file_is_refused_before_loading(tiny_sources, tmp_path, capsys, no_model_loaded):
    (tmp_path / "notes.txt").write_text("a file where a folder should be")
    out = tmp_path / "notes.txt" / "model"
    with pytest.raises(SystemExit) as info:
        convert_main(["--src", str(tiny_sources["llama"]), "--layers", "1", "--out", str(out)])
    assert info.value.code == 2
    assert f"--out {out}: {tmp_path / 'notes.txt'} is a file, not a folder" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("size", ["2 gigs", "0GB", "5GiB", "-1MB", "1000"])
def test_a_bad_shard_size_is_refused_before_loading(size, tiny_sources, tmp_path, capsys, no_model_loaded):
    argv = ["--src", str(tiny_sources["llama"]), "--layers", "1", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as info:
        convert_main([*argv, f"--max-shard-size={size}"])
    assert info.value.code == 2
    assert (
        f"--max-shard-size {size!r} is not allowed; expected a positive size with a unit, such as 500MB or 2GB "
        "(units: KB, MB, GB, TB)" in one_line(capsys.readouterr().err)
    )
    assert list(tmp_path.iterdir()) == []


# ---- the program's name


def test_raven_convert_is_installed_next_to_convert():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["raven-convert"] == "raven_convert.cli:main"
    assert scripts["convert"] == "raven_convert.cli:convert_main"  # main, but ImageMagick's command lines go on


def test_help_says_which_program_this_is(capsys):
    with pytest.raises(SystemExit) as info:
        convert_main(["--help"])
    assert info.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.startswith("raven-convert (also installed as `convert`, not ImageMagick's), of the raven-hybrid")


# ---- Ctrl-C


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

    monkeypatch.setattr(raven_convert.export, "model_card", interrupt)  # while the weights are being written
    assert convert_main(argv) == 130
    line = one_line(capsys.readouterr().err)
    assert (
        line
        == f"interrupted: nothing was written to --out {out}. To resume: python -m raven_convert {shlex.join(argv)}"
    )
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
    monkeypatch.setattr(raven_convert.files, "free_bytes", lambda folder: 1_000_000)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(tiny_sources["llama"]), "--mixer", "raven", "--layers", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "the model out needs about" in err and "only 1.0 MB is free there" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_midway_leaves_nothing_and_says_what_was_needed(tiny_sources, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(raven_convert.export.shutil, "copy2", full)  # while the modeling code is copied in
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--src", str(tiny_sources["llama"]), "--mixer", "raven", "--layers", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "no space left on the device while writing the model out" in err
    assert "it needs about" in err and "nothing partial was kept" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no out, no hidden .out.partial


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    from raven_convert.files import DiskSpaceError
    from raven_convert.train.checkpoint import latest_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, 1, lambda folder: (folder / "w.bin").write_bytes(b"x" * 2_000_000), {"step": 1}, keep=2)

    def full(folder):
        (folder / "w.bin").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskSpaceError, match=r"writing the step-2 checkpoint .* it needs about 2\.0 MB"):
        save_checkpoint(tmp_path, 2, full, {"step": 2}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert latest_checkpoint(tmp_path)[1] == {"step": 1}


def test_a_setting_of_a_mixer_the_command_does_not_use_is_refused(tiny_sources, tmp_path, capsys, no_model_loaded):
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        convert_main(["--src", str(tiny_sources["llama"]), "--layers", "1", "--sila-conv-size", "8", "--out", str(out)])
    assert one_line(capsys.readouterr().err).endswith(
        "error: --sila-conv-size sets the sila mixer, but no --mixer sila converts a layer here (converted "
        "to: raven); drop it, or add --mixer sila --layers SPEC"
    )
    assert not out.exists()
