"""Where a decode step's time goes: GPU time of the replayed CUDA graph against the whole generate() step.

    python scripts/bench/profile_decode.py --mixer raven --batches 1,32 --context 4k

For each batch: generate() warms up (compiles the kernels, captures the graph), then the captured decode step is
replayed 100 times and timed with CUDA events (GPU time per step), and generate() is timed over `--steps` tokens
(wall time per step, sampling and stopping criteria included). The difference is the host's share of a step.
Last, at the first batch size, the decode step run eagerly op by op (what the graph replays) under torch.profiler:
kernels per step and the operators by GPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from bench_generate import SMOLLM2_135M, build_models, parse_sizes  # noqa: E402

from raven_layers import DEFAULT_MIXER  # noqa: E402


def gpu_ms_per_replay(cache, replays: int = 100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        cache.graph.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixer", default=DEFAULT_MIXER)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", default="4k")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    (context,) = parse_sizes(args.context)
    models = build_models([args.mixer], [("", "0-29:2")], None)
    next(models)  # the teacher on transformers and on this engine: bench_generate.py measures them
    next(models)
    _, model = next(models)
    rows = []
    for batch in parse_sizes(args.batches):
        ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, context), device="cuda")
        kwargs = dict(do_sample=False, pad_token_id=2)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kwargs)  # warm-up and capture
            cache = model._static_cache
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kwargs)  # leaves room for 100 replays
            gpu = gpu_ms_per_replay(cache)
            timings = []
            for n in (1, args.steps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
                torch.cuda.synchronize()
                timings.append(time.perf_counter() - t)
        wall = (timings[1] - timings[0]) / args.steps * 1e3
        rows.append((batch, gpu, wall))
        print(f"batch {batch}: graph replay {gpu:.3f} ms (GPU), generate step {wall:.3f} ms (wall)", flush=True)
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (parse_sizes(args.batches)[0], context), device="cuda")
    cache = model.static_cache(ids.shape[0], context + 16)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model.use_decode_graphs = False  # what the graph replays, op by op
        token = ids[:, -1:]
        model(token, cache=cache, use_cache=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                model(token, cache=cache, use_cache=True)
            torch.cuda.synchronize()
        model.use_decode_graphs = True
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"eager decode step at batch {ids.shape[0]}: {kernels / 8:.0f} GPU kernels per step")
    print(events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=70))
    print("| batch | graph replay ms (GPU) | generate ms/step (wall) | host share |")
    print("| --- | --- | --- | --- |")
    for batch, gpu, wall in rows:
        print(f"| {batch} | {gpu:.3f} | {wall:.3f} | {max(0.0, 1 - gpu / wall):.0%} |")


if __name__ == "__main__":
    main()
