"""Where time to first token goes: generate(max_new_tokens=1) against the model's bare forward, under torch.profiler.

    python scripts/bench/profile_prefill.py --out $OUT --mixers raven,sse --contexts 16k,32k

Same models as bench_generate.py (the teacher under `cache_implementation="static"`, each hybrid on its default
path). For every (model, context) at batch 1: generate() warms up, then time to first token (the best of 3), the
bare forward `model(ids)` without a cache (the best of 3), and one profiled generate() whose operator tables (by GPU
time and by host time) go to OUT/profile_prefill_<model>_<context>.txt. A table of the three timings, the GPU's
busy time in the profiled run and its share of the wall time is printed last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import (  # noqa: E402
    SMOLLM2_135M,
    add_model_arguments,
    checked_mixers,
    layer_specs,
    models_of,
    parse_sizes,
)


def best_of(fn, repeats: int = 3) -> float:
    """Best wall time of `fn()` in ms, the GPU drained before and after."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def profile(name: str, model, context: int, out: Path) -> tuple[float, float, float]:
    """TTFT, bare forward and profiled GPU busy time (ms) of one model at one context; writes its operator tables."""
    kwargs = dict(max_new_tokens=1, do_sample=False, pad_token_id=2)
    if name == "teacher":
        kwargs["cache_implementation"] = "static"
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (1, context), device="cuda")
    mask = torch.ones_like(ids)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 3})  # warm-up
        ttft = best_of(lambda: model.generate(ids, attention_mask=mask, **kwargs))
        bare = best_of(lambda: model(ids, use_cache=False, logits_to_keep=1))
        with torch.profiler.profile(activities=activities) as prof:
            model.generate(ids, attention_mask=mask, **kwargs)
            torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    (out / f"profile_prefill_{name}_{context // 1024}k.txt").write_text(
        events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
        + "\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    )
    print(f"{name} {context}: TTFT {ttft:.1f} ms, bare forward {bare:.1f} ms, GPU busy {gpu_ms:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50), flush=True)
    return ttft, bare, gpu_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, mixers="raven,sse")
    parser.add_argument("--contexts", default="16k,32k")
    args = parser.parse_args(argv)
    contexts = parse_sizes(args.contexts)
    mixers = checked_mixers(args, "CUDA prefill")
    rows = []
    for name, model in models_of(args, mixers, layer_specs(args)):
        for context in contexts:
            rows.append((name, context, *profile(name, model, context, args.out)))
            torch.cuda.empty_cache()
        del model  # freed before the next model is built (build_models)
    print("| model | context | TTFT ms | bare forward ms | GPU busy ms (profiled) |")
    print("| --- | --- | --- | --- | --- |")
    for name, context, ttft, bare, gpu_ms in rows:
        print(f"| {name} | {context // 1024}K | {ttft:.1f} | {bare:.1f} | {gpu_ms:.1f} |")


if __name__ == "__main__":
    main()
