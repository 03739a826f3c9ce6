"""Speed and memory: generate() timings per length and batch, the path timed, cache bytes (constant mixer state,
growing KV), out-of-memory rows, table, plot."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import raven_convert.evaluate.speed as speed
from raven_convert import build_hybrid, plan_layers
from raven_convert.evaluate.speed import cache_bytes, format_speed_table, measure_speed, plot_speed
from tests.conftest import tiny_config

LENGTHS = [16, 64]
BATCHES = [1, 2]
CPU_PATH = "generate, dynamic cache (eager)"


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
    return {
        "teacher": measure_speed(teacher, LENGTHS, BATCHES, **kwargs),
        "raven": measure_speed(hybrid, LENGTHS, BATCHES, **kwargs),
    }


def test_rows_name_length_batch_and_path(results):
    json.dumps(results)  # JSON-serialisable as it is
    for entries in results.values():
        assert [(e["context_length"], e["batch_size"]) for e in entries] == [(n, b) for n in LENGTHS for b in BATCHES]
        for e in entries:
            assert not e["skipped"] and e["path"] == CPU_PATH
            assert len(e["ttft_seconds_all"]) == len(e["generate_seconds_all"]) == 2
            assert e["ttft_seconds"] == min(e["ttft_seconds_all"]) > 0
            wall = (min(e["generate_seconds_all"]) - e["ttft_seconds"]) / 4  # the best calls' difference per step
            assert e["decode_step_seconds_wall"] == pytest.approx(wall)
            assert len(e["decode_step_seconds_all"]) == 2 and 0 < e["first_decode_step_seconds"]
            step = min(e["decode_step_seconds_all"])  # timed inside the call, from the second decode step
            assert 0 < step and e["decode_seconds"] == pytest.approx(4 * step)
            assert e["decode_ms_per_token"] == pytest.approx(1e3 * step)
            assert e["decode_tokens_per_second"] == pytest.approx(e["batch_size"] / step)
            assert e["prefill_tokens_per_second"] == pytest.approx(e["batch_size"] * e["context_length"] / min(
                e["ttft_seconds_all"]))  # fmt: skip
            assert e["device"] == "cpu" and e["dtype"] == "float32" and e["torch"] and e["transformers"]
            assert e["trained_length"] == 512
            if e["peak_memory_method"] is not None:
                assert e["peak_memory_bytes"] >= e["peak_memory_growth_bytes"] >= 0
    assert results["raven"][0]["layer_mixers"] == ["raven", "attention", "raven", "attention"]


@pytest.mark.parametrize("which", ["teacher", "hybrid"])
def test_decode_is_timed_through_generate_with_fixed_lengths(request, which, monkeypatch):
    model = request.getfixturevalue(which)
    calls = []
    generate = model.generate

    def spy(ids, **kwargs):
        out = generate(ids, **kwargs)
        calls.append((ids.shape, kwargs, out.shape))
        return out

    monkeypatch.setattr(model, "generate", spy)
    (row,) = measure_speed(model, [16], [3], decode_tokens=5, warmup=1, repeats=2, progress=False)
    assert [kwargs["max_new_tokens"] for _, kwargs, _ in calls] == [6, 1, 1, 6, 6]  # warm-up, TTFT, decode
    for shape, kwargs, out in calls:
        assert shape == (3, 16) and out == (3, 16 + kwargs["max_new_tokens"])  # no early stop
        assert kwargs["eos_token_id"] is None and kwargs["do_sample"] is False
        assert kwargs["cache_implementation"] == "dynamic"
    assert row["path"] == CPU_PATH and row["batch_size"] == 3


@pytest.mark.transformers_api
def test_mixer_state_is_constant_while_kv_grows(results, teacher):
    short, long = (e["cache_bytes_per_sequence"] for e in results["teacher"][::2])
    assert short["mixer"] == long["mixer"] == 0
    cfg = teacher.config
    assert short["attention"] == 4 * 2 * cfg.num_key_value_heads * 16 * cfg.head_dim * 4  # layers, k+v, fp32
    assert long["attention"] == 4 * short["attention"]
    assert results["teacher"][2]["cache_bytes_per_sequence_after_decode"]["attention"] == long["attention"] * 68 // 64

    short, long = (e["cache_bytes_per_sequence"] for e in results["raven"][::2])
    assert short["mixer"] == long["mixer"] > 0
    assert long["attention"] == 4 * short["attention"] > 0  # the two kept attention layers
    assert short["total"] == short["attention"] + short["mixer"]
    assert results["raven"][2]["cache_bytes_per_sequence_after_decode"]["mixer"] == long["mixer"]


def test_out_of_memory_skips_the_row_and_the_evaluation_goes_on(teacher, monkeypatch):
    timed = speed.generate_times

    def failing(model, ids, steps, repeats):
        if ids.shape[0] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return timed(model, ids, steps, repeats)

    monkeypatch.setattr(speed, "generate_times", failing)
    entries = measure_speed(teacher, [32, 8], [1, 4], decode_tokens=1, warmup=0, repeats=1, progress=False)
    assert [(e["context_length"], e["batch_size"], e["skipped"]) for e in entries] == [
        (32, 1, False),
        (32, 4, True),
        (8, 1, False),
        (8, 4, True),
    ]
    assert "out of memory" in entries[1]["reason"] and entries[1]["path"] == CPU_PATH
    assert entries[2]["prefill_tokens_per_second"] > 0
    table = format_speed_table({"teacher": entries})
    assert f"   4  {CPU_PATH}  skipped: out of memory" in table


def test_out_of_memory_measuring_the_cache_skips_the_length(teacher, monkeypatch):
    sizes = speed.cache_sizes

    def failing(model, prompt, more_tokens):
        if prompt.shape[1] == 32:
            raise MemoryError("cannot allocate")
        return sizes(model, prompt, more_tokens)

    monkeypatch.setattr(speed, "cache_sizes", failing)
    entries = measure_speed(teacher, [32, 8], [1, 2], decode_tokens=1, warmup=0, repeats=1, progress=False)
    assert [e["skipped"] for e in entries] == [True, True, False, False]
    assert entries[1]["reason"] == "out of memory (host): cannot allocate"


def test_bad_arguments_are_refused(teacher):
    with pytest.raises(ValueError, match="batches must be one or more sizes >= 1"):
        measure_speed(teacher, [8], [0], progress=False)
    with pytest.raises(ValueError, match="decode_tokens and repeats >= 1"):
        measure_speed(teacher, [8], [1], decode_tokens=0, progress=False)


def test_cache_bytes_of_other_caches():
    kv = torch.zeros(1, 2, 5, 4)
    assert cache_bytes(((kv, kv), (kv, kv))) == {"attention": 4 * kv.numel() * 4, "mixer": 0, "total": 640}
    assert cache_bytes(None) == {"attention": 0, "mixer": 0, "total": 0}


def test_table_and_plot(results, tmp_path):
    table = format_speed_table(results)
    print(table)
    lines = table.splitlines()
    assert len(lines) == 1 + 8 and lines[0].split()[:5] == ["model", "length", "batch", "path", "TTFT"]
    assert lines[1].startswith("teacher") and lines[-1].startswith("raven")
    assert lines[-1].split()[1:3] == ["64", "2"] and CPU_PATH in lines[-1]
    path = plot_speed(results, tmp_path / "speed.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_rows_of_older_reports_still_render(tmp_path):
    """Reports from before the generate() timing have no path, TTFT or generate times: they render with '-'."""
    old = {"context_length": 16384, "batch_size": 1, "skipped": False, "prefill_seconds": 0.079}
    old |= {"prefill_tokens_per_second": 207474.9, "decode_tokens_per_second": 37.9, "peak_memory_bytes": 2**31}
    old |= {"cache_bytes_per_sequence": {"attention": 47174400, "mixer": 1474560, "total": 48648960}}
    row = format_speed_table({"raven": [old]}).splitlines()[1].split()
    assert row[:6] == ["raven", "16384", "1", "-", "-", "37.9"]
    assert plot_speed({"raven": [old]}, tmp_path / "old.png").stat().st_size > 5000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_times_the_fast_paths(teacher, hybrid):
    paths = {}
    for name, model in {"teacher": teacher, "hybrid": hybrid}.items():
        model = copy.deepcopy(model).to("cuda", torch.bfloat16)
        rows = measure_speed(model, [256], [1, 4], decode_tokens=8, warmup=1, repeats=2, progress=False)
        assert [(e["batch_size"], e["skipped"]) for e in rows] == [(1, False), (4, False)]
        assert all(e["decode_tokens_per_second"] > 0 and e["ttft_seconds"] > 0 for e in rows)
        assert rows[0]["peak_memory_method"] == "cuda_max_memory_allocated"
        paths[name] = {e["path"] for e in rows}
    assert paths == {
        "teacher": {"generate, transformers static cache, compiled"},
        "hybrid": {"generate, static cache, CUDA graphs"},
    }
