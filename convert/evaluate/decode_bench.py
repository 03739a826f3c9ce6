"""Decode speed as users decode: `generate()` timed per decode step, with the bandwidth floor of the step (CUDA).

    bandwidth = copy_bandwidth()                                  # bytes/s, measured on this GPU now
    row = measure_decode("sila", hybrid, batch=32, context=16384, steps=16, bandwidth=bandwidth)

A hybrid (a model with `layer_mixers` in its config, the teacher converted with no layer included) runs its own
`generate()`: the static hybrid cache and CUDA-graphed decode steps. Any other model runs transformers'
`generate(cache_implementation="static")`, whose decode step transformers compiles: the teacher at its best under
stock transformers. On other devices (CPU) both run generate() on the dynamic cache, eager (`decode_path` names the
path a device gets). A prompt of `context` random tokens per row (speed does not depend on the values); one warm-up
call (compilation, graph capture), then the best of two calls for 1 new token (time to first token) and for
`steps + 1`. A decode step is timed inside the long call (`StepClock`: an event on the device's stream as each
token's logits are ready, from the second decode step to the last), so neither the prompt's time nor the first
step's one-time work lands in it; `step_wall_s`, the two calls' difference over `steps`, keeps them.

The floor of a step is the bytes it must move (step_bytes: every weight read once, every attention layer's keys and
values up to its window, what each mixer reads and writes of its state: `Mixer.step_state_share`) over the
device-to-device copy bandwidth; `floor_share` is floor / step, how close the step comes to what the memory allows.
scripts/bench/bench_generate.py, bench_capacity.py, raven_convert.depth and raven-eval's speed part (speed.py) time
through here.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList

from raven_layers.common import Mixer, recompile_limits
from raven_layers.decode_loop import ScoreObserver

from .runtime import seconds_between, stream_mark, sync


def is_hybrid(model) -> bool:
    """Whether `model` decodes on this project's engine (a hybrid, converted layers or none)."""
    return bool(getattr(model.config, "layer_mixers", None))


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), best of `repeats` copies."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * int(gib * 2**30) / best


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step must move at `batch` x `context` in bf16: every weight read once, every attention
    layer's keys and values read (a windowed layer: at most its window), and what each mixer reads and writes of
    its state (`mixer_step_bytes`)."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    kinds = getattr(config, "layer_mixers", None) or ["attention"] * config.num_hidden_layers
    windows = getattr(config, "attention_windows", None) or [None] * len(kinds)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * 2  # keys and values, bf16
    kv = sum(batch * min(context, w or context) * per_token for k, w in zip(kinds, windows) if k == "attention")
    return weights + kv + batch * mixer_step_bytes(model)


def _mixer_states(model) -> list[tuple[object, int]]:
    """Each mixer layer's module and the bytes of its state for one sequence (from the cache of a 4-token forward);
    none without mixers."""
    if not is_hybrid(model) or set(model.config.layer_mixers) == {"attention"}:
        return []
    ids = torch.full((1, 4), 3, device=next(model.parameters()).device)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    mixers = {m.layer_idx: m for m in model.modules() if isinstance(m, Mixer)}
    return [(mixers[i], layer.nbytes()) for i, layer in enumerate(cache.layers) if layer.kind == "mixer"]


def mixer_state_bytes(model) -> int:
    """The bytes of one sequence's mixer states (0 without mixers)."""
    return sum(nbytes for _, nbytes in _mixer_states(model))


def mixer_step_bytes(model) -> int:
    """The bytes of one sequence's mixer states a decode step reads and writes: each state both ways, times the
    share of it its mixer touches (`Mixer.step_state_share`: SSE's unrouted partitions are left alone, Raven
    writes K of its M slots)."""
    return round(sum(2 * nbytes * mixer.step_state_share() for mixer, nbytes in _mixer_states(model)))


def decode_path(model, device: torch.device) -> str:
    """Which decode path `timed_generate` times on `device`: the label a speed row carries."""
    if device.type != "cuda":
        return "generate, dynamic cache (eager)"
    if not is_hybrid(model):
        return "generate, transformers static cache, compiled"
    graphs = getattr(model, "use_decode_graphs", True)
    return "generate, static cache, CUDA graphs" if graphs else "generate, static cache (eager)"


def generate_kwargs(model, device: torch.device, new_tokens: int, prefill_chunk: int | None = None) -> dict:
    """The arguments of a timed generate(): greedy, exactly `new_tokens` new tokens (no EOS token ends a row: random
    weights may choose one, and a processor that forbids it would be work a user's generate() does not do), the
    static cache on CUDA (a hybrid's with CUDA-graphed steps, transformers' compiled one otherwise) and the dynamic
    cache elsewhere."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None)
    kwargs["cache_implementation"] = "static" if device.type == "cuda" else "dynamic"
    if prefill_chunk is not None:
        kwargs["prefill_chunk_size"] = prefill_chunk
    return kwargs


class StepClock(ScoreObserver):
    """A logits processor that changes nothing and marks each new token: generate() calls its processors once a
    token in transformers' loop and in this project's (decode_loop.py) alike, when the token's logits are ready,
    or, where decode_loop chooses greedy tokens inside the step, once the step that chose it is queued. On CUDA a
    mark is an event recorded on the stream, so the host never waits for it; elsewhere the step has finished."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None) -> torch.FloatTensor | None:
        self.marks.append(stream_mark(self.cuda))
        return scores

    def step_s(self) -> float | None:
        """Mean seconds of a decode step from the second to the last (marks 1 to n-1), None under 3 marks. Mark 0
        follows the prompt, mark 1 the first decode step, which may carry one-time work (`first_step_s`)."""
        if len(self.marks) < 3:
            return None
        return seconds_between(self.marks[1], self.marks[-1]) / (len(self.marks) - 2)

    def first_step_s(self) -> float | None:
        """Seconds from the prompt's logits to the first decode step's (None under 2 marks)."""
        return seconds_between(self.marks[0], self.marks[1]) if len(self.marks) >= 2 else None


