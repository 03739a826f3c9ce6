"""induction_scores.py: the table and JSON of each head's induction, duplicate-token and previous-token weights
(raven_convert.copying, tested in tests/convert/test_copying.py), on a Transformer and on a hybrid's kept layers."""

import json

import pytest

from raven_convert.cli import main as convert
from scripts.tools.induction_scores import main
from tests.conftest import make_tiny_source


def test_a_transformer_is_scored_layer_by_layer_and_a_hybrid_on_its_kept_layers(tmp_path, capsys):
    src = make_tiny_source("llama", tmp_path / "llama")
    main(["--src", str(src), "--length", "16", "--rows", "2", "--json", str(tmp_path / "scores.json")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["layer", "induction", "max"] and len(out) == 1 + 4 + 1
    assert out[-1].startswith("layers by their strongest induction head: ")
    record = json.loads((tmp_path / "scores.json").read_text())
    assert record["settings"]["length"] == 16 and [r["layer"] for r in record["layers"]] == [0, 1, 2, 3]
    assert all(len(r["induction"]) == 4 and all(0 <= w <= 1 for w in r["previous"]) for r in record["layers"])

    convert(["--src", str(src), "--mixer", "sila", "--layers", "1", "--out", str(tmp_path / "hybrid")])
    capsys.readouterr()
    main(["--src", str(tmp_path / "hybrid"), "--length", "16", "--rows", "2"])
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert [int(row.split()[0]) for row in rows] == [0, 2, 3]
    with pytest.raises(SystemExit):
        main(["--src", str(src), "--length", "400"])
    assert "must fit the model's 512 positions" in capsys.readouterr().err
