"""Recipes: every shipped recipe validates, bad ones fail naming the field, the pipeline runs end to end and resumes."""

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from convert.train.__main__ import main
from convert.train.recipe import STAGES, load_recipe, parse_recipe
from convert.train.stages import run_recipe
from tests.helpers import WORDS, corpus

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))
MINIMAL = {"source": "Qwen/Qwen3-0.6B", "layers": [{"mixer": "raven", "layers": "0-23:5"}], "data": {"source": "x"}}


def test_the_shipped_recipes_are_there():
    names = {p.name for p in RECIPES}
    for mixer in ("raven", "sse", "sila"):
        assert {f"smollm2-{mixer}.yaml", f"qwen3-0.6b-{mixer}.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and f"python -m convert.train recipes/{path.name} --run-dir runs/{path.stem}" in first
    assert recipe.layers and recipe.data.seq_len >= 2


@pytest.mark.parametrize(
    "change, field, hint",
    [
        ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"align": {"steps": -1}}, "align.steps", "greater than or equal to 0"),
        ({"train": {"steps": -5}}, "train.steps", "greater than or equal to 0"),
        ({"train": {"lr_typo": 1}}, "train.lr_typo", "Extra inputs"),
        ({"layers": [{"mixer": "mamba", "layers": "0"}]}, "layers.0.mixer", "'raven', 'sse' or 'sila'"),
        ({"layers": [{"mixer": "raven", "layers": "0-x"}]}, "layers.0.layers", "accepted forms"),
        ({"mixer_settings": {"mamba": {}}}, "mixer_settings", "unknown mixer"),
        ({"mixer_settings": {"raven": {"slots": 3}}}, "mixer_settings", "allowed"),
        ({"token_weights": {"reference": "student"}}, "token_weights.reference", "'teacher'"),
        ({"data": {"source": "x", "validation_fraction": 1.5}}, "data.validation_fraction", "less than 1"),
    ],
)
def test_malformed_recipe_names_the_field(change, field, hint):
    with pytest.raises(ValueError) as info:
        parse_recipe({**MINIMAL, **change})
    lines = str(info.value).splitlines()
    assert any(line.startswith(f"{field}: ") and hint in line for line in lines[1:]), str(info.value)


def test_load_recipe_rejects_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "align": {"steps": -1, "batch_size": 0}}))
    with pytest.raises(ValueError, match=r"(?m)^align\.steps: .*\n^align\.batch_size: "):
        load_recipe(path)
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == 2


def haystack(folder: Path) -> Path:
    folder.mkdir()
    text = "\n\n".join(f"Paragraph {i}. " + " ".join(WORDS) + "." for i in range(40))
    (folder / "essay.txt").write_text(text)
    return folder


