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
checkpoints are deleted once its DONE is written. The export hard-links the final model's weights (no second copy
on one file system). A stage turned off by the recipe (steps 0, token weights disabled, extend/evaluate/export
null) still writes DONE with "skipped": true. Running a stage needs the DONE of every stage
before it; a missing one is an error naming it. The inputs of the stages left to run (teacher, data, haystack,
perplexity texts) are checked before the first one starts (recipe.check_inputs), so a missing path or a bad data
file costs no stage. A non-finite loss stops its stage with a FloatingPointError naming the step and what was kept.

A stage's fingerprint hashes the recipe fields it reads and the fingerprints of the stages before it. When a DONE
was written under another fingerprint (the recipe changed since), the run stops and names the changed fields
instead of silently reusing stale results; `redo` (CLI: --redo STAGE) deletes that stage and every later one, but
not the checkpoints of an unfinished stage unless told so (CLI: --discard-checkpoints). BOOKKEEPING fields (how often
to log and checkpoint, how many checkpoints to keep) are left out of the fingerprints.

Several GPUs: run the stages before train in one process, then
    accelerate launch --num_processes 2 -m raven_convert.train RECIPE --run-dir DIR --stages train
train and extend are data parallel (train.batch_size rows per process); only the main process writes files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from raven_convert.console import is_main_process
from raven_convert.files import check_writable, copy_dir, disk_bytes, format_bytes, write_json
from raven_convert.train.checkpoint import CHECKPOINTS
from raven_convert.train.recipe import STAGES, Recipe, check_inputs

MARKER = "DONE"
# Fields that change how a stage logs and checkpoints, not what it computes: changing them keeps its results valid.
BOOKKEEPING = ("log_every", "save_every", "keep_checkpoints")
DATA_PARALLEL = ("train", "extend")  # the stages that run under `accelerate launch` on several processes

# The recipe fields each stage reads (its own settings and what shapes its inputs).
STAGE_FIELDS = {
    "convert": ("source", "layers", "mixer_settings", "sliding_window", "window_layers", "dtype", "seed"),
    "align": ("data", "align"),
    "weights": ("data", "token_weights"),
    "train": ("data", "train"),
    "extend": ("data", "token_weights", "extend"),
    "evaluate": ("evaluate",),
    "export": ("export",),
}
CHOICE_FIELDS = ("layer_choice", "data.source", "data.text_field")  # what convert also reads under layers: auto:N


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_done(run_dir: Path, stage: str) -> dict | None:
    marker = Path(run_dir) / stage / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def stage_inputs(recipe: Recipe, stage: str) -> dict:
    """{"field.path": value} of the recipe fields `stage` reads (JSON-ready), without BOOKKEEPING."""
    data = recipe.model_dump(mode="json")
    inputs = {}
    for path in STAGE_FIELDS[stage] + (CHOICE_FIELDS if stage == "convert" and recipe.auto() else ()):
        value = data
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        inputs[path] = {k: v for k, v in value.items() if k not in BOOKKEEPING} if isinstance(value, dict) else value
    return inputs


def fingerprints(recipe: Recipe) -> dict[str, str]:
    """{stage: hash of its inputs and of every earlier stage's fingerprint}."""
    out, previous = {}, ""
    for stage in STAGES:
        text = previous + json.dumps(stage_inputs(recipe, stage), sort_keys=True)
        out[stage] = previous = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def _changed_fields(old: dict, new: dict) -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            f"{k}.{sub}" if sub else k
            for k in sorted(set(old) | set(new))
            for sub in _changed_fields(old.get(k), new.get(k))
        ]
    return [] if old == new else [""]


def _stale(run_dir: Path, stage: str, done: dict, recipe: Recipe, prints: dict[str, str]) -> str | None:
    """Why `stage`'s DONE no longer matches the recipe (a message naming the changed fields), or None."""
    if done.get("fingerprint", prints[stage]) == prints[stage]:
        return None
    changed, first = [], stage
    for earlier in STAGES[: STAGES.index(stage) + 1]:
        recorded = (read_done(run_dir, earlier) or {}).get("inputs")
        if recorded is not None:
            new = [p for p in _changed_fields(recorded, stage_inputs(recipe, earlier)) if p not in changed]
            if new and not changed:
                first = earlier  # the earliest stage whose own settings changed
            changed += new
    what = ", ".join(changed) or "an earlier stage's inputs"
    return (
        f"stage {stage!r} in {run_dir} ran under a different recipe (changed: {what}); rerun from there with "
        f"--redo {first}, or use another --run-dir"
    )


