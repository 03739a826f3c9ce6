"""window_cost.py: a model's loss with chosen layers as sliding windows, with and without attention sinks; a window
or sinks that cover the whole row change nothing."""

import pytest
import torch

from raven_convert.sources import Source
from raven_convert.surgery import build_hybrid
from scripts.tools.window_cost import main, row_losses
from tests.conftest import make_tiny_source


def test_windows_change_the_loss_past_them_and_sinks_over_the_whole_row_undo_it(tmp_path):
    model = Source.resolve(str(make_tiny_source("llama", tmp_path / "llama"))).load_model("float32")
    hybrid = build_hybrid(model, ["attention"] * 4, {}).eval()
    hybrid.config._attn_implementation = "sdpa"
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    base = row_losses(hybrid, ids, 8, set(), 0)
    windowed = row_losses(hybrid, ids, 8, {1, 2}, 0)
    assert torch.equal(windowed[:, :8], base[:, :8]) and not torch.allclose(windowed[:, 8:], base[:, 8:])
    assert torch.allclose(row_losses(hybrid, ids, 8, {1, 2}, 48), base, atol=1e-5)  # every key a sink
    assert torch.allclose(row_losses(hybrid, ids, 48, {1, 2}, 0), base, atol=1e-5)  # a window over the row
    some = row_losses(hybrid, ids, 8, {1, 2}, 2)
    assert not torch.allclose(some[:, 8:], windowed[:, 8:])


def test_the_table_has_a_row_per_layer_set_and_sink_count(tmp_path, capsys):
    src = make_tiny_source("llama", tmp_path / "llama")
    (tmp_path / "a.txt").write_text(" ".join(f"word{i % 41}" for i in range(900)))
    args = ["--src", str(src), "--text", str(tmp_path / "a.txt"), "--window", "16", "--length", "160"]
    main([*args, "--layers", "1", "0,3", "--sinks", "0,2", "--rows", "1"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:]] == [["none", "-"], ["1", "0"], ["1", "2"], ["0,3", "0"], ["0,3", "2"]]
    with pytest.raises(SystemExit):
        main([*args[:6], "--length", "100", "--layers", "1"])
    assert "rows more than 100 tokens longer than the window" in capsys.readouterr().err
