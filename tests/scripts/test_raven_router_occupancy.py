"""raven_router_occupancy.py: slots written and effective slots per key/value head, counted exactly; a Transformer
is converted first, a trained hybrid read as it is, and a hybrid without Raven layers refused."""

import json

import pytest
import torch

from raven_convert import Source
from raven_convert.cli import main as convert
from scripts.tools.raven_router_occupancy import main, occupancy, report
from tests.conftest import make_tiny_source

TEXT = "Rivers bend twice before the town. Boats wait at the mill. Nobody hurries here in spring. " * 4


def test_occupancy_counts_the_slots_written_and_their_effective_number():
    idx = torch.tensor([[[0, 1], [0, 1]], [[0, 1], [2, 3]]])  # [T=2, H_kv=2, K=2]
    used, effective = occupancy(idx, num_slots=8)
    assert used == [2, 4]
    assert effective == pytest.approx([2.0, 4.0])
    skewed = torch.tensor([[[0]], [[0]], [[0]], [[1]]])  # slot 0 three times, slot 1 once
    p = torch.tensor([0.75, 0.25])
    assert occupancy(skewed, 4)[1] == pytest.approx([float(torch.exp(-(p * p.log()).sum()))])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("occupancy")
    (root / "text.txt").write_text(TEXT)
    return make_tiny_source("llama", root / "llama", num_hidden_layers=4), root / "text.txt"


def test_a_transformer_is_converted_and_each_raven_layer_routed_three_ways(teacher, capsys):
    src, text = teacher
    main(["--src", str(src), "--layers", "1,3", "--raven-num-slots", "16", "--raven-top-k", "4", "--text", str(text)])
    lines = capsys.readouterr().out.splitlines()[2:]
    routings = ("evaluation", "training (Gumbel)", "centred")
    assert [(line.split()[0], routing in line) for line, routing in zip(lines, routings * 2)] == [
        (layer, True) for layer in ("1", "3") for _ in routings
    ]


def test_each_row_counts_what_the_router_writes(teacher, tmp_path):
    src, text = teacher
    out = tmp_path / "hybrid"
    flags = ["--raven-num-slots", "16", "--raven-top-k", "4"]
    assert convert(["--src", str(src), "--mixer", "raven", "--layers", "1,3", *flags, "--out", str(out)]) == 0
    source = Source.resolve(str(out))
    hybrid, tokenizer = source.load_model("float32"), source.load_tokenizer()
    found = report(hybrid, tokenizer(TEXT, return_tensors="pt").input_ids)
    assert [(r["layer"], r["routing"]) for r in found] == [
        (layer, routing) for layer in (1, 3) for routing in ("evaluation", "training (Gumbel)", "centred")
    ]
    for row in found:
        assert len(row["used"]) == 2 and all(4 <= u <= 16 for u in row["used"])  # 2 kv heads; top-4 of 16
        assert all(1 <= e <= u + 1e-9 for e, u in zip(row["effective"], row["used"]))
        assert 0 <= row["common"] and row["tokens"] > 0 and row["slots"] > 0 and row["margin"] >= 0


def test_a_trained_hybrid_is_read_as_it_is_and_one_without_raven_refused(teacher, tmp_path, capsys):
    src, text = teacher
    hybrid = tmp_path / "hybrid"
    assert convert(["--src", str(src), "--mixer", "raven", "--layers", "2", "--out", str(hybrid)]) == 0
    capsys.readouterr()
    table = tmp_path / "occupancy.json"
    main(
        ["--src", str(hybrid), "--text", str(text), "--json", str(table)]
    )  # its own layers: --layers is a Transformer's
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["2", "2", "2"]
    record = json.loads(table.read_text())
    assert record["src"] == str(hybrid) and [r["layer"] for r in record["rows"]] == [2, 2, 2]
    sila = tmp_path / "sila"
    assert convert(["--src", str(src), "--mixer", "sila", "--layers", "2", "--out", str(sila)]) == 0
    with pytest.raises(SystemExit, match="no Raven layer in the model"):
        main(["--src", str(sila), "--text", str(text)])
