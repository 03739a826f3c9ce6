"""sweep_sila_decode.py times SILA's decode step under each number of warps on a GPU and records it with its
output's difference from the default's (run on the device machine: `python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_small_sweep_records_every_choice(tmp_path):
    import sweep_sila_decode

    from raven_kernels.sila.utils import step_warps

    sweep_sila_decode.main(["--out", str(tmp_path), "--batches", "2", "--warps", "2,4"])
    rows = json.loads((tmp_path / "sweep_sila_decode.json").read_text())["rows"]
    default = step_warps(sweep_sila_decode.D, sweep_sila_decode.D)  # first, then each choice not the default
    assert rows[0]["default"] and rows[0]["warps"] == default
    assert [r["warps"] for r in rows[1:]] == [w for w in (2, 4) if w != default]
    assert all(r["us"] > 0 and r["max_diff"] < 1e-3 for r in rows)


def test_a_memory_per_query_head_is_swept_in_its_own_layout(tmp_path):
    """--state-heads query: 9 memories of one query head each, recorded as such, every choice the default's output."""
    import sweep_sila_decode

    sweep_sila_decode.main(["--out", str(tmp_path), "--batches", "2", "--warps", "2", "--state-heads", "query"])
    record = json.loads((tmp_path / "sweep_sila_decode.json").read_text())
    assert (record["info"]["heads"], record["info"]["group"], record["info"]["state_heads"]) == (9, 1, "query")
    assert all(r["us"] > 0 and r["max_diff"] < 1e-3 for r in record["rows"])
    sweep_sila_decode.main(["--out", str(tmp_path), "--batches", "2", "--warps", "2"])
    assert json.loads((tmp_path / "sweep_sila_decode.json").read_text())["info"]["heads"] == 3
