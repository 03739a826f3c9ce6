"""reach.py: each head's weight on the first token, far back and near, read from eager attention on text: exact on
weights whose sums are known, on a Transformer's layers and on a hybrid's kept ones; the order in which to window."""

from __future__ import annotations

import pytest
import torch

from raven_convert.copying import attention_weights
from raven_convert.reach import by_far_weight, head_reach, text_rows
from raven_convert.sources import Source
from raven_convert.surgery import build_hybrid
from tests.conftest import make_tiny_source


def uniform_attention(T: int) -> torch.Tensor:
    """[1, 1, T, T]: every query spreads its weight evenly over itself and every key before it."""
    causal = torch.ones(T, T).tril()
    return (causal / causal.sum(-1, keepdim=True))[None, None]


def test_the_weights_are_those_of_uniform_attention():
    T, far, near, skip = 40, 10, 4, 20
    (row,) = head_reach({3: uniform_attention(T)}, far, near, skip)
    queries = torch.arange(skip, T, dtype=torch.float64)
    seen = queries + 1  # keys 0..t
    assert row["layer"] == 3
    assert row["sink"][0] == pytest.approx((1 / seen).mean().item())
    assert row["far"][0] == pytest.approx(((queries - far + 1 - 1) / seen).mean().item())  # keys 1..t - far
    assert row["near"][0] == pytest.approx((near / seen).mean().item())


def test_a_head_on_its_previous_token_is_near_and_one_on_the_first_token_is_a_sink():
    T = 32
    previous = torch.zeros(T, T)
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    first = torch.zeros(T, T)
    first[:, 0] = 1.0
    (row,) = head_reach({0: torch.stack([previous, first])[None]}, far=8, near=2, skip=16)
    assert row["near"] == [1.0, 0.0] and row["sink"] == [0.0, 1.0] and row["far"] == [0.0, 0.0]


def test_a_model_is_read_on_every_attention_layer_and_a_hybrid_on_those_it_kept(tmp_path):
    src = make_tiny_source("llama", tmp_path / "llama")
    source = Source.resolve(str(src))
    model = source.load_model("float32")
    texts = [" ".join(f"word{i % 37}" for i in range(400))]
    ids = text_rows(source.load_tokenizer(), texts, rows=2, length=64)
    assert ids.shape == (2, 64)
    rows = head_reach(attention_weights(model, ids), far=16, near=4, skip=32)
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert len(r["far"]) == model.config.num_attention_heads
        for sink, far, near in zip(r["sink"], r["far"], r["near"]):  # three disjoint sets of keys
            assert min(sink, far, near) >= 0 and sink + far + near <= 1 + 1e-5
    hybrid = build_hybrid(model, ["attention", "sila", "attention", "sila"], {})
    kept = head_reach(attention_weights(hybrid, ids), far=16, near=4, skip=32)
    assert [r["layer"] for r in kept] == [0, 2]
    assert kept[0] == rows[0]  # the layers before the first mixer see the same inputs


def test_too_little_text_and_a_bad_skip_are_refused_by_name(tmp_path):
    tokenizer = Source.resolve(str(make_tiny_source("llama", tmp_path / "llama"))).load_tokenizer()
    with pytest.raises(ValueError, match=r"2 rows of 64 need 128"):
        text_rows(tokenizer, ["a few words"], rows=2, length=64)
    with pytest.raises(ValueError, match="skip 40: expected 0 to 39"):
        head_reach({0: uniform_attention(40)}, far=8, near=2, skip=40)


def test_layers_are_ordered_by_their_far_weight_copying_ones_left_out():
    rows = [{"layer": i, "far": far} for i, far in enumerate([[0.5, 0.3], [0.1, 0.1], [0.0, 0.2], [0.05, 0.0]])]
    assert by_far_weight(rows) == [3, 1, 2, 0]  # 2 and 1 tie at 0.1: the lower layer first
    assert by_far_weight(rows, leave_out={3}) == [1, 2, 0]
