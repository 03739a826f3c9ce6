"""One call evaluates a model (teacher or hybrid) and writes a report directory: report.json plus the PNGs.

    report = evaluate_model(EvalRequest(model="runs/smollm2-raven", out=Path("runs/smollm2-raven/eval")))

Parts: retrieval (passkey and RULER-style needles, heatmaps; TASK@NAME, a task on a named haystack, is a part of
its own), perplexity with position-wise loss curves (when texts are given), generate() speed and memory versus
context and batch (when lengths are given), and for hybrids the pictures each mixer's declaration names (the
papers' pictures of the built-in mixers' memories) on a passkey prompt. The recipe pipeline calls `evaluate_model`
at its end.

Under a launch of N processes (the recipe's evaluate stage passes its `parallel`, see shares.py) retrieval and
perplexity are split across the processes, each on its own device, and every process gets the results in one
process's order, so report.json is the one a single process writes. Speed and the mixer pictures run on the main
process alone, after the others have returned (timings must not share the machine with other work); only the main
process writes files.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from raven_layers.architectures import layer_windows
from raven_layers.registry import import_object

from ..files import write_json
from ..sources import Source
from .perplexity import format_perplexity_table, load_texts, perplexity, plot_loss_curve
from .pictures import PictureContext
from .retrieval import (
    format_past_window,
    format_table,
    past_window,
    plot_niah_heatmap,
    run_retrieval,
    save_results,
    summarize,
)
from .runtime import load_for_evaluation, run_info
from .settings import EvalRequest
from .shares import OneProcess
from .speed import format_speed_table, measure_speed, plot_speed


def mixer_pictures(model, tokenizer, request: EvalRequest, out: Path) -> dict[str, str]:
    """For the first layer of each mixer kind, the pictures its declaration names (`MixerSpec.pictures`, see
    pictures.py: Raven ESL and slot allocation, SILA input-gate traces, SSE partition usage and state entropy), on a
    passkey prompt. Returns {picture: file name}."""
    kinds = getattr(model.config, "layer_mixers", None) or []
    context = PictureContext(model, tokenizer, out, request.picture_length, request.seed, request.chat_template)
    files = {}
    for kind in dict.fromkeys(k for k in kinds if k != "attention"):
        path = model.config.mixer_spec(kind).pictures
        if path is not None:
            files |= import_object(path, f"the pictures of mixer {kind!r}")(context, kinds.index(kind))
    return files


def widest_window(config) -> int | None:
    """The widest attention window of a hybrid whose every kept attention layer is windowed (None otherwise, and
    for models that are not hybrids): the needles further back are answered through its mixers or not at all."""
    kinds = getattr(config, "layer_mixers", None)
    if not kinds or "attention" not in kinds:
        return None
    windows = [w for w, kind in zip(layer_windows(config), kinds) if kind == "attention"]
    return None if None in windows else max(windows)


def model_stamp(model: str) -> str:
    """A short hash of a local model's file names, sizes and modification times (of the name for a Hub id): whether
    a report was made with the model as it is now."""
    path = Path(model)
    files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
    seen = [
        (str(f.relative_to(path) if path.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns) for f in files
    ]
    return hashlib.sha256(json.dumps([model, seen]).encode()).hexdigest()[:16]


def _earlier_report(out: Path, report: dict, log) -> dict | None:
    """out/report.json when it was made with the same request and model (its finished parts can be kept), else None."""
    path = out / "report.json"
    try:
        earlier = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as err:
        log(f"warning: {path} is not readable ({err}); evaluating every part again")
        return None
    if earlier is None or not earlier.get("finished"):
        return None
    if {k: earlier.get(k) for k in ("request", "model_stamp")} != {k: report[k] for k in ("request", "model_stamp")}:
        log(f"{path} was made with other settings or another model; evaluating every part again")
        return None
    log(f"resuming: {', '.join(earlier['finished'])} done already ({path})")
    return earlier


def evaluate_model(request: EvalRequest, log=print, resume: bool = False, parallel=None) -> dict:
    """Run every requested part, write `request.out`/report.json and the PNGs, print the tables; return the report.

    report.json is rewritten after every part and lists the parts done under "finished", so an interruption keeps
    them; with `resume`, the parts that an earlier report.json in `request.out` (same request, same model files)
    finished are kept instead of run again. A part that raises is recorded under "failed" (part -> error) and the
    others still run; the caller decides what a failure means.

    With `parallel` (rank, world, is_main, device, gather: shares.py) every process of a launch calls this; each
    loads the model on its own device (`parallel.device` unless `request.device`) and the main process logs and
    writes. Perplexity runs first, then retrieval; the others return after retrieval, without speed and pictures:
    their caller waits for the main process's result (the recipe stage polls for its DONE, which no collective's
    timeout cuts short)."""
    parallel = parallel or OneProcess()
    log = log if parallel.is_main else lambda message: None
    Source.resolve(request.model, "model")  # before anything is written or loaded
    request.check_haystacks()
    out = Path(request.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_for_evaluation(request.model, request.dtype, request.device or parallel.device)
    if request.attention_window is not None:
        if not hasattr(model, "set_attention_window"):
            raise ValueError(
                f"attention_window={request.attention_window} applies to converted hybrids only; "
                f"{request.model!r} is a {type(model).__name__}"
            )
        model.set_attention_window(request.attention_window)
    name = Path(request.model).name or request.model
    window = widest_window(model.config)
    report = {"request": request.model_dump(mode="json")}
    report |= {"model_stamp": model_stamp(request.model), "run": run_info(model), "retrieval": {}, "finished": []}
    earlier = _earlier_report(out, report, log) if resume and parallel.is_main else None
    earlier = parallel.gather(earlier)[0]  # the main process's reading: every process skips the same parts
    if earlier is not None:
        report |= {
            k: v
            for k, v in earlier.items()
            if k in ("retrieval", "perplexity", "speed", "pictures", "finished", "seconds")
        }
    failed = {}

    def part(name: str, run) -> None:
        if name in report["finished"]:
            return
        start = time.perf_counter()
        try:
            run()
            report["finished"].append(name)
            report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)  # where the time goes
        except Exception as err:  # one part failing must not cost the parts that ran, nor hide them
            failed[name] = f"{type(err).__name__}: {err}"
            log(f"{name} failed: {failed[name]}")
        if parallel.is_main:
            write_json(report | ({"failed": failed} if failed else {}), out / "report.json")  # a kill keeps these

    def retrieval(task: str, variant: str) -> None:
        samples = request.prompts(task, variant, tokenizer)
        log(f"{task} ({variant}): {len(samples)} prompts")
        results = run_retrieval(model, tokenizer, samples, batch_size=request.batch_size, parallel=parallel)
        summary = summarize(results)
        if parallel.is_main:
            save_results(results, summary, out / f"retrieval_{task}_{variant}.json")
            plot_niah_heatmap(results, out / f"niah_{task}_{variant}.png", f"{name}: {task} ({variant})")
        if window is not None:  # how much the mixers answer alone
            split = past_window(results, window)
            summary["tasks"][f"{task}/{variant}"]["past_window"] = split
            log(format_past_window(split))
        report["retrieval"].update(summary["tasks"])
        log(format_table(summary))

    def ppl() -> None:
        texts = load_texts(request.ppl_data)
        result = perplexity(model, tokenizer, texts, request.ppl_lengths, request.ppl_windows, parallel=parallel)
        if parallel.is_main:
            plot_loss_curve({name: result}, out / "loss_curve.png")
        report["perplexity"] = result
        log(format_perplexity_table({name: result}))

    def speed() -> None:
        result = measure_speed(model, request.speed_lengths, request.speed_batches)
        plot_speed({name: result}, out / "speed.png")
        report["speed"] = result
        log(format_speed_table({name: result}))

    if request.ppl_data:  # first: seconds of work, and the number an evaluation cut short should still give
        part("perplexity", ppl)
    for task in request.tasks:
        for variant in request.variants:
            part(f"retrieval {task} ({variant})", lambda t=task, v=variant: retrieval(t, v))
    if not parallel.is_main:  # speed and pictures: the main process alone
        return report | ({"failed": failed} if failed else {})
    if request.speed_lengths:
        part("speed", speed)
    if request.pictures and getattr(model.config, "layer_mixers", None):
        part("pictures", lambda: report.update(pictures=mixer_pictures(model, tokenizer, request, out)))
    if failed:
        report["failed"] = failed
    write_json(report, out / "report.json")
    log(f"wrote {out / 'report.json'} and {len(list(out.glob('*.png')))} pictures")
    return report
