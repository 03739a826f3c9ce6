"""Recipes: one validated YAML file describing the whole distillation, and the resumable pipeline that runs it.

    recipe = load_recipe("recipes/smollm2-raven.yaml")
    summary = run_recipe(recipe, "runs/smollm2-raven")            # convert -> align -> weights -> train -> ...
    run_recipe(recipe, "runs/smollm2-raven", stages=["train"])     # one stage, on the earlier stages' outputs

Stages, in order: convert, align, weights, train, evaluate, export. Stage S writes under RUN_DIR/S/ and, last and
atomically, RUN_DIR/S/DONE (JSON: the stage's summary, including "model", the latest complete model directory
after the stage). A stage whose DONE exists is skipped, so an interrupted run continues where it stopped (stage 2
also resumes from its own checkpoints in RUN_DIR/train/checkpoints). A stage turned off by the recipe (steps 0,
token weights disabled, evaluate null) still writes DONE with "skipped": true. Running a stage needs the DONE of
every stage before it; a missing one is an error naming it.

Relative paths in a recipe (source and data.source when they exist as local paths, data.cache_dir, export.dir,
evaluate.haystack_dir, evaluate.ppl_data) are resolved against the current working directory when the recipe is
loaded, not against the recipe file's directory: the shipped recipes are written to be run from the repository
root. Names that do not exist locally (Hub ids such as Qwen/Qwen3-0.6B) are kept as given.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from convert.layer_spec import ACCEPTED_FORMS, LayerSpecError, parse_layer_spec
from convert.train.stage2 import TrainConfig

STAGES = ("convert", "align", "weights", "train", "evaluate", "export")
MIXERS = ("raven", "sse", "sila")
MARKER = "DONE"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerAssignment(_Strict):
    """One `--mixer M --layers SPEC` pair of `convert`."""

    mixer: Literal["raven", "sse", "sila"]
    layers: str

    @field_validator("layers")
    @classmethod
    def _spec(cls, value: str) -> str:
        try:
            parse_layer_spec(value, 1 << 20)  # syntax only; ranges are checked against the model at convert
        except LayerSpecError:
            raise ValueError(f"{value!r} is not a layer spec; accepted forms: {ACCEPTED_FORMS}") from None
        return value


class DataSettings(_Strict):
    source: str = Field(description="local .txt/.jsonl(.gz)/.parquet file or directory, or a Hub dataset id")
    text_field: str = "text"
    seq_len: int = Field(1024, ge=2)
    max_documents: int | None = Field(None, ge=1)
    validation_fraction: float = Field(0.01, ge=0, lt=1)
    cache_dir: str | None = Field(None, description="packed-row cache; default RUN_DIR/cache")
    seed: int = 0


class AlignSettings(_Strict):
    steps: int = Field(0, ge=0, description="0 skips stage 1")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = 0
    log_every: int = Field(10, ge=0)


class TokenWeightSettings(_Strict):
    enabled: bool = False
    tau: float = Field(0.2, ge=0, le=1)
    lam: float = Field(0.5, ge=0)
    reference: Literal["teacher"] = "teacher"
    batch_size: int = Field(8, ge=1)
    query_block: int = Field(256, ge=1)


class TrainSettings(TrainConfig):
    """stage2.TrainConfig, except that steps 0 skips stage 2."""

    steps: int = Field(0, ge=0, description="optimizer steps; 0 skips stage 2")


class EvaluateSettings(_Strict):
    """Fields of convert.evaluate.EvalRequest (model and out are set by the pipeline)."""

    tasks: list[str] = Field(default_factory=lambda: ["passkey", "niah_single_2"], min_length=1)
    variants: list[Literal["standard", "no_inst", "strong_inst"]] = Field(default_factory=lambda: ["standard"])
    lengths: list[int] = Field(default_factory=lambda: [1024, 2048, 4096], min_length=1)
    depths: list[float] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], min_length=1)
    samples: int = Field(4, ge=1)
    batch_size: int = Field(8, ge=1)
    haystack_dir: str | None = None
    chat_template: bool | None = False
    ppl_data: str | None = None
    ppl_lengths: list[int] = Field(default_factory=lambda: [512, 2048])
    ppl_windows: int = Field(8, ge=1)
    speed_lengths: list[int] = Field(default_factory=list)
    pictures: bool = True
    picture_length: int = Field(1024, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0

    @field_validator("lengths", "ppl_lengths", "speed_lengths")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value):
            raise ValueError(f"lengths must be >= 1, got {value}")
        return value

    @field_validator("depths")
    @classmethod
    def _depths(cls, value: list[float]) -> list[float]:
        if any(not 0 <= v <= 1 for v in value):
            raise ValueError(f"depths must lie in [0, 1], got {value}")
        return value


class ExportSettings(_Strict):
    dir: str


class Recipe(_Strict):
    source: str = Field(description="teacher: Hub id, model directory or .gguf file")
    layers: list[LayerAssignment] = Field(min_length=1)
    mixer_settings: dict[str, dict] = Field(default_factory=dict)
    sliding_window: int | None = Field(None, ge=1)
    window_layers: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    data: DataSettings
    align: AlignSettings = Field(default_factory=AlignSettings)
    token_weights: TokenWeightSettings = Field(default_factory=TokenWeightSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    evaluate: EvaluateSettings | None = None
    export: ExportSettings | None = None

    @field_validator("mixer_settings")
    @classmethod
    def _settings(cls, value: dict[str, dict]) -> dict[str, dict]:
        from raven_layers import MIXER_SETTINGS

        for mixer, values in value.items():
            if mixer not in MIXER_SETTINGS:
                raise ValueError(f"unknown mixer {mixer!r}; allowed: {sorted(MIXER_SETTINGS)}")
            try:
                MIXER_SETTINGS[mixer].from_dict(values)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{mixer}: {err}") from None
        return value

    @field_validator("window_layers")
    @classmethod
    def _window_spec(cls, value: str | None) -> str | None:
        if value is not None:
            LayerAssignment._spec(value)
        return value


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per error: 'field.path: message'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(recipe)"
        lines.append(f"{prefix}{loc}: {e['msg']}")
    return "\n".join(lines)


def _local(value: str, base: Path) -> str:
    path = (base / Path(value).expanduser()).resolve()
    return str(path)


def _if_exists(value: str, base: Path) -> str:
    path = base / Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def resolve_paths(recipe: Recipe, base: str | Path | None = None) -> Recipe:
    """A copy of `recipe` with relative paths resolved against `base` (default: the current directory)."""
    base = Path(base or Path.cwd())
    r = recipe.model_copy(deep=True)
    r.source = _if_exists(r.source, base)
    r.data.source = _if_exists(r.data.source, base)
    if r.data.cache_dir:
        r.data.cache_dir = _local(r.data.cache_dir, base)
    if r.export:
        r.export.dir = _local(r.export.dir, base)
    if r.evaluate:
        if r.evaluate.haystack_dir:
            r.evaluate.haystack_dir = _local(r.evaluate.haystack_dir, base)
        if r.evaluate.ppl_data:
            r.evaluate.ppl_data = _local(r.evaluate.ppl_data, base)
    return r


def parse_recipe(data, base: str | Path | None = None, name: str = "recipe") -> Recipe:
    """Validate a recipe mapping; ValueError with one 'field.path: message' line per problem."""
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping of recipe fields, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise ValueError(f"{name} is not a valid recipe:\n{format_validation_error(err)}") from None
    return resolve_paths(recipe, base)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a YAML recipe; relative paths resolve against the current working directory."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    return parse_recipe(data, name=str(path))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _write_json_atomic(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_done(run_dir: Path, stage: str) -> dict | None:
    marker = Path(run_dir) / stage / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


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


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_teacher(recipe: Recipe):
    from convert.sources import Source

    return Source.resolve(recipe.source).load_model(recipe.dtype).to(_device()).eval().requires_grad_(False)


def _load_hybrid(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True).to(_device())


def _dataset(recipe: Recipe, run_dir: Path, model_dir: Path):
    """(train, val) packed with the converted model's tokenizer (same for every stage, so the cache is shared)."""
    from transformers import AutoTokenizer

    from convert.train.data import build_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    d = recipe.data
    return build_dataset(
        d.source,
        tokenizer,
        d.seq_len,
        d.cache_dir or run_dir / "cache",
        validation_fraction=d.validation_fraction,
        max_documents=d.max_documents,
        seed=d.seed,
        text_field=d.text_field,
    )