def stage_state(run_dir: Path, stage: str) -> str:
    """What a rerun of an unfinished `stage` starts from: its latest complete checkpoint (evaluate: the parts its
    report.json finished), or nothing of it."""
    from raven_convert.train.checkpoint import latest_checkpoint

    report = Path(run_dir) / "evaluate" / "report.json"
    finished = json.loads(report.read_text()).get("finished") if stage == "evaluate" and report.is_file() else None
    if finished:
        return (
            f"the evaluate stage's finished parts ({', '.join(finished)}) are kept in {report}, a rerun runs the rest"
        )
    found = latest_checkpoint(Path(run_dir) / stage)
    if found is None:
        return f"nothing of the {stage} stage was saved, a rerun starts it afresh"
    return f"the {stage} stage's last good checkpoint {found[0]} is kept, a rerun resumes after step {found[1]['step']}"


def resumable_checkpoints(run_dir: Path, stages) -> list[str]:
    """For each of `stages` with a checkpoint but no DONE: 'PATH (step N) of the unfinished STAGE stage'."""
    from raven_convert.train.checkpoint import latest_checkpoint

    found = []
    for stage in stages:
        latest = None if read_done(run_dir, stage) is not None else latest_checkpoint(Path(run_dir) / stage)
        if latest is not None:
            found.append(f"{latest[0]} (step {latest[1]['step']}) of the unfinished {stage} stage")
    return found


def saved_so_far(run_dir: str | Path, stages: list[str] | None = None) -> str:
    """One sentence: the stages DONE in run_dir, and what the first unfinished one of `stages` resumes from."""
    run_dir = Path(run_dir).resolve()
    finished = [s for s in STAGES if (run_dir / s / MARKER).is_file()]
    text = f"stages done in {run_dir}: {', '.join(finished)}" if finished else f"no stage finished in {run_dir}"
    pending = [s for s in (stages or STAGES) if s in STAGES and s not in finished]
    return f"{text}; {stage_state(run_dir, pending[0])}" if pending else text


def _require(run_dir: Path, stage: str) -> dict:
    """DONE of every stage before `stage`, all present, else a ValueError naming the first missing one."""
    done = {}
    for earlier in STAGES[: STAGES.index(stage)]:
        summary = read_done(run_dir, earlier)
        if summary is None:
            raise ValueError(
                f"stage {stage!r} needs the outputs of stage {earlier!r}, but {run_dir / earlier / MARKER} is "
                f"missing; run it first (--stages {earlier}) or run the whole recipe"
            )
        done[earlier] = summary
    return done


def _latest_model(run_dir: Path, done: dict) -> Path:
    for stage in reversed(list(done)):
        if done[stage].get("model"):
            return run_dir / done[stage]["model"]
    raise ValueError(f"no model directory in {run_dir}: run the convert stage first")


def _learns(recipe: Recipe, stage: str) -> bool:
    """Whether `stage` has a learning rate in the recipe (align, train, extend)."""
    return hasattr(getattr(recipe, stage, None), "lr")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per process under a launcher


def _load_teacher(recipe: Recipe):
    from raven_convert.sources import Source

    return Source.resolve(recipe.source).load_model(recipe.dtype).to(_device()).eval().requires_grad_(False)


def _load_hybrid(model_dir: Path):
    """The hybrid in `model_dir` as the toolkit's own HybridForCausalLM (its kernels, its mixer registry), whatever
    was imported or loaded before in this process: never the copy of the code the directory carries, which
    AutoModelForCausalLM with trust_remote_code would pick where nothing registered the toolkit's classes."""
    from raven_layers import HybridForCausalLM

    return HybridForCausalLM.from_pretrained(str(model_dir)).to(_device())


def _dataset(recipe: Recipe, run_dir: Path, model_dir: Path, seq_len: int | None = None):
    """(train, val) packed with the converted model's tokenizer (same for every stage, so the cache is shared),
    into rows of data.seq_len tokens or of `seq_len`."""
    from transformers import AutoTokenizer

    from raven_convert.train.data import build_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    d = recipe.data
    return build_dataset(
        d.source,
        tokenizer,
        seq_len or d.seq_len,
        d.cache_dir or run_dir / "cache",
        validation_fraction=d.validation_fraction,
        max_documents=d.max_documents,
        seed=d.seed,
        text_field=d.text_field,
        retrieval=d.retrieval,
    )


