"""--layers auto:N: seeded, cached layer scores; the N lowest converted; the choice recorded in config, card and
DONE; the grammar's errors in the CLI and in recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raven_convert import layer_choice, layer_choice_report, layer_scan
from raven_convert.cli import main
from raven_convert.layer_choice import ChoiceSettings, build_probes, choice_record, rank_layers
from raven_convert.layer_spec import auto_count
from raven_convert.sources import Source
from raven_convert.train.choice_parts import training_parts
from raven_convert.train.data import load_documents
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stages import run_recipe
from tests.conftest import make_tiny_source
from tests.helpers import read_weights
from tests.helpers import words_corpus as make_words_corpus

PARTS = training_parts()
SMALL = ChoiceSettings(window=8, samples=3, text_rows=2, seq_len=96, rounds=2, batch_size=4)
SMALL_FLAGS = ["--choice-window", "8", "--choice-samples", "3", "--choice-text-rows", "2", "--choice-seq-len", "96"]


@pytest.fixture(scope="module")
def words_corpus(tmp_path_factory) -> Path:
    """A folder with one .jsonl of 20 documents over 80 made-up words (the probes need 32 distinct ones)."""
    return make_words_corpus(tmp_path_factory.mktemp("words"))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return make_tiny_source("llama", tmp_path_factory.mktemp("teacher") / "llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def loaded(teacher):
    source = Source.resolve(str(teacher))
    return source.load_model("float32"), source.load_tokenizer()


def test_auto_grammar():
    assert auto_count("auto:3") == 3
    assert auto_count(" AUTO:29 ", 30) == 29
    assert auto_count("0-29:2", 30) is None
    for bad, problem in [("auto:0", "N = 0 is out of range"), ("auto:abc", "'abc' is not a number of layers")]:
        with pytest.raises(ValueError, match=problem):
            auto_count(bad, 30)
    with pytest.raises(ValueError, match=r"auto:30.*from 1 to 29 \(the model has 30 layers"):
        auto_count("auto:30", 30)
    with pytest.raises(ValueError, match="N is missing"):
        auto_count("auto", 30)


def test_probes_come_from_the_training_generator(words_corpus, loaded):
    _, tokenizer = loaded
    probes = build_probes(load_documents(str(words_corpus)), tokenizer, SMALL, PARTS)
    assert len(probes["retrieval"]) == 3 and len(probes["text"]) == 2
    for ids, start in probes["retrieval"]:
        assert len(ids) <= SMALL.seq_len and 0 < start < len(ids)
    assert all(len(row) == SMALL.seq_len for row in probes["text"])
    again = build_probes(load_documents(str(words_corpus)), tokenizer, SMALL, PARTS)
    assert again == probes  # seeded
    other = build_probes(load_documents(str(words_corpus)), tokenizer, SMALL.model_copy(update={"seed": 1}), PARTS)
    assert other["retrieval"] != probes["retrieval"]


def test_scores_are_seeded_and_cached(words_corpus, loaded, tmp_path, monkeypatch):
    model, tokenizer = loaded
    first = rank_layers(
        model, tokenizer, load_documents(str(words_corpus)), SMALL, tmp_path / "a", log=lambda m: None, parts=PARTS
    )
    again = rank_layers(
        model, tokenizer, load_documents(str(words_corpus)), SMALL, tmp_path / "b", log=lambda m: None, parts=PARTS
    )
    assert first["ranking"] == again["ranking"] and first["key"] == again["key"]  # a fresh cache: same scores
    assert sorted(row["layer"] for row in first["ranking"]) == list(range(6))
    assert [row["round"] for row in first["ranking"]] == [1, 1, 1, 2, 2, 2]  # 2 rounds of 3 layers each

    def no_scan(*args, **kwargs):
        raise AssertionError("scored again despite the cache")

    monkeypatch.setattr(layer_choice, "score_layers", no_scan)
    cached = rank_layers(
        model, tokenizer, load_documents(str(words_corpus)), SMALL, tmp_path / "a", log=print, parts=PARTS
    )
    assert cached == first


def _fake_scores(monkeypatch, important: int | None = None, calls: list | None = None):
    """score_layers replaced by one ranking layers by index, descending (layer 5 lowest), with `important` highest."""

    def fake(hybrid, probes, settings, eos, log=print, fitted=None):
        if calls is not None:
            calls.append(1)
        L = len(hybrid.model.layers)
        scores = {i: float(L - i) + (100.0 if i == important else 0.0) for i in range(L)}
        rows = [{"layer": i, "round": 1, "retrieval": s, "kl": 0.0, "score": s} for i, s in scores.items()]
        return sorted(rows, key=lambda r: r["score"])

    monkeypatch.setattr(layer_choice, "score_layers", fake)


def test_auto_n_converts_the_n_lowest(loaded, words_corpus, tmp_path, monkeypatch):
    model, tokenizer = loaded

    def rank(**settings):
        corpus = load_documents(str(words_corpus))
        return rank_layers(
            model, tokenizer, corpus, SMALL.model_copy(update=settings), tmp_path, log=lambda m: None, parts=PARTS
        )

    result = rank(rounds=1)
    for n in (1, 3, 5):
        record = choice_record(result, n)
        scores = record["score"]
        assert len(record["chosen"]) == n
        kept = [i for i in range(6) if i not in record["chosen"]]
        assert max(scores[i] for i in record["chosen"]) <= min(scores[i] for i in kept)
    _fake_scores(monkeypatch, important=5)
    result = rank(seed=3)
    assert choice_record(result, 5)["chosen"] == [0, 1, 2, 3, 4]  # layer 5, the lowest but made important, kept
    assert choice_record(result, 2)["chosen"] == [3, 4]


def test_cli_auto_end_to_end(teacher, words_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--src",
        str(teacher),
        "--mixer",
        "sse",
        "--sse-lora-rank",
        "8",
        "--layers",
        "auto:2",
        "--out",
        str(out),
        "--choice-data",
        str(words_corpus),
        "--choice-cache",
        str(tmp_path / "cache"),
        *SMALL_FLAGS,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "layer  round  retrieval" in printed and "layer map:" in printed
    config = json.loads((out / "config.json").read_text())
    record = config["layer_choice"]
    assert len(record["chosen"]) == 2 and len(record["score"]) == 6 and record["seed"] == 0
    assert [i for i, k in enumerate(config["layer_mixers"]) if k == "sse"] == record["chosen"]
    card = (out / "README.md").read_text()
    assert "## Layer choice" in card and f"- converted: {', '.join(map(str, record['chosen']))}" in card
    assert (out / "layer_choice.png").read_bytes()[:4] == b"\x89PNG"
    from raven_layers import HybridForCausalLM

    reloaded = HybridForCausalLM.from_pretrained(str(out))  # the record survives a reload and a re-save
    assert reloaded.config.layer_choice == record


@pytest.mark.parametrize(
    ("layers", "extra", "problem"),
    [
        ("auto:0", [], "N = 0 is out of range; expected auto:N with N a whole number from 1 to 5"),
        ("auto:6", [], "N = 6 is out of range"),
        ("auto:abc", [], "'abc' is not a number of layers"),
        ("auto:2", ["--layers", "0"], "must come alone"),
        ("auto:2", ["--sliding-window", "4", "--window-layers", "0"], "--window-layers '0' cannot name kept layers"),
        ("auto:2", ["--choice-ablation", "mixers"], "expected one of ['window', 'mixer', 'both'], got 'mixers'"),
    ],
)
def test_cli_refuses_bad_auto(teacher, words_corpus, tmp_path, capsys, monkeypatch, layers, extra, problem):
    monkeypatch.setattr(Source, "load_model", lambda *a, **k: pytest.fail("loaded the model despite bad input"))
    argv = [
        "--src",
        str(teacher),
        "--mixer",
        "sse",
        "--layers",
        layers,
        "--out",
        str(tmp_path / "o"),
        "--choice-data",
        str(words_corpus),
        *extra,
    ]
    if extra[:1] == ["--layers"]:
        argv[2:2] = ["--mixer", "sse"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert problem in capsys.readouterr().err


def test_cli_needs_choice_data(teacher, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Source, "load_model", lambda *a, **k: pytest.fail("loaded the model despite bad input"))
    with pytest.raises(SystemExit):
        main(["--src", str(teacher), "--layers", "auto:2", "--out", str(tmp_path / "o")])
    assert "pass --choice-data PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "--src",
                str(teacher),
                "--layers",
                "auto:2",
                "--out",
                str(tmp_path / "o"),
                "--choice-data",
                str(tmp_path / "missing"),
                "--choice-window",
                "0",
            ]
        )
    assert "--choice-window 0: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_cli_choice_options_need_auto(teacher, words_corpus, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--src", str(teacher), "--layers", "0", "--out", str(tmp_path / "o"), "--choice-data", str(words_corpus)])
    assert "no --layers is auto:N" in capsys.readouterr().err


def _recipe(teacher, corpus, layers="auto:2", **extra) -> dict:
    return {
        "source": str(teacher),
        "layers": [{"mixer": "sse", "layers": layers}],
        "mixer_settings": {"sse": {"lora_rank": 8}},
        "dtype": "float32",
        "layer_choice": SMALL.model_dump(),
        "data": {"source": str(corpus), "seq_len": 32, "validation_fraction": 0.1},
        **extra,
    }


FIT = SMALL.model_copy(update={"ablation": "mixer", "fit_steps": 4, "fit_rows": 4, "fit_batch_size": 2, "rounds": 1})


def test_mixer_ablation_keeps_the_layer_its_mixer_imitates_worst(words_corpus, loaded, tmp_path, monkeypatch):
    """ablation "mixer": the mixers of every layer are aligned, then each replaces its layer in the scan; a mixer
    made to imitate badly (its output scaled up) makes its layer the one most worth keeping."""
    model, tokenizer = loaded
    corpus = str(words_corpus)
    with pytest.raises(ValueError, match="needs the mixer to fit"):
        rank_layers(model, tokenizer, load_documents(corpus), FIT, tmp_path, log=lambda m: None, parts=PARTS)
    fits, real = [], layer_choice.fit_mixers

    def spoiled(source, teacher, mixer, rows, settings, log=print, *, align):
        fits.append((mixer, len(rows)))
        fitted = real(source, teacher, mixer, rows, settings, log, align=align)
        with torch.no_grad():
            fitted.model.layers[2].self_attn.o_proj.weight.mul_(30.0)
        return fitted

    monkeypatch.setattr(layer_choice, "fit_mixers", spoiled)
    mixer = ("sila", {"conv_size": 2})
    result = rank_layers(
        model, tokenizer, load_documents(corpus), FIT, tmp_path, log=lambda m: None, mixer=mixer, parts=PARTS
    )
    assert fits == [(mixer, 4)]
    assert result["ranking"][-1]["layer"] == 2 and result["mixer"] == {"name": "sila", "settings": {"conv_size": 2}}
    record = choice_record(result, 3)
    assert "aligned mixers" in record["method"] and 2 not in record["chosen"]
    assert "replaced by its sila mixer after 4 align steps" in layer_choice_report.card_section(record)
    layer_choice_report.plot_choice(record, tmp_path / "choice.png")
    windows = rank_layers(model, tokenizer, load_documents(corpus), SMALL, tmp_path, log=lambda m: None, parts=PARTS)
    other = rank_layers(
        model, tokenizer, load_documents(corpus), FIT, tmp_path, lambda m: None, ("raven", {}), parts=PARTS
    )
    assert len({result["key"], windows["key"], other["key"]}) == 3  # the mixer and its settings are in the key
    assert len(fits) == 2


def test_both_sums_the_window_and_the_mixer_scores(words_corpus, loaded, tmp_path):
    """ablation "both": each layer scored windowed and replaced by its fitted mixer, the two scores summed (one
    round: the same base for the three scans of the same probes); the record, table and card show the parts."""
    from raven_convert.surgery import build_hybrid

    model, tokenizer = loaded
    both_settings = FIT.model_copy(update={"ablation": "both"})
    probes = build_probes(load_documents(str(words_corpus)), tokenizer, both_settings, PARTS)
    hybrid = build_hybrid(model, ["attention"] * 6, {}).eval()
    mixer = ("sila", {"conv_size": 2})
    fitted = layer_choice.fit_mixers(model, hybrid, mixer, probes["fit"], FIT, log=lambda m: None, align=PARTS.align)

    def scores(ablation, fitted):
        settings = FIT.model_copy(update={"ablation": ablation})
        rows = layer_scan.score_layers(hybrid, probes, settings, 0, lambda m: None, fitted)
        assert [row["score"] for row in rows] == sorted(row["score"] for row in rows)
        return {row["layer"]: row for row in rows}

    window, fit, both = scores("window", None), scores("mixer", fitted), scores("both", fitted)
    for i in range(6):
        assert both[i]["parts"] == pytest.approx({"window": window[i]["score"], "mixer": fit[i]["score"]}, abs=1e-6)
        assert both[i]["score"] == pytest.approx(window[i]["score"] + fit[i]["score"], abs=1e-6)
        assert both[i]["kl"] == pytest.approx(window[i]["kl"] + fit[i]["kl"], abs=1e-6)
    result = rank_layers(
        model, tokenizer, load_documents(str(words_corpus)), both_settings, tmp_path, print, mixer, parts=PARTS
    )
    record = choice_record(result, 3)
    assert sorted(record["parts"]) == ["mixer", "window"] and "plus replacement" in record["method"]
    table = layer_choice_report.format_table(record)
    assert "the sum over the window and the mixer" in table and "  window     mixer" in table
    card = layer_choice_report.card_section(record)
    assert "cut to 8 tokens, and with the layer's attention replaced by its sila mixer" in card
    assert "the sum over both ablations" in card
    assert "| layer | round | retrieval | KL | window | mixer | score |" in card
    row = f"| 0 | 1 | {record['retrieval'][0]:.4f} | {record['kl'][0]:.4f} | {record['parts']['window'][0]:.4f} | "
    assert row in card


def test_recipe_fits_its_own_mixer(teacher, words_corpus, tmp_path):
    """The recipe's mixer settings build the fitted mixers (SSE's default LoRA rank does not fit the tiny model)."""
    with pytest.raises(ValueError, match=r"layer_choice.ablation: Input should be 'window', 'mixer' or 'both'"):
        parse_recipe(_recipe(teacher, words_corpus, layer_choice={"ablation": "mixers"}))
    recipe = parse_recipe(_recipe(teacher, words_corpus, layer_choice=FIT.model_dump()))
    done = run_recipe(recipe, tmp_path / "run", stages=["convert"])["convert"]
    assert len(done["layer_choice"]["chosen"]) == 2


def test_recipe_parsing(teacher, words_corpus, tmp_path):
    assert parse_recipe(_recipe(teacher, words_corpus)).auto() == ("sse", 2)
    for layers, problem in [
        ("auto:0", "layers.0.layers: Value error, layers 'auto:0': N = 0 is out of range"),
        ("auto:abc", "'abc' is not a number of layers"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_recipe(_recipe(teacher, words_corpus, layers))
    with pytest.raises(ValueError, match="layers auto:N chooses every converted layer"):
        parse_recipe(
            _recipe(teacher, words_corpus)
            | {"layers": [{"mixer": "sse", "layers": "auto:2"}, {"mixer": "sila", "layers": "0"}]}
        )
    with pytest.raises(ValueError, match=r"N = 6 is out of range; expected .* from 1 to 5 \(the model has 6"):
        run_recipe(parse_recipe(_recipe(teacher, words_corpus, "auto:6")), tmp_path / "run", stages=["convert"])
    assert not (tmp_path / "run" / "convert").exists()


def test_recipe_convert_stage_records_the_choice(teacher, words_corpus, tmp_path, monkeypatch):
    calls = []
    _fake_scores(monkeypatch, important=5, calls=calls)
    recipe = parse_recipe(_recipe(teacher, words_corpus))
    done = run_recipe(recipe, tmp_path / "run", stages=["convert"])["convert"]
    assert done["layer_choice"]["chosen"] == [3, 4]
    assert (tmp_path / "run" / done["picture"]).is_file()
    assert "layer_choice" in done["inputs"] and "data.source" in done["inputs"]
    assert any((tmp_path / "run" / "cache" / "layer_choice").glob("*.json"))
    run_recipe(
        recipe,
        tmp_path / "again",
        stages=["convert"],
    )
    assert len(calls) == 2  # another run dir has its own cache
    fixed = parse_recipe(_recipe(teacher, words_corpus, "0-5:2"))
    assert "layer_choice" not in run_recipe(fixed, tmp_path / "fixed", stages=["convert"])["convert"]["inputs"]
    windowed = parse_recipe(_recipe(teacher, words_corpus, sliding_window=4))  # the kept layers windowed
    run_recipe(windowed, tmp_path / "windowed", stages=["convert"])
    config = json.loads((tmp_path / "windowed" / "convert" / "model" / "config.json").read_text())
    kinds = config["layer_mixers"]
    assert [w for w, k in zip(config["attention_windows"], kinds) if k == "attention"] == [4] * (len(kinds) - 2)
    assert all(w is None for w, k in zip(config["attention_windows"], kinds) if k != "attention")


def test_scoring_reuses_the_prefix(loaded):
    """Windowing a layer changes nothing before it, and a window as long as the probe changes nothing at all."""
    model, _ = loaded
    from raven_convert.surgery import build_hybrid

    hybrid = build_hybrid(model, ["attention"] * 6, {})
    stack = layer_scan._Stack(hybrid, window=96)
    ids = torch.randint(3, 100, (2, 64))
    h, context = stack.start(ids)
    full = stack.finish(h, 0, context, {})
    reference = hybrid.model(ids).last_hidden_state
    torch.testing.assert_close(full, reference)
    assert torch.equal(
        stack.finish(h, 0, context, {2: "window", 4: "window"}), full
    )  # window 96 >= 64 tokens: no change


def _kl_past_window(logits: torch.Tensor, reference: torch.Tensor, window: int) -> float:
    """Mean KL(reference || model) over the positions from `window` on; [B, T, V] logits."""
    p = reference[:, window:].float().log_softmax(-1)
    q = logits[:, window:].float().log_softmax(-1)
    return ((p.exp() * (p - q)).sum(-1)).mean().item()


def test_restore_scores_what_restoring_a_layer_recovers(words_corpus, loaded, tmp_path, monkeypatch):
    """direction "restore": the base is the teacher with every layer replaced by its fitted mixer, and a layer's KL
    part is the base's KL to the teacher less the KL with that layer's attention restored (checked here through the
    model's own forward); a mixer made to imitate badly makes its layer the first kept, ranked last."""
    from raven_convert.surgery import build_hybrid

    model, tokenizer = loaded
    settings = FIT.model_copy(update={"ablation": "mixer", "direction": "restore", "text_rows": 2})
    probes = build_probes(load_documents(str(words_corpus)), tokenizer, settings, PARTS)
    hybrid = build_hybrid(model, ["attention"] * 6, {}).eval()
    fitted = layer_choice.fit_mixers(
        model, hybrid, ("sila", {"conv_size": 2}), probes["fit"], settings, print, align=PARTS.align
    )
    with torch.no_grad():
        fitted.model.layers[2].self_attn.o_proj.weight.mul_(30.0)
    rows = layer_scan.score_layers(hybrid, probes, settings, 0, lambda m: None, fitted)
    assert rows[-1]["layer"] == 2  # the spoiled mixer's layer recovers most: kept first
    assert [row["score"] for row in rows] == sorted(row["score"] for row in rows)  # one round: ascending

    ids = torch.tensor(probes["text"])  # [2, seq_len]
    attention = list(hybrid.model.layers)
    with torch.no_grad():
        teacher = hybrid(ids, use_cache=False).logits

        def kl_with(kept: set[int]) -> float:
            for j in range(6):
                hybrid.model.layers[j] = attention[j] if j in kept else fitted.model.layers[j]
            try:
                return _kl_past_window(hybrid(ids, use_cache=False).logits, teacher, settings.window)
            finally:
                for j in range(6):
                    hybrid.model.layers[j] = attention[j]

        base = kl_with(set())
        for row in rows:
            assert row["kl"] == pytest.approx(base - kl_with({row["layer"]}), abs=1e-4)

    greedy = layer_scan.score_layers(hybrid, probes, settings.model_copy(update={"rounds": 3}), 0, print, fitted)
    assert [row["round"] for row in greedy] == [3, 3, 2, 2, 1, 1]  # the first kept, in round 1, rank last
    assert greedy[-1]["layer"] == 2


def test_restore_is_its_own_cache_entry_and_recorded(teacher, words_corpus, loaded, tmp_path):
    """The direction is in the cache key (the default's key unchanged: older caches stay valid), the record, the
    table's title and the card."""
    model, tokenizer = loaded
    corpus = str(words_corpus)
    cut = rank_layers(model, tokenizer, load_documents(corpus), SMALL, tmp_path, log=lambda m: None, parts=PARTS)
    assert "direction" not in SMALL.key_fields()
    restore = SMALL.model_copy(update={"direction": "restore", "rounds": 1})
    result = rank_layers(model, tokenizer, load_documents(corpus), restore, tmp_path, log=lambda m: None, parts=PARTS)
    assert result["key"] != cut["key"]
    record = choice_record(result, 4)
    assert record["direction"] == "restore" and choice_record(cut, 4)["direction"] == "cut"
    assert record["chosen"] == sorted(record["order"][:4])
    assert record["score"][record["order"][-1]] == max(record["score"])  # the first kept recovers most
    assert "recovered by restoring" in layer_choice_report.format_table(record)
    card = layer_choice_report.card_section(record)
    assert "every layer but the kept ones ablated" in card and "the fall of the answer tokens' NLL" in card
    layer_choice_report.plot_choice(record, tmp_path / "restore.png")
    with pytest.raises(ValueError, match=r"layer_choice.direction: Input should be 'cut' or 'restore'"):
        parse_recipe(_recipe(teacher, words_corpus, layer_choice={"direction": "restores"}))


def test_round_sizes_schedule_the_greedy_rounds(words_corpus, loaded, tmp_path, teacher, capsys):
    """round_sizes: the layers each greedy round ranks in turn, the last round taking the rest (restore: the first
    kept layers one at a time); the cache key of settings without it is unchanged; --choice-round-sizes parses."""
    assert SMALL.schedule(6) == [3, 3] and SMALL.model_copy(update={"rounds": 4}).schedule(6) == [2, 2, 2]
    sizes = SMALL.model_copy(update={"round_sizes": [1, 1]})
    assert sizes.schedule(6) == [1, 1, 4] and "round_sizes" not in SMALL.key_fields()
    model, tokenizer = loaded
    restore = sizes.model_copy(update={"direction": "restore"})
    result = rank_layers(
        model, tokenizer, load_documents(str(words_corpus)), restore, tmp_path, log=lambda m: None, parts=PARTS
    )
    assert [row["round"] for row in result["ranking"]] == [3, 3, 3, 3, 2, 1]  # kept first: rounds 1 and 2, one each
    with pytest.raises(ValueError, match="round_sizes.0"):
        ChoiceSettings(round_sizes=[0])
    args = ["--src", str(teacher), "--layers", "auto:2", "--out", str(tmp_path / "out"), "--choice-data"]
    args += [str(words_corpus), "--choice-round-sizes", "1,x"]
    with pytest.raises(SystemExit):
        main(args)
    assert "expected a comma-separated list such as 1,1,2, got '1,x'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def half(teacher, tmp_path_factory) -> Path:
    """The 6-layer teacher with layers 1 and 4 converted to SILA (conv_size 2): a hybrid to convert further."""
    out = tmp_path_factory.mktemp("half") / "hybrid"
    argv = ["--src", str(teacher), "--mixer", "sila", "--sila-conv-size", "2", "--layers", "1,4", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_auto_n_on_a_hybrid_ranks_only_its_attention_layers(half, words_corpus, tmp_path):
    """A hybrid converted further is scanned as it is (its mixers run in every pass: the scan's base is the hybrid's
    own forward); every ablation and direction ranks its attention layers only, and auto:N converts N - 2 of them
    beside its two mixers."""
    source = Source.resolve(str(half))
    model, tokenizer = source.load_model("float32"), source.load_tokenizer()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    stack = layer_scan._Stack(model, window=8)
    ids = torch.randint(3, 100, (2, 48))
    with torch.no_grad():
        h, context = stack.start(ids)
        torch.testing.assert_close(stack.finish(h, 0, context, {}), model.model(ids).last_hidden_state)
    sila = ("sila", {"conv_size": 2})
    for settings in (
        SMALL,
        FIT.model_copy(update={"ablation": "both"}),
        FIT.model_copy(update={"direction": "restore"}),
    ):
        documents = load_documents(str(words_corpus))
        result = rank_layers(model, tokenizer, documents, settings, tmp_path, lambda m: None, sila, parts=PARTS)
        assert result["fixed"] == [1, 4] and sorted(row["layer"] for row in result["ranking"]) == [0, 2, 3, 5]
        record = choice_record(result, 4)
        assert record["fixed"] == [1, 4] and record["chosen"] == sorted([1, 4, *record["order"][:2]])
        assert [record["score"][i] for i in (1, 4)] == [None, None] and record["score"][record["order"][0]] is not None
        assert "   -  before" in layer_choice_report.format_table(record)
        card = layer_choice_report.card_section(record)
        assert "- converted before, by the source: 1, 4" in card and "| 1 | - | - | - |" in card
        layer_choice_report.plot_choice(record, tmp_path / "choice.png")
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())  # left as it was


def test_cli_auto_n_converts_a_hybrid_further(half, words_corpus, tmp_path, capsys):
    def convert(mixer: str, out):
        argv = ["--src", str(half), "--mixer", mixer, "--layers", "auto:4", "--out", str(out)]
        return main(
            argv + ["--choice-data", str(words_corpus), "--choice-cache", str(tmp_path / "cache"), *SMALL_FLAGS]
        )

    with pytest.raises(SystemExit):
        convert("raven", tmp_path / "raven")
    assert "layer 1 is sila in the source and raven in the plan" in capsys.readouterr().err
    out = tmp_path / "out"
    assert convert("sila", out) == 0
    assert "converted layers 1 (sila), 4 (sila)" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    record = config["layer_choice"]
    assert record["fixed"] == [1, 4] and {1, 4} < set(record["chosen"]) and len(record["chosen"]) == 4
    assert [i for i, kind in enumerate(config["layer_mixers"]) if kind == "sila"] == record["chosen"]
    assert config["converted_from"][0]["model"] == str(half)
    before, after = read_weights(half), read_weights(out)
    assert all(torch.equal(after[name], before[name]) for name in before if ".1.self_attn." in name)
