"""The static hybrid cache computes what the dynamic one does: decoding, left padding, windows that wrap, beams."""

import copy
import functools
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import HybridCache, StaticHybridCache, output_cache
from raven_layers.backend import use_backend
from raven_layers.decode_attention import decode_attention
from raven_layers.decode_fusion import REDUCED_PRODUCTS
from tests.conftest import tiny_config

pytestmark = pytest.mark.transformers_api
SETTINGS = {
    "raven": {"num_slots": 16, "top_k": 4, "chunk_size": 4},
    "sila": {"chunk_size": 4},
    "sse": {"num_partitions": 4, "top_k": 2, "lora_rank": 8, "chunk_size": 4},
}


# qwen3 at 5 layers, not the shared fixture's 24: raven, windowed attention, sila, full attention, sse; every layer
# runs in each interpreted decode step
LAYERS = {"llama": 4, "qwen3": 5}


@pytest.fixture(scope="module", params=sorted(LAYERS))
def hybrid(request):
    torch.manual_seed(0)
    config = tiny_config(request.param, num_hidden_layers=LAYERS[request.param])
    source = AutoModelForCausalLM.from_config(config).eval()
    n = source.config.num_hidden_layers
    kinds = plan_layers([("raven", "0"), ("sila", "2"), ("sse", "-1")], n)
    windows = [5 if i % 4 == 1 else None for i in range(n)]  # a 5-token ring next to full attention
    return build_hybrid(source, kinds, SETTINGS, attention_windows=windows).eval()


def generate(model, ids, mask, implementation, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            cache_implementation=implementation,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )


