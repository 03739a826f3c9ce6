"""bench_products.py times each product with the work before it, as the default step runs it and fused, and records
every tiling with its output's difference from the default's (run on the device machine: `python -m pytest -m gpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_small_run_records_the_pair_and_every_tiling(tmp_path):
    import bench_products

    bench_products.main(["--out", str(tmp_path), "--batches", "2", "--outputs", "32", "--warps", "4"])
    rows = json.loads((tmp_path / "bench_products.json").read_text())["rows"]
    assert len(rows) == len(bench_products.PRODUCTS) * 3  # the pair, the default tiling, one more
    assert all(r["us"] > 0 and r["max_diff"] < 0.1 for r in rows)
    assert [r["kernel"] for r in rows[:3]] == ["Inductor + cuBLAS", "fused", "fused"]
