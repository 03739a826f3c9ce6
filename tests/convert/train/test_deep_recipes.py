"""The deep SILA recipes (smollm2-sila-deep22/26.yaml) convert 22 and 26 of 30 layers: 22 chosen as the half-depth
recipe chooses (each layer cut in turn), 26 by restoring attention into the model with every layer ablated; the
progressive one converts the half-depth recipe's hybrid further to 22. Their convert stage, on a 30-layer tiny Llama
at CPU size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raven_convert.train.recipe import load_recipe
from raven_convert.train.stages import run_recipe
from tests.conftest import make_tiny_source
from tests.convert.train.test_recipe import header_command, header_commands
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


def test_the_progressive_recipe_converts_the_half_depth_hybrid_further(inputs, tmp_path):
    """smollm2-sila-deep22-progressive.yaml: its header runs smollm2-sila.yaml first and then itself, starting from
    the model the first exports; it is deep22's recipe but for start_from and half its align and train steps; its
    convert stage keeps the 15 layers the first step converted and converts 7 more."""
    path = RECIPES / "smollm2-sila-deep22-progressive.yaml"
    first, second = header_commands(path)
    assert first == header_command(RECIPES / "smollm2-sila.yaml") and second == header_command(path)
    bare, deep = load_recipe(path), load_recipe(RECIPES / "smollm2-sila-deep22.yaml")
    assert bare.start_from == str(Path.cwd() / first[first.index("--run-dir") + 1] / "model")
    assert (bare.align.steps, bare.train.steps) == (deep.align.steps // 2, deep.train.steps // 2)
    differ = {"start_from", "align", "train"}
    assert bare.model_dump(exclude=differ) == deep.model_dump(exclude=differ)
    assert bare.align.model_dump(exclude={"steps"}) == deep.align.model_dump(exclude={"steps"})
    assert bare.train.model_dump(exclude={"steps", "warmup_steps"}) == deep.train.model_dump(
        exclude={"steps", "warmup_steps"}
    )

    budget = [o for o in CPU_BUDGET if not o.startswith("layer_choice.rounds")]
    half = run_recipe(load_recipe(RECIPES / "smollm2-sila.yaml", inputs + budget), tmp_path / "half", ["convert"])
    start = tmp_path / "half" / half["convert"]["model"]
    recipe = load_recipe(path, inputs + budget + [f"start_from={json.dumps(str(start))}"])
    assert recipe.auto() == ("sila", 22) and recipe.start_from == str(start)
    choice = run_recipe(recipe, tmp_path / "run", stages=["convert"])["convert"]["layer_choice"]
    assert choice["fixed"] == half["convert"]["layer_choice"]["chosen"] and len(choice["fixed"]) == 15
    assert len(choice["chosen"]) == 22 and set(choice["fixed"]) < set(choice["chosen"])
    assert sorted(choice["order"]) == [i for i in range(30) if i not in choice["fixed"]]
