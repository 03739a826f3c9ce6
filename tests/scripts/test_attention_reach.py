"""attention_reach.py: the table and JSON of each head's sink, far and near weights on a folder of text
(raven_convert.reach, tested in tests/convert/test_reach.py), its order of layers to window, and its refusals."""

import json

import pytest

from scripts.tools.attention_reach import main
from tests.conftest import make_tiny_source


def test_a_model_is_read_on_text_and_its_layers_ordered_for_windows(tmp_path, capsys):
    src = make_tiny_source("llama", tmp_path / "llama")
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(" ".join(f"word{i % 41}" for i in range(600)))
    args = ["--src", str(src), "--text", str(text), "--length", "96", "--far", "24"]
    main([*args, "--leave-out", "1", "--json", str(tmp_path / "reach.json")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["layer", "sink", "max"] and len(out) == 1 + 4 + 1
    order = out[-1].split(": ")[1].split(", ")
    assert out[-1].startswith("layers by least far weight (1 left out): ") and sorted(order) == ["0", "2", "3"]
    record = json.loads((tmp_path / "reach.json").read_text())
    assert record["settings"] | {"skip": 48, "far": 24, "leave_out": "1"} == record["settings"]
    assert [r["layer"] for r in record["layers"]] == [0, 1, 2, 3]
    with pytest.raises(SystemExit):
        main([*args[:4], "--length", "96", "--far", "96"])
    assert "--far 96 and --skip 192 must lie inside rows of --length 96" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args[:4], "--length", "1000", "--far", "24"])
    assert "--length 1000: the model has 512 positions" in capsys.readouterr().err
