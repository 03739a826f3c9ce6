"""sweep_sse_decode.py times SSE's decode step under each number of warps on a GPU and records it with its output's
difference from the default's (run on the device machine: `python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_small_sweep_records_every_choice(tmp_path):
    import sweep_sse_decode

    sweep_sse_decode.main(["--out", str(tmp_path), "--batches", "2", "--warps", "2,4"])
    rows = json.loads((tmp_path / "sweep_sse_decode.json").read_text())["rows"]
    m = sweep_sse_decode  # its default at batch 2 first, then each other choice
    default = m.step_warps(m.C, m.D, 2 * m.H, torch.device("cuda"))
    assert rows[0]["default"] and rows[0]["warps"] == default
    assert [r["warps"] for r in rows[1:]] == [w for w in (2, 4) if w != default]
    assert all(r["us"] > 0 and r["max_diff"] < 1e-3 for r in rows)
