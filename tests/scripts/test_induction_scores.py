"""induction_scores.py: each head's induction, duplicate-token and previous-token weights, read exactly from the
attention weights; run on a Transformer, with a converted hybrid refused."""

import json

import pytest
import torch

from raven_convert.cli import main as convert
from scripts.tools.induction_scores import head_scores, main, repeated_tokens
from tests.conftest import make_tiny_source


def test_head_scores_read_the_weights_each_pattern_puts_where_it_looks():
    L = 4
    induction = torch.zeros(1, 1, 2 * L, 2 * L)
    previous = torch.zeros(1, 1, 2 * L, 2 * L)
    for t in range(L, 2 * L - 1):
        induction[0, 0, t, t - L + 1] = 1.0  # to the token after the earlier occurrence
    for t in range(1, 2 * L):
        previous[0, 0, t, t - 1] = 0.5
    (a,) = head_scores((torch.cat([induction, previous], dim=1),), L)
    assert a["layer"] == 0
    assert a["induction"] == pytest.approx([1.0, 0.0])
    assert a["duplicate"] == pytest.approx([0.0, 0.0])
    assert a["previous"] == pytest.approx([0.0, 0.5])


def test_repeated_tokens_repeat_each_row_past_the_vocabularys_first_eighth():
    ids = repeated_tokens(vocab_size=128, rows=3, length=10, seed=0)
    assert ids.shape == (3, 20) and torch.equal(ids[:, :10], ids[:, 10:])
    assert int(ids.min()) >= 16 and int(ids.max()) < 128
    assert torch.equal(ids, repeated_tokens(128, 3, 10, 0))


def test_a_transformer_is_scored_layer_by_layer_and_a_hybrid_refused(tmp_path, capsys):
    src = make_tiny_source("llama", tmp_path / "llama")
    main(["--src", str(src), "--length", "16", "--rows", "2", "--json", str(tmp_path / "scores.json")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["layer", "induction", "max"] and len(out) == 1 + 4 + 1
    assert out[-1].startswith("layers by their strongest induction head: ")
    record = json.loads((tmp_path / "scores.json").read_text())
    assert record["settings"]["length"] == 16 and [r["layer"] for r in record["layers"]] == [0, 1, 2, 3]
    assert all(len(r["induction"]) == 4 and all(0 <= w <= 1 for w in r["previous"]) for r in record["layers"])

    convert(["--src", str(src), "--mixer", "sila", "--layers", "1", "--out", str(tmp_path / "hybrid")])
    with pytest.raises(SystemExit):
        main(["--src", str(tmp_path / "hybrid")])
    assert "is a converted hybrid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--src", str(src), "--length", "400"])
    assert "must fit the model's 512 positions" in capsys.readouterr().err
