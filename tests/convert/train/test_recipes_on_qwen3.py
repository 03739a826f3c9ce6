"""The SmolLM2 recipes hold nothing of SmolLM2: with only --src changed the SILA one converts and trains a Qwen3
teacher (its q_norm/k_norm, 24 layers: auto:15 still means 15), through every training stage. Budgets shrink to
CPU size; the recipe's layers, layer choice, mixer settings, retrieval data, token weights and extend stay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raven_convert.train.recipe import load_recipe
from raven_convert.train.stages import run_recipe
from tests.helpers import words_corpus as make_words_corpus

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
CPU_BUDGET = [  # sizes and steps only
    "data.seq_len=64",
    "data.validation_fraction=0.1",
    "layer_choice.samples=2",
    "layer_choice.text_rows=1",
    "layer_choice.seq_len=96",
    "layer_choice.window=8",
    "layer_choice.rounds=1",
    "layer_choice.fit_steps=2",
    "layer_choice.fit_rows=2",
    "layer_choice.fit_batch_size=1",
    "align.steps=2",
    "align.batch_size=1",
    "token_weights.batch_size=4",
    "train.steps=2",
    "train.batch_size=1",
    "train.eval_batches=1",
    "extend.seq_len=128",
    "extend.steps=1",
    "extend.batch_size=1",
    "extend.eval_batches=1",
    "evaluate=null",
    "export=null",
]


@pytest.fixture(scope="module")
def words_corpus(tmp_path_factory) -> Path:
    """30 documents over 80 made-up words: enough distinct words for the retrieval samples and the probes."""
    return make_words_corpus(tmp_path_factory.mktemp("corpus"), documents=30, words_per_document=120)


@pytest.mark.parametrize("mixer", ["sila"])  # the best recipe, and the one that reads the teacher's attention most
def test_the_smollm2_recipe_trains_a_qwen3_teacher(mixer, tiny_sources, words_corpus, tmp_path):
    inputs = [f"source={tiny_sources['qwen3']}", f"data.source={words_corpus}"]
    recipe = load_recipe(RECIPES / f"smollm2-{mixer}.yaml", inputs + CPU_BUDGET)
    assert recipe.auto() == (mixer, 15) and recipe.data.retrieval is not None and recipe.extend is not None
    done = run_recipe(recipe, tmp_path / "run", stages=["convert", "align", "weights", "train", "extend"])
    choice = done["convert"]["layer_choice"]
    assert len(choice["chosen"]) == 15 and len(choice["score"]) == 24
    assert (done["weights"].get("skipped") is True) == (mixer != "sila")  # SILA's token weights, from Qwen3
    assert done["extend"]["seq_len"] == 128 and done["extend"]["steps_this_run"] == 1
    config = json.loads((tmp_path / "run" / done["extend"]["model"] / "config.json").read_text())
    assert [i for i, kind in enumerate(config["layer_mixers"]) if kind == mixer] == choice["chosen"]
