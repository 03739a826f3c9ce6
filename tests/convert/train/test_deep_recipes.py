"""The deep SILA recipes (smollm2-sila-deep22/26.yaml) convert 22 and 26 of 30 layers: 22 chosen as the half-depth
recipe chooses (each layer cut in turn), 26 by restoring attention into the model with every layer ablated. Their
convert stage, on a 30-layer tiny Llama at CPU size."""

from __future__ import annotations

import json

import pytest

from raven_convert.train.recipe import load_recipe
from raven_convert.train.stages import run_recipe
from tests.conftest import make_tiny_source
from tests.convert.train.test_recipes_on_qwen3 import CPU_BUDGET, RECIPES
from tests.helpers import words_corpus as make_words_corpus


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("deep")
    teacher = make_tiny_source("llama", root / "llama", num_hidden_layers=30)
    corpus = make_words_corpus(root / "corpus", documents=30, words_per_document=120)
    return [f"source={teacher}", f"data.source={corpus}"]


@pytest.mark.parametrize("depth, direction", [(22, "cut"), (26, "restore")])
def test_the_deep_recipes_convert_their_depth(depth, direction, inputs, tmp_path):
    budget = [o for o in CPU_BUDGET if not o.startswith("layer_choice.rounds")]  # the recipes' own rounds kept
    recipe = load_recipe(RECIPES / f"smollm2-sila-deep{depth}.yaml", inputs + budget)
    assert recipe.auto() == ("sila", depth) and recipe.layer_choice.direction == direction
    half = load_recipe(RECIPES / "smollm2-sila.yaml", inputs + budget)
    assert recipe.model_dump(exclude={"layers", "layer_choice"}) == half.model_dump(exclude={"layers", "layer_choice"})
    done = run_recipe(recipe, tmp_path / "run", stages=["convert"])
    choice = done["convert"]["layer_choice"]
    assert len(choice["chosen"]) == depth and choice["chosen"] == sorted(choice["order"][:depth])
    record = json.loads((tmp_path / "run" / done["convert"]["model"] / "config.json").read_text())["layer_choice"]
    assert record["direction"] == direction
    if direction == "restore":  # eight rounds of four: the 4 kept come from the first
        assert max(record["round"]) == 8
        assert {record["round"][i] for i in range(30) if i not in choice["chosen"]} == {1}
