"""Speed and memory: prefill and decode timings, cache bytes (constant mixer state, growing KV), table, plot."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import raven_convert.evaluate.speed as speed
from raven_convert import build_hybrid, plan_layers
from raven_convert.evaluate.speed import cache_bytes, format_speed_table, measure_speed, plot_speed
from tests.conftest import tiny_config

LENGTHS = [16, 64]


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


@pytest.fixture(scope="module")
def hybrid(teacher):
    kinds = plan_layers([("raven", "0,2")], 4)
    return build_hybrid(teacher, kinds, {"raven": {"num_slots": 16, "top_k": 4}})


@pytest.fixture(scope="module")
def results(teacher, hybrid):
    kwargs = dict(decode_tokens=4, warmup=1, repeats=2, progress=False)
    return {"teacher": measure_speed(teacher, LENGTHS, **kwargs), "raven": measure_speed(hybrid, LENGTHS, **kwargs)}


def test_entries(results):
    json.dumps(results)  # JSON-serialisable as it is
    for entries in results.values():
        assert [e["context_length"] for e in entries] == LENGTHS
        for e in entries:
            assert not e["skipped"]
            assert e["prefill_tokens_per_second"] > 0 and e["decode_tokens_per_second"] > 0
            assert len(e["prefill_seconds_all"]) == len(e["decode_seconds_all"]) == 2
            assert e["decode_ms_per_token"] == pytest.approx(1e3 * e["decode_seconds"] / 4)
            assert e["device"] == "cpu" and e["dtype"] == "float32" and e["torch"] and e["transformers"]
            assert e["trained_length"] == 512
            if e["peak_memory_method"] is not None:
                assert e["peak_memory_bytes"] >= e["peak_memory_growth_bytes"] >= 0
    assert results["raven"][0]["layer_mixers"] == ["raven", "attention", "raven", "attention"]


@pytest.mark.transformers_api
def test_mixer_state_is_constant_while_kv_grows(results, teacher):
    short, long = (e["cache_bytes_per_sequence"] for e in results["teacher"])
    assert short["mixer"] == long["mixer"] == 0
    cfg = teacher.config
    assert short["attention"] == 4 * 2 * cfg.num_key_value_heads * 16 * cfg.head_dim * 4  # layers, k+v, fp32
    assert long["attention"] == 4 * short["attention"]
    assert results["teacher"][1]["cache_bytes_per_sequence_after_decode"]["attention"] == long["attention"] * 68 // 64

    short, long = (e["cache_bytes_per_sequence"] for e in results["raven"])
    assert short["mixer"] == long["mixer"] > 0
    assert long["attention"] == 4 * short["attention"] > 0  # the two kept attention layers
    assert short["total"] == short["attention"] + short["mixer"]
    assert results["raven"][1]["cache_bytes_per_sequence_after_decode"]["mixer"] == long["mixer"]


def test_batch_size_counts_per_sequence(teacher, results):
    (e,) = measure_speed(teacher, [16], batch_size=2, decode_tokens=2, warmup=0, repeats=1, progress=False)
    assert e["cache_bytes_per_sequence"] == results["teacher"][0]["cache_bytes_per_sequence"]


def test_out_of_memory_skips_the_length(teacher, monkeypatch):
    run_once = speed._run_once

    def failing(model, prompt, decode_tokens):
        if prompt.shape[1] == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return run_once(model, prompt, decode_tokens)

    monkeypatch.setattr(speed, "_run_once", failing)
    entries = measure_speed(teacher, [32, 8], decode_tokens=1, warmup=0, repeats=1, progress=False)
    assert entries[0]["skipped"] and "out of memory" in entries[0]["reason"]
    assert not entries[1]["skipped"] and entries[1]["prefill_tokens_per_second"] > 0
    assert "skipped" in format_speed_table({"teacher": entries})


def test_cache_bytes_of_other_caches():
    kv = torch.zeros(1, 2, 5, 4)
    assert cache_bytes(((kv, kv), (kv, kv))) == {"attention": 4 * kv.numel() * 4, "mixer": 0, "total": 640}
    assert cache_bytes(None) == {"attention": 0, "mixer": 0, "total": 0}


def test_table_and_plot(results, tmp_path):
    table = format_speed_table(results)
    print(table)
    lines = table.splitlines()
    assert len(lines) == 1 + 4 and "prefill tok/s" in lines[0]
    assert lines[1].startswith("teacher") and lines[-1].startswith("raven") and " 64 " in lines[-1]
    path = plot_speed(results, tmp_path / "speed.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
