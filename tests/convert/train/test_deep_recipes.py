"""The deep SILA recipes (smollm2-sila-deep22/26.yaml) convert 22 and 26 of 30 layers: 22 as the half-depth recipe's
layer choice picked them for SmolLM2 (each layer cut in turn), 26 around the 4 layers that copy most, both with a
memory per query head; the progressive one converts the half-depth recipe's hybrid
further to 22. Their convert stage (and the 22-layer one's training stages), on a 30-layer tiny Llama at CPU size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert.copying import copying_scores, most_copying
from raven_convert.layer_spec import parse_layer_spec
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


def test_the_deep22_recipe_trains_its_22_layers_with_a_memory_per_query_head(inputs, tmp_path):
    """smollm2-sila-deep22.yaml writes out the 22 layers auto:22 picked for SmolLM2 (its header says so) and gives
    each query head its own memory; the rest is the half-depth recipe. Converted, each of its layers keeps as many
    memories as the teacher has query heads (the tiny Llama: 4, over 2 kv heads), whose k/v rows start as copies of
    their kv head's; every training stage runs on them, and training sets the copies apart."""
    recipe = load_recipe(RECIPES / "smollm2-sila-deep22.yaml", inputs + CPU_BUDGET)
    (assignment,) = recipe.layers
    layers = parse_layer_spec(assignment.layers, 30)
    assert assignment.mixer == "sila" and len(layers) == 22 and recipe.auto() is None
    assert recipe.layer_choice.ablation == "both" and recipe.layer_choice.direction == "cut"  # for auto:N elsewhere
    assert recipe.mixer_settings["sila"] == {"conv_size": 4, "state_heads": "query"}
    half = load_recipe(RECIPES / "smollm2-sila.yaml", inputs + CPU_BUDGET)
    own = {"layers", "layer_choice", "mixer_settings"}
    assert recipe.model_dump(exclude=own) == half.model_dump(exclude=own)
    done = run_recipe(recipe, tmp_path / "run", stages=["convert", "align", "weights", "train", "extend"])

    def k_copies(stage: str) -> list[torch.Tensor]:
        """Per converted layer, the k projection's rows as [kv head, its 2 query heads' copies, rows a head]."""
        path = tmp_path / "run" / done[stage]["model"]
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        mixers = [layer.self_attn for i, layer in enumerate(model.model.layers) if i in layers]
        assert len(mixers) == 22 and {(m.num_kv_heads, m.source_kv_heads) for m in mixers} == {(4, 2)}
        return [m.k_proj.weight.detach().unflatten(0, (2, 2, -1)) for m in mixers]

    assert all(torch.equal(k[:, 0], k[:, 1]) for k in k_copies("convert"))
    assert done["extend"]["steps_this_run"] == 1
    assert all(not torch.equal(k[:, 0], k[:, 1]) for k in k_copies("extend"))


def test_the_deep26_recipe_keeps_the_four_layers_that_copy_most(inputs, tmp_path):
    """smollm2-sila-deep26.yaml writes out the 26 layers around the 4 that copy most in SmolLM2 (the induction
    scores in docs/results/depth/induction_scores.json), with a memory per query head; the rest is the half-depth
    recipe. Its layer choice, for auto:N, keeps the 4 layers of the strongest induction heads whatever the restoring
    scan says: on the tiny Llama auto:26 converts all but those 4."""
    recipe = load_recipe(RECIPES / "smollm2-sila-deep26.yaml", inputs + CPU_BUDGET)
    (assignment,) = recipe.layers
    layers = parse_layer_spec(assignment.layers, 30)
    measured = json.loads((RECIPES.parent / "docs/results/depth/induction_scores.json").read_text())["layers"]
    kept = most_copying([max(row["induction"]) for row in measured], 4)
    assert len(layers) == 26 and sorted(set(range(30)) - set(layers)) == kept == [17, 18, 20, 23]
    assert recipe.mixer_settings["sila"] == {"conv_size": 4, "state_heads": "query"}
    choice = recipe.layer_choice
    assert (choice.ablation, choice.direction, choice.keep_copying) == ("both", "restore", 4)
    half = load_recipe(RECIPES / "smollm2-sila.yaml", inputs + CPU_BUDGET)
    own = {"layers", "layer_choice", "mixer_settings"}
    assert recipe.model_dump(exclude=own) == half.model_dump(exclude=own)

    auto = load_recipe(
        RECIPES / "smollm2-sila-deep26.yaml", inputs + CPU_BUDGET + ['layers=[{mixer: sila, layers: "auto:26"}]']
    )
    done = run_recipe(auto, tmp_path / "run", stages=["convert"])
    record = json.loads((tmp_path / "run" / done["convert"]["model"] / "config.json").read_text())["layer_choice"]
    teacher = AutoModelForCausalLM.from_pretrained(inputs[0].split("=", 1)[1])
    assert (
        record["kept_copying"]
        == most_copying(copying_scores(teacher), 4)
        == sorted(set(range(30)) - set(record["chosen"]))
    )


def test_the_progressive_recipe_converts_the_half_depth_hybrid_further(inputs, tmp_path):
    """smollm2-sila-deep22-progressive.yaml: its header runs smollm2-sila.yaml first and then itself, starting from
    the model the first exports; it is deep22's recipe but for start_from, half its align and train steps, and its
    layers (auto:22, the 15 of the first step kept) with their memory per kv head, as measured; its convert stage
    keeps the 15 layers the first step converted and converts 7 more."""
    path = RECIPES / "smollm2-sila-deep22-progressive.yaml"
    first, second = header_commands(path)
    assert first == header_command(RECIPES / "smollm2-sila.yaml") and second == header_command(path)
    bare, deep = load_recipe(path), load_recipe(RECIPES / "smollm2-sila-deep22.yaml")
    assert bare.start_from == str(Path.cwd() / first[first.index("--run-dir") + 1] / "model")
    assert (bare.align.steps, bare.train.steps) == (deep.align.steps // 2, deep.train.steps // 2)
    differ = {"start_from", "align", "train", "layers", "mixer_settings"}
    assert bare.auto() == ("sila", 22) and bare.mixer_settings["sila"] == {"conv_size": 4}
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
