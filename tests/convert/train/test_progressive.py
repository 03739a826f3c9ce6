"""Progressive conversion through the recipe pipeline: a recipe with start_from converts the hybrid an earlier
recipe exported further (auto:N beside its mixers), aligns only the new layers to the start hybrid's attention,
keeps the teacher (`source`) for token weights and training, and a changed start_from makes the run stop."""

from __future__ import annotations

import json

import pytest
import torch

from raven_convert.train import stages
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stages import run_recipe
from tests.helpers import read_weights, words_corpus

SILA = {"sila": {"conv_size": 2}}
CHOICE = {"window": 8, "samples": 2, "text_rows": 1, "seq_len": 64, "rounds": 1, "batch_size": 2}


def tiny_recipe(teacher, corpus, layers: str, **sections) -> dict:
    return {
        "source": str(teacher),
        "layers": [{"mixer": "sila", "layers": layers}],
        "mixer_settings": SILA,
        "dtype": "float32",
        "data": {"source": str(corpus), "seq_len": 32, "validation_fraction": 0.1},
        "align": {"steps": 3, "batch_size": 2, "log_every": 1},
        **sections,
    }


@pytest.fixture(scope="module")
def start(tiny_sources, tmp_path_factory) -> dict:
    """{"teacher", "corpus", "model"}: the tiny Llama with layer 1 converted to SILA, aligned and trained by a recipe
    that exports it."""
    root = tmp_path_factory.mktemp("start")
    corpus = words_corpus(root / "corpus")
    train = {"steps": 2, "batch_size": 2, "trainable": "mixers"}
    recipe = tiny_recipe(tiny_sources["llama"], corpus, "1", train=train, export={"dir": str(root / "model")})
    run_recipe(parse_recipe(recipe), root / "run")
    return {"teacher": tiny_sources["llama"], "corpus": corpus, "model": root / "model"}


def test_a_recipe_converts_the_hybrid_it_starts_from_further(start, tmp_path, monkeypatch):
    loaded, load_teacher = [], stages.load_teacher

    def spy(recipe, parallel, model=None):  # which model each stage loads as its teacher
        loaded.append(model)
        return load_teacher(recipe, parallel, model)

    monkeypatch.setattr(stages, "load_teacher", spy)
    further = tiny_recipe(
        start["teacher"],
        start["corpus"],
        "auto:3",
        start_from=str(start["model"]),
        layer_choice=CHOICE,
        token_weights={"enabled": True, "batch_size": 4, "query_block": 16},
        train={"steps": 2, "batch_size": 2, "trainable": "mixers+lora", "lora_rank": 2},
    )
    run = tmp_path / "run"
    done = run_recipe(parse_recipe(further), run, stages=["convert", "align", "weights", "train"])

    convert = done["convert"]
    assert convert["start_from"] == str(start["model"]) and convert["inputs"]["start_from"] == str(start["model"])
    chosen = convert["layer_choice"]["chosen"]
    assert convert["layer_choice"]["fixed"] == [1] and 1 in chosen and len(chosen) == 3
    new = sorted(set(chosen) - {1})
    config = json.loads((run / "convert" / "model" / "config.json").read_text())
    assert config["converted_from"] == [
        {"model": str(start["model"]), "layer_mixers": ["attention", "sila"] + 2 * ["attention"]}
    ]
    first, converted = read_weights(start["model"]), read_weights(run / "convert" / "model")
    aligned, trained = read_weights(run / "align" / "model"), read_weights(run / "train" / "model")
    mixer_1 = [name for name in first if name.startswith("model.layers.1.self_attn.")]
    assert all(
        torch.equal(converted[name], first[name]) and torch.equal(aligned[name], first[name]) for name in mixer_1
    )

    # align: the new layers only, against the start hybrid; the weights stage reads the teacher
    assert set(done["align"]["final_layer_losses"]) == {str(i) for i in new}
    assert loaded == [str(start["model"]), None]
    for i in new:
        mixer = [name for name in converted if name.startswith(f"model.layers.{i}.self_attn.")]
        assert any(not torch.equal(aligned[name], converted[name]) for name in mixer), i
    assert all(torch.equal(aligned[n], t) for n, t in converted.items() if ".self_attn." not in n)
    # train trains every mixer again, the start's among them
    assert any(not torch.equal(trained[name], first[name]) for name in mixer_1)
    assert not done["weights"].get("skipped")

    again = parse_recipe(further | {"start_from": str(start["model"].parent / "run" / "align" / "model")})
    with pytest.raises(ValueError, match=r"stage 'convert' .*\(changed: start_from\).*--redo convert"):
        run_recipe(again, run, stages=["convert", "align"])
