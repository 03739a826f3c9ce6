"""sweep_raven_decode.py times each split of Raven's decode step on a GPU and records it with its output's difference
from the default's (run on the device machine: `python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_small_sweep_records_every_split(tmp_path):
    import sweep_raven_decode

    sweep_raven_decode.main(["--out", str(tmp_path), "--batches", "2", "--blocks", "4,8", "--warps", "1",
                             "--ranges", "1,4"])  # fmt: skip
    rows = json.loads((tmp_path / "sweep_raven_decode.json").read_text())["rows"]
    splits = [(r["block"], r["warps"], r["ranges"], r["top_k_by"]) for r in rows]
    grid = {(b, 1, n, by) for b in (4, 8) for n in (1, 4) for by in ("rounds", "sort")}
    # the default first, then every split of the grid once (the default among them or not)
    assert rows[0]["default"] and sum(r["default"] for r in rows) == 1
    assert grid <= set(splits) and len(set(splits)) == len(splits) == len(grid | {splits[0]})
    assert all(r["us"] > 0 and r["max_diff"] < 1e-3 for r in rows)
