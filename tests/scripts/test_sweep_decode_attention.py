"""sweep_decode_attention.py times each tiling on a GPU and records it with its output's difference from the
default's (run on the device machine: `python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_small_sweep_records_every_tiling(tmp_path):
    import sweep_decode_attention

    sweep_decode_attention.main(
        ["--out", str(tmp_path), "--batches", "2", "--contexts", "1k", "--blocks", "64", "--warps", "4",
         "--stages", "0,2", "--per-sm", "2", "--native", "0,1", "--merge", "0,1", "--max-ranges", "0,2"]
    )  # fmt: skip
    rows = json.loads((tmp_path / "sweep_decode_attention.json").read_text())["rows"]
    keys = ("block", "warps", "stages", "per_sm", "native", "merge_in_kernel", "max_ranges")
    tilings = [tuple(r[k] for k in keys) for r in rows]
    grid = {(64, 4, s, 2, n, m, r) for s in (None, 2) for n in (False, True) for m in (False, True) for r in (None, 2)}
    # the default first, then every tiling of the grid once (the default among them or not)
    assert rows[0]["default"] and sum(r["default"] for r in rows) == 1
    assert grid <= set(tilings) and len(set(tilings)) == len(tilings) == len(grid | {tilings[0]})
    assert all(r["us"] > 0 and r["max_diff"] < 0.05 for r in rows)