def test_static_generate_equals_dynamic_with_left_padding_and_wrapping_windows(hybrid):
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :8] = 0  # one real token
    dynamic = generate(hybrid, ids, mask, "dynamic")
    assert type(output_cache(dynamic)) is HybridCache
    for _ in range(2):  # the second generation reuses the static cache's buffers
        static = generate(hybrid, ids, mask, "static")
        assert type(output_cache(static)) is StaticHybridCache
        assert torch.equal(static.sequences, dynamic.sequences)
        for a, b in zip(static.logits, dynamic.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", sorted(LAYERS))
def test_a_memory_per_query_head_converts_as_the_kv_heads_layout_and_generates_on_the_static_cache(model_type):
    """SILA with state_heads "query" built from a GQA teacher (qwen3: with q/k norms) widens the attention's k/v
    projections: the hybrid's logits are the kv-head layout's, and its static generation is its dynamic one."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=3)).eval()
    kinds = plan_layers([("sila", "0,2")], 3)
    narrow, wide = (
        build_hybrid(source, kinds, {"sila": {"chunk_size": 4, "state_heads": heads}}).eval()
        for heads in ("kv", "query")
    )
    layer = wide.model.layers[2].self_attn
    assert layer.num_kv_heads == 4 and layer.k_proj.weight.shape[0] == 4 * 16
    torch.testing.assert_close(layer.v_proj.weight[16:32], source.model.layers[2].self_attn.v_proj.weight[:16])
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(wide(ids, attention_mask=mask).logits, narrow(ids, attention_mask=mask).logits)
    dynamic, static = (generate(wide, ids, mask, implementation) for implementation in ("dynamic", "static"))
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_static_beam_search_equals_dynamic(hybrid):
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(num_beams=3, num_return_sequences=2)
    dynamic = generate(hybrid, ids, mask, "dynamic", **kwargs)
    static = generate(hybrid, ids, mask, "static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)


# the kernels once, on qwen3 (llama's layers run the same kernels at the same shapes)
@pytest.mark.parametrize(
    ("hybrid", "backend"), [("llama", "torch"), ("qwen3", "torch"), ("qwen3", "triton")], indirect=["hybrid"]
)
def test_decode_steps_by_hand_equal_a_full_forward(hybrid, backend):
    """Decode steps through the PyTorch forms, and through the kernels (decode attention included, interpreted on
    CPU), against one full forward of the PyTorch forms."""
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(2))  # 7 steps: the 5-token ring wraps
    cache = StaticHybridCache(hybrid.config, batch_size=2, max_length=13)
    with torch.no_grad():
        full = hybrid(ids, use_cache=False).logits
        with use_backend(backend):
            steps = [hybrid(ids[:, :6], cache=cache, use_cache=True).logits]
            steps += [hybrid(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 13 and int(cache.step) == 13
    sizes = cache.state_bytes()
    assert sizes["mixer"] > 0 and sizes["attention"] > 0
    with pytest.raises(ValueError, match="the static cache holds 13 tokens per sequence; 13 are cached and 1 more"):
        hybrid(ids[:, :1], cache=cache, use_cache=True)


def test_chunked_prefill_equals_one_prefill(hybrid):
    ids = torch.randint(3, 100, (2, 23), generator=torch.Generator().manual_seed(3))
    one, chunked = (StaticHybridCache(hybrid.config, batch_size=2, max_length=32) for _ in range(2))
    with torch.no_grad():
        whole = hybrid(ids, cache=one, use_cache=True).logits
        parts = [hybrid(ids[:, i : i + 7], cache=chunked, use_cache=True).logits for i in range(0, 23, 7)]
        nxt = ids[:, -1:]
        after = [hybrid(nxt, cache=c, use_cache=True).logits for c in (one, chunked)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[0], after[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_generate_with_prefill_chunks_equals_one_prefill(hybrid, implementation):
    """transformers' `prefill_chunk_size`: chunks of 4 (the last of one token) across a left-padded prompt of 13,
    past the 5-token window: mixer states and attention carried across chunks."""
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    whole = generate(hybrid, ids, mask, implementation)
    chunked = generate(hybrid, ids, mask, implementation, prefill_chunk_size=4)
    assert torch.equal(chunked.sequences, whole.sequences)
    for a, b in zip(chunked.logits, whole.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bad_static_cache_arguments_are_refused(hybrid):
    with pytest.raises(ValueError, match="max_length = 0 is not allowed; expected an integer >= 1"):
        StaticHybridCache(hybrid.config, batch_size=1, max_length=0)
    cache = StaticHybridCache(hybrid.config, batch_size=2, max_length=8)
    with pytest.raises(ValueError, match="made for batch size 2 was given 3 rows"):
        hybrid(torch.ones(3, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported by hybrid models"):
        hybrid.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, cache_implementation="offloaded")


def test_batch_changes_and_crop_follow_the_dynamic_cache(hybrid):
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    static, dynamic = StaticHybridCache(hybrid.config, batch_size=2, max_length=12), HybridCache(hybrid.config)
    with torch.no_grad():
        for cache in (static, dynamic):
            hybrid(ids, cache=cache, use_cache=True)
            cache.batch_repeat_interleave(2)
            cache.batch_select_indices(torch.tensor([0, 3]))
        steps = [hybrid(ids[:, -1:], cache=cache, use_cache=True).logits for cache in (static, dynamic)]
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-4, atol=1e-4)
    assert static.batch_size == 2
    static.crop(7)  # the current length: nothing to roll back
    with pytest.raises(ValueError, match="cannot be rolled back from 7 to 5 tokens"):
        static.crop(5)


@pytest.mark.parametrize(("sila", "sinks"), [({}, 0), ({"state_heads": "query"}, 0), ({}, 2)])
def test_compiled_decode_step_equals_eager(monkeypatch, sila, sinks):
    """The step the CUDA graphs capture, compiled whole by torch.compile (the kernels are custom ops; interpreted
    on CPU), equals the eager step: every mixer (SILA also with a memory per query head), a full and a wrapping
    windowed attention layer (also with attention sinks, a row's second one written by a step), left padding. On
    the CPU with dynamo's aot_eager backend (the whole-graph trace, guards and functionalisation; Inductor's code is
    test_gpu.py's, whose graphed steps are compiled), which takes a tenth of Inductor's C++ builds' time here."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=5)).eval()
    kinds = plan_layers([("raven", "0"), ("sila", "2"), ("sse", "4")], 5)
    settings = {**SETTINGS, "sila": {**SETTINGS["sila"], **sila}}
    windows = [None, 5, None, None, None]
    hybrid = build_hybrid(source, kinds, settings, attention_windows=windows, attention_sinks=sinks).eval()
    if not torch.cuda.is_available():
        hybrid.decode_compile_options = {}  # aot_eager takes no Inductor options (test_decode_fusion.py runs them)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(3))  # 6 steps: the 5-token ring wraps
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, : 5 if sinks else 2] = 0

    prefilled = StaticHybridCache(hybrid.config, batch_size=2, max_length=12)
    with torch.no_grad(), use_backend("torch"):  # the prefill is not under test: the PyTorch forms fill the cache
        first = hybrid(ids[:, :6], attention_mask=mask, cache=prefilled).logits[:, -1:]

    def decode(compiled: bool) -> torch.Tensor:
        hybrid.compile_decode = compiled
        step = hybrid.decode_function()
        cache = copy.deepcopy(prefilled)  # one prefill for both: compile_decode changes only the steps
        logits = [first]
        with torch.no_grad(), use_backend("triton"):
            for t in range(6, 12):
                with cache.decoding_step(), decode_attention(hybrid.config):
                    logits.append(step(ids[:, t : t + 1], cache))
                cache.advance(1)
        return torch.cat(logits, dim=1)

    torch.testing.assert_close(decode(True), decode(False), rtol=1e-5, atol=1e-5)


def test_compiled_decode_step_is_not_capped_by_dynamos_recompile_limit(monkeypatch):
    """Every (model, batch, cache length) compiles the step once; past dynamo's default of 8 compilations per
    function the 9th would silently run eager, so the step lifts the limit while it is traced (and only then)."""
    import torch._dynamo.config as dynamo_config

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda *args: seen.append(dynamo_config.recompile_limit))
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, plan_layers([("raven", "0")], 2), SETTINGS)
    step = hybrid.decode_function()
    before = dynamo_config.recompile_limit
    step(torch.zeros(1, 1, dtype=torch.long), None)
    assert seen == [1 << 20] and dynamo_config.recompile_limit == before


