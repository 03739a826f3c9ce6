"""Perplexity at several context lengths: windows, the position-wise loss curve, inputs, plot."""

import gzip
import json
import math
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from raven_convert.evaluate.perplexity import _Scorer, load_texts, perplexity, plot_loss_curve, token_stream
from raven_convert.evaluate.runtime import compare_models
from tests.conftest import tiny_config, tiny_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Pack my box with five dozen liquor jugs! " * 5,
    "How vexingly quick daft zebras jump; 0123456789. " * 5,
]


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", max_position_embeddings=32)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def text_dir(tmp_path):
    for i, text in enumerate(TEXTS):
        (tmp_path / f"doc{i}.txt").write_text(text)
    return tmp_path


def reference_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """[windows, L - 1] NLL from the model's full logits, one window at a time."""
    with torch.no_grad():
        rows = [F.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:], reduction="none") for w in ids]
    return torch.stack(rows)


def test_lengths_curve_and_mean(llama, tokenizer, text_dir, capsys):
    texts = load_texts(text_dir)
    assert texts == TEXTS  # sorted file order
    res = perplexity(llama, tokenizer, texts, [16, 64], max_windows=3, batch_size=2, logits_rows=7)
    assert "windows 3/3" in capsys.readouterr().err
    json.dumps(res)  # JSON-serialisable as it is
    assert res["trained_length"] == 32 and res["dtype"] == "float32" and res["torch"] and res["transformers"]
    assert [e["context_length"] for e in res["results"]] == [16, 64]
    stream, _ = token_stream(tokenizer, texts, eos_token_id=tokenizer.eos_token_id)
    assert 3 * 64 <= res["stream_tokens"] <= len(stream)
    assert stream[: len(tokenizer(TEXTS[0])["input_ids"]) + 1][-1] == tokenizer.eos_token_id  # documents joined
    for e in res["results"]:
        L = e["context_length"]
        assert not e["skipped"] and e["windows"] == 3 and e["tokens_scored"] == 3 * (L - 1)
        assert math.isfinite(e["mean_nll"]) and e["perplexity"] == pytest.approx(math.exp(e["mean_nll"]))
        curve = e["curve"]
        assert not curve["bucketed"] and curve["positions"] == list(range(1, L))
        assert len(curve["loss"]) == L - 1 and all(math.isfinite(x) for x in curve["loss"])
        assert sum(curve["loss"]) / (L - 1) == pytest.approx(e["mean_nll"], rel=1e-6)
        # the same numbers as the model's own full logits (the head is applied 7 rows at a time here)
        ids = torch.tensor(stream[: 3 * L]).view(3, L)
        ref = reference_nll(llama, ids)
        assert e["mean_nll"] == pytest.approx(ref.mean().item(), rel=1e-5)
        torch.testing.assert_close(
            torch.tensor(curve["loss"], dtype=torch.float64), ref.mean(0).double(), rtol=1e-5, atol=1e-5
        )
    short, long = res["results"]
    assert not short["beyond_trained"] and "mean_nll_beyond_trained" not in short
    assert long["beyond_trained"]
    within, beyond = long["mean_nll_within_trained"], long["mean_nll_beyond_trained"]
    assert (31 * within + 32 * beyond) / 63 == pytest.approx(long["mean_nll"], rel=1e-6)


def test_the_head_is_applied_in_slices_where_it_can_be(llama):
    scorer = _Scorer(llama, logits_rows=5)
    ids = torch.randint(3, 100, (2, 24))
    with torch.no_grad():
        nll = scorer(ids)
    assert scorer.split is not None  # the check against the full logits passed
    torch.testing.assert_close(nll, reference_nll(llama, ids), rtol=1e-5, atol=1e-5)
    assert _Scorer(Oracle()).split is None


def test_batching_changes_nothing(llama, tokenizer):
    one = perplexity(llama, tokenizer, TEXTS, [16], max_windows=4, batch_size=1, progress=False)
    three = perplexity(llama, tokenizer, TEXTS, [16], max_windows=4, batch_size=3, progress=False)
    assert three["results"][0]["mean_nll"] == pytest.approx(one["results"][0]["mean_nll"], rel=1e-5)


