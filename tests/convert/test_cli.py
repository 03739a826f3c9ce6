"""`convert` rejects every bad input with a message naming the value and what is allowed, before heavy work, and
hands a command line that is not its own (ImageMagick's) to the next `convert` on PATH."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from transformers import GPT2Config

from raven_convert import Source
from raven_convert.cli import TRIED, is_foreign, main


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Errors must come before the weights are loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the source weights were loaded before the input was validated")

    monkeypatch.setattr(Source, "load_model", refuse)


def run_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unsupported_architecture_names_the_supported_ones(tmp_path, capsys, no_heavy_work):
    GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
    err = run_error(capsys, ["--src", str(tmp_path / "gpt2"), "--layers", "0", "--out", str(tmp_path / "o")])
    assert "unsupported source architecture 'gpt2'; supported: ['llama', 'mistral', 'qwen2', 'qwen3']" in err


@pytest.mark.parametrize(
    ("src", "message"),
    [
        ("missing.gguf", "--src 'missing.gguf': no such GGUF file"),
        ("not a hub id!", "--src 'not a hub id!' is neither an existing directory, a .gguf file, nor a Hub id"),
    ],
)
def test_bad_sources(tmp_path, capsys, src, message):
    assert message in run_error(capsys, ["--src", src, "--layers", "0", "--out", str(tmp_path / "o")])


def test_directory_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = run_error(capsys, ["--src", str(tmp_path / "empty"), "--layers", "0", "--out", str(tmp_path / "o")])
    assert "is a directory without config.json" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layers", "0-9"], "--layers '0-9': layer 9 is out of range. The model has 4 layers"),
        (["--layers", "3-1"], "range '3-1' is reversed (3 > 1)"),
        (["--layers", "0,0"], "layer(s) [0] are named more than once"),
        (["--layers", "x"], "'x' is not a layer, range or stepped range"),
        (
            ["--mixer", "raven", "--layers", "0-2", "--mixer", "raven", "--layers", "2,3"],
            "layer 2 is assigned twice: to raven by --layers '0-2' and to raven by --layers '2,3'",
        ),
        (
            ["--mixer", "raven", "--layers", "0", "--layers", "1"],
            "each --mixer needs one --layers: got 1 --mixer and 2",
        ),
        (
            ["--layers", "0", "--raven-top-k", "300"],
            "raven.top_k = 300 is not allowed; expected an integer in [1, num_slots=256]",
        ),
        (["--layers", "0", "--raven-num-slots", "0"], "raven.num_slots = 0 is not allowed; expected an integer >= 1"),
        (["--layers", "0", "--raven-alpha", "0"], "raven.alpha = 0.0 is not allowed; expected a number > 0"),
        (
            ["--layers", "0", "--raven-chunk-size", "-2"],
            "raven.chunk_size = -2 is not allowed; expected an integer >= 1",
        ),
        (["--layers", "0", "--push-to-hub", "bad repo!"], "bad repo!"),
        (
            ["--mixer", "sse", "--layers", "0", "--sse-top-k", "5"],
            "sse.top_k = 5 is not allowed; expected an integer in [1, num_partitions=4]",
        ),
        (
            ["--mixer", "sse", "--layers", "0"],  # default rank 64 does not fit this tiny model
            "sse.lora_rank = 64 is not allowed; expected an integer in [1, 32]",
        ),
        (["--mixer", "sila", "--layers", "0", "--sila-conv-size", "0"], "sila.conv_size = 0 is not allowed"),
        (["--mixer", "sse", "--layers", "0", "--sse-balance-coef", "-1"], "sse.balance_coef = -1.0 is not allowed"),
        (["--layers", "0", "--sliding-window", "0"], "--sliding-window 0 is not allowed; expected an integer >= 1"),
        (["--layers", "0", "--window-layers", "1"], "--window-layers '1' needs --sliding-window"),
        (
            ["--layers", "0", "--attention-sinks", "4"],
            "--attention-sinks 4 keeps the first tokens visible to sliding-window layers, and this plan keeps no",
        ),
        (
            ["--layers", "0", "--sliding-window", "8", "--attention-sinks", "-1"],
            "--attention-sinks -1 is not allowed; expected an integer >= 0",
        ),
        (
            ["--layers", "0", "--sliding-window", "8", "--window-layers", "0-1"],
            "--window-layers '0-1' names layer(s) [0], which become mixers; only kept attention layers",
        ),
        (
            ["--layers", "0", "--sliding-window", "8", "--window-layers", "9"],
            "--window-layers '9': layer 9 is out of range",
        ),
    ],
)
def test_bad_arguments(tiny_sources, tmp_path, capsys, no_heavy_work, extra, message):
    err = run_error(capsys, ["--src", str(tiny_sources["llama"]), "--out", str(tmp_path / "o"), *extra])
    assert message in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mixer", "mamba", "--layers", "0"], "argument --mixer: unknown mixer 'mamba'; allowed: raven, sse, sila"),
        (["--mixer", "sla", "--layers", "0"], "argument --mixer: unknown mixer 'sla'; did you mean 'sila'?"),
        (["--mixer", "no_such_module:MIXER", "--layers", "0"], "cannot import 'no_such_module'"),
        (["--layers", "0", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (
            ["--layers", "0", "--raven-qk-norm", "maybe"],
            "argument --raven-qk-norm: expected true or false or auto, got 'maybe'",
        ),
        (["--layers", "0", "--raven-num-slots", "many"], "argument --raven-num-slots: invalid int value: 'many'"),
        (["--layers", "0", "--raven-gumbel", "auto"], "argument --raven-gumbel: expected true or false, got 'auto'"),
    ],
)
def test_bad_choices(tiny_sources, tmp_path, capsys, extra, message):
    assert message in run_error(capsys, ["--src", str(tiny_sources["llama"]), "--out", str(tmp_path / "o"), *extra])


def test_non_empty_output_is_kept(tiny_sources, tmp_path, capsys, no_heavy_work):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    err = run_error(capsys, ["--src", str(tiny_sources["llama"]), "--layers", "0", "--out", str(out)])
    assert f"--out '{out}' exists and is not empty; pass --overwrite to replace it" in err
    assert (out / "precious.txt").read_text() == "keep me"


def test_layer_map_is_printed_before_loading(tiny_sources, tmp_path, capsys, monkeypatch):
    def stop(*args, **kwargs):
        raise SystemExit("stopped at load")

    monkeypatch.setattr(Source, "load_model", stop)
    with pytest.raises(SystemExit, match="stopped at load"):
        main(["--src", str(tiny_sources["qwen3"]), "--mixer", "raven", "--layers", "0-23:5", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert re.search(r"raven +5 layers: 0,5,10,15,20\n", printed)
    assert re.search(r"attention +19 layers: 1,2,3,4,6,", printed)
    assert "layer   5  becomes raven" in printed and "layer   6  keeps attention" in printed


def test_every_mixer_flag_says_what_it_sets(capsys):
    """--help: each mixer setting's flag carries the comment of its declaration and its default."""
    from raven_convert.cli import build_parser, setting_notes
    from raven_layers import registered_mixers

    text = " ".join(build_parser().format_help().split())
    for spec in registered_mixers():
        notes = setting_notes(spec.settings)
        assert notes and set(notes) <= {f.name for f in dataclasses.fields(spec.settings)}
    assert "--raven-num-slots VALUE M, paper default (default: 256)" in text
    assert '--sse-implementation VALUE parallel form: "masking", "varlen", or "auto"' in text
    assert "--sila-conv-size VALUE kernel of the short causal depthwise convolution" in text


