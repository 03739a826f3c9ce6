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
as W-token sliding windows. The ratios to both teachers say what converting buys over each: over transformers, the
engine and the mixers together; over `teacher-engine`, the mixers alone.

Each row also has its bandwidth floor: the bytes a decode step must read (every weight once, every kept attention
layer's keys and values, every mixer's state read and written) over the device-to-device copy bandwidth measured
at the start of the run, and the share of that floor the step reaches (floor / step).

For every (model, batch, context): a prompt of `context` random tokens per row; generate() runs once to warm up
(compilation, graph capture), then is timed for 1 new token (time to first token: prefill and one step) and for
`--steps + 1` new tokens; decode ms/step is the difference over `--steps`. `--prefill-chunk N` prefills every model
in chunks of N tokens (transformers' `prefill_chunk_size`), for prompts too long for one pass (128K). Peak memory is
of the timed runs. A configuration that runs out of memory is reported as OOM. Writes OUT/bench_generate.json (with
the GPU and library versions) and prints a table of ratios to the teacher last. The largest batch that fits at a
long context, and the throughput there: bench_capacity.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raven_convert.evaluate.decode_bench import copy_bandwidth, measure_decode  # noqa: E402

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            value = int(part.rstrip("k")) * scale
        except ValueError:
            raise SystemExit(f"{text!r}: {part!r} is not a size; expected numbers such as 1,32 or 4k,16k") from None
        if value < 1:
            raise SystemExit(f"{text!r}: sizes must be >= 1")
        sizes.append(value)
    return sizes


def add_model_arguments(parser: argparse.ArgumentParser, mixers: str | None = None) -> None:
    """--out, --mixers (default: the built-in ones), --layers and --windows: the models every bench script builds
    (build_models)."""
    from raven_layers.registry import BUILTIN_MIXERS

    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mixers", default=mixers or ",".join(spec.name for spec in BUILTIN_MIXERS))
    parser.add_argument("--layers", default="0-29:2", help="the layers each hybrid converts")
    parser.add_argument(
        "--depths", default=None, help="instead of --layers: numbers of layers converted, each spread evenly (15,22)"
    )
    parser.add_argument("--windows", type=int, default=None, help="also run each hybrid with W-token windows")


def spread_layers(n: int, num_layers: int) -> str:
    """A layer spec converting n of num_layers layers, the kept ones spread evenly (the last layer kept first).

    >>> spread_layers(26, 30)
    '0-2,4-9,11-16,18-23,25-28'
    """
    if not 0 <= n <= num_layers:
        raise ValueError(f"--depths: {n} layers converted; expected 0 to {num_layers}")
    kept = {num_layers - 1 - int(k * num_layers / (num_layers - n)) for k in range(num_layers - n)}
    converted = [i for i in range(num_layers) if i not in kept]
    if not converted:
        return "none"
    runs, start = [], converted[0]
    for a, b in zip(converted, converted[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


def layer_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(suffix, layer spec) per hybrid of each mixer: --layers alone, or one per --depths entry."""
    if args.depths is None:
        return [("", args.layers)]
    n = SMOLLM2_135M["num_hidden_layers"]
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
        return [(f"-{d}of{n}", spread_layers(d, n)) for d in depths]
    except ValueError as err:
        raise SystemExit(f"--depths {args.depths!r}: {err}") from None


def checked_mixers(args: argparse.Namespace, what: str) -> list[str]:
    """The --mixers list, after --mixers and --windows are checked and a CUDA device is found (`what` it measures)."""
    from raven_layers import resolve_mixer

    try:
        mixers = [resolve_mixer(m.strip()).name for m in args.mixers.split(",") if m.strip()]
    except ValueError as err:
        raise SystemExit(f"--mixers: {err}") from None
    if args.windows is not None and args.windows < 1:
        raise SystemExit(f"--windows {args.windows}: expected an integer >= 1")
    if not torch.cuda.is_available():
        raise SystemExit(f"{Path(sys.argv[0]).stem} measures {what}: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    return mixers


def write_record(path: Path, results: list[dict], **extra) -> None:
    """results as JSON at `path`, atomically, with the command, the GPU and the library versions."""
    import transformers

    record = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        **extra,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def release() -> None:
    """Free what the last model left: its compiled steps keep references to its cache (and transformers' compiled
    generate its CUDA graphs' memory pool)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def build_models(mixers: list[str], specs: list[tuple[str, str]], windows: int | None):
    """(name, model) pairs: the teacher on transformers first, then on this project's engine (`teacher-engine`, no
    layer converted), then one hybrid per mixer and layer spec of `specs` ((name suffix, spec) pairs), and each again
    with windows. Drop `model` before asking for the next: each model's memory (its static cache and compiled step
    too) is freed before the next is built, or the next one's peak memory and batch capacity would include it. The
    teacher's weights stay: every hybrid is built from them."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raven_convert import build_hybrid, plan_layers

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), attn_implementation="sdpa")
    teacher = teacher.to("cuda", torch.bfloat16).eval()
    yield "teacher", teacher
    release()
    n = SMOLLM2_135M["num_hidden_layers"]
    engine = build_hybrid(teacher, ["attention"] * n, {}).to("cuda", torch.bfloat16).eval()
    yield "teacher-engine", engine
    del engine
    release()
    for mixer in mixers:
        for suffix, layers in specs:
            kinds = plan_layers([(mixer, layers)], n)
            for window in [None] + ([windows] if windows else []):
                spans = [window if kind == "attention" else None for kind in kinds] if window else None
                hybrid = build_hybrid(teacher, kinds, {}, attention_windows=spans).to("cuda", torch.bfloat16).eval()
                yield f"{mixer}{suffix}" + (f"-sw{window}" if window else ""), hybrid
                del hybrid
                release()


def table(results: list[dict]) -> str:
    """Markdown: each row's step against the teacher on transformers and on this engine, and its bandwidth floor."""
    ok = [r for r in results if not r.get("oom")]
    bases = {m: {(r["batch"], r["context"]): r for r in ok if r["model"] == m} for m in ("teacher", "teacher-engine")}
    lines = [
        "| model | batch | context | ms/step | tokens/s | vs transformers | vs engine teacher | floor ms | of floor "
        "| TTFT ms | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if r.get("oom"):
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | OOM | | | | | | | |")
            continue
        ratios = []
        for base in bases.values():
            t = base.get((r["batch"], r["context"]))
            ratios.append(f"{r['step_ms'] / t['step_ms']:.2f}x" if t else "-")
        floor = f"{r['floor_ms']:.2f} | {r['floor_share']:.0%}" if "floor_share" in r else "- | -"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{ratios[0]} | {ratios[1]} | {floor} | {r['ttft_ms']:.1f} | {r['peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="4k,16k")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill_chunk_size for every model")
    args = parser.parse_args(argv)
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise SystemExit(f"--prefill-chunk {args.prefill_chunk}: expected an integer >= 1")
    batches, contexts = parse_sizes(args.batches), parse_sizes(args.contexts)
    specs = layer_specs(args)
    mixers = checked_mixers(args, "CUDA decoding")
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = []
    for name, model in build_models(mixers, specs, args.windows):
        for context in contexts:
            for batch in batches:
                entry = measure_decode(name, model, batch, context, args.steps, args.prefill_chunk, bandwidth)
                results.append(entry)
                print(json.dumps(entry), flush=True)
        del model
    write_record(args.out / "bench_generate.json", results, copy_tb_per_s=round(bandwidth / 1e12, 3))
    print(table(results))


if __name__ == "__main__":
    main()
