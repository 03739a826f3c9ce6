"""What the benchmarks and profilers in scripts/bench/ share: the model shapes they build (SmolLM2-135M's, Qwen3-8B's),
the models a decode benchmark runs (the teacher on transformers, the teacher on this project's engine, each hybrid),
their command-line flags, and the JSON record each writes.

    from common import SMOLLM2_135M, build_models   # a script in scripts/bench/ (its folder is on sys.path)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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

QWEN3_8B = {  # Qwen3-8B's shapes (memory_plan.py)
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


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


SETTINGS_FROM = ("recipe", "defaults")  # where a benchmark's hybrids take their mixers' settings (mixer_settings)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def add_settings_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mixer-settings",
        type=checked_settings_from,
        default="recipe",
        help="each mixer's settings: its SmolLM2 recipe's (recipes/smollm2-MIXER.yaml, the hybrid that recipe "
        "trains), or the mixer's own defaults (Raven: the paper's M = 256, top-32); either with settings changed "
        "after it, e.g. recipe,sila.state_heads=query",
    )


def parse_settings_from(text: str) -> tuple[str, dict[str, dict]]:
    """'recipe' or 'defaults', then any MIXER.SETTING=VALUE changes (values read as YAML):
    'recipe,sila.state_heads=query' -> ('recipe', {'sila': {'state_heads': 'query'}})."""
    import yaml

    base, *changes = text.split(",")
    if base not in SETTINGS_FROM:
        raise ValueError(f"mixer settings {text!r}: expected one of {SETTINGS_FROM}, then MIXER.SETTING=VALUE changes")
    overrides: dict[str, dict] = {}
    for change in changes:
        key, sep, value = change.partition("=")
        mixer, dot, name = key.partition(".")
        if not (sep and dot and mixer and name):
            raise ValueError(f"mixer settings {text!r}: {change!r} is not MIXER.SETTING=VALUE (sila.state_heads=query)")
        overrides.setdefault(mixer, {})[name] = yaml.safe_load(value)
    return base, overrides


def checked_settings_from(text: str) -> str:
    """--mixer-settings as given, once `parse_settings_from` reads it (argparse's `type`)."""
    try:
        parse_settings_from(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def mixer_settings(mixer: str, settings_from: str) -> dict[str, dict]:
    """`mixer`'s settings as build_hybrid takes them: from its SmolLM2 recipe's `mixer_settings` ('recipe': the
    model whose quality the docs report, Raven with M = 64 slots and top-8), or none ('defaults': the mixer's own),
    with the changes `settings_from` names after them (parse_settings_from). A mixer with no SmolLM2 recipe takes
    its defaults."""
    base, overrides = parse_settings_from(settings_from)
    recipe = RECIPES / f"smollm2-{mixer}.yaml"
    settings = {}
    if base == "recipe" and recipe.is_file():
        from raven_convert.train.recipe import load_recipe

        settings = dict(load_recipe(recipe).mixer_settings.get(mixer, {}))
    settings.update(overrides.get(mixer, {}))
    return {mixer: settings} if settings else {}


def numbers(text: str) -> list[int]:
    """A sweep's comma-separated choices: '1,2,4' -> [1, 2, 4] (argparse's `type`)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers such as 1,2,4") from None


def add_model_arguments(parser: argparse.ArgumentParser, mixers: str | None = None) -> None:
    """--out, --mixers (default: the built-in ones), --layers, --windows and --mixer-settings: the models every bench
    script builds (build_models)."""
    from raven_layers.registry import BUILTIN_MIXERS

    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mixers", default=mixers or ",".join(spec.name for spec in BUILTIN_MIXERS))
    parser.add_argument("--layers", default="0-29:2", help="the layers each hybrid converts")
    parser.add_argument(
        "--depths", default=None, help="instead of --layers: numbers of layers converted, each spread evenly (15,22)"
    )
    parser.add_argument("--windows", type=int, default=None, help="also run each hybrid with W-token windows")
    parser.add_argument(
        "--windowed-layers",
        type=numbers,
        default=None,
        help="with --windows: window only K of each hybrid's kept attention layers (the first K; speed does not "
        "depend on which), once per K (2,4); the others stay full attention. Default: every kept layer",
    )
    parser.add_argument(
        "--attention-sinks",
        type=int,
        default=0,
        metavar="S",
        help="with --windows: the windowed layers also attend to each row's first S tokens (default 0)",
    )
    add_settings_argument(parser)
    parser.add_argument(
        "--decode-options",
        type=checked_decode_options,
        default="default",
        help="the decode step's compilation on this engine: default (the model's), plain (Inductor's own), eager, "
        "or Inductor options (shared,a=1,...)",
    )


def parse_decode_options(text: str) -> dict | None:
    """A decode step's compilation as `model.decode_compile_options` takes it: 'default' -> the model's own
    (raven_layers.decode_fusion.default_decode_options()), 'plain' -> {} (Inductor's defaults, no fusion), 'eager'
    -> None (not compiled: `compile_decode = False`), 'a=1,b=True' -> {'a': 1, 'b': True} (Inductor options, Python
    literals), 'fused' alone or among them -> FUSED_PROJECTIONS, 'shared' -> SHARED_PROJECTIONS (the fusion reading
    the weights in place), 'reduced' -> REDUCED_PRODUCTS (that, and a small batch's products as Inductor's
    reductions), 'default' among them -> the model's own, with the options after it
    ('default,triton.enable_pdl=True')."""
    import ast

    from raven_layers.decode_fusion import (
        FUSED_PROJECTIONS,
        FUSED_PROLOGUES,
        REDUCED_PRODUCTS,
        SHARED_PROJECTIONS,
        check_decode_options,
        default_decode_options,
    )

    named = {"default": default_decode_options(), "plain": {}, "eager": None}
    if text in named:
        return named[text]
    options = {}
    for item in text.split(","):
        passes = {
            "fused": FUSED_PROJECTIONS,
            "shared": SHARED_PROJECTIONS,
            "reduced": REDUCED_PRODUCTS,
            "prologues": FUSED_PROLOGUES,
            "default": named["default"],
        }
        if item in passes:
            options.update(passes[item])
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not name=value; expected default, plain, eager, fused, shared, reduced, prologues or "
                "name=value,..."
            )
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{value!r} of {name} is not a Python literal (True, 1, 'x')") from None
    try:
        check_decode_options(options)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return options


def checked_decode_options(text: str) -> str:
    parse_decode_options(text)
    return text


def set_decode_options(model, options: dict | None) -> None:
    """Compile `model`'s decode step with `options` (parse_decode_options), or not at all for None."""
    model.compile_decode = options is not None
    model.decode_compile_options = options or {}


def spread_layers(n: int, num_layers: int) -> str:
    """A layer spec converting n of num_layers layers, the kept ones spread evenly (the last layer kept first).

    >>> spread_layers(26, 30)
    '0-6,8-13,15-21,23-28'
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
    if args.windowed_layers is not None and (args.windows is None or min(args.windowed_layers) < 1):
        raise SystemExit(f"--windowed-layers {args.windowed_layers}: expected counts >= 1, beside --windows W")
    if args.attention_sinks < 0 or (args.attention_sinks and args.windows is None):
        raise SystemExit(f"--attention-sinks {args.attention_sinks}: expected a count >= 0, beside --windows W")
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


def graphed_us(fn, calls: int = 20, replays: int = 20) -> float:
    """GPU microseconds of one call of `fn` (no arguments) with `calls` calls captured in one CUDA graph: what a call
    takes inside a graphed decode step, without the eager launch cost that dwarfs a kernel of a few microseconds.
    `fn` runs once first, outside the graph (its compilation and one-time buffers)."""
    from raven_convert.evaluate.decode_bench import replay_ms

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_ms(graph, replays) * 1e3 / calls


def sweep_info(bandwidth: float, **extra) -> dict:
    """What a sweep's record says of its run: the GPU, the library versions, the copy bandwidth measured (bytes/s),
    `extra`, and the command."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_tb_per_s": round(bandwidth / 1e12, 3),
        **extra,
        "command": " ".join(sys.argv),
    }


def timing_fields(bytes_read: int, us: float, bandwidth: float, out: torch.Tensor, reference: torch.Tensor) -> dict:
    """A sweep row's measures: microseconds a call, the bytes it must read per second and their share of the copy
    bandwidth (bytes/s), and the max abs difference of its output from the default's."""
    return {
        "us": round(us, 2),
        "tb_per_s": round(bytes_read / us / 1e6, 3),
        "of_copy": round(bytes_read / (us / 1e6) / bandwidth, 3),
        "max_diff": (out - reference).abs().max().item(),
    }


def warps_sweep(argv, doc: str, name: str, default, use_warps, inputs, step, bytes_moved, **info) -> None:
    """A decode step's warps swept (sweep_sila_decode.py, sweep_sse_decode.py): for each batch of `--batches`,
    `inputs(batch)` gives the step's arguments and its state (a dict of tensors the step rewrites in place),
    `bytes_moved(state)` the bytes a call must move, and each warp count of `--warps` (the default first, set
    through the context `use_warps(warps)`; `default`: a count, or the count a batch gets) is timed in a CUDA graph
    and compared with the default's output. Writes OUT/`name`.json and prints the table."""
    default_of = default if callable(default) else lambda batch: default
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--warps", type=numbers, default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    from raven_convert.evaluate.decode_bench import copy_bandwidth
    from raven_convert.files import write_json

    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; warps {args.warps}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record, rows = sweep_info(bandwidth, **info), []
    for batch in parse_sizes(args.batches):
        x, first = inputs(batch)
        reference = step(x, {n: t.clone() for n, t in first.items()}).float()
        scratch = {n: t.clone() for n, t in first.items()}  # the timed steps rewrite it; `first` stays
        default = default_of(batch)
        for warps in [default, *(w for w in args.warps if w != default)]:
            row = {"batch": batch, "warps": warps, "default": warps == default}
            try:
                with use_warps(warps):
                    out = step(x, {n: t.clone() for n, t in first.items()}).float()
                    us = graphed_us(lambda x=x, scratch=scratch: step(x, scratch))
            except Exception as error:  # a choice the GPU cannot hold (registers)
                rows.append(row | {"error": f"{error}"[:200]})
                continue
            rows.append(row | timing_fields(bytes_moved(first), us, bandwidth, out, reference))
        write_json({"info": record, "rows": rows}, args.out / f"{name}.json")
    print_sweep(record, rows, {"warps": lambda r: f"{r['warps']}{' (default)' if r['default'] else ''}"})


def shown_rows(rows: list[dict]) -> list[dict]:
    """The rows of one shape a sweep prints: the default's, then the five fastest."""
    timed = [r for r in rows if "us" in r]
    return [r for r in timed if r["default"]] + sorted(timed, key=lambda r: r["us"])[:5]


def print_sweep(info: dict, rows: list[dict], columns: dict) -> None:
    """A sweep's record last: its info, then per batch the default's row and the five fastest, each with `columns`
    (heading -> the cell of a row) before its timings."""
    print(f"\n{info}")
    names = ["batch", *columns, "us", "TB/s", "of copy", "max diff"]
    print("| " + " | ".join(names) + " |")
    print("|" + " --- |" * len(names))
    for batch, group in itertools.groupby(rows, key=lambda r: r["batch"]):
        for r in shown_rows(list(group)):
            timings = [f"{r['us']:.1f}", f"{r['tb_per_s']:.2f}", f"{r['of_copy']:.0%}", f"{r['max_diff']:.2g}"]
            print("| " + " | ".join([str(batch), *(cell(r) for cell in columns.values()), *timings]) + " |")


def release() -> None:
    """Free what the last model left: its compiled steps keep references to its cache (and transformers' compiled
    generate its CUDA graphs' memory pool)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def window_plans(
    kinds: list[str], window: int | None, counts: list[int] | None = None
) -> list[tuple[str, list[int | None] | None]]:
    """(name suffix, attention_windows) of each model a layer plan is benchmarked as: full attention first, then with
    `window` on every kept attention layer, or on the first K of them for each K of `counts` (more than it keeps:
    all of them, once).

    >>> window_plans(["attention", "sila", "attention"], 4096, [1, 2])
    [('', None), ('-sw4096x1', [4096, None, None]), ('-sw4096', [4096, None, 4096])]
    """
    if window is None:
        return [("", None)]
    kept = [i for i, kind in enumerate(kinds) if kind == "attention"]
    plans = [("", None)]
    for count in dict.fromkeys(min(c, len(kept)) for c in counts or [len(kept)]):  # each count once, in order
        if count:
            label = f"-sw{window}" + ("" if count == len(kept) else f"x{count}")
            plans.append((label, [window if i in kept[:count] else None for i in range(len(kinds))]))
    return plans


def models_of(args: argparse.Namespace, mixers: list[str], specs: list[tuple[str, str]]):
    """build_models with the model arguments (add_model_arguments) a bench script parsed."""
    return build_models(
        mixers,
        specs,
        args.windows,
        args.decode_options,
        args.mixer_settings,
        args.windowed_layers,
        sinks=args.attention_sinks,
    )


def build_models(
    mixers: list[str],
    specs: list[tuple[str, str]],
    windows: int | None,
    decode_options: str = "default",
    settings_from: str = "recipe",
    windowed_layers: list[int] | None = None,
    sinks: int = 0,
):
    """(name, model) pairs: the teacher on transformers first, then on this project's engine (`teacher-engine`, no
    layer converted), then one hybrid per mixer and layer spec of `specs` ((name suffix, spec) pairs), and each again
    with windows on its kept layers, all or the first K for each K of `windowed_layers` (window_plans), with `sinks`
    attention sinks (its name then ends in -sinksS); the models
    on this engine compile their decode step as `decode_options` says (parse_decode_options) and take their mixers'
    settings as `settings_from` says (mixer_settings).
    Drop `model` before asking for the next: each model's memory (its static cache and compiled step
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
    set_decode_options(engine, parse_decode_options(decode_options))
    yield "teacher-engine", engine
    del engine
    release()
    for mixer in mixers:
        settings = mixer_settings(mixer, settings_from)
        for suffix, layers in specs:
            kinds = plan_layers([(mixer, layers)], n)
            for label, spans in window_plans(kinds, windows, windowed_layers):
                sunk = sinks if spans is not None else 0
                hybrid = build_hybrid(teacher, kinds, settings, attention_windows=spans, attention_sinks=sunk)
                hybrid = hybrid.to("cuda", torch.bfloat16).eval()
                set_decode_options(hybrid, parse_decode_options(decode_options))
                yield f"{mixer}{suffix}{label}" + (f"-sinks{sunk}" if sunk else ""), hybrid
                del hybrid
                release()