def _save_model(model, model_dir_from: Path, out: Path, base_model: str) -> None:
    """A complete model dir at `out` (atomic): weights of `model`, code and tokenizer of `model_dir_from`."""
    from transformers import AutoTokenizer

    from raven_convert.export import save_hybrid

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir_from))
    save_hybrid(model.cpu(), tokenizer, out, base_model=base_model, overwrite=True)


def _stage_convert(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from raven_convert.layer_choice import ChoiceSettings, stage_summary
    from raven_convert.pipeline import ConvertRequest, convert_model

    out = run_dir / "convert" / "model"
    request = ConvertRequest(
        out=out,
        assignments=[(a.mixer, a.layers) for a in recipe.layers],
        src=recipe.source,
        mixer_settings=recipe.mixer_settings,
        sliding_window=recipe.sliding_window,
        window_layers=recipe.window_layers,
        dtype=recipe.dtype,
        seed=recipe.seed,
        overwrite=True,
        choice_data=recipe.data.source,
        choice_text_field=recipe.data.text_field,
        choice_settings=recipe.layer_choice or ChoiceSettings(),
        choice_cache=Path(recipe.data.cache_dir or run_dir / "cache") / "layer_choice",
    )
    convert_model(request, log=lambda m: log(f"[convert] {m}"))
    summary = {"model": "convert/model", "layers": [[a.mixer, a.layers] for a in recipe.layers]}
    return summary | stage_summary(out, run_dir)


def _stage_align(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from raven_convert.train.align import align, validation_losses
    from raven_convert.train.data import batch_iterator

    settings, model_dir = recipe.align, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, val_rows = _dataset(recipe, run_dir, model_dir)
    teacher, hybrid = _load_teacher(recipe), _load_hybrid(model_dir)
    held_out = _held_out_batches(val_rows, settings.batch_size, settings.seed)
    before = validation_losses(teacher, hybrid, held_out) if held_out else None
    history = align(
        teacher,
        hybrid,
        lambda first: batch_iterator(train_rows, settings.batch_size, settings.seed, start_step=first),
        out_dir=run_dir / "align",
        **settings.model_dump(exclude={"batch_size"}),  # the recipe's align fields are align()'s arguments
    )
    after = validation_losses(teacher, hybrid, held_out) if held_out else None
    _save_model(hybrid, model_dir, run_dir / "align" / "model", recipe.source)
    final = history[-1]
    write_json({"history": history}, run_dir / "align" / "history.json")
    if after is not None:
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
        "validation_before": None if before is None else before["loss"],
        "validation_after": None if after is None else after["loss"],
        "validation_layers_after": None if after is None else {str(k): v for k, v in after["layers"].items()},
    }


def _stage_weights(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from transformers import AutoTokenizer

    from raven_convert.train.data import save_atomic
    from raven_convert.train.token_weights import plot_token_weights, weight_table

    settings = recipe.token_weights
    if not settings.enabled:
        return {"skipped": True}
    train_rows, _ = _dataset(recipe, run_dir, run_dir / done["convert"]["model"])
    weights = weight_table(  # [len(train_rows), T], row i belongs to train_rows[i]
        _load_teacher(recipe),
        train_rows,
        settings.batch_size,
        tau=settings.tau,
        lam=settings.lam,
        query_block=settings.query_block,
        out_dir=run_dir / "weights",
        save_every=settings.save_every,
        keep_checkpoints=settings.keep_checkpoints,
        log=log,
    )
    save_atomic(weights, run_dir / "weights" / "weights.pt")
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / done["convert"]["model"]))
    shown = train_rows[0]["input_ids"][:400]
    plot_token_weights(
        tokenizer.convert_ids_to_tokens(shown.tolist()),
        weights[0, : len(shown)],
        run_dir / "weights" / "weights.png",
        title="token loss weights of the first training row (darker: retrieves from further back)",
    )
    return {
        "picture": "weights/weights.png",
        "file": "weights/weights.pt",
        "shape": list(weights.shape),
        "mean": weights.mean().item(),
        "max": weights.max().item(),
    }


