"""The largest batch that fits at a long context, per model, and decode throughput at that batch, in one run.

    python scripts/bench/bench_capacity.py --out docs/results/generate --context 32k --windows 4096

Models as in bench_generate.py (SmolLM2-135M's shape, bf16, random weights): the teacher on transformers'
`generate(cache_implementation="static")` with its compiled step, each hybrid on its fast path (static hybrid
cache, compiled step in a CUDA graph), and with `--windows W` each hybrid again with its attention layers as W-token
sliding windows.

Per model: the memory of one sequence's cache of `context + 2 * steps + 16` tokens is measured (allocated bytes
after a one-token forward has made every buffer); the batch that fills the GPU's free memory less `--reserve` GiB
(the step's activations and logits) is tried, and shrunk by 5% after each out-of-memory until it runs. That batch is
"the largest that fits". Throughput is then timed there for the teacher and the windowed hybrids (`--time all`
times every model).

Every row also has the teacher on this project's engine (`teacher-engine`, converted with no layer) beside
transformers' teacher, and each timed row the share of its bandwidth floor it reached (bench_generate.py says how the
floor is counted).

Decode speed does not depend on the values in the cache, so the caches are not prefilled from `context` real tokens
(at batch 1,000 that alone takes minutes): the teacher's static step attends over its whole buffer whatever was
written (transformers' `StaticLayer.get_mask_sizes` is its full length), and each hybrid's counters are set as if
`context` tokens were cached, so its decode attention reads every slot and its positions are `context` onward. The
teacher is timed through generate() ((steps + 1 tokens - 1 token) / steps, as bench_generate.py does); a hybrid
through its forward, one greedy token per step. Writes OUT/bench_capacity.json and prints a table of ratios last.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    SMOLLM2_135M,
    add_model_arguments,
    checked_mixers,
    layer_specs,
    models_of,
    parse_sizes,
    write_record,
)

from raven_convert.evaluate.decode_bench import copy_bandwidth, step_bytes  # noqa: E402

PROMPT = 16  # tokens actually run through the model before the counters are moved


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def make_cache(name: str, model, batch: int, length: int):
    """An empty cache for `batch` sequences of `length` tokens, its buffers made by a forward of PROMPT tokens."""
    from transformers import StaticCache

    from raven_layers import StaticHybridCache
    from raven_layers.cache import OUTPUT_CACHE_FIELD

    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, PROMPT), device="cuda")
    if name == "teacher":
        cache = StaticCache(config=model.config, max_cache_len=length)
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **{OUTPUT_CACHE_FIELD: cache})
        cache.reset()  # buffers kept, counters back to zero
        return cache
    cache = StaticHybridCache(model.config, batch, length, device="cuda", dtype=model.dtype)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def bytes_per_sequence(name: str, model, length: int) -> int:
    free_memory()
    before = torch.cuda.memory_allocated()
    cache = make_cache(name, model, 1, length)
    used = torch.cuda.memory_allocated() - before
    del cache
    free_memory()
    return used


def as_if_cached(cache, context: int) -> None:
    """Move a hybrid cache's counters as if `context` real tokens were cached in every row (see the docstring)."""
    cache.step.fill_(context)
    cache.positions.fill_(context)
    for valid in cache.valid.values():
        valid.fill_(True)
    cache.num_tokens = context


def time_teacher(model, cache, batch: int, steps: int) -> float:
    from raven_layers.cache import OUTPUT_CACHE_FIELD

    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, PROMPT), device="cuda")
    args = dict(do_sample=False, pad_token_id=2, attention_mask=torch.ones_like(ids), **{OUTPUT_CACHE_FIELD: cache})

    def run(new_tokens: int) -> float:
        cache.reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **args)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(steps + 1)  # compiles the step for this batch
    return (min(run(steps + 1) for _ in range(2)) - min(run(1) for _ in range(2))) / steps


