"""profile_decode.py's breakdown of a step's GPU time by kernel name, on kernel names its GPU runs recorded (the
timing itself runs on the device machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))


def test_every_kernel_of_a_recorded_step_falls_in_its_part():
    from profile_decode import breakdown, category

    rows = json.loads((ROOT / "docs/results/depth/decode/profile_decode_b1_all_mixers_beside_recipe.json").read_text())
    names = {k["name"] for row in rows["rows"] for k in row["top_kernels"]}
    assert category("attention_fwd_kernel_split") == category("merge_fwd_kernel") == "attention"
    assert category("triton_tem_fused_mm_0") == "products"  # a Triton GEMM template (max_autotune_gemm)
    for mixer in ("raven_fwd_kernel_decode", "sse_fwd_kernel_step", "sila_fwd_kernel_decode"):
        assert mixer in names and category(mixer) == "mixer step"
    products = [n for n in names if n.startswith(("nvjet", "std::enable_if", "void cutlass"))]
    assert products and all(category(n) == "products" for n in products)
    assert all(category(n) == "fused (Inductor)" for n in names if n.startswith("triton_"))
    sila = next(row for row in rows["rows"] if row["model"] == "sila" and row["variant"] == "default")
    parts = breakdown(sila["top_kernels"])
    assert sum(p["us_per_step"] for p in parts.values()) == pytest.approx(
        sum(k["us_per_step"] for k in sila["top_kernels"])
    )
    assert parts["mixer step"]["per_step"] == 15 and parts["attention"]["per_step"] == 15  # 15 of 30 converted


def test_a_rows_generated_code_is_named_by_model_batch_and_variant():
    from profile_decode import code_name

    assert code_name("sila", 1, "default,triton.enable_pdl=True") == "code_sila_b1_default-triton-enable-pdl-True.py"
    assert code_name("teacher-engine", 128, "plain") == "code_teacher-engine_b128_plain.py"