def timed_generate(
    model, ids: torch.Tensor, new_tokens: int, prefill_chunk: int | None = None, clock: StepClock | None = None
) -> float:
    """Seconds for one greedy generate() of `new_tokens` tokens after the prompt `ids` [B, T] (see the module);
    `clock` marks each token's logits."""
    kwargs = generate_kwargs(model, ids.device, new_tokens, prefill_chunk)
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    sync(ids.device)
    start = time.perf_counter()
    # every (batch, cache length) compiles once; past dynamo's default of 8 the step would run eager, silently
    with torch.no_grad(), torch._dynamo.config.patch(**recompile_limits(1 << 20)):
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    sync(ids.device)
    return time.perf_counter() - start


def warm_up(model, ids: torch.Tensor, steps: int, prefill_chunk: int | None = None) -> None:
    """One untimed generate() of `steps + 1` new tokens: it compiles and captures the step, and the longest call
    first leaves a static cache that every timed call fits (transformers makes a new one only for a longer one)."""
    timed_generate(model, ids, steps + 1, prefill_chunk)


def generate_times(model, ids: torch.Tensor, steps: int, repeats: int = 2, prefill_chunk: int | None = None) -> dict:
    """After `warm_up`: `repeats` generate() calls of 1 new token, then `repeats` of `steps + 1`. Returns {"ttft_s":
    the best 1-token call, "step_s": the best long call's decode step (`StepClock`; with `steps` < 2 the wall-clock
    one), "step_wall_s": (best long call - best 1-token call) / steps, "first_step_s": the first decode step of the
    long call with the best step, "ttft_all", "long_all", "step_all": every call's seconds}."""
    ttft = [timed_generate(model, ids, 1, prefill_chunk) for _ in range(repeats)]
    clocks = [StepClock(ids.device) for _ in range(repeats)]
    long = [timed_generate(model, ids, steps + 1, prefill_chunk, clock) for clock in clocks]
    wall = (min(long) - min(ttft)) / steps
    clocked = [(step, clock) for clock in clocks if (step := clock.step_s()) is not None]
    step, best = min(clocked, key=lambda pair: pair[0]) if clocked else (wall, None)
    return {
        "ttft_s": min(ttft),
        "step_s": step,
        "step_wall_s": wall,
        "first_step_s": best.first_step_s() if best is not None else None,
        "ttft_all": ttft,
        "long_all": long,
        "step_all": [pair[0] for pair in clocked],
    }


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 100) -> float:
    """GPU milliseconds of one replay of a captured CUDA graph, the replays queued back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # the first replay uploads the graph
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def decode_graph_ms(model) -> float | None:
    """GPU milliseconds of one replay of `model`'s captured decode step (this engine's models after a generate();
    None for others): a step's GPU work alone, without generate()'s loop. Where greedy decoding chose its tokens in
    the step (decode_loop.py), the graph that did. The replays write the cache's buffers, which the next
    generate() fills anew."""
    cache = getattr(model, "_static_cache", None)
    captured = [getattr(cache, name, None) for name in ("token_graph", "graph")]
    graphs = [c.graph for c in captured if c is not None and c.graph is not None]
    return replay_ms(graphs[0]) if graphs else None


def measure_decode(
    name: str,
    model,
    batch: int,
    context: int,
    steps: int,
    prefill_chunk: int | None = None,
    bandwidth: float = 0,
    repeats: int = 2,
) -> dict:
    """{model, batch, context, ttft_ms, step_ms, step_ms_all, step_wall_ms, first_step_ms, graph_ms, tokens_per_s,
    peak_gib} (`step_ms`: the best of `repeats` timed calls, each one's in `step_ms_all`; `graph_ms`:
    `decode_graph_ms`, None off this engine; with `bandwidth`, bytes/s: floor_ms and floor_share too), or {...,
    oom: True} where the batch does not fit."""
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda")
    entry = {"model": name, "batch": batch, "context": context}
    if bandwidth:
        entry["floor_ms"] = round(step_bytes(model, batch, context) / bandwidth * 1e3, 3)
    try:
        warm_up(model, ids, steps, prefill_chunk)
        torch.cuda.reset_peak_memory_stats()
        times = generate_times(model, ids, steps, repeats, prefill_chunk)
        first, step = times["ttft_s"], times["step_s"]
        entry.update(
            ttft_ms=round(first * 1e3, 2),
            step_ms=round(step * 1e3, 3),
            step_ms_all=[round(s * 1e3, 3) for s in times["step_all"]],
            step_wall_ms=round(times["step_wall_s"] * 1e3, 3),
            first_step_ms=None if times["first_step_s"] is None else round(times["first_step_s"] * 1e3, 3),
            tokens_per_s=round(batch / step, 1),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        )
        graph_ms = decode_graph_ms(model)
        entry["graph_ms"] = None if graph_ms is None else round(graph_ms, 3)
        if "floor_ms" in entry:
            entry["floor_share"] = round(entry["floor_ms"] / entry["step_ms"], 3)
    except torch.OutOfMemoryError:
        entry["oom"] = True
    del ids
    torch.cuda.empty_cache()
    return entry
