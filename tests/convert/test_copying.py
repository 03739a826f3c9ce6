"""copying.py: each head's induction, duplicate-token and previous-token weights, read exactly from eager attention
on a Transformer and on a hybrid's kept layers; `layer_choice.keep_copying` keeps the layers of the strongest
induction heads as attention under auto:N, its scan cached as without it, and refuses more than auto:N leaves."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert.cli import main
from raven_convert.copying import attention_weights, copying_scores, head_scores, most_copying, repeated_tokens
from raven_convert.layer_choice import ChoiceSettings
from raven_convert.sources import Source
from raven_convert.surgery import build_hybrid
from raven_convert.train.recipe import load_recipe
from raven_convert.train.stages import run_recipe
from tests.conftest import make_tiny_source
from tests.convert.test_layer_choice import SMALL_FLAGS
from tests.convert.train.test_recipes_on_qwen3 import RECIPES
from tests.helpers import words_corpus as make_words_corpus


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_source("llama", tmp_path_factory.mktemp("copying") / "llama", num_hidden_layers=6)


def test_head_scores_read_the_weights_each_pattern_puts_where_it_looks():
    L = 4
    induction = torch.zeros(1, 1, 2 * L, 2 * L)
    previous = torch.zeros(1, 1, 2 * L, 2 * L)
    for t in range(L, 2 * L - 1):
        induction[0, 0, t, t - L + 1] = 1.0  # to the token after the earlier occurrence
    for t in range(1, 2 * L):
        previous[0, 0, t, t - 1] = 0.5
    (a,) = head_scores({3: torch.cat([induction, previous], dim=1)}, L)
    assert a["layer"] == 3
    assert a["induction"] == pytest.approx([1.0, 0.0])
    assert a["duplicate"] == pytest.approx([0.0, 0.0])
    assert a["previous"] == pytest.approx([0.0, 0.5])


def test_repeated_tokens_repeat_each_row_past_the_vocabularys_first_eighth():
    ids = repeated_tokens(vocab_size=128, rows=3, length=10, seed=0)
    assert ids.shape == (3, 20) and torch.equal(ids[:, :10], ids[:, 10:])
    assert int(ids.min()) >= 16 and int(ids.max()) < 128
    assert torch.equal(ids, repeated_tokens(128, 3, 10, 0))


def test_the_weights_are_the_transformers_own_and_a_hybrid_has_them_where_it_kept_attention(teacher):
    model = Source.resolve(str(teacher)).load_model("float32")
    implementation = model.config._attn_implementation
    ids = repeated_tokens(model.config.vocab_size, 2, 12, seed=0)
    weights = attention_weights(model, ids)
    assert model.config._attn_implementation == implementation  # left as it was
    reference = AutoModelForCausalLM.from_pretrained(teacher, attn_implementation="eager")
    with torch.no_grad():
        expected = reference(ids, output_attentions=True).attentions
    assert sorted(weights) == list(range(6))
    for i in range(6):
        torch.testing.assert_close(weights[i], expected[i])
    scores = copying_scores(model, length=12, rows=2)
    assert scores == [max(row["induction"]) for row in head_scores(weights, 12)]

    hybrid = build_hybrid(model, ["attention", "sila", "attention", "attention", "sila", "attention"], {})
    scores = copying_scores(hybrid, length=12, rows=2)
    assert [i for i, s in enumerate(scores) if s is None] == [1, 4] and all(0 < s <= 1 for s in scores if s)
    with pytest.raises(ValueError, match="length 300 repeated needs 600 positions; the model has 512"):
        copying_scores(model, length=300)


def test_most_copying_takes_the_highest_scores_leaving_converted_layers_out():
    assert most_copying([0.1, None, 0.9, 0.3, 0.9], 2) == [2, 4]
    assert most_copying([0.5, 0.5, 0.1], 1) == [0]  # a tie to the lower layer
    assert most_copying([None, 0.2], 3) == [1]


def test_keep_copying_keeps_the_strongest_induction_layers_under_auto_n(teacher, tmp_path, capsys):
    corpus = make_words_corpus(tmp_path / "corpus")

    def convert(out, *extra):
        argv = ["--src", str(teacher), "--mixer", "sila", "--sila-conv-size", "2", "--layers", "auto:4"]
        argv += ["--out", str(out), "--choice-data", str(corpus), "--choice-cache", str(tmp_path / "cache")]
        assert main(argv + SMALL_FLAGS + list(extra)) == 0
        printed = capsys.readouterr().out
        return json.loads((out / "config.json").read_text())["layer_choice"], printed

    plain, _ = convert(tmp_path / "plain")
    record, printed = convert(tmp_path / "kept", "--choice-keep-copying", "2")
    assert "scores read from" in printed  # the same scan: keep_copying is not in the cache key
    model = Source.resolve(str(teacher)).load_model("float32")
    kept = most_copying(copying_scores(model), 2)
    assert record["kept_copying"] == kept and not set(kept) & set(record["chosen"]) and len(record["chosen"]) == 4
    assert sorted(record["order"][-2:]) == kept  # ranked last, in the scan's order: auto:N keeps them
    rest = [i for i in plain["order"] if i not in kept]
    assert record["order"][:4] == rest[:4] and record["chosen"] == sorted(rest[:4])  # the scan chose the rest
    assert record["copying"] == pytest.approx(copying_scores(model), abs=1e-6)
    assert f"kept for copying (the strongest induction heads): {kept[0]}, {kept[1]}" in printed
    assert "copying  rank  converted" in printed
    card = (tmp_path / "kept" / "README.md").read_text()
    assert (
        f"layers of the strongest induction heads (copying earlier tokens, on random tokens repeated): {kept[0]}"
        in card
    )


def test_keep_copying_refuses_more_layers_than_auto_n_keeps_before_loading(teacher, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Source, "load_model", lambda *a, **k: pytest.fail("loaded the model despite bad input"))
    corpus = make_words_corpus(tmp_path / "corpus")
    argv = ["--src", str(teacher), "--mixer", "sila", "--layers", "auto:5", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        main(argv + ["--choice-data", str(corpus), "--choice-keep-copying", "2"])
    err = capsys.readouterr().err
    assert "layer_choice.keep_copying (--choice-keep-copying) 2: auto:5 keeps 1 of the 6 layers as attention" in err
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        ChoiceSettings(keep_copying=-1)


def test_a_recipe_asking_more_copying_layers_than_auto_n_keeps_is_refused_before_any_stage(teacher, tmp_path):
    corpus = make_words_corpus(tmp_path / "corpus")
    overrides = [f"source={teacher}", f"data.source={corpus}", 'layers=[{mixer: sila, layers: "auto:5"}]']
    recipe = load_recipe(RECIPES / "smollm2-sila-deep26.yaml", overrides)  # keep_copying: 4
    with pytest.raises(ValueError, match="keep_copying .* 4: auto:5 keeps 1 of the 6 layers as attention"):
        run_recipe(recipe, tmp_path / "run", stages=["convert"])
    assert not (tmp_path / "run" / "convert").exists()
