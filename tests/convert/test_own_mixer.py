"""Bring your own mixer: a mixer declared outside the toolkit (tests/support/gla_mixer.py) goes through convert,
align, train, export, a clean reload and evaluation with no edit to the toolkit, and every part that lists mixers
reads them from the registry."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from raven_convert import Source
from raven_convert.cli import build_parser
from raven_convert.cli import main as convert_main
from raven_convert.evaluate.report import EvalRequest, mixer_pictures
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stages import run_recipe
from raven_layers import ENTRY_POINT_GROUP
from tests.conftest import tiny_tokenizer
from tests.convert.train.test_recipe import haystack
from tests.helpers import corpus
from tests.scripts.test_clean_load import run as clean_load
from tests.support import gla_mixer

ROOT = Path(__file__).resolve().parents[2]
GLA = "tests.support.gla_mixer:MIXER"


def test_a_registered_mixer_is_accepted_by_the_cli_the_recipes_the_export_and_the_report(
    mixer_registry, tiny_sources, tmp_path
):
    recipe = {"source": "x", "layers": [{"mixer": "gla", "layers": "1"}], "mixer_settings": {"gla": {"gate_rank": 4}}}
    with pytest.raises(ValueError, match=r"layers.0.mixer: .*unknown mixer 'gla'"):
        parse_recipe(recipe)
    assert "--gla-gate-rank" not in build_parser().format_help()

    mixer_registry.register_mixer(gla_mixer.MIXER)
    assert "gla options (see tests.support.gla_mixer)" in build_parser().format_help()
    assert parse_recipe(recipe).mixer_settings == {"gla": {"gate_rank": 4}}
    with pytest.raises(ValueError, match=r"mixer_settings: .*unknown GLA setting\(s\) \['rank'\]; 'rank': did you"):
        parse_recipe(recipe | {"mixer_settings": {"gla": {"rank": 4}}})

    out = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--mixer", "gla", "--layers", "1,2", "--gla-gate-rank", "4"]
    assert convert_main([*args, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["layer_mixers"] == ["attention", "gla", "gla", "attention"]
    assert config["mixer_settings"]["gla"]["gate_rank"] == 4 and config["mixer_sources"] == {"gla": GLA}
    carried = (out / "mixer_gla.py").read_text()
    assert carried == (ROOT / "tests/support/gla_mixer.py").read_text().replace("from raven_layers.", "from .")
    assert "from .mixer_gla import MIXER as MIXER_GLA" in (out / "extra_mixers.py").read_text()
    assert "- gla layer: constant state of 2 KiB (per key/value head: [d, d])" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(model.model.layers[1].self_attn) is gla_mixer.GLAMixer  # where the toolkit is, the toolkit's code
    request = EvalRequest(model=str(out), out=tmp_path / "eval", picture_length=300)
    request.out.mkdir()
    assert mixer_pictures(model, tiny_tokenizer(), request, request.out) == {"gla_forget_gates": "gla_forget_gates.png"}
    assert (request.out / "gla_forget_gates.png").stat().st_size > 1000


def test_a_mixer_named_by_import_path_gets_its_flags(mixer_registry, tiny_sources, tmp_path):
    out = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), f"--mixer={GLA}", "--layers", "1", "--gla-gate-temperature", "8"]
    assert convert_main([*args, "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["mixer_settings"]["gla"]["gate_temperature"] == 8.0


@pytest.mark.parametrize(
    "line, why",
    [
        ("from raven_convert.files import write_json", "imports what the model does not carry"),
        ("from raven_layers.modeling_hybrid import HybridModel", "imports what the model does not carry"),
        ("import raven_layers.common", "imports a package the model does not carry"),
    ],
)
def test_a_mixer_whose_module_imports_what_a_model_lacks_is_refused_before_loading(
    mixer_registry, tiny_sources, tmp_path, monkeypatch, capsys, line, why
):
    name = f"own_mixer_{abs(hash(line))}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from dataclasses import dataclass
            {line}
            from raven_layers.common import MixerSpec
            from tests.support.gla_mixer import GLAMixer, GLASettings

            @dataclass(frozen=True)
            class OwnSettings(GLASettings):
                NAME, LABEL = "own", "Own"

            class OwnMixer(GLAMixer):
                pass

            MIXER = MixerSpec(settings=OwnSettings, layer=OwnMixer, state="[d, d]")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(Source, "load_model", lambda *a, **k: pytest.fail("loaded before the mixer was checked"))
    out = tmp_path / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--mixer", f"{name}:MIXER", "--layers", "1", "--out", str(out)]
    with pytest.raises(SystemExit) as info:
        convert_main(args)
    assert info.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"mixer 'own': {tmp_path / name}.py, line 3: {line!r} {why}; a model carries the mixer's module" in err


def test_an_own_mixer_converts_aligns_trains_exports_reloads_clean_and_evaluates(
    mixer_registry, tiny_sources, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    corpus(tmp_path / "corpus")
    haystack(tmp_path / "essays")
    recipe = parse_recipe(
        {
            "source": str(tiny_sources["llama"]),
            "layers": [{"mixer": GLA, "layers": "1"}, {"mixer": "raven", "layers": "2"}],
            "mixer_settings": {"gla": {"gate_rank": 4}, "raven": {"num_slots": 8, "top_k": 2}},
            "dtype": "float32",
            "data": {"source": "corpus", "seq_len": 32, "validation_fraction": 0.1},
            "align": {"steps": 2, "batch_size": 2, "log_every": 1},
            "train": {"steps": 2, "batch_size": 2, "log_every": 1},
            "evaluate": {
                "tasks": ["passkey"],
                "lengths": [300],
                "depths": [0.5],
                "samples": 1,
                "batch_size": 1,
                "haystack_dir": "essays",
                "picture_length": 300,
            },
            "export": {"dir": "exported"},
        }
    )
    results = run_recipe(recipe, tmp_path / "run")
    assert set(results["align"]["final_layer_losses"]) == {"1", "2"}
    assert results["train"]["steps_this_run"] == 2 and results["train"]["val_ce"] > 0
    report = json.loads((tmp_path / "run" / "evaluate" / "report.json").read_text())
    assert set(report["pictures"]) == {"gla_forget_gates", "raven_esl", "raven_slot_allocation"}

    exported = tmp_path / "exported"
    proc = clean_load(exported, tmp_path / "check.json")  # a Python that can import neither toolkit nor tests
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["problems"] == [] and record["layer_mixers"] == ["attention", "gla", "raven", "attention"]
    assert record["module"].startswith("transformers_modules")

    # the toolkit, in a new process, imports the mixer from where the model's config says it was declared
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [str(exported), "--out", "again", "--tasks", "passkey", "--lengths", "300", "--depths", "0.5"]
    args += ["--samples", "1", "--haystack-dir", "essays", "--picture-length", "300"]
    proc = subprocess.run(
        [sys.executable, "-m", "raven_convert.evaluate", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert set(again["pictures"]) == set(report["pictures"]) and "failed" not in again


def test_the_docs_walk_through_the_example_mixer():
    section = (ROOT / "docs" / "ADD_A_MIXER.md").read_text()
    module = (ROOT / "tests/support/gla_mixer.py").read_text()
    shown = [
        "from raven_layers.common import Mixer, MixerSettings, MixerSpec, init_fresh_parameters",
        'NAME, LABEL = "gla", "GLA"',
        "gate_rank: int = 16",
        "self.save_state(cache, (memory,), num_tokens=T)",
        'state="[d, d]"',
        "references=(gla_recurrent,)",
        f'pictures="{gla_mixer.MIXER.pictures}"',
    ]
    assert [line for line in shown if line not in section or line not in module] == []
    assert f"--mixer {GLA}" in section and f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in section
