"""bench_generate.py's models and rows: layers spread for --depths, the bytes a decode step must read, and the table
against both teachers (the GPU timing itself runs on the device)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_capacity  # noqa: E402
from bench_generate import measure_grid, table  # noqa: E402
from common import (  # noqa: E402
    SETTINGS_FROM,
    add_model_arguments,
    checked_mixers,
    layer_specs,
    mixer_settings,
    spread_layers,
    window_plans,
)

from raven_convert import plan_layers  # noqa: E402
from raven_convert.layer_spec import parse_layer_spec  # noqa: E402


def test_hybrids_take_their_smollm2_recipes_mixer_settings_unless_told_otherwise():
    """The benchmarks time the hybrid each SmolLM2 recipe trains (Raven: M = 64, top-8), or with --mixer-settings
    defaults the mixer's own (the paper's M = 256, top-32); the settings build a hybrid."""
    from raven_convert.train.recipe import load_recipe
    from raven_layers.registry import BUILTIN_MIXERS

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    assert mixer_settings("raven", "recipe") == {"raven": {"num_slots": 64, "top_k": 8, "router_init": "centred"}}
    for spec in BUILTIN_MIXERS:
        expected = load_recipe(recipes / f"smollm2-{spec.name}.yaml").mixer_settings[spec.name]
        assert mixer_settings(spec.name, "recipe") == {spec.name: expected}
        assert mixer_settings(spec.name, "defaults") == {}
    assert mixer_settings("mymixer", "recipe") == {}  # no SmolLM2 recipe: the mixer's own
    from transformers import AutoModelForCausalLM

    from raven_convert import build_hybrid
    from tests.conftest import tiny_config

    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2))
    hybrid = build_hybrid(source, plan_layers([("raven", "0")], 2), mixer_settings("raven", "recipe"))
    built = hybrid.model.layers[0].self_attn.settings
    assert (built.num_slots, built.top_k) == (64, 8)
    with pytest.raises(ValueError, match="'recipes'.*expected one of"):
        mixer_settings("raven", "recipes")
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args(["--out", "o"]).mixer_settings == SETTINGS_FROM[0] == "recipe"
    assert parser.parse_args(["--out", "o", "--mixer-settings", "defaults"]).mixer_settings == "defaults"
    # changes after the base: a recipe's settings with one changed, or a default changed
    sila = load_recipe(recipes / "smollm2-sila.yaml").mixer_settings["sila"]
    assert mixer_settings("sila", "recipe,sila.state_heads=query") == {"sila": {**sila, "state_heads": "query"}}
    assert mixer_settings("raven", "defaults,raven.top_k=4,sila.conv_size=2") == {"raven": {"top_k": 4}}
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "o", "--mixer-settings", "recipe,state_heads=query"])


@pytest.mark.parametrize("n", [0, 1, 15, 22, 26, 29, 30])
def test_spread_layers_converts_n_and_keeps_the_rest_apart(n):
    converted = parse_layer_spec(spread_layers(n, 30), 30)
    assert len(converted) == n
    kept = [i for i in range(30) if i not in converted]
    if len(kept) > 1:  # evenly spread: gaps differ by at most one
        gaps = [b - a for a, b in zip(kept, kept[1:])]
        assert max(gaps) - min(gaps) <= 1
    if kept:
        assert kept[-1] == 29


def test_layer_specs_name_each_depth_and_refuse_bad_ones():
    args = argparse.Namespace(layers="0-29:2", depths=None)
    assert layer_specs(args) == [("", "0-29:2")]
    args.depths = "15,26"
    assert [suffix for suffix, _ in layer_specs(args)] == ["-15of30", "-26of30"]
    for bad in ("31", "x"):
        args.depths = bad
        with pytest.raises(SystemExit, match=f"--depths '{bad}'"):
            layer_specs(args)


def test_window_plans_window_all_or_the_first_k_kept_layers():
    """--windows W adds each hybrid with every kept layer windowed; --windowed-layers K,... adds one model per K
    instead, with only the first K windowed (the rest full attention, as a recipe's window_layers leaves them)."""
    kinds = plan_layers([("sila", spread_layers(22, 30))], 30)
    kept = [i for i, kind in enumerate(kinds) if kind == "attention"]
    assert window_plans(kinds, None, [2]) == [("", None)]
    plans = dict(window_plans(kinds, 4096, [2, 4, 8, 9]))
    assert list(plans) == ["", "-sw4096x2", "-sw4096x4", "-sw4096"]  # 8 and 9 of 8 kept layers: all, once
    assert [i for i, w in enumerate(plans["-sw4096x2"]) if w] == kept[:2]
    assert [i for i, w in enumerate(plans["-sw4096"]) if w] == kept
    assert all(plans["-sw4096x4"][i] is None for i, kind in enumerate(kinds) if kind != "attention")


@pytest.mark.parametrize("windows, counts", [(None, [2]), (4096, [0, 2])])
def test_windowed_layers_need_windows_and_counts_of_one_or_more(tmp_path, windows, counts):
    args = argparse.Namespace(mixers="sila", windows=windows, windowed_layers=counts, out=tmp_path, attention_sinks=0)
    with pytest.raises(SystemExit, match="--windowed-layers .* expected counts >= 1, beside --windows W"):
        checked_mixers(args, "speed")


@pytest.mark.parametrize("windows, sinks", [(None, 4), (4096, -1)])
def test_attention_sinks_need_windows_and_a_count(tmp_path, windows, sinks):
    args = argparse.Namespace(mixers="sila", windows=windows, windowed_layers=None, out=tmp_path, attention_sinks=sinks)
    with pytest.raises(SystemExit, match=rf"--attention-sinks {sinks}: expected a count >= 0, beside --windows W"):
        checked_mixers(args, "speed")


def test_tables_compare_with_both_teachers():
    rows = [
        {
            "model": m,
            "batch": 32,
            "context": 16384,
            "step_ms": ms,
            "tokens_per_s": 32 / ms * 1e3,
            "ttft_ms": 1.0,
            "peak_gib": 1.0,
            "floor_ms": 2.0,
            "floor_share": round(2.0 / ms, 3),
        }
        for m, ms in (("teacher", 30.0), ("teacher-engine", 5.0), ("sila-22of30", 2.5))
    ] + [{"model": "sila-26of30", "batch": 32, "context": 16384, "oom": True}]
    text = table(rows)
    assert "| vs transformers | vs engine teacher | floor ms | of floor |" in text
    assert "| sila-22of30 | 32 | 16384 | 2.50 | - | 12800 | 0.08x | 0.50x | 2.00 | 80% |" in text
    assert "| sila-26of30 | 32 | 16384 | OOM |" in text
    capacity = [
        {
            "model": "teacher",
            "context": 32768,
            "cache_mib_per_sequence": 700.0,
            "batch": 100,
            "step_ms": 50.0,
            "tokens_per_s": 2000.0,
        },
        {
            "model": "teacher-engine",
            "context": 32768,
            "cache_mib_per_sequence": 700.0,
            "batch": 120,
            "step_ms": 20.0,
            "tokens_per_s": 6000.0,
        },
        {
            "model": "sila-26of30",
            "context": 32768,
            "cache_mib_per_sequence": 95.0,
            "batch": 900,
            "step_ms": 30.0,
            "tokens_per_s": 30000.0,
            "floor_share": 0.5,
        },
    ]
    text = bench_capacity.table(capacity)
    assert "| largest batch | vs teacher | vs teacher-engine | ms/step |" in text and "| of floor | peak GiB |" in text
    assert "| sila-26of30 | 32768 | 95.0 | 900 | 9.0x | 7.5x | 30.0 | 30000 | 15.0x | 5.0x | 50% | - |" in text


def test_a_failing_configuration_is_a_row_and_the_others_still_run():
    """One model's error (not an OOM) neither ends the run nor loses the rows before it: each is saved as it comes."""
    saved = []

    def measure(name, model, batch, context):
        if name == "sse" and batch == 32:
            raise RuntimeError("Triton compilation failed\nat 12:4: ...")
        return {"model": name, "batch": batch, "context": context, "step_ms": 1.0, "tokens_per_s": batch * 1e3,
                "ttft_ms": 1.0, "peak_gib": 1.0, "graph_ms": 0.9 if name == "sila" else None}  # fmt: skip

    models = iter([("teacher-engine", object()), ("sse", object()), ("sila", object())])
    rows = measure_grid(models, [16384], [1, 32], measure, lambda rows: saved.append(len(rows)))
    assert [(r["model"], r["batch"]) for r in rows] == [
        (m, b) for m in ("teacher-engine", "sse", "sila") for b in (1, 32)
    ]
    assert rows[3]["error"] == "RuntimeError: Triton compilation failed\nat 12:4: ..." and saved == [1, 2, 3, 4, 5, 6]
    text = table(rows)
    assert "| sse | 32 | 16384 | failed: RuntimeError: Triton compilation failed |" in text
    assert "| sila | 32 | 16384 | 1.00 | 0.90 | 32000 | - | 1.00x |" in text  # its graph's replay beside its step
    assert "| teacher-engine | 32 | 16384 | 1.00 | - | 32000 |" in text


def test_decode_options_name_the_models_compilation():
    from common import parse_decode_options

    from raven_layers.decode_fusion import FUSED_PROJECTIONS, FUSED_PROLOGUES, REDUCED_PRODUCTS, SHARED_PROJECTIONS

    assert parse_decode_options("default") == {**REDUCED_PRODUCTS, "combo_kernels": True}
    assert parse_decode_options("plain") == {} and parse_decode_options("eager") is None
    assert parse_decode_options("fused,combo_kernels=True") == {**FUSED_PROJECTIONS, "combo_kernels": True}
    assert parse_decode_options("shared") == SHARED_PROJECTIONS
    assert parse_decode_options("reduced,combo_kernels=True") == {**REDUCED_PRODUCTS, "combo_kernels": True}
    assert parse_decode_options("prologues,combo_kernels=True") == {**FUSED_PROLOGUES, "combo_kernels": True}
    pdl = {**REDUCED_PRODUCTS, "combo_kernels": True, "triton.enable_pdl": True}
    assert parse_decode_options("default,triton.enable_pdl=True") == pdl
    with pytest.raises(argparse.ArgumentTypeError, match="not name=value"):
        parse_decode_options("combo_kernels")
    with pytest.raises(argparse.ArgumentTypeError, match="not a Python literal"):
        parse_decode_options("combo_kernels=yes please")
    with pytest.raises(argparse.ArgumentTypeError, match="max_autotune_gemm=True cannot autotune .* FUSED_PROJ"):
        parse_decode_options("shared,combo_kernels=True,max_autotune_gemm=True")
    assert parse_decode_options("fused,max_autotune_gemm=True") == {**FUSED_PROJECTIONS, "max_autotune_gemm": True}


def test_repeats_below_one_are_refused_before_anything_is_built(tmp_path):
    """--repeats N times each row's generate() N times (the best is the row's step, every one in step_ms_all); 0 is
    refused by name before a model is built or the GPU asked for."""
    import bench_generate

    with pytest.raises(SystemExit, match="--repeats 0: expected an integer >= 1"):
        bench_generate.main(["--out", str(tmp_path), "--repeats", "0"])