CONVERT = "import sys; from raven_convert.cli import convert_main; sys.exit(convert_main())"


def write_program(folder, text: str):
    """An executable `convert` in `folder`, a shell script of `text`."""
    folder.mkdir()
    path = folder / "convert"
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)


@pytest.mark.skipif(sys.platform == "win32", reason="shell scripts stand in for the programs")
def test_convert_hands_imagemagicks_command_lines_to_the_next_convert_on_path(tmp_path):
    """Installed as `convert`, the toolkit stands before ImageMagick's on PATH: a command line that is not its own
    goes on to the next `convert`, past a wrapper (a pyenv shim) that brings it back here."""
    write_program(tmp_path / "shim", f'exec "{sys.executable}" -c "{CONVERT}" "$@"\n')
    write_program(tmp_path / "magick", 'echo "imagemagick $*" > "$OUT_FILE"\n')
    out = tmp_path / "called"
    env = {**os.environ, "PATH": f"{tmp_path / 'shim'}{os.pathsep}{tmp_path / 'magick'}", "OUT_FILE": str(out)}
    env.pop(TRIED, None)
    done = subprocess.run([sys.executable, "-c", CONVERT, "in.png", "-resize", "50%", "out.jpg"], env=env, timeout=120)
    assert done.returncode == 0 and out.read_text() == "imagemagick in.png -resize 50% out.jpg\n"


def test_convert_keeps_its_own_command_lines_and_names_what_it_cannot_hand_on(tmp_path):
    assert not is_foreign([]) and not is_foreign(["-h"]) and not is_foreign(["--src", "x", "--layers", "0"])
    assert is_foreign(["in.png", "out.jpg"]) and is_foreign(["-version"])
    env = {**os.environ, "PATH": str(tmp_path)}  # no other convert there
    env.pop(TRIED, None)
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, "in.png", "out.jpg"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "'in.png' is not an option of raven-convert" in done.stderr and "no other `convert` on PATH" in done.stderr