def test_pipeline_end_to_end_resumes_and_reruns_one_stage(tiny_sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the working directory
    corpus(tmp_path / "corpus")
    haystack(tmp_path / "essays")
    recipe = parse_recipe(
        {
            "source": str(tiny_sources["llama"]),
            "layers": [{"mixer": "raven", "layers": "1"}, {"mixer": "sila", "layers": "2"}],
            "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
            "dtype": "float32",
            "data": {"source": "corpus", "seq_len": 32, "validation_fraction": 0.1},
            "align": {"steps": 3, "batch_size": 2, "log_every": 1},
            "token_weights": {"enabled": True, "batch_size": 4, "query_block": 16},
            "train": {"steps": 3, "batch_size": 2, "trainable": "mixers+lora", "lora_rank": 2, "log_every": 1},
            "extend": {"seq_len": 48, "steps": 2, "batch_size": 2, "log_every": 1},
            "evaluate": {
                "tasks": ["passkey"],
                "lengths": [400],
                "depths": [0.5],
                "samples": 1,
                "batch_size": 1,
                "haystack_dir": "essays",
                "pictures": False,
            },
            "export": {"dir": "exported"},
        }
    )
    run = tmp_path / "run"
    results = run_recipe(recipe, run)
    assert list(results) == list(STAGES)
    for stage in STAGES:
        assert json.loads((run / stage / "DONE").read_text()) == results[stage]
    assert set(results["align"]["final_layer_losses"]) == {"1", "2"}
    assert (run / results["weights"]["picture"]).stat().st_size > 1000
    rows = results["weights"]["shape"]
    assert rows[1] == 32 and rows[0] >= 2
    assert results["train"]["steps_this_run"] == 3 and results["train"]["model"] == "train/model"
    assert results["train"]["val_ce"] > 0 and results["align"]["validation_after"] > 0
    assert results["extend"]["seq_len"] == 48 and results["extend"]["model"] == "extend/model"
    assert (run / "evaluate" / "report.json").is_file()
    exported = tmp_path / "exported"
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    assert list(model.config.layer_mixers) == ["attention", "raven", "sila", "attention"]
    assert not any("lora" in name for name, _ in model.named_parameters())

    # a rerun finds every DONE and does nothing
    stamps = {s: (run / s / "DONE").stat().st_mtime_ns for s in STAGES}
    assert run_recipe(recipe, run) == results
    assert {s: (run / s / "DONE").stat().st_mtime_ns for s in STAGES} == stamps

    # one stage again: only train reruns (resuming from its checkpoint), the others stay untouched
    (run / "train" / "DONE").unlink()
    again = run_recipe(recipe, run, stages=["train"])
    assert list(again) == ["train"] and again["train"]["model"] == "train/model"
    assert (run / "train" / "DONE").is_file()
    for stage in STAGES:
        if stage != "train":
            assert (run / stage / "DONE").stat().st_mtime_ns == stamps[stage]
    AutoModelForCausalLM.from_pretrained(run / "train" / "model", trust_remote_code=True)

    # a changed recipe never reuses stale stages: the run stops naming the field, and --redo reruns from there
    changed = recipe.model_copy(deep=True)
    changed.train.lr = 1e-2
    with pytest.raises(ValueError, match=r"stage 'train' .*different recipe \(changed: train.lr\).*--redo train"):
        run_recipe(changed, run)
    with pytest.raises(ValueError, match=r"stage 'evaluate' .*\(changed: train.lr\).*--redo train"):
        run_recipe(changed, run, stages=["evaluate"])  # a later stage points back at the one whose settings moved
    redone = run_recipe(changed, run, redo="train")
    for stage in ("convert", "align", "weights"):
        assert (run / stage / "DONE").stat().st_mtime_ns == stamps[stage]
    assert redone["train"]["inputs"]["train"]["lr"] == 1e-2 and redone["train"]["steps_this_run"] == 3


def test_a_stage_without_its_inputs_fails_clearly(tmp_path):
    recipe = parse_recipe(MINIMAL)
    with pytest.raises(ValueError, match=r"stage 'align' needs the outputs of stage 'convert'.*--stages convert"):
        run_recipe(recipe, tmp_path / "run", stages=["align"])
    with pytest.raises(ValueError, match="unknown stage"):
        run_recipe(recipe, tmp_path / "run", stages=["distill"])


def test_a_multi_process_launch_runs_only_the_data_parallel_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"only the train/extend stages run.*\['convert', 'align'"):
        run_recipe(parse_recipe(MINIMAL), tmp_path / "run")


def test_overrides_apply_before_validation(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL | {"evaluate": {"samples": 2}}))
    recipe = load_recipe(path, ["train.steps=20", "evaluate=null", "extend.seq_len=64", "extend.steps=3"])
    assert recipe.train.steps == 20 and recipe.evaluate is None and recipe.extend.seq_len == 64
    no = load_recipe(path, ["train.mixed_precision=no", "align.mixed_precision=no"])  # YAML's `no` is false
    assert no.train.mixed_precision == "no" and no.align.mixed_precision == "no"
    with pytest.raises(ValueError, match=r"train.steps: Input should be greater than or equal to 0"):
        load_recipe(path, ["train.steps=-1"])
    with pytest.raises(ValueError, match=r"override 'train.steps' is not of the form dotted.key=value"):
        load_recipe(path, ["train.steps"])
    with pytest.raises(ValueError, match=r"train.stepz: Extra inputs are not permitted"):
        load_recipe(path, ["train.stepz=3"])
