"""Decode speed of converted hybrids against their teacher twice over, in one run: the teacher at its best under
stock transformers, and the teacher on this project's own decode engine.

    python scripts/bench/bench_generate.py --out docs/results/generate --batches 1,32 --contexts 4k,16k
    python scripts/bench/bench_generate.py --out runs/depth --mixers sila --depths 15,22,26 \
        --batches 32,128 --contexts 16k

Models have SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads over 3 KV heads, vocabulary 49,152), in
bfloat16 with random weights (speed does not depend on the values): the teacher runs transformers' own
`generate(cache_implementation="static")`, whose decode step transformers compiles (`torch.compile`,
"reduce-overhead"); `teacher-engine` is the same teacher converted with no layer, so it decodes on this project's
engine (static hybrid cache, split-K attention, CUDA-graphed steps); each hybrid converts `--layers` (default
`0-29:2`, 15 of 30 layers), or with `--depths N,...` N layers spread evenly over the stack for each N, and runs
its default `generate()` on the same engine. `--windows W` adds every hybrid again with its kept attention layers
as W-token sliding windows (`--windowed-layers 2,4`: only 2, then 4 of them, the rest full attention). The ratios
to both teachers say what converting buys over each: over transformers, the engine and the mixers together; over
`teacher-engine`, the mixers alone.

Each row also has its bandwidth floor: the bytes a decode step must read (every weight once, every kept attention
layer's keys and values, what each mixer reads and writes of its state: all of SILA's memory, SSE's routed and shared
partitions, Raven's slots read and its K written) over the device-to-device copy bandwidth measured
at the start of the run, and the share of that floor the step reaches (floor / step).

For every (model, batch, context): a prompt of `context` random tokens per row; generate() runs once to warm up
(compilation, graph capture), then is timed for 1 new token (time to first token: prefill and one step) and for
`--steps + 1` new tokens; decode ms/step is timed inside the long call from its second step to its last
(raven_convert.evaluate.decode_bench.StepClock; `step_wall_ms`, the calls' difference over `--steps`, and
`first_step_ms` are in the JSON; the row's step is the best of `--repeats` long calls, default 2, each one's
in `step_ms_all`). Every generate() is greedy with no processor and no EOS stop (exactly the
tokens asked for), so this engine's loop chooses each token inside the replayed step (raven_layers/decode_loop.py).
On this engine `graph ms` is the GPU time of one replay of that captured step alone: what the step costs the GPU,
without generate()'s loop. `--prefill-chunk N` prefills every model
in chunks of N tokens (transformers' `prefill_chunk_size`), for prompts too long for one pass (128K). Peak memory is
of the timed runs. A configuration that runs out of memory is reported as OOM, one that fails otherwise by its
error (the other models still run; the exit status says so). Writes OUT/bench_generate.json (with the GPU and
library versions) after every row, and prints a table of ratios to the teacher last. The largest batch that fits at
a long context, and the throughput there: bench_capacity.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import add_model_arguments, checked_mixers, layer_specs, models_of, parse_sizes, write_record  # noqa: E402

from raven_convert.evaluate.decode_bench import copy_bandwidth, measure_decode  # noqa: E402


def measure_grid(models, contexts: list[int], batches: list[int], measure, save) -> list[dict]:
    """Every (model, context, batch) through measure(name, model, batch, context): one that fails is a row naming
    its error, not the end of the run (the other models still run), and save(rows) follows each row, so a run cut
    short keeps what it measured."""
    results = []
    for name, model in models:
        for context in contexts:
            for batch in batches:
                try:
                    entry = measure(name, model, batch, context)
                except Exception as err:  # reported in its row and by the exit status
                    entry = {"model": name, "batch": batch, "context": context,
                             "error": f"{type(err).__name__}: {err}"[:300]}  # fmt: skip
                results.append(entry)
                print(json.dumps(entry), flush=True)
                save(results)
        del model
    return results


def table(results: list[dict]) -> str:
    """Markdown: each row's step against the teacher on transformers and on this engine, and its bandwidth floor."""
    ok = [r for r in results if not r.get("oom") and "error" not in r]
    bases = {m: {(r["batch"], r["context"]): r for r in ok if r["model"] == m} for m in ("teacher", "teacher-engine")}
    lines = [
        "| model | batch | context | ms/step | graph ms | tokens/s | vs transformers | vs engine teacher | floor ms "
        "| of floor | TTFT ms | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if r.get("oom") or "error" in r:
            what = "OOM" if r.get("oom") else f"failed: {r['error'].splitlines()[0][:80]}"
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {what} | | | | | | | | |")
            continue
        ratios = []
        for base in bases.values():
            t = base.get((r["batch"], r["context"]))
            ratios.append(f"{r['step_ms'] / t['step_ms']:.2f}x" if t else "-")
        floor = f"{r['floor_ms']:.2f} | {r['floor_share']:.0%}" if "floor_share" in r else "- | -"
        graph = "-" if r.get("graph_ms") is None else f"{r['graph_ms']:.2f}"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {graph} | "
            f"{r['tokens_per_s']:.0f} | {ratios[0]} | {ratios[1]} | {floor} | {r['ttft_ms']:.1f} | "
            f"{r['peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="4k,16k")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill_chunk_size for every model")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed generate() calls a row: its step is the best, all in the JSON"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: expected an integer >= 1")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise SystemExit(f"--prefill-chunk {args.prefill_chunk}: expected an integer >= 1")
    batches, contexts = parse_sizes(args.batches), parse_sizes(args.contexts)
    specs = layer_specs(args)
    mixers = checked_mixers(args, "CUDA decoding")
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s", flush=True)

    def measure(name, model, batch, context):
        return measure_decode(name, model, batch, context, args.steps, args.prefill_chunk, bandwidth, args.repeats)

    def save(rows):
        extra = dict(copy_tb_per_s=round(bandwidth / 1e12, 3), decode_options=args.decode_options)
        extra.update(mixer_settings=args.mixer_settings)
        write_record(args.out / "bench_generate.json", rows, **extra)

    models = models_of(args, mixers, specs)
    results = measure_grid(models, contexts, batches, measure, save)
    print(table(results))
    failed = [r for r in results if "error" in r]
    if failed:
        raise SystemExit(f"bench_generate: {len(failed)} of {len(results)} configurations failed (their rows say why)")


if __name__ == "__main__":
    main()