def time_hybrid(model, cache, context: int, steps: int, timed: bool) -> float | None:
    """ms per step of `steps` greedy steps; untimed, one eager step (no compilation) shows that the batch runs."""
    as_if_cached(cache, context)
    model.use_decode_graphs = timed
    token = torch.randint(3, SMOLLM2_135M["vocab_size"], (cache.batch_size, 1), device="cuda")
    with torch.no_grad():
        for _ in range(2 if timed else 1):  # compile and warm up, then capture
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if not timed:
            return None
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def largest_batch(
    name: str, model, context: int, steps: int, reserve_gib: float, timed: bool, bandwidth: float = 0
) -> dict:
    """The largest batch of `model` that fits at `context` and, where `timed`, its step there (with `bandwidth`,
    bytes/s: the step's bandwidth floor and the share of it reached, as bench_generate.py's rows)."""
    length = context + 2 * steps + PROMPT
    per_sequence = bytes_per_sequence(name, model, length)
    free_memory()
    batch = int((torch.cuda.mem_get_info()[0] - reserve_gib * 2**30) // per_sequence)
    entry = {"model": name, "context": context, "cache_mib_per_sequence": round(per_sequence / 2**20, 2), "batch": 0}
    while batch >= 1:
        cache = None
        try:
            torch.cuda.reset_peak_memory_stats()
            cache = make_cache(name, model, batch, length)
            if name == "teacher":
                step = time_teacher(model, cache, batch, steps)
            else:
                step = time_hybrid(model, cache, context, steps, timed)
            entry.update(batch=batch, peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            if step is not None:
                entry.update(step_ms=round(step * 1e3, 3), tokens_per_s=round(batch / step, 1))
            break
        except (torch.OutOfMemoryError, RuntimeError) as error:  # Triton's launcher raises a RuntimeError
            if "out of memory" not in str(error).lower():
                raise
            batch = int(batch * 0.95)
        finally:
            del cache
            free_memory()
    if bandwidth and "step_ms" in entry:  # once the cache is freed: step_bytes runs a short forward
        floor = step_bytes(model, entry["batch"], context) / bandwidth * 1e3
        entry.update(floor_ms=round(floor, 3), floor_share=round(floor / entry["step_ms"], 3))
    return entry


def table(results: list[dict]) -> str:
    """Markdown: each model's largest batch and throughput there, against the teacher on transformers and on this
    project's engine (teacher-engine)."""
    teachers = [next((r for r in results if r["model"] == m), None) for m in ("teacher", "teacher-engine")]
    teachers = [t for t in teachers if t is not None]
    names = " | ".join(f"vs {t['model']}" for t in teachers)
    lines = [
        f"| model | context | cache MiB/seq | largest batch | {names} | ms/step | tokens/s | {names} | of floor "
        "| peak GiB |",
        "| --- | --- | --- | --- | "
        + "--- | " * len(teachers)
        + "--- | --- | "
        + "--- | " * len(teachers)
        + "--- | --- |",
    ]
    for r in results:
        batches = " | ".join(f"{r['batch'] / max(t['batch'], 1):.1f}x" for t in teachers)
        if "tokens_per_s" in r:
            rates = " | ".join(
                f"{r['tokens_per_s'] / t['tokens_per_s']:.1f}x" if "tokens_per_s" in t else "-" for t in teachers
            )
            floor = f"{r['floor_share']:.0%}" if "floor_share" in r else "-"
            speed = f"{r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {rates} | {floor}"
        else:
            speed = " | ".join(["-"] * (3 + len(teachers)))
        lines.append(
            f"| {r['model']} | {r['context']} | {r['cache_mib_per_sequence']:.1f} | {r['batch']} | {batches} | "
            f"{speed} | {r.get('peak_gib', '-')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--context", default="32k")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reserve", type=float, default=3.0, help="GiB left free for the step's workspace")
    parser.add_argument("--time", choices=("windowed", "all"), default="windowed", help="which hybrids to time")
    args = parser.parse_args(argv)
    (context,) = parse_sizes(args.context)
    mixers = checked_mixers(args, "CUDA memory")
    bandwidth = copy_bandwidth()
    results = []
    for name, model in models_of(args, mixers, layer_specs(args)):
        timed = name.startswith("teacher") or args.time == "all" or "-sw" in name
        entry = largest_batch(name, model, context, args.steps, args.reserve, timed, bandwidth)
        results.append(entry)
        print(json.dumps(entry), flush=True)
        del model  # freed before the next model is built (build_models)
    gpu_gib = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    write_record(
        args.out / "bench_capacity.json",
        results,
        gpu_gib=gpu_gib,
        copy_tb_per_s=round(bandwidth / 1e12, 3),
        decode_options=args.decode_options,
        mixer_settings=args.mixer_settings,
    )
    print(table(results))


if __name__ == "__main__":
    main()