def test_decode_compile_options_reach_torch_compile_and_recompile_when_changed(monkeypatch):
    """`model.decode_compile_options` are torch.compile's Inductor options for the decode step (the in-place fusion,
    a small batch's products as reductions and combo kernels until set); the step is compiled once per options (none
    passed when empty: other backends take none), and changed options give a new step."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, plan_layers([("sila", "0")], 2), SETTINGS)
    first = hybrid.decode_function()
    assert hybrid.decode_function() is first and len(calls) == 1
    assert calls[0]["options"] == {**REDUCED_PRODUCTS, "combo_kernels": True} == hybrid.decode_compile_options
    hybrid.decode_compile_options = {"freezing": True}
    second = hybrid.decode_function()
    assert second is not first and calls[1]["options"] == {"freezing": True}
    assert hybrid.decode_function() is second and len(calls) == 2
    hybrid.decode_compile_options = {}
    assert hybrid.decode_function() is not second and "options" not in calls[2]


@pytest.mark.parametrize(
    "mixer, op, buffers",
    [
        ("sila", "sila_decode", {"tail": 11, "memory": 14}),
        ("raven", "raven_decode_step", {"S^k": 11, "S^v": 12}),
        ("sse", "sse_decode_step", {"state": 15}),
    ],
)
def test_the_compiled_step_updates_the_mixer_state_where_it_lies(mixer, op, buffers):
    """Through Inductor (its CPU code; the Triton kernels interpreted): a mixer layer's decode step hands the cache's
    state buffers themselves to its one-kernel step (no copy of them before or after) and leaves them equal to the
    eager step's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    settings = {"sse": {"sse": {"lora_rank": 8, "num_partitions": 4, "top_k": 2}}}.get(mixer, {})  # the tiny model's
    hybrid = build_hybrid(source, ["attention", mixer], settings).eval()
    hybrid.decode_compile_options = {}
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = StaticHybridCache(hybrid.config, batch_size=1, max_length=16)
    with torch.no_grad(), use_backend("triton"):
        hybrid(ids[:, :8], cache=cache)
        eager_cache = copy.deepcopy(cache)
        for compiled, step_cache in ((False, eager_cache), (True, cache)):
            hybrid.compile_decode = compiled
            with step_cache.decoding_step(), decode_attention(hybrid.config):
                state = step_cache.layers[1].state
                if compiled:
                    _, code = run_and_get_code(hybrid.decode_function(), ids[:, 8:], step_cache)
                else:
                    hybrid.decode_function()(ids[:, 8:], step_cache)
            assert all(a is b for a, b in zip(step_cache.layers[1].state, state))
    for compiled_state, eager_state in zip(cache.layers[1].state, eager_cache.layers[1].state):
        torch.testing.assert_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)
    (call,) = [line for line in "\n".join(code).splitlines() if f"= torch.ops.raven_hybrid.{op}.default(" in line]
    arguments = top_level_arguments(call[call.index("(") + 1 : call.rindex(")")])
    for name, index in buffers.items():  # the graph's own inputs, the cache's buffers: no copies
        assert re.fullmatch(r"arg\d+_1", arguments[index]), f"{name}: {arguments[index]} in {call}"


def top_level_arguments(text: str) -> list[str]:
    """The comma-separated arguments of a call's text, commas inside brackets kept."""
    arguments, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if char == "," and depth == 0:
            arguments.append(text[start:i].strip())
            start = i + 1
    return [*arguments, text[start:].strip()]
