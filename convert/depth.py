"""How much of a model to convert: one recipe at several depths, its quality against the decode speed each depth buys.

    python -m raven_convert.depth run recipes/smollm2-sila.yaml --depths 15,22,26 --run-root runs/depth \
        --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --data ../shared/data/corpus \
        --haystack ../shared/data/pg_essays --ppl-data ../shared/data/pg_essays --lengths 1024,2048,4096,8192
    python -m raven_convert.depth collect --teacher runs/depth/teacher 15=runs/a 22=runs/b \
        --speed bench_generate.json --out docs/results/depth
    python -m raven_convert.depth budget --teacher runs/depth/teacher runs/half runs/whole --target-ppl 1.05 \
        --out docs/results/depth/budget

`run` evaluates the teacher once with the recipe's evaluate settings (RUN_ROOT/teacher), then runs the recipe with
`layers: auto:N` for each depth N (RUN_ROOT/autoN: each an ordinary recipe run, so a rerun skips what is done and
resumes what was cut; a depth of all the teacher's L layers converts every one, RUN_ROOT/allL), and on CUDA times
`generate()` of each trained hybrid and of the teacher on this project's engine (converted with no layer) at
`--batches` x `--context` (RUN_ROOT/speed.json, decode_bench's rows). `collect`
assembles the same from runs made elsewhere (a recipe run directory or an evaluation folder per depth) and, for speed,
a `scripts/bench/bench_generate.py --depths` JSON (its rows `teacher-engine` and `MIXER-NofL`).

Both write OUT/depth.json, depth.md (one table) and depth.png (quality and speed against the depth), atomically. Per
depth: perplexity and its ratio to the teacher's, the retrieval cells (task x length, at `--lengths`) within
`--within` points of the teacher's or above, passkey per length, the keys and values one token adds to the cache
(from the evaluation's speed part) and the throughput against the teacher on the same engine (its step over the
hybrid's, same batch and context). `budget` puts runs of one recipe at several budgets against the tokens they read
(raven_convert/budget.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raven_convert.budget import budget
from raven_convert.evaluate.compare import length_label, load_report, quality, report_path
from raven_convert.files import atomic_file, write_json, write_png

DEFAULT_BATCHES = (32, 128)
DEFAULT_CONTEXT = 16384


def parse_depths(text: str) -> list[int]:
    """'15,22,26' -> [15, 22, 26] (sorted, each once); ValueError naming --depths otherwise."""
    try:
        depths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--depths {text!r}: expected layer counts such as 15,22,26") from None
    if not depths or depths[0] < 1:
        raise ValueError(f"--depths {text!r}: each depth is a number of layers converted, at least 1")
    return depths


def depth_runs(depths: list[int], layers: int) -> dict[int, tuple[str, str]]:
    """{depth: (the layer spec that converts it, its run directory's name)}: auto:N into autoN (the recipe's layer
    choice) below the model's `layers`, every layer into allN at `layers` itself (nothing is left to choose);
    ValueError naming --depths past it."""
    if depths[-1] > layers:
        raise ValueError(f"--depths: {depths[-1]} is more layers than the model's {layers}; expected 1 to {layers}")
    return {d: (f"auto:{d}", f"auto{d}") if d < layers else (f"0-{layers - 1}", f"all{d}") for d in depths}


def teacher_layers(source: str) -> int:
    """The teacher's number of decoder layers, from its config (no weights loaded); ValueError naming `source`."""
    from raven_convert.sources import Source

    try:
        return Source.resolve(source).load_config().num_hidden_layers
    except ValueError as err:
        raise ValueError(f"source: {err}") from None


def throughput(rows: list[dict], name: str) -> dict[str, float]:
    """{"BxC": throughput of `name` over the teacher's on this engine} from decode_bench rows (same batch and context;
    an out-of-memory teacher or hybrid gives no entry)."""
    engine = {(r["batch"], r["context"]): r for r in rows if r["model"] == "teacher-engine" and "step_ms" in r}
    out = {}
    for r in rows:
        base = engine.get((r["batch"], r["context"]))
        if r["model"] == name and "step_ms" in r and base:
            out[f"{r['batch']}x{r['context']}"] = round(base["step_ms"] / r["step_ms"], 3)
    return out


def sweep_table(points: list[dict], within: float) -> str:
    """Markdown: one row per depth, the teacher (depth 0) first."""
    speeds = sorted({key for p in points for key in p.get("speed", {})}, key=lambda k: [int(x) for x in k.split("x")])
    lengths = sorted({n for p in points for n in p["passkey"]})
    header = ["converted", "kept attention", "ppl (x teacher)", f"cells within {within:g}"]
    header += [f"passkey {length_label(n)}" for n in lengths] + ["KV bytes/token (x teacher)"]
    header += [f"throughput B{k.split('x')[0]} @{length_label(int(k.split('x')[1]))}" for k in speeds]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    teacher_kv = points[0]["kv_bytes_per_token"]
    for p in points:
        ppl = "-" if p["perplexity"] is None else f"{p['perplexity']:.2f}"
        ppl += f" ({p['perplexity_ratio']:.2f}x)" if p.get("perplexity_ratio") else ""
        kv = p["kv_bytes_per_token"]
        kv_text = "-" if kv is None else f"{kv:,.0f}" + (f" ({kv / teacher_kv:.2f}x)" if teacher_kv else "")
        cells = [f"{p['depth']} of {p['layers']}", str(p["layers"] - p["depth"]), ppl]
        cells.append(f"{p['cells_within']} of {p['cells']}")
        cells += [f"{p['passkey'][n]:.0f}%" if n in p["passkey"] else "-" for n in lengths]
        cells.append(kv_text)
        cells += [f"{p['speed'][k]:.2f}x" if k in p.get("speed", {}) else "-" for k in speeds]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_sweep(points: list[dict], path: str | Path, title: str) -> Path:
    """Quality (cells within, passkey at the longest length, perplexity ratio) and speed (throughput against the
    teacher on the same engine, cache per token) against the layers converted, written atomically (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    depths = [p["depth"] for p in points]
    left.plot(depths, [100 * p["cells_within"] / max(p["cells"], 1) for p in points], "o-", label="cells within")
    longest = max((n for p in points for n in p["passkey"]), default=None)
    if longest:
        keep = [p for p in points if longest in p["passkey"]]
        left.plot([p["depth"] for p in keep], [p["passkey"][longest] for p in keep], "s--", label=f"passkey {longest}")
    left.set_ylim(-5, 105)
    left.set_xlabel("layers converted")
    left.set_ylabel("% (cells within the teacher's, passkey accuracy)")
    ratio = left.twinx()
    keep = [p for p in points if p.get("perplexity_ratio")]
    ratio.plot([p["depth"] for p in keep], [p["perplexity_ratio"] for p in keep], "^:", color="tab:red")
    ratio.set_ylabel("perplexity / teacher's", color="tab:red")
    left.legend(loc="lower left", fontsize=8)
    left.set_title("quality")
    for key in sorted({k for p in points for k in p.get("speed", {})}, key=lambda k: [int(x) for x in k.split("x")]):
        keep = [p for p in points if key in p.get("speed", {})]
        batch, context = key.split("x")
        right.plot([p["depth"] for p in keep], [p["speed"][key] for p in keep], "o-", label=f"B{batch} @{context}")
    base = points[0]["kv_bytes_per_token"]
    keep = [p for p in points if base and p["kv_bytes_per_token"]]
    right.plot([p["depth"] for p in keep], [base / p["kv_bytes_per_token"] for p in keep], "k:", label="1 / cache")
    right.axhline(1, color="grey", linewidth=0.5)
    right.set_xlabel("layers converted")
    right.set_ylabel("x the teacher on the same engine")
    right.legend(loc="upper left", fontsize=8)
    right.set_title("decode throughput, cache per token")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return write_png(fig, path)


def assemble(teacher: dict, reports: dict[int, dict], layers: int, rows: list[dict], mixer: str, args) -> list[dict]:
    """The points of the sweep, the teacher (depth 0) first."""
    points = [{"depth": 0, "layers": layers} | quality(teacher, teacher, args.lengths, args.within, args.ppl_length)]
    points[0].update(perplexity_ratio=1.0, speed={k: 1.0 for k in throughput(rows, "teacher-engine")})
    for depth, report in sorted(reports.items()):
        point = {"depth": depth, "layers": layers}
        point |= quality(report, teacher, args.lengths, args.within, args.ppl_length)
        point["speed"] = throughput(rows, f"{mixer}-{depth}of{layers}")
        points.append(point)
    return points


def write_sweep(points: list[dict], out: Path, title: str, within: float, sources: dict) -> str:
    """depth.json, depth.md and depth.png in `out`; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    text = sweep_table(points, within)
    write_json({"title": title, "sources": sources, "points": points}, out / "depth.json")
    with atomic_file(out / "depth.md", "w") as f:
        f.write(f"{title}\n\n{text}\n")
    plot_sweep(points, out / "depth.png", title)
    return text


def _converted(report: dict) -> tuple[int, int] | None:
    """(layers converted, layers) of the hybrid a report evaluated (from its layer map), or None for another model."""
    kinds = report.get("run", {}).get("layer_mixers")
    return None if not kinds else (sum(kind != "attention" for kind in kinds), len(kinds))


def collect(args) -> str:
    teacher = load_report(args.teacher)
    reports, sources = {}, {"teacher": str(report_path(args.teacher))}
    for item in args.runs:
        depth, sep, path = item.partition("=")
        if not sep or not depth.strip().isdigit():
            raise ValueError(f"{item!r} is not N=PATH (N: the layers that run converted)")
        report = load_report(path)
        found = _converted(report)
        if found and found[0] != int(depth):
            raise ValueError(f"{item!r}: that model converts {found[0]} of its {found[1]} layers, not {depth}")
        reports[int(depth)] = report
        sources[depth] = str(report_path(path))
    layers = args.layers or next((found[1] for r in reports.values() if (found := _converted(r))), None)
    if layers is None:
        raise ValueError("--layers: none of the reports records its layer map; give the teacher's number of layers")
    rows = json.loads(Path(args.speed).read_text())["results"] if args.speed else []
    if args.speed:
        sources["speed"] = str(args.speed)
    points = assemble(teacher, reports, layers, rows, args.mixer, args)
    return write_sweep(points, Path(args.out), args.title or f"{args.mixer} at several depths", args.within, sources)


def measure_speed(recipe, runs: dict[int, Path], batches: list[int], context: int, steps: int, log=print) -> list:
    """decode_bench rows of the teacher on this engine and each depth's trained hybrid (bf16, CUDA)."""
    import torch

    from raven_convert.evaluate.decode_bench import copy_bandwidth, measure_decode
    from raven_convert.sources import Source
    from raven_convert.surgery import build_hybrid
    from raven_convert.train.run_state import read_done
    from raven_layers import HybridForCausalLM

    teacher = Source.resolve(recipe.source).load_model("bfloat16")
    L = teacher.config.num_hidden_layers
    bandwidth = copy_bandwidth()
    models = {"teacher-engine": lambda: build_hybrid(teacher, ["attention"] * L, {})}
    for depth, run in runs.items():
        done = read_done(run, "evaluate")
        models[f"{recipe.layers[0].mixer}-{depth}of{L}"] = lambda d=run / done["model"]: (
            HybridForCausalLM.from_pretrained(d)
        )
    rows = []
    for name, build in models.items():
        model = build().to("cuda", torch.bfloat16).eval()
        for batch in batches:
            rows.append(measure_decode(name, model, batch, context, steps, bandwidth=bandwidth))
            log(f"[speed] {json.dumps(rows[-1])}")
        del model
        torch.cuda.empty_cache()
    return rows


def run(args) -> str:
    from raven_convert.evaluate.report import EvalRequest, evaluate_model
    from raven_convert.train.recipe import FinetuneRecipe, check_inputs, input_overrides, load_recipe
    from raven_convert.train.stages import run_recipe

    inputs = input_overrides(args)
    base = load_recipe(args.recipe, inputs + args.overrides)
    if isinstance(base, FinetuneRecipe):
        raise ValueError(f"{args.recipe} fine-tunes (it has no `layers`): a depth sweep converts layers")
    if len(base.layers) != 1:
        raise ValueError(f"layers: the sweep converts auto:N of one mixer; {args.recipe} assigns {len(base.layers)}")
    if base.evaluate is None:
        raise ValueError(f"evaluate: {args.recipe} does not evaluate; the sweep compares evaluations (set evaluate)")
    if args.ppl_length is None:  # the length the recipe's evaluation measures, not one it skips
        args.ppl_length = (base.evaluate.ppl_lengths or [2048])[0]
    root, mixer = Path(args.run_root), base.layers[0].mixer
    named = depth_runs(args.depths, teacher_layers(base.source))
    recipes = {
        d: load_recipe(args.recipe, inputs + args.overrides + [f'layers=[{{mixer: {mixer}, layers: "{spec}"}}]'])
        for d, (spec, _) in named.items()
    }
    for recipe in recipes.values():  # each depth's layer choice against the teacher's layers, the data, the outputs
        check_inputs(recipe, list(recipe.stages))
    teacher_out = root / "teacher"
    request = EvalRequest(model=base.source, out=teacher_out, **base.evaluate.model_dump())
    failed = evaluate_model(request, log=lambda m: print(f"[teacher] {m}", flush=True), resume=True).get("failed")
    if failed:  # the sweep compares every depth with it: stop before training anything
        parts = "; ".join(f"{part}: {error}" for part, error in failed.items())
        raise ValueError(f"the teacher's evaluation failed ({parts}); its report is in {teacher_out / 'report.json'}")
    runs = {}
    for d, recipe in recipes.items():
        runs[d] = root / named[d][1]
        print(f"[depth] {d} layers converted -> {runs[d]}", flush=True)
        run_recipe(recipe, runs[d])
    rows = []
    if args.speed:
        import torch

        if torch.cuda.is_available():
            rows = measure_speed(base, runs, args.batches, args.context, args.steps)
            write_json({"results": rows}, root / "speed.json")
        else:
            print("[speed] no CUDA device: the table has quality and cache sizes only", flush=True)
    teacher = load_report(teacher_out)
    reports = {d: load_report(r) for d, r in runs.items()}
    layers = _converted(reports[args.depths[0]])[1]
    sources = {"recipe": str(args.recipe), "teacher": str(teacher_out), **{str(d): str(r) for d, r in runs.items()}}
    points = assemble(teacher, reports, layers, rows, mixer, args)
    return write_sweep(points, root, args.title or f"{args.recipe} at several depths", args.within, sources)


def _depths_argument(text: str) -> list[int]:
    try:
        return parse_depths(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(err).removeprefix("--depths ")) from None


def build_parser() -> argparse.ArgumentParser:
    from raven_convert.evaluate.runtime import parse_lengths
    from raven_convert.train.recipe import INPUT_FLAGS

    parser = argparse.ArgumentParser(prog="python -m raven_convert.depth", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="run a recipe at several depths, then tabulate and plot")
    go.add_argument("recipe")
    go.add_argument("--depths", type=_depths_argument, required=True, help="layers converted, e.g. 15,22,26")
    go.add_argument("--run-root", required=True, help="the teacher's evaluation and one recipe run per depth")
    for field, (flag, metavar, text) in INPUT_FLAGS.items():
        go.add_argument(flag, dest=field, metavar=metavar, help=f"{text}; sets {field}")
    go.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    go.add_argument("--no-speed", dest="speed", action="store_false", help="skip the decode timing (CUDA only)")
    go.add_argument("--batches", type=parse_lengths, default=list(DEFAULT_BATCHES), help="decode batches (32,128)")
    go.add_argument(
        "--context", type=lambda t: parse_lengths(t)[0], default=DEFAULT_CONTEXT, help="decode context (16k)"
    )
    go.add_argument("--steps", type=int, default=16, help="decode steps timed")
    got = sub.add_parser("collect", help="tabulate and plot runs made elsewhere")
    got.add_argument("runs", nargs="+", metavar="N=PATH", help="a run directory or evaluation folder per depth")
    got.add_argument("--teacher", required=True, help="the teacher's evaluation (same settings)")
    got.add_argument("--layers", type=int, default=None, help="the teacher's layers (default: from the reports)")
    got.add_argument("--mixer", required=True, help="the mixer, as bench_generate.py names its rows")
    got.add_argument("--speed", default=None, help="a scripts/bench/bench_generate.py --depths JSON")
    got.add_argument("--out", required=True)
    spent = sub.add_parser("budget", help="quality against the tokens read, from runs of one recipe at several budgets")
    spent.add_argument("runs", nargs="+", metavar="RUN", help="a recipe run directory or its archive (stages.json)")
    spent.add_argument("--teacher", required=True, help="the teacher's evaluation (same settings)")
    spent.add_argument("--target-ppl", type=float, default=1.05, help="the perplexity ratio to reach (1.05)")
    spent.add_argument("--out", required=True)
    for p in (go, got, spent):
        p.add_argument(
            "--lengths", type=parse_lengths, default=None, help="the retrieval lengths compared (default: all)"
        )
        p.add_argument("--within", type=float, default=10.0, help="points under the teacher a cell may be (10)")
        run_default = "the recipe's first evaluate.ppl_lengths" if p is go else "2048"
        p.add_argument(
            "--ppl-length", type=int, default=None if p is go else 2048, help=f"the perplexity compared ({run_default})"
        )
        p.add_argument("--title", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            print(run(args))
        elif args.command == "budget":
            print(budget(args))
        else:
            print(collect(args))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