class Oracle(nn.Module):
    """Logits peaked on the true next token: it reads the next input token (the last position gets anything)."""

    def __init__(self, vocab: int = 128):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=1024, vocab_size=vocab, _name_or_path="oracle")
        self.scale = nn.Parameter(torch.tensor(50.0))

    def forward(self, input_ids, **kwargs):
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        return SimpleNamespace(logits=self.scale * F.one_hot(nxt, self.config.vocab_size).float())


def test_a_model_that_knows_the_next_token_has_perplexity_one(tokenizer):
    res = perplexity(Oracle(), tokenizer, TEXTS, [8, 32], max_windows=4, progress=False)
    for e in res["results"]:
        assert e["windows"] == 4 and e["perplexity"] == pytest.approx(1.0, abs=1e-6)
        assert max(e["curve"]["loss"]) < 1e-6
    assert res["model"] == "oracle" and res["trained_length"] == 1024


def test_long_windows_get_a_bucketed_curve(llama, tokenizer):
    res = perplexity(llama, tokenizer, TEXTS, [64, 4096], max_windows=2, curve_points=8, progress=False)
    e, too_long = res["results"]
    curve = e["curve"]
    assert curve["bucketed"] and 2 <= len(curve["loss"]) <= 8
    assert curve["bucket_start"][0] == 1 and curve["bucket_end"][-1] == 64
    assert curve["bucket_start"][1:] == curve["bucket_end"][:-1]
    sizes = [b - a for a, b in zip(curve["bucket_start"], curve["bucket_end"])]
    assert sum(n * x for n, x in zip(sizes, curve["loss"])) / 63 == pytest.approx(e["mean_nll"], rel=1e-6)
    assert too_long["skipped"] and "fewer than 4096" in too_long["reason"]


def test_loads_txt_jsonl_gz_and_directories(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    records = [{"source": "a.pod", "text": "alpha"}, {"source": "b.pod", "text": ""}, {"source": "c", "text": "gamma"}]
    with gzip.open(corpus / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
    (corpus / "notes.jsonl").write_text(json.dumps({"source": "n", "text": "delta"}) + "\n")
    (corpus / "z.txt").write_text("zeta\nline two")
    (corpus / "ignored.md").write_text("not a corpus file")
    assert load_texts(corpus / "docs.jsonl.gz") == ["alpha", "gamma"]
    assert load_texts(corpus / "z.txt") == ["zeta\nline two"]
    assert load_texts(corpus) == ["alpha", "gamma", "delta", "zeta\nline two"]
    assert load_texts(corpus, max_documents=3) == ["alpha", "gamma", "delta"]
    with pytest.raises(ValueError, match="expected"):
        load_texts(corpus / "ignored.md")
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing")


def test_plot_loss_curve(llama, tokenizer, tmp_path):
    res = perplexity(llama, tokenizer, TEXTS, [16, 64], max_windows=2, progress=False)
    oracle = perplexity(Oracle(), tokenizer, TEXTS, [64], max_windows=2, progress=False)
    path = plot_loss_curve({"tiny llama": res, "oracle": oracle}, tmp_path / "plots" / "curve.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_compare_models_measures_each_model_and_writes_the_table_json_and_plot(tiny_sources, tmp_path, capsys):
    src = str(tiny_sources["llama"])
    args = Namespace(model=[src], dtype="float32", device="cpu", out=tmp_path / "r.json", plot=tmp_path / "r.png")
    measured = []

    def measure(model, tokenizer):
        measured.append((type(model).__name__, tokenizer.pad_token, str(model.device), model.dtype))
        return {"score": 1.5}

    results = compare_models(args, measure, lambda r: f"table of {len(r)}", lambda r, path: path.write_text("png"))
    assert results == {src: {"score": 1.5}} == json.loads(args.out.read_text())
    assert measured == [("LlamaForCausalLM", "<pad>", "cpu", torch.float32)]
    assert args.plot.read_text() == "png" and "table of 1" in capsys.readouterr().out