def _save_model(model, model_dir_from: Path, out: Path, base_model: str) -> None:
    """A complete model dir at `out` (atomic): weights of `model`, code and tokenizer of `model_dir_from`."""
    from transformers import AutoTokenizer

    from convert.export import save_hybrid

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir_from))
    save_hybrid(model.cpu(), tokenizer, out, base_model=base_model, overwrite=True)


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial"))
    try:
        shutil.rmtree(tmp)
        shutil.copytree(src, tmp)
        if dst.exists():
            old = dst.parent / f".{dst.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stage_convert(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from convert.pipeline import ConvertRequest, convert_model

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
    )
    convert_model(request, log=lambda m: log(f"[convert] {m}"))
    return {"model": "convert/model", "layers": [[a.mixer, a.layers] for a in recipe.layers]}


def _stage_align(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from convert.train.align import align
    from convert.train.data import batch_iterator

    settings, model_dir = recipe.align, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, _ = _dataset(recipe, run_dir, model_dir)
    teacher, hybrid = _load_teacher(recipe), _load_hybrid(model_dir)
    batches = batch_iterator(train_rows, settings.batch_size, settings.seed)
    history = align(
        teacher,
        hybrid,
        batches,
        settings.steps,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        grad_clip=settings.grad_clip,
        warmup_steps=settings.warmup_steps,
        log_every=settings.log_every,
    )
    _save_model(hybrid, model_dir, run_dir / "align" / "model", recipe.source)
    final = history[-1]
    _write_json_atomic({"history": history}, run_dir / "align" / "history.json")
    return {
        "model": "align/model",
        "steps": len(history),
        "final_loss": final["loss"],
        "final_layer_losses": {str(k): v for k, v in final["layers"].items()},
        "first_layer_losses": {str(k): v for k, v in history[0]["layers"].items()},
        "tokens_per_second": final["tokens_per_second"],
    }


def _stage_weights(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from convert.train.data import save_atomic
    from convert.train.token_weights import token_weights

    settings = recipe.token_weights
    if not settings.enabled or recipe.train.steps == 0:
        return {"skipped": True}
    train_rows, _ = _dataset(recipe, run_dir, run_dir / done["convert"]["model"])
    teacher = _load_teacher(recipe)
    device = next(teacher.parameters()).device
    parts, n, clock = [], len(train_rows), time.perf_counter()
    with torch.no_grad():
        for start in range(0, n, settings.batch_size):
            batch = train_rows.batch(torch.arange(start, min(start + settings.batch_size, n)))
            w = token_weights(
                teacher,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                tau=settings.tau,
                lam=settings.lam,
                query_block=settings.query_block,
            )
            parts.append(w.cpu())
            log(f"[weights] rows {min(start + settings.batch_size, n)}/{n} ({time.perf_counter() - clock:.0f} s)")
    weights = torch.cat(parts)  # [len(train_rows), T], row i belongs to train_rows[i]
    save_atomic(weights, run_dir / "weights" / "weights.pt")
    return {
        "file": "weights/weights.pt",
        "shape": list(weights.shape),
        "mean": weights.mean().item(),
        "max": weights.max().item(),
    }


def _stage_train(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from convert.train.stage2 import TrainConfig, latest_checkpoint, merge_lora, train

    settings, model_dir = recipe.train, _latest_model(run_dir, done)
    if settings.steps == 0:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    train_rows, _ = _dataset(recipe, run_dir, run_dir / done["convert"]["model"])
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
    history = train(student, teacher, train_rows, config, run_dir / "train", token_weights=weights)
    if config.trainable == "mixers+lora":
        merge_lora(student)
    _save_model(student, model_dir, run_dir / "train" / "model", recipe.source)
    summary = {"model": "train/model", "steps": config.steps, "steps_this_run": len(history)}
    if history:
        summary |= {k: history[-1][k] for k in ("loss", "ce", "kd", "aux", "tokens_per_second")}
        _write_json_atomic({"history": history}, run_dir / "train" / "history.json")
    elif latest_checkpoint(run_dir / "train"):
        summary["resumed_from"] = str(latest_checkpoint(run_dir / "train")[0])
    return summary


def _stage_evaluate(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    from convert.evaluate.report import EvalRequest, evaluate_model

    model_dir = _latest_model(run_dir, done)
    if recipe.evaluate is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    out = run_dir / "evaluate"
    request = EvalRequest(model=str(model_dir), out=out, **recipe.evaluate.model_dump())
    report = evaluate_model(request, log=lambda m: log(f"[evaluate] {m}"))
    return {"model": str(model_dir.relative_to(run_dir)), "report": "evaluate/report.json", **report.get("run", {})}


def _stage_export(recipe: Recipe, run_dir: Path, done: dict) -> dict:
    model_dir = _latest_model(run_dir, done)
    if recipe.export is None:
        return {"skipped": True, "model": str(model_dir.relative_to(run_dir))}
    target = Path(recipe.export.dir)
    _copy_atomic(model_dir, target)
    return {"model": str(model_dir.relative_to(run_dir)), "exported_to": str(target)}


RUNNERS = {
    "convert": _stage_convert,
    "align": _stage_align,
    "weights": _stage_weights,
    "train": _stage_train,
    "evaluate": _stage_evaluate,
    "export": _stage_export,
}


def run_recipe(recipe: Recipe, run_dir: str | Path, stages: list[str] | None = None) -> dict:
    """Run `stages` (default: all, in order) of `recipe` into `run_dir`, skipping those whose DONE exists.
    Returns {stage: summary} for the stages asked for (a skipped stage's summary is read from its DONE)."""
    run_dir = Path(run_dir).resolve()
    wanted = list(STAGES) if stages is None else list(stages)
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; allowed: {', '.join(STAGES)}")
    wanted = [s for s in STAGES if s in wanted]
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(recipe.model_dump(mode="json"), run_dir / "recipe.json")
    results = {}
    for stage in wanted:
        existing = read_done(run_dir, stage)
        if existing is not None:
            log(f"[{stage}] done already ({run_dir / stage / MARKER}); skipping")
            results[stage] = existing
            continue
        done = _require(run_dir, stage)
        log(f"[{stage}] starting")
        clock = time.perf_counter()
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        summary = RUNNERS[stage](recipe, run_dir, done)
        summary["seconds"] = round(time.perf_counter() - clock, 3)
        _write_json_atomic(summary, run_dir / stage / MARKER)
        state = "skipped (turned off by the recipe)" if summary.get("skipped") else f"done in {summary['seconds']} s"
        log(f"[{stage}] {state}")
        results[stage] = summary
    return results