def _stage_train(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from raven_convert.train.stage2 import TrainConfig, train

    settings, model_dir = recipe.train, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, val_rows = _dataset(recipe, run_dir, run_dir / done["convert"]["model"])
    weights = None
    if not done["weights"].get("skipped"):
        weights = torch.load(run_dir / done["weights"]["file"], weights_only=True)
        if tuple(weights.shape) != (len(train_rows), train_rows.seq_len):
            raise ValueError(
                f"{run_dir / done['weights']['file']} has shape {tuple(weights.shape)} but the training data has "
                f"{len(train_rows)} rows of {train_rows.seq_len}: delete {run_dir / 'weights'} and rerun weights"
            )
    config = TrainConfig(**settings.model_dump())
    teacher = _load_teacher(recipe) if config.kd_weight > 0 else None
    student = _load_hybrid(model_dir)
    validation = val_rows if len(val_rows) else None
    history = train(
        student, teacher, train_rows, config, run_dir / "train", token_weights=weights, validation=validation
    )
    return _finish_training(student, config, history, model_dir, run_dir, "train", recipe.source)


def _finish_training(student, config, history, model_dir: Path, run_dir: Path, stage: str, base_model: str) -> dict:
    """Merge LoRA, save the model under RUN_DIR/stage/model (main process only), and summarise the run."""
    from raven_convert.train.checkpoint import latest_checkpoint
    from raven_convert.train.stage2 import merge_lora

    if config.trainable == "mixers+lora":
        merge_lora(student)
    if is_main_process():
        _save_model(student, model_dir, run_dir / stage / "model", base_model)
    summary = {"model": f"{stage}/model", "steps": config.steps, "steps_this_run": len(history)}
    if history:
        summary |= {k: history[-1][k] for k in ("loss", "ce", "kd", "aux", "tokens_per_second")}
        summary["val_ce"] = history[-1].get("val_ce")
        if is_main_process():
            write_json({"history": history}, run_dir / stage / "history.json")
    elif latest_checkpoint(run_dir / stage):
        summary["resumed_from"] = str(latest_checkpoint(run_dir / stage)[0])
    return summary


def _stage_extend(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from raven_convert.train.stage2 import TrainConfig, train
    from raven_convert.train.token_weights import token_weights

    settings, model_dir = recipe.extend, _latest_model(run_dir, done)
    if settings is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, val_rows = _dataset(recipe, run_dir, run_dir / done["convert"]["model"], settings.seq_len)
    config = TrainConfig(**settings.model_dump(exclude={"seq_len"}))
    weighted = recipe.token_weights.enabled
    teacher = _load_teacher(recipe) if config.kd_weight > 0 or weighted else None
    weights = None
    if weighted:
        tw = recipe.token_weights

        def weights(batch):  # [B, T] from the teacher at this length, as each batch is drawn
            return token_weights(
                teacher,
                batch["input_ids"],
                position_ids=batch["position_ids"],
                tau=tw.tau,
                lam=tw.lam,
                query_block=tw.query_block,
            )

    student = _load_hybrid(model_dir)
    validation = val_rows if len(val_rows) else None
    history = train(
        student, teacher, train_rows, config, run_dir / "extend", token_weights=weights, validation=validation
    )
    return _finish_training(student, config, history, model_dir, run_dir, "extend", recipe.source) | {
        "seq_len": settings.seq_len
    }


def _stage_evaluate(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from raven_convert.evaluate.report import EvalRequest, evaluate_model

    model_dir = _latest_model(run_dir, done)
    if recipe.evaluate is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    out = run_dir / "evaluate"
    request = EvalRequest(model=str(model_dir), out=out, **recipe.evaluate.model_dump())
    report = evaluate_model(request, log=lambda m: log(f"[evaluate] {m}"), resume=True)
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


def _stage_export(recipe: Recipe, run_dir: Path, done: dict) -> dict:
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
    "export": _stage_export,
}


def _drop_checkpoints(run_dir: Path, stage: str) -> None:
    """A finished stage's checkpoints go once its DONE is written: a rerun starts after DONE, never from them."""
    if is_main_process():
        shutil.rmtree(run_dir / stage / CHECKPOINTS, ignore_errors=True)


def _disk_use(run_dir: Path, stage: str, summary: dict) -> int:
    """Bytes a finished stage leaves (its checkpoints go, DONE is not counted). The export lies outside its stage
    folder and its weights are hard links to the model it exported, which take no more space."""
    if "exported_to" in summary:
        return disk_bytes(run_dir / stage, summary["exported_to"], besides=(run_dir / summary["model"],))
    return disk_bytes(run_dir / stage) - disk_bytes(run_dir / stage / CHECKPOINTS)


def _held_out_batches(rows, batch_size: int, seed: int, count: int = 4) -> list[dict]:
    """Up to `count` fixed batches of held-out rows (fewer rows than batch_size: one smaller batch)."""
    from raven_convert.train.data import batch_iterator

    if not len(rows):
        return []
    iterator = batch_iterator(rows, min(batch_size, len(rows)), seed, epochs=1)
    return [batch for _, batch in zip(range(count), iterator)]


def run_recipe(
    recipe: Recipe,
    run_dir: str | Path,
    stages: list[str] | None = None,
    redo: str | None = None,
    discard_checkpoints: bool = False,
) -> dict:
    """Run `stages` (default: all, in order) of `recipe` into `run_dir`, skipping those whose DONE exists.

    `redo` deletes that stage's outputs and every later stage's first (checkpoints included), so they run again.
    It refuses (ValueError) to delete the checkpoint of a stage that has not finished, which a rerun would resume
    from, unless `discard_checkpoints`.
    Returns {stage: summary} for the stages asked for (a skipped stage's summary is read from its DONE).
    """
    run_dir = Path(run_dir).resolve()
    wanted = list(STAGES) if stages is None else list(stages)
    unknown = [s for s in wanted + ([redo] if redo else []) if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; allowed: {', '.join(STAGES)}")
    wanted = [s for s in STAGES if s in wanted]
    several = [s for s in wanted if s not in DATA_PARALLEL]
    if _world_size() > 1 and (several or redo):
        raise ValueError(
            f"under a multi-process launch only the {'/'.join(DATA_PARALLEL)} stages run (with --stages), without "
            f"--redo; run {several or 'the others'} in one process first"
        )
    rerun = set(STAGES[STAGES.index(redo) :]) if redo else set()
    resumable = resumable_checkpoints(run_dir, [s for s in STAGES if s in rerun])
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
    if redo:
        for stage in STAGES[STAGES.index(redo) :]:
            if (run_dir / stage).exists():
                lost = [r for r in resumable if r.endswith(f" {stage} stage")]
                log(
                    f"[{stage}] --redo {redo}: deleting {run_dir / stage}"
                    + "".join(f", with checkpoint {r}" for r in lost)
                )
                shutil.rmtree(run_dir / stage)
    if is_main_process():
        write_json(recipe.model_dump(mode="json"), run_dir / "recipe.json")
    prints = fingerprints(recipe)
    results = {}
    for stage in wanted:
        existing = read_done(run_dir, stage)
        if existing is not None:
            reason = _stale(run_dir, stage, existing, recipe, prints)
            if reason:
                raise ValueError(reason)
            log(f"[{stage}] done already ({run_dir / stage / MARKER}); skipping")
            _drop_checkpoints(run_dir, stage)  # left behind when a run was killed right after DONE
            results[stage] = existing
            continue
        done = _require(run_dir, stage)
        for earlier, summary in done.items():
            reason = _stale(run_dir, earlier, summary, recipe, prints)
            if reason:
                raise ValueError(reason)
        log(f"[{stage}] starting")
        clock = time.perf_counter()
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        try:
            summary = RUNNERS[stage](recipe, run_dir, done)
        except FloatingPointError as err:  # a diverged step: say what survives instead of a traceback
            advice = f"Lower {stage}.lr (--set {stage}.lr=...) or check" if _learns(recipe, stage) else "Check"
            raise FloatingPointError(
                f"the {stage} stage stopped: {err}; {stage_state(run_dir, stage)}. {advice} the data before rerunning"
            ) from err
        summary["seconds"] = round(time.perf_counter() - clock, 3)
        summary["disk_bytes"] = _disk_use(run_dir, stage, summary)
        summary |= {"fingerprint": prints[stage], "inputs": stage_inputs(recipe, stage)}
        if is_main_process():
            write_json(summary, run_dir / stage / MARKER)
            _drop_checkpoints(run_dir, stage)
        if summary.get("skipped"):
            log(f"[{stage}] skipped (turned off by the recipe)")
        else:
            log(f"[{stage}] done in {summary['seconds']:.1f} s, {format_bytes(summary['disk_bytes'])} on disk")
        results[stage] = summary
    return results
