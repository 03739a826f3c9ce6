"""The recipe pipeline: stages that convert, align, weight, train, extend, evaluate and export, resumable.

    recipe = load_recipe("recipes/smollm2-raven.yaml")
    summary = run_recipe(recipe, "runs/smollm2-raven")            # every stage, in order
    run_recipe(recipe, "runs/smollm2-raven", stages=["train"])     # one stage, on the earlier stages' outputs
    run_recipe(recipe, "runs/smollm2-raven", redo="train")         # rerun train and every later stage

Stages, in order: convert, align, weights, train, extend, evaluate, export. Stage S writes under RUN_DIR/S/ and,
last and atomically, RUN_DIR/S/DONE (JSON: the stage's summary, including "model", the latest complete model
directory after the stage, its fingerprint, and "disk_bytes", what its outputs take, also logged). A stage whose
DONE exists is skipped, so an interrupted run continues where it stopped: align, weights, train and extend resume
from their own checkpoints (see checkpoint.py), evaluate from the parts its report.json records, and each stage's
checkpoints are deleted once its DONE is written. A stage's model hard-links the weight files it left unchanged
from the model it started from (align writes only the mixers' file, see weights.py), the export those of the final
model (no second copy on one file system). A stage turned off by the recipe (steps 0, token weights disabled,
extend/evaluate/export null) still writes DONE with "skipped": true. Running a stage needs the DONE of every stage
before it; a missing one is an error naming it. The inputs of the stages left to run (teacher, data, haystack,
perplexity texts) are checked before the first one starts (recipe.check_inputs), so a missing path or a bad data
file costs no stage. A non-finite loss stops its stage with a FloatingPointError naming the step and what was kept.

A fine-tuning recipe (recipe.FinetuneRecipe) runs its own stages (weights -> train -> export, finetune.py's
runners) through the same machinery: `recipe.stages` orders them, `recipe.stage_fields` names what each reads.

A stage's fingerprint hashes the recipe fields it reads and the fingerprints of the stages before it (run_state.py:
what a run directory records and what it means). When a DONE was written under another fingerprint (the recipe
changed since), the run stops and names the changed fields instead of silently reusing stale results; `redo` (CLI:
--redo STAGE) deletes that stage and every later one, but not the checkpoints of an unfinished stage unless told so
(CLI: --discard-checkpoints). BOOKKEEPING fields (how often to log and checkpoint, how many checkpoints to keep) are
left out of the fingerprints.

Several GPUs: every stage runs under a launch of N processes (see distributed.py for the strategies):
    accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 -m raven_convert.train RECIPE ...
align, weights, train and extend split the work (batch_size rows per process in align, train and extend), evaluate
splits retrieval and perplexity (speed and pictures on the main process alone); convert and export run on the main
process while the others wait for its DONE; only the main process writes files. A stage's fingerprint counts its
global batch (batch_size x the processes it ran on).
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from raven_convert.console import is_main_process
from raven_convert.files import check_writable, copy_dir, format_bytes, write_json
from raven_convert.train.distributed import Parallel, wait_for, world_size
from raven_convert.train.models import load_hybrid, load_teacher, save_trained
from raven_convert.train.recipe import STAGES, FinetuneRecipe, Recipe, check_inputs
from raven_convert.train.run_state import (
    MARKER,
    disk_use,
    drop_checkpoints,
    fingerprints,
    read_done,
    recorded_processes,
    require_done,
    resumable_checkpoints,
    stage_inputs,
    stage_state,
    stale_reason,
)
from raven_convert.train.token_weights import load_weight_table

MAIN_ONLY = ("convert", "export")  # under a launch, the main process runs these; the others wait


def release_memory() -> None:
    """Free what a finished stage left in reference cycles (FSDP2's modules and their hooks point at each other), so
    the next stage starts with only what it loads: without it a launch's stages pile their models up on the GPU
    until Python's collector happens to run."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _latest_model(run_dir: Path, done: dict) -> Path:
    for stage in reversed(list(done)):
        if done[stage].get("model"):
            return run_dir / done[stage]["model"]
    raise ValueError(f"no model directory in {run_dir}: run the convert stage first")


def _learns(recipe: Recipe, stage: str) -> bool:
    """Whether `stage` has a learning rate in the recipe (align, train, extend)."""
    return hasattr(getattr(recipe, stage, None), "lr")


def recipe_dataset(
    recipe: Recipe | FinetuneRecipe, run_dir: Path, tokenizer, seq_len: int | None = None, retrieval=None
):
    """(train, val) of data.source packed with `tokenizer` (or the one in that model directory: the converted
    model's, the same for every stage, so the cache is shared), into rows of data.seq_len tokens or of `seq_len`,
    with data.retrieval's samples or `retrieval`'s (a RetrievalMix). Under a launch the main process tokenises and
    the others read its cache."""
    from transformers import AutoTokenizer

    from raven_convert.train.data import build_dataset

    if isinstance(tokenizer, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    d = recipe.data
    cache = d.cache_dir or run_dir / "cache"
    return Parallel().main_first(  # under a launch the main process tokenises, the others read its cache
        lambda: build_dataset(
            d.source,
            tokenizer,
            seq_len or d.seq_len,
            cache,
            validation_fraction=d.validation_fraction,
            max_documents=d.max_documents,
            seed=d.seed,
            text_field=d.text_field,
            retrieval=retrieval or d.retrieval,
            max_skipped=d.max_skipped,
        ),
        cache,
    )


def _stage_convert(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from raven_convert.layer_choice import ChoiceSettings, stage_summary
    from raven_convert.pipeline import ConvertRequest, convert_model

    out = run_dir / "convert" / "model"
    request = ConvertRequest.of(
        dict(recipe),  # mixer_settings, sliding_window, window_layers, attention_sinks, dtype, seed
        out=out,
        assignments=[(a.mixer, a.layers) for a in recipe.layers],
        src=recipe.start_from or recipe.source,  # a further conversion builds on the hybrid it starts from
        overwrite=True,
        choice_data=recipe.data.source,
        choice_text_field=recipe.data.text_field,
        choice_settings=recipe.layer_choice or ChoiceSettings(),
        choice_cache=Path(recipe.data.cache_dir or run_dir / "cache") / "layer_choice",
    )
    convert_model(request, log=lambda m: log(f"[convert] {m}"))
    summary = {"model": "convert/model", "layers": [[a.mixer, a.layers] for a in recipe.layers]}
    if recipe.start_from:
        summary["start_from"] = recipe.start_from
    return summary | stage_summary(out, run_dir)


def _stage_align(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from raven_convert.train.align import align, place_mixers, validation_losses
    from raven_convert.train.common import aligned_layers
    from raven_convert.train.data import batch_iterator

    settings, model_dir = recipe.align, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, val_rows = recipe_dataset(recipe, run_dir, model_dir)
    # a further conversion imitates the hybrid it starts from, whose hidden states its new mixers will see
    teacher = load_teacher(recipe, parallel, recipe.start_from)
    hybrid = load_hybrid(model_dir, "cpu")  # align places the mixers
    held_out = _held_out_batches(val_rows, settings.batch_size, settings.seed)
    place_mixers(hybrid, parallel, aligned_layers(teacher, hybrid))
    before = validation_losses(teacher, hybrid, held_out) if held_out else None
    rows = settings.batch_size * parallel.world  # a global batch: batch_size rows per process
    history = align(
        teacher,
        hybrid,
        lambda first: batch_iterator(train_rows, rows, settings.seed, start_step=first),
        out_dir=run_dir / "align",
        parallel=parallel,
        **settings.model_dump(exclude={"batch_size"}),  # the recipe's align fields are align()'s arguments
    )
    after = validation_losses(teacher, hybrid, held_out) if held_out else None
    save_trained(parallel, hybrid, model_dir, run_dir / "align" / "model", recipe.source)
    final = history[-1]
    if parallel.is_main:
        write_json({"history": history}, run_dir / "align" / "history.json")
    if after is not None and parallel.is_main:
        worst = sorted(after["layers"], key=lambda i: -after["layers"][i])[:3]
        log(
            f"[align] validation MSE {before['loss']:.4g} -> {after['loss']:.4g}; worst layers "
            + ", ".join(f"{i}: {after['layers'][i]:.4g}" for i in worst)
        )
    return {
        "model": "align/model",
        "steps": len(history),
        "final_loss": final["loss"],
        "final_layer_losses": {str(k): v for k, v in final["layers"].items()},
        "first_layer_losses": {str(k): v for k, v in history[0]["layers"].items()},
        "tokens_per_second": final["tokens_per_second"],
        "mfu": final["mfu"],
        "validation_before": None if before is None else before["loss"],
        "validation_after": None if after is None else after["loss"],
        "validation_layers_after": None if after is None else {str(k): v for k, v in after["layers"].items()},
    } | ({"graph_layouts": final["graph_layouts"]} if "graph_layouts" in final else {})


def _stage_weights(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from transformers import AutoTokenizer

    from raven_convert.train.data import save_atomic
    from raven_convert.train.stage2_rows import rows_read
    from raven_convert.train.token_weights import plot_first_row, resolve_kernel, weight_table

    settings = recipe.token_weights
    if not settings.enabled or recipe.train.steps == 0:  # only the train stage reads the table
        return {"skipped": True}
    train_rows, _ = recipe_dataset(recipe, run_dir, run_dir / done["convert"]["model"])
    only = rows_read(recipe.train, len(train_rows), parallel.world)  # only the rows the train stage reads
    log(f"[weights] {len(only):,} of {len(train_rows):,} rows: those {recipe.train.steps:,} train steps read")
    weights = weight_table(  # [len(train_rows), T], row i belongs to train_rows[i]; NaN where train never reads
        load_teacher(recipe, parallel),
        train_rows,
        settings.batch_size,
        tau=settings.tau,
        lam=settings.lam,
        query_block=settings.query_block,
        out_dir=run_dir / "weights",
        save_every=settings.save_every,
        keep_checkpoints=settings.keep_checkpoints,
        log=log,
        parallel=parallel,
        kernel=resolve_kernel(settings.kernel, parallel.device),
        only=only,
        precision=settings.precision,
    )
    summary = {"picture": "weights/weights.png", "file": "weights/weights.pt", "shape": list(weights.shape)}
    summary |= {"rows": len(only), "mean": weights[only].mean().item(), "max": weights[only].max().item()}
    if not parallel.is_main:
        return summary
    save_atomic(weights, run_dir / "weights" / "weights.pt")
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / done["convert"]["model"]))
    plot_first_row(tokenizer, train_rows, weights, run_dir / "weights" / "weights.png")
    return summary


def _stage_train(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from raven_convert.train.stage2_config import TrainConfig

    settings, model_dir = recipe.train, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, val_rows = recipe_dataset(recipe, run_dir, run_dir / done["convert"]["model"])
    weights = None
    if not done["weights"].get("skipped"):
        weights = load_weight_table(run_dir / done["weights"]["file"], train_rows)
    config = TrainConfig(**settings.model_dump())
    teacher = load_teacher(recipe, parallel) if config.kd_weight > 0 else None
    rows = (train_rows, val_rows)
    return _train_hybrid(recipe, run_dir, "train", model_dir, config, teacher, rows, weights, parallel)


def _train_hybrid(recipe, run_dir: Path, stage: str, model_dir: Path, config, teacher, rows, weights, parallel) -> dict:
    """Stage 2's loop (train and extend) on the hybrid in `model_dir` over rows = (train, validation): the model
    saved under RUN_DIR/stage/model (LoRA merged; by the main process, a tensor at a time), and the run summarised."""
    from raven_convert.train.stage2 import train

    student = load_hybrid(model_dir, "cpu" if parallel.sharded else None)  # fsdp moves each shard to its device
    train_rows, val_rows = rows
    validation = val_rows if len(val_rows) else None
    out = run_dir / stage
    history = train(
        student, teacher, train_rows, config, out, token_weights=weights, validation=validation, parallel=parallel
    )
    save_trained(parallel, student, model_dir, run_dir / stage / "model", recipe.source, lora=config)
    return training_summary(config, history, run_dir, stage)


def training_summary(config, history: list[dict], run_dir: Path, stage: str) -> dict:
    """The DONE summary of a training stage whose model is RUN_DIR/stage/model; its history.json written."""
    from raven_convert.train.checkpoint import latest_checkpoint

    summary = {"model": f"{stage}/model", "steps": config.steps, "steps_this_run": len(history)}
    if history:
        summary |= {k: history[-1][k] for k in ("loss", "ce", "kd", "aux", "tokens_per_second", "mfu")}
        summary["val_ce"] = history[-1].get("val_ce")
        if "graph_layouts" in history[-1]:  # the step graphs captured (CUDA graphs)
            summary["graph_layouts"] = history[-1]["graph_layouts"]
        if is_main_process():
            write_json({"history": history}, run_dir / stage / "history.json")
    elif latest_checkpoint(run_dir / stage):
        summary["resumed_from"] = str(latest_checkpoint(run_dir / stage)[0])
    return summary


def _stage_extend(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from raven_convert.train.stage2_config import TrainConfig
    from raven_convert.train.token_weights import resolve_kernel, token_weights

    settings, model_dir = recipe.extend, _latest_model(run_dir, done)
    if settings is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    tokenizer = run_dir / done["convert"]["model"]
    train_rows, val_rows = recipe_dataset(recipe, run_dir, tokenizer, settings.seq_len, settings.retrieval)
    config = TrainConfig(**settings.model_dump(exclude={"seq_len", "retrieval"}))
    weighted = recipe.token_weights.enabled
    teacher = load_teacher(recipe, parallel) if config.kd_weight > 0 or weighted else None
    weights = None
    if weighted:
        tw = recipe.token_weights
        kernel = resolve_kernel(tw.kernel, parallel.device)

        def weights(batch):  # [B, T] from the teacher at this length, as each batch is drawn (eager, graphed or not)
            with record_function("train.token_weights"):  # a phase of stage 2's step in profile_train.py
                return token_weights(
                    teacher,
                    batch["input_ids"],
                    position_ids=batch["position_ids"],
                    tau=tw.tau,
                    lam=tw.lam,
                    query_block=tw.query_block,
                    kernel=kernel,
                    precision=tw.precision,
                )

    rows = (train_rows, val_rows)
    summary = _train_hybrid(recipe, run_dir, "extend", model_dir, config, teacher, rows, weights, parallel)
    return summary | {"seq_len": settings.seq_len}


def _stage_evaluate(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    from raven_convert.evaluate.report import EvalRequest, evaluate_model

    model_dir = _latest_model(run_dir, done)
    if recipe.evaluate is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    out = run_dir / "evaluate"
    request = EvalRequest(model=str(model_dir), out=out, **recipe.evaluate.model_dump())
    report = evaluate_model(request, log=lambda m: log(f"[evaluate] {m}"), resume=True, parallel=parallel)
    if not parallel.is_main:  # speed and pictures run on the main process alone: wait, polling, for its DONE
        wait_for(run_dir / "evaluate" / MARKER)
        return read_done(run_dir, "evaluate")
    if report.get("failed"):  # not DONE: a rerun evaluates again, the parts that ran stay readable meanwhile
        parts = "; ".join(f"{part}: {error}" for part, error in report["failed"].items())
        raise ValueError(f"evaluation parts failed ({parts}); the parts that ran are in {out / 'report.json'}")
    return {"model": str(model_dir.relative_to(run_dir)), "report": "evaluate/report.json", **report.get("run", {})}


def export_dir(recipe: Recipe, run_dir: Path) -> Path:
    """Where the export stage writes the model: export.dir, or RUN_DIR/model. Never a stage's own directory, whose
    DONE marker and internal files would ship with the model."""
    target = Path(recipe.export.dir).resolve() if recipe.export.dir else Path(run_dir).resolve() / "model"
    for stage in STAGES:
        folder = Path(run_dir).resolve() / stage
        if target == folder or folder in target.parents or target in folder.parents:
            raise ValueError(
                f"export.dir = {recipe.export.dir!r} overlaps the {stage} stage's directory {folder}: choose a folder "
                f"outside the stage directories (leave export.dir out for {Path(run_dir) / 'model'})"
            )
    return target


def stage_export(recipe: Recipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    model_dir = _latest_model(run_dir, done)
    if recipe.export is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    target = export_dir(recipe, run_dir)
    copy_dir(model_dir, target)  # weights hard-linked: the export takes no second copy of them
    return {"model": str(model_dir.relative_to(run_dir)), "exported_to": str(target)}


RUNNERS = {
    "convert": _stage_convert,
    "align": _stage_align,
    "weights": _stage_weights,
    "train": _stage_train,
    "extend": _stage_extend,
    "evaluate": _stage_evaluate,
    "export": stage_export,
}


def _held_out_batches(rows, batch_size: int, seed: int, count: int = 4) -> list[dict]:
    """Up to `count` fixed batches of held-out rows (fewer rows than batch_size: one smaller batch)."""
    from raven_convert.train.data import batch_iterator

    if not len(rows):
        return []
    iterator = batch_iterator(rows, min(batch_size, len(rows)), seed, epochs=1)
    return [batch for _, batch in zip(range(count), iterator)]


def run_recipe(
    recipe: Recipe | FinetuneRecipe,
    run_dir: str | Path,
    stages: list[str] | None = None,
    redo: str | None = None,
    discard_checkpoints: bool = False,
    runners: dict | None = None,
) -> dict:
    """Run `stages` (default: all, in order) of `recipe` into `run_dir`, skipping those whose DONE exists.

    `redo` deletes that stage's outputs and every later stage's first (checkpoints included), so they run again.
    It refuses (ValueError) to delete the checkpoint of a stage that has not finished, which a rerun would resume
    from, unless `discard_checkpoints`. `runners` ({stage: function(recipe, run_dir, done) -> summary}, default
    the pipeline's) run the stages; finetune.run_finetune_recipe passes those of a fine-tuning recipe.
    Returns {stage: summary} for the stages asked for (a skipped stage's summary is read from its DONE).
    """
    run_dir = Path(run_dir).resolve()
    order, runners = recipe.stages, RUNNERS if runners is None else runners
    if isinstance(recipe, FinetuneRecipe) and runners is RUNNERS:
        raise TypeError("a fine-tuning recipe (no `layers`) runs with raven_convert.train.finetune.run_finetune_recipe")
    wanted = list(order) if stages is None else list(stages)
    unknown = [s for s in wanted + ([redo] if redo else []) if s not in order]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; allowed: {', '.join(order)}")
    wanted = [s for s in order if s in wanted]
    if world_size() > 1 and redo:
        raise ValueError(f"--redo {redo} deletes stages: run it in one process, not under a multi-process launch")
    rerun = set(order[order.index(redo) :]) if redo else set()
    resumable = resumable_checkpoints(run_dir, [s for s in order if s in rerun])
    if resumable and not discard_checkpoints:
        raise ValueError(
            f"--redo {redo} would delete the checkpoint {'; '.join(resumable)}, which a rerun without --redo resumes "
            f"from; rerun without --redo to resume, or add --discard-checkpoints to delete it and start over"
        )
    check_inputs(recipe, [s for s in wanted if s in rerun or read_done(run_dir, s) is None])  # before any stage
    check_writable(run_dir, "--run-dir")
    if recipe.export is not None:  # a bad or unwritable export.dir is refused now, not after training
        check_writable(export_dir(recipe, run_dir), "export.dir", swapped=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if redo:  # what the rerun keeps must still hold before anything is deleted
        prints = fingerprints(recipe, recorded_processes(run_dir))
        now = fingerprints(recipe, dict.fromkeys(STAGES, world_size()))
        for earlier in order[: order.index(redo)]:
            existing = read_done(run_dir, earlier)
            reason = existing is not None and stale_reason(run_dir, earlier, existing, recipe, prints, now)
            if reason:
                raise ValueError(f"--redo {redo} deleted nothing: {reason}")
        for stage in order[order.index(redo) :]:
            if (run_dir / stage).exists():
                lost = [r for r in resumable if r.endswith(f" {stage} stage")]
                log(
                    f"[{stage}] --redo {redo}: deleting {run_dir / stage}"
                    + "".join(f", with checkpoint {r}" for r in lost)
                )
                shutil.rmtree(run_dir / stage)
    if is_main_process():
        write_json(recipe.model_dump(mode="json"), run_dir / "recipe.json")
    processes = recorded_processes(run_dir)
    prints = fingerprints(recipe, processes)  # what each DONE recorded, if the recipe is unchanged
    now = fingerprints(recipe, dict.fromkeys(STAGES, world_size()))  # the same global batches on this launch
    parallel = Parallel(getattr(recipe, "distributed", None))  # a fine-tuning recipe runs data parallel
    results = {}
    for stage in wanted:
        existing = parallel.gather(read_done(run_dir, stage))[0]  # the main's view: a slow process may see its DONE
        if existing is not None:
            reason = stale_reason(run_dir, stage, existing, recipe, prints, now)
            if reason:
                raise ValueError(reason)
            log(f"[{stage}] done already ({run_dir / stage / MARKER}); skipping")
            drop_checkpoints(run_dir, stage)  # left behind when a run was killed right after DONE
            results[stage] = existing
            continue
        done = require_done(run_dir, stage, order)
        for earlier, summary in done.items():
            reason = stale_reason(run_dir, earlier, summary, recipe, prints, now)
            if reason:
                raise ValueError(reason)
        log(f"[{stage}] starting")
        if stage in MAIN_ONLY and not parallel.is_main:
            wait_for(run_dir / stage / MARKER)  # the main process runs it alone; its DONE ends the wait
            results[stage] = read_done(run_dir, stage)
            continue
        clock = time.perf_counter()
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            summary = runners[stage](recipe, run_dir, done, parallel)
        except FloatingPointError as err:  # a diverged step: say what survives instead of a traceback
            advice = f"Lower {stage}.lr (--set {stage}.lr=...) or check" if _learns(recipe, stage) else "Check"
            raise FloatingPointError(
                f"the {stage} stage stopped: {err}; {stage_state(run_dir, stage)}. {advice} the data before rerunning"
            ) from err
        summary["seconds"] = round(time.perf_counter() - clock, 3)
        if torch.cuda.is_available():  # what the stage held on this process's GPU at most (nvidia-smi's view)
            summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_reserved()
        release_memory()
        summary |= {"fingerprint": prints[stage], "inputs": stage_inputs(recipe, stage, processes[stage])}
        summary["processes"] = processes[stage]
        if is_main_process():  # it alone counts the disk: another process's walk would race its checkpoints' removal
            summary["disk_bytes"] = disk_use(run_dir, stage, summary)
            write_json(summary, run_dir / stage / MARKER)
            drop_checkpoints(run_dir, stage)
        if stage not in MAIN_ONLY:
            parallel.barrier()  # every process reads this DONE before the next stage
        if summary.get("skipped"):
            log(f"[{stage}] skipped (turned off by the recipe)")
        else:
            peak = summary.get("peak_gpu_memory_bytes")
            held = f", at most {format_bytes(peak)} of GPU memory" if peak else ""
            disk = f", {format_bytes(summary['disk_bytes'])} on disk" if "disk_bytes" in summary else ""  # main's
            log(f"[{stage}] done in {summary['seconds']:.1f} s{disk}{held}")
        results[stage] = summary
    return results
