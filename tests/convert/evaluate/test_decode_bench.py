"""decode_bench: the bytes a decode step must move (its bandwidth floor), and the generate() path each device gets;
the CUDA timing runs on the device (scripts/bench/bench_generate.py, test_speed.py's GPU test)."""

from __future__ import annotations

import pytest
import torch

from raven_convert import build_hybrid, plan_layers
from raven_convert.evaluate.decode_bench import (
    decode_path,
    generate_kwargs,
    is_hybrid,
    mixer_state_bytes,
    mixer_step_bytes,
    step_bytes,
)


def test_step_bytes_counts_weights_kv_and_mixer_states(tiny_sources):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    c = teacher.config
    L, per_token = c.num_hidden_layers, 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    weights = sum(p.numel() * p.element_size() for p in teacher.parameters())  # tied weights counted once
    assert step_bytes(teacher, 2, 100) == weights + 2 * 100 * per_token * L
    engine = build_hybrid(teacher, ["attention"] * L, {}).eval()
    assert step_bytes(engine, 2, 100) == step_bytes(teacher, 2, 100)
    kinds = plan_layers([("sila", "0")], L)
    hybrid = build_hybrid(teacher, kinds, {"sila": {"conv_size": 2}}).eval()
    state = mixer_state_bytes(hybrid)
    assert state > 0
    assert step_bytes(hybrid, 2, 100) == weights_of(hybrid) + 2 * 100 * per_token * (L - 1) + 2 * 2 * state
    windowed = build_hybrid(teacher, ["attention"] * L, {}, attention_windows=[16] * L).eval()
    assert step_bytes(windowed, 2, 100) == weights + 2 * 16 * per_token * L  # a window reads at most its span
    assert is_hybrid(engine) and not is_hybrid(teacher)


@pytest.mark.parametrize(
    "mixer, settings, share",
    [
        ("sila", {}, 1.0),  # the memory and the convolution's tail, read and written
        ("sse", {"num_partitions": 4, "top_k": 1, "lora_rank": 8}, 0.4),  # routed and shared of 5, both ways
        ("sse", {"num_partitions": 4, "top_k": 1, "read_top_k": 3, "lora_rank": 8}, 0.6),  # and 2 more read
        ("sse", {"num_partitions": 4, "top_k": 2, "shared_partition": False, "lora_rank": 8}, 0.5),
        ("raven", {"num_slots": 64, "top_k": 8}, (1 + 8 / 64) / 2),  # every slot read, K written
    ],
)  # fmt: skip
def test_a_steps_floor_counts_the_state_its_mixer_touches(tiny_sources, mixer, settings, share):
    """The floor counts what a step moves of each mixer's state: SSE reads and writes only its routed partitions
    and the shared one (and reads the k' - k more it reads), Raven reads every slot and writes K."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    L = teacher.config.num_hidden_layers
    hybrid = build_hybrid(teacher, plan_layers([(mixer, "0")], L), {mixer: settings}).eval()
    state = mixer_state_bytes(hybrid)
    assert state > 0 and mixer_step_bytes(hybrid) == round(2 * state * share)
    assert step_bytes(hybrid, 3, 10) - step_bytes(hybrid, 2, 10) == (
        step_bytes(hybrid, 3, 0) - step_bytes(hybrid, 2, 0) + 10 * 2 * (L - 1) * hybrid.config.num_key_value_heads
        * (hybrid.config.hidden_size // hybrid.config.num_attention_heads) * 2
    )  # one more row: its keys and values and its mixer state's share  # fmt: skip
    assert step_bytes(hybrid, 3, 0) - step_bytes(hybrid, 2, 0) == mixer_step_bytes(hybrid)


def weights_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def test_cuda_times_the_fast_path_and_other_devices_the_dynamic_cache(tiny_sources):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    hybrid = build_hybrid(teacher, plan_layers([("sila", "0")], teacher.config.num_hidden_layers), {}).eval()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for model in (teacher, hybrid):
        kwargs = generate_kwargs(model, cuda, 5)
        assert kwargs["cache_implementation"] == "static"  # a hybrid's graphed step, transformers' compiled one
        assert kwargs["max_new_tokens"] == 5 and kwargs["do_sample"] is False
        assert kwargs["eos_token_id"] is None and "min_new_tokens" not in kwargs  # exactly 5 tokens, no processor
        assert generate_kwargs(model, cpu, 5, prefill_chunk=64) == kwargs | {
            "cache_implementation": "dynamic",
            "prefill_chunk_size": 64,
        }
        assert decode_path(model, cpu) == "generate, dynamic cache (eager)"
    assert decode_path(teacher, cuda) == "generate, transformers static cache, compiled"
    assert decode_path(hybrid, cuda) == "generate, static cache, CUDA graphs"
    hybrid.use_decode_graphs = False
    assert decode_path(hybrid, cuda) == "generate, static cache (eager)"


def test_the_cuda_arguments_run_each_generate_on_its_static_cache(tiny_sources):
    """What CUDA adds (compilation, graph replay) needs the device; the cache and the fixed lengths show on CPU."""
    from transformers import AutoModelForCausalLM, StaticCache

    from raven_layers.cache import output_cache
    from raven_layers.static_cache import StaticHybridCache

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    hybrid = build_hybrid(teacher, plan_layers([("sila", "0")], teacher.config.num_hidden_layers), {}).eval()
    ids = torch.randint(3, teacher.config.vocab_size, (2, 16))
    for model, cache in ((teacher, StaticCache), (hybrid, StaticHybridCache)):
        kwargs = generate_kwargs(model, torch.device("cuda"), 3)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **kwargs)
        assert out.sequences.shape == (2, 16 + 3) and isinstance(output_cache(out), cache)


def test_step_clock_marks_every_token_and_changes_nothing(tiny_sources):
    from transformers import AutoModelForCausalLM

    from raven_convert.evaluate.decode_bench import StepClock, generate_times, timed_generate
    from raven_layers.decode_loop import applies

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    hybrid = build_hybrid(teacher, plan_layers([("sila", "0")], teacher.config.num_hidden_layers), {}).eval()
    ids = torch.randint(3, teacher.config.vocab_size, (2, 12))
    kwargs = generate_kwargs(hybrid, ids.device, 5)
    with torch.no_grad():
        plain = hybrid.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        clock = StepClock(ids.device)
        clocked = hybrid.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=[clock], **kwargs)
    assert torch.equal(plain, clocked) and len(clock.marks) == 5  # a mark a new token: the prompt's, 4 steps
    assert applies(hybrid.generation_config, kwargs | {"logits_processor": [clock]})  # this project's loop still
    assert clock.first_step_s() > 0 and clock.step_s() == pytest.approx((clock.marks[-1] - clock.marks[1]) / 3)
    assert StepClock(ids.device).step_s() is None
    for model in (teacher, hybrid):
        short = StepClock(ids.device)
        assert timed_generate(model, ids, 2, clock=short) > 0 and short.step_s() is None and len(short.marks) == 2
        times = generate_times(model, ids, steps=4)
        assert times["step_s"] == min(times["step_all"]) > 0 and len(times["step_all"]) == 2
        assert times["step_wall_s"] == pytest.approx((min(times["long_all"]) - min(times["ttft_all"])) / 4)
        one = generate_times(model, ids, steps=1)  # one decode step: nothing to time inside the call
        assert one["step_all"] == [] and one["step_s"] == one["step_wall_s"]
