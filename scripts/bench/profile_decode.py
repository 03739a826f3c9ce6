"""Where a decode step's time goes, and what Inductor's options change: kernels per step and step time of each
model's compiled, CUDA-graphed decode step, under several `model.decode_compile_options`.

    python scripts/bench/profile_decode.py --models teacher-engine,sila --batches 1,32 --context 16k --out OUT \\
        --variants plain default eager fused shared combo_kernels=True

For each model (SmolLM2-135M-shaped, bf16, random weights; the teacher on this project's engine is the teacher
converted with no layer, a hybrid converts `--layers`), batch and variant, the step is compiled afresh: generate()
warms up (compiles, captures the graph; `compile s`), then
- `kernels`: GPU kernels per step, from torch.profiler over 8 runs of the step outside the graph (what the graph
  replays);
- `replay ms`: GPU time of one replay of the graph generate() replays (greedy: the step with its choice of token;
  100 replays, CUDA events);
- `generate ms`: time per step of generate() over `--steps` tokens (token choice and stopping criteria included),
  marked on the stream as each token is chosen, from the second decode step to the last (`StepClock` of
  raven_convert/evaluate/decode_bench.py), in its own loop (raven_layers/decode_loop.py: greedy, so the step's
  graph chooses the token too) and in transformers' (`use_decode_loop = False`);
- `max |dlogit|`: the first decode step's logits against the `plain` variant's (compiled, nothing fused: always
  measured first), same prompt (bf16: the options may round differently; a wrong fusion shows as a large one).

A variant is `plain` (Inductor's own options), `default` (the model's own: `default_decode_options()` of
raven_layers/decode_fusion.py), `eager` (the eager step captured: `compile_decode = False`), or
comma-separated Inductor options `name=value` (Python literals) and `fused`, `shared`, `reduced` or `prologues` (the
projection fusion of raven_layers/decode_fusion.py over concatenated weights, or over the weights in place, or that
with a batch of up to 4 rows' products as Inductor's reductions, or with each RMSNorm, the residual add before it
and each MLP's gated activation inside the product that reads them; e.g. `shared,combo_kernels=True`). The table is
printed last and written to OUT/profile_decode.json with the profiler's top kernels of each row and where its GPU
time goes (`breakdown`: the attention, the mixers' step kernels, the products, Inductor's fused kernels, the rest;
printed as a table too). `--save-code` also writes each row's generated step (the wrapper that launches every
kernel, and the kernels' source) to OUT/code_MODEL_bBATCH_VARIANT.py, to tell which ops a kernel of the profile
holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from common import (  # noqa: E402
    SMOLLM2_135M,
    add_settings_argument,
    build_models,
    parse_decode_options,
    parse_sizes,
    release,
    set_decode_options,
    spread_layers,
)

from raven_convert.evaluate.decode_bench import StepClock, decode_graph_ms, timed_generate  # noqa: E402
from raven_convert.files import write_json  # noqa: E402
from raven_layers.decode_attention import decode_attention  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict | None]:
    try:
        return text, parse_decode_options(text)
    except argparse.ArgumentTypeError as error:
        raise SystemExit(f"--variants: {error}") from None


# Where a step's GPU time goes, by kernel name: the first pattern a name contains decides
CATEGORIES = (
    ("attention", ("attention_fwd_kernel", "merge_fwd_kernel")),
    ("mixer step", ("raven_fwd_kernel", "sse_fwd_kernel", "sila_fwd_kernel")),
    ("products", ("nvjet", "gemv", "gemm", "cutlass", "xmma", "splitKreduce", "triton_tem")),  # tem: Triton GEMMs
    ("fused (Inductor)", ("triton_",)),
)


def category(name: str) -> str:
    """The part of a decode step a kernel of this name belongs to (CATEGORIES), else "other"."""
    return next((label for label, patterns in CATEGORIES if any(p in name for p in patterns)), "other")


def breakdown(kernels: list[dict]) -> dict[str, dict[str, float]]:
    """{category: {"per_step": kernels, "us_per_step": GPU time}} of a step's kernels (every one, not the top)."""
    parts = {label: {"per_step": 0.0, "us_per_step": 0.0} for label, _ in (*CATEGORIES, ("other", ()))}
    for kernel in kernels:
        part = parts[category(kernel["name"])]
        part["per_step"] += kernel["per_step"]
        part["us_per_step"] += kernel["us_per_step"]
    return parts


def kernels_per_step(model, cache, token: torch.Tensor, runs: int = 8) -> tuple[float, list[dict]]:
    """GPU kernels one decode step launches (the step outside its graph), and every kernel by GPU time."""
    step = model.decode_function()
    with cache.decoding_step(), decode_attention(model.config):
        step(token, cache)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                step(token, cache)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    every = [
        {"name": e.key[:90], "per_step": e.count / runs, "us_per_step": e.self_device_time_total / runs} for e in events
    ]
    return sum(e.count for e in events) / runs, every


def code_name(model: str, batch: int, variant: str) -> str:
    """The file `--save-code` writes a step's generated code to: code_<model>_b<batch>_<variant>.py, the variant's
    punctuation as dashes."""
    slug = "".join(c if c.isalnum() else "-" for c in variant).strip("-")
    return f"code_{model}_b{batch}_{slug}.py"


def measure(model, batch: int, context: int, steps: int, options: dict | None, code: Path | None = None) -> dict:
    """One row (see the module's docstring); with `code`, the source Inductor generated for the step (every graph
    the warm-up compiled: the wrapper that launches each kernel, and the kernels) is written there."""
    model._static_cache = None  # a fresh cache and graph: the step below is compiled anew
    set_decode_options(model, options)
    release()
    seed = torch.Generator(device="cuda").manual_seed(batch)  # every variant decodes the same prompt
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (batch, context), device="cuda", generator=seed)
    kwargs = dict(do_sample=False, pad_token_id=2)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()

        def warm_up():  # compiles, captures
            return model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kwargs)

        if code is None:
            warm_up()
        else:
            sources = run_and_get_code(warm_up)[1]
            text = "\n\n".join(sources) or "# no graph compiled (the eager step, or Inductor's cache served it)\n"
            tmp = code.with_name(code.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(code)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        out = model.generate(
            ids, max_new_tokens=2, min_new_tokens=2, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        first_step = out.logits[1].float()  # [B, V]: logits[0] is the prefill's
        cache = model._static_cache
        kernels, every = kernels_per_step(model, cache, out.sequences[:, -1:])
        per_step = {}
        for loop in (True, False):
            model.use_decode_loop = loop
            clock = StepClock(ids.device)
            timed_generate(model, ids, steps + 1, clock=clock)  # as bench_generate times a step
            per_step[loop] = clock.step_s() * 1e3
        model.use_decode_loop = True
        replay = decode_graph_ms(model)  # the step generate() replays: greedy, with its choice of token
    return {
        "compile_s": compile_s,
        "kernels": kernels,
        "replay_ms": replay,
        "generate_ms": per_step[True],
        "transformers_loop_ms": per_step[False],
        "first_step_logits": first_step,
        "top_kernels": every[:15],
        "breakdown": breakdown(every),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="teacher-engine,sila", help="teacher-engine and/or mixer names")
    parser.add_argument("--layers", default="0-29:2", help="the layers each hybrid converts, or a number to spread")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", default="16k")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--save-code", action="store_true", help="write each row's generated step to OUT/code_MODEL_bBATCH_VARIANT.py"
    )
    parser.add_argument("--variants", nargs="+", default=["plain", "default", "eager"])
    parser.add_argument("--out", type=Path, required=True)
    add_settings_argument(parser)
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: expected an integer >= 2 (a step is timed from the second one)")
    variants = [parse_variant(v) for v in args.variants]
    if variants[0][0] != "plain":
        variants.insert(0, ("plain", {}))  # the reference of every |dlogit|: compiled, nothing fused
    (context,) = parse_sizes(args.context)
    names = args.models.split(",")
    layers = args.layers
    if layers.isdigit():
        layers = spread_layers(int(layers), SMOLLM2_135M["num_hidden_layers"])
    mixers = [name for name in names if name != "teacher-engine"]
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "layers": layers}
    info["mixer_settings"] = args.mixer_settings
    rows = []

    def save():  # after every row: a run cut short keeps what it measured
        write_json({"info": info, "rows": rows}, args.out / "profile_decode.json")

    for name, model in build_models(mixers, [("", layers)], None, settings_from=args.mixer_settings):
        if name not in names:
            continue
        for batch in parse_sizes(args.batches):
            reference = None
            for label, options in variants:
                try:
                    code = args.out / code_name(name, batch, label) if args.save_code else None
                    row = measure(model, batch, context, args.steps, options, code)
                except Exception as error:  # a variant Inductor cannot compile: the others still run
                    print(f"{name} B{batch} {label}: failed ({type(error).__name__}: {error})", flush=True)
                    rows.append({"model": name, "batch": batch, "variant": label, "error": f"{error}"[:500]})
                    save()
                    continue
                logits = row.pop("first_step_logits")
                reference = logits if reference is None else reference
                row["max_dlogit"] = (logits - reference).abs().max().item()
                rows.append({"model": name, "batch": batch, "context": context, "variant": label, **row})
                save()
                print(
                    f"{name} B{batch} {label}: compile {row['compile_s']:.1f} s, {row['kernels']:.0f} kernels, "
                    f"replay {row['replay_ms']:.3f} ms, generate {row['generate_ms']:.3f} ms "
                    f"({row['transformers_loop_ms']:.3f} in transformers' loop)",
                    flush=True,
                )
        del model
    for row in rows:
        if "top_kernels" in row:
            print(f"\n{row['model']} B{row['batch']} {row['variant']}: top kernels per step")
            for k in row["top_kernels"][:10]:
                print(f"  {k['per_step']:5.1f} x {k['us_per_step']:8.1f} us  {k['name']}")
    print(f"\n{info}")
    labels = [label for label, _ in CATEGORIES] + ["other"]
    print("| model | batch | variant | " + " | ".join(f"{label} us (kernels)" for label in labels) + " | GPU us |")
    print("| --- | --- | --- |" + " --- |" * (len(labels) + 1))
    for row in rows:
        if "breakdown" in row:
            parts = [row["breakdown"][label] for label in labels]
            cells = " | ".join(f"{part['us_per_step']:.0f} ({part['per_step']:.0f})" for part in parts)
            total = sum(part["us_per_step"] for part in parts)
            print(f"| {row['model']} | {row['batch']} | {row['variant']} | {cells} | {total:.0f} |")
    print()
    print(
        "| model | batch | variant | compile s | kernels/step | replay ms | generate ms | in transformers' loop | "
        "max abs dlogit |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | {row['batch']} | {row['variant']} | failed: {row['error'][:60]} | | | | | |")
            continue
        print(
            f"| {row['model']} | {row['batch']} | {row['variant']} | {row['compile_s']:.1f} | {row['kernels']:.0f} | "
            f"{row['replay_ms']:.3f} | {row['generate_ms']:.3f} | {row['transformers_loop_ms']:.3f} | "
            f"{row['max_dlogit']:.3g} |"
        )


if __name__ == "__main__":
    main()
