"""Fine-tune any causal LM with SILA's token weights: the model stays in its own class (no conversion, no hybrid
wrapper) and is saved in its own format; the weights come from a reference Transformer's attention.

From Python (a training script with a model, a reference and packed rows):

    from raven_convert.train.data import build_dataset
    from raven_convert.train.finetune import finetune

    rows, held_out = build_dataset("corpus/", tokenizer, seq_len=2048, cache_dir="cache")
    history = finetune(model, reference, rows, {"steps": 600, "trainable": "all", "lr": 5e-5}, "runs/ft",
                       tokenizer=tokenizer, reference_tokenizer=reference_tokenizer, validation=held_out,
                       save_to="runs/ft/model")      # reference=None: a plain (uniformly weighted) fine-tune

From a recipe without `layers` (recipe.FinetuneRecipe; recipes/smollm2-finetune.yaml):

    raven-train recipes/smollm2-finetune.yaml --run-dir runs/ft --data CORPUS [--src MODEL] [--reference MODEL]

Its stages, weights -> train -> export, run as the pipeline's do (stages.run_recipe: DONE markers, fingerprints,
--redo, checkpoints that resume exactly), and train is stage 2's loop (stage2.train: progress lines with tok/s,
validation, distillation from the reference when kd_weight > 0). What trains: `trainable` "all", "patterns"
(`trainable_patterns`, regular expressions of parameter names) or "lora" (peft on `lora_targets`, merged before
saving).

Choices:

- The reference must share the student's tokenizer (the weights belong to the student's token ids):
  check_same_tokenizer compares the vocabularies and the BOS/EOS/UNK tokens and refuses with the differences,
  before any data is packed, model loaded or weight computed (where the tokenizers can be had first).
- The weight table is token_weights.weight_table's (streamed, checkpointed, resumable), cached under
  CACHE/weights-KEY/weights.pt, KEY a hash of the reference (architecture, parameter names, shapes, dtypes and a
  strided sample of each parameter's values), of the packed rows themselves and of tau and lam: not of the
  student, so runs with other students, settings or run directories over the same data reuse it.
- The student is saved with its own save_pretrained (transformers copies a trust_remote_code class's code files
  beside it, so the folder reloads with trust_remote_code), the tokenizer beside it, atomically.
- Several processes (accelerate launch): fill the weight cache in one process first (the recipe: --stages weights,
  then --stages train under the launcher), since every process would otherwise compute the table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from raven_convert.console import is_main_process
from raven_convert.files import atomic_file, replace_dir
from raven_convert.sources import model_fingerprint
from raven_convert.train.checkpoint import CHECKPOINTS
from raven_convert.train.data import PackedDataset, save_atomic
from raven_convert.train.distributed import Parallel
from raven_convert.train.lora import merge_lora
from raven_convert.train.recipe import FinetuneRecipe, FinetuneTrain, FinetuneWeights, WeightSettings
from raven_convert.train.run_state import CHECKPOINTS_AT
from raven_convert.train.stage2 import train
from raven_convert.train.stage2_config import TrainConfig
from raven_convert.train.stage2_rows import rows_read
from raven_convert.train.stages import log, recipe_dataset, run_recipe, stage_export, training_summary
from raven_convert.train.token_weights import load_weight_table, plot_first_row, resolve_kernel, weight_table

WEIGHTS_FORMAT = 1  # bump when the weight table's computation changes, so that old caches are not reused
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token")


def check_same_tokenizer(tokenizer, reference_tokenizer, student: str, reference: str) -> None:
    """Refuse (ValueError) a reference whose tokenizer differs from the student's: vocabulary (token -> id) or
    BOS/EOS/UNK token. The message names both models, the vocabulary sizes and a few differing tokens."""
    a, b = tokenizer.get_vocab(), reference_tokenizer.get_vocab()
    problems = []
    if a != b:
        parts = [f"{len(a):,} vs {len(b):,} tokens"]
        only_a = sorted(set(a) - set(b), key=a.get)[:3]
        only_b = sorted(set(b) - set(a), key=b.get)[:3]
        moved = sorted((t for t in set(a) & set(b) if a[t] != b[t]), key=a.get)[:3]
        if only_a:
            parts.append(f"only the student's has {only_a}")
        if only_b:
            parts.append(f"only the reference's has {only_b}")
        if moved:
            parts.append("other ids for " + ", ".join(f"{t!r} ({a[t]} vs {b[t]})" for t in moved))
        problems.append(f"the vocabularies differ ({'; '.join(parts)})")
    for name in SPECIAL_TOKENS:
        mine, theirs = getattr(tokenizer, name, None), getattr(reference_tokenizer, name, None)
        if mine != theirs:
            problems.append(f"{name} {mine!r} vs {theirs!r}")
    if problems:
        raise ValueError(
            f"the reference {reference} does not share the tokenizer of the student {student}: "
            f"{'; '.join(problems)}. Token weights belong to the student's tokens, so the reference must read the "
            "same token ids: choose a reference with the student's tokenizer"
        )


def weights_cache_key(reference, rows: PackedDataset, settings: WeightSettings, only: Tensor | None = None) -> str:
    """sha256 (hex) of what decides the weight table: the reference (sources.model_fingerprint), the packed rows
    (their token and position ids, in order), the rows weighted (`only`, where not all), tau, lam, precision and
    WEIGHTS_FORMAT. Not the student's: every student with this tokenizer reuses the table."""
    data = hashlib.sha256()
    for field in ("input_ids", "position_ids"):
        values = rows.tensors[field][rows.rows].int()  # [N, T]
        data.update(f"{field} {tuple(values.shape)}".encode())
        data.update(values.numpy().tobytes())
    payload = {
        "format": WEIGHTS_FORMAT,
        "reference": model_fingerprint(reference),
        "rows": data.hexdigest(),
        "tau": settings.tau,
        "lam": settings.lam,
    }
    if settings.precision != "float32":  # keyed only when set, so tables cached before the field stay valid
        payload["precision"] = settings.precision
    if only is not None and len(only) < len(rows):  # likewise: a table of every row keeps its key
        payload["only"] = hashlib.sha256(torch.as_tensor(only, dtype=torch.long).numpy().tobytes()).hexdigest()
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def weights_cache_folder(reference, rows: PackedDataset, settings: WeightSettings, cache_dir, only=None) -> Path:
    """Where cached_weight_table keeps the table and, while it is computed, its checkpoints."""
    return Path(cache_dir) / f"weights-{weights_cache_key(reference, rows, settings, only)[:24]}"


def cached_weight_table(
    reference,
    rows: PackedDataset,
    settings: WeightSettings,
    cache_dir,
    log: Callable[[str], None] = print,
    only: Tensor | None = None,
) -> tuple[Tensor, Path]:
    """(table [len(rows), T], its file): token_weights.weight_table of `reference` on `rows` (with `only`: those
    rows, NaN elsewhere), loaded from cache_dir/weights-KEY/weights.pt (KEY: weights_cache_key) or computed there,
    resumably (its checkpoints beside it, deleted once the table is written). A damaged cache file is computed
    again."""
    folder = weights_cache_folder(reference, rows, settings, cache_dir, only)
    path = folder / "weights.pt"
    if path.is_file():
        try:
            table = load_weight_table(path, rows)
            log(f"[weights] loaded {tuple(table.shape)} token weights from the cache {path}")
            return table, path
        except Exception as err:  # a truncated or damaged file is recomputed, not trained on
            log(f"[weights] the cached token weights {path} are damaged ({type(err).__name__}); computing them again")
    table = weight_table(
        reference,
        rows,
        settings.batch_size,
        tau=settings.tau,
        lam=settings.lam,
        query_block=settings.query_block,
        out_dir=folder,
        save_every=settings.save_every,
        keep_checkpoints=settings.keep_checkpoints,
        log=log,
        kernel=resolve_kernel(settings.kernel, next(reference.parameters()).device),
        precision=settings.precision,
        only=only,
    )
    if is_main_process():
        save_atomic(table, path)
        shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)
    return table, path


def save_model(model, tokenizer, out) -> Path:
    """`model` with its own save_pretrained (a trust_remote_code class with its code files) and `tokenizer`
    beside it, at `out` as a whole: a reader sees the old folder or the new one."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _name(model) -> str:
    return getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or type(model).__name__


def _tokenizer_of(model, role: str):
    from transformers import AutoTokenizer

    name = _name(model)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"no tokenizer found for the {role} {name!r} ({err}); pass {role}_tokenizer=...") from None


def finetune(
    model,
    reference,
    dataset: PackedDataset,
    config: TrainConfig | dict,
    out_dir,
    *,
    tokenizer=None,
    reference_tokenizer=None,
    weights: FinetuneWeights | dict | None = None,
    token_weights: Tensor | None = None,
    cache_dir=None,
    validation=None,
    save_to=None,
    log: Callable[[str], None] = log,
) -> list[dict]:
    """Fine-tune `model` (any causal LM, as loaded, on its device) on `dataset` (packed rows) with stage 2's loop,
    each token's loss weighted by the token weights of `reference` (a Transformer sharing the model's tokenizer,
    on its device; None: uniform weights), and return stage2.train's history.

    config: stage2_config.TrainConfig, or the fields of recipe.FinetuneTrain (`trainable` "all" by default, "patterns"
    or "lora"); out_dir: where the
    checkpoints go and a rerun resumes from. tokenizer, reference_tokenizer: the two models' tokenizers, checked
    to be the same before any weight is computed (default: loaded from each model's name_or_path). weights:
    recipe.FinetuneWeights or its fields (tau, lam, batch_size, ...; enabled false: uniform); the table is cached
    under cache_dir (default out_dir/cache, see cached_weight_table) unless `token_weights` passes it [N, T].
    kd_weight > 0 distils from `reference`. save_to: a folder for the trained model in its own format (LoRA merged)
    and its tokenizer (main process only); LoRA is merged in any case.
    """
    config = config if isinstance(config, TrainConfig) else FinetuneTrain.model_validate(config)
    settings = FinetuneWeights.model_validate(weights or {})
    weighted = reference is not None and settings.enabled and token_weights is None
    if weighted or save_to is not None:
        tokenizer = tokenizer if tokenizer is not None else _tokenizer_of(model, "tokenizer")
    if weighted:
        if reference_tokenizer is None:
            reference_tokenizer = _tokenizer_of(reference, "reference")
        check_same_tokenizer(tokenizer, reference_tokenizer, repr(_name(model)), repr(_name(reference)))
    if config.kd_weight > 0:
        if reference is None:
            raise ValueError("kd_weight > 0 distils from the reference, and reference is None")
        sizes = [getattr(m.config, "vocab_size", None) for m in (model, reference)]
        if None not in sizes and sizes[0] != sizes[1]:
            raise ValueError(
                f"kd_weight > 0 needs logits of one width; the model has {sizes[0]}, the reference {sizes[1]}"
            )
    if weighted:
        token_weights, _ = cached_weight_table(reference, dataset, settings, cache_dir or Path(out_dir) / "cache", log)
    teacher = reference if config.kd_weight > 0 else None
    history = train(model, teacher, dataset, config, out_dir, token_weights=token_weights, validation=validation)
    if config.uses_lora:
        merge_lora(model)
    if save_to is not None and is_main_process():
        save_model(model, tokenizer, save_to)
        log(f"[train] saved {type(model).__name__} and its tokenizer to {save_to}")
    return history


def _sources(recipe: FinetuneRecipe):
    from raven_convert.sources import Source

    return Source.resolve(recipe.source), Source.resolve(recipe.reference or recipe.source)


def _stage_weights(recipe: FinetuneRecipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    settings = recipe.token_weights
    if not settings.enabled or recipe.train.steps == 0:  # only the train stage reads the table
        return {"skipped": True}
    student, reference = _sources(recipe)
    trust = recipe.trust_remote_code
    tokenizer = student.load_tokenizer(trust)
    if recipe.reference:  # before the data is packed or a model loaded
        check_same_tokenizer(tokenizer, reference.load_tokenizer(trust), recipe.source, recipe.reference)
    train_rows, _ = recipe_dataset(recipe, run_dir, tokenizer)
    only = rows_read(recipe.train, len(train_rows), parallel.world)  # only the rows the train stage reads
    log(f"[weights] {len(only):,} of {len(train_rows):,} rows: those {recipe.train.steps:,} train steps read")
    model = reference.load_model(recipe.dtype, trust).to(parallel.device)
    cache = settings.cache_dir or recipe.data.cache_dir or run_dir / "cache"
    # where its checkpoints go while it runs, for what an interruption says was saved (run_state.stage_state)
    folder = weights_cache_folder(model, train_rows, settings, cache, only)
    if parallel.is_main:
        with atomic_file(run_dir / "weights" / CHECKPOINTS_AT, "w") as f:
            f.write(str(folder.resolve()))
    table, cached = cached_weight_table(model, train_rows, settings, cache, log, only)
    target = run_dir / "weights" / "weights.pt"
    target.unlink(missing_ok=True)
    try:
        os.link(cached, target)  # the run keeps its table however the cache is cleaned, at no extra space
    except OSError:
        shutil.copy2(cached, target)
    plot_first_row(tokenizer, train_rows, table, run_dir / "weights" / "weights.png")
    return {
        "picture": "weights/weights.png",
        "file": "weights/weights.pt",
        "cache": str(cached),
        "shape": list(table.shape),
        "rows": len(only),
        "mean": table[only].mean().item(),
        "max": table[only].max().item(),
    }


def _stage_train(recipe: FinetuneRecipe, run_dir: Path, done: dict, parallel: Parallel) -> dict:
    student, reference = _sources(recipe)
    trust, config = recipe.trust_remote_code, recipe.train
    tokenizer = student.load_tokenizer(trust)
    train_rows, val_rows = recipe_dataset(recipe, run_dir, tokenizer)
    weights = None
    if not done["weights"].get("skipped"):
        weights = load_weight_table(run_dir / done["weights"]["file"], train_rows)
    model = student.load_model(recipe.dtype, trust).to(parallel.device)
    teacher = reference.load_model(recipe.dtype, trust).to(parallel.device) if config.kd_weight > 0 else None
    history = finetune(
        model,
        teacher,
        train_rows,
        config,
        run_dir / "train",
        tokenizer=tokenizer,
        token_weights=weights,
        weights={"enabled": weights is not None},
        validation=val_rows if len(val_rows) else None,
        save_to=run_dir / "train" / "model",
    )
    return training_summary(config, history, run_dir, "train") | {"class": type(model).__name__}


RUNNERS = {"weights": _stage_weights, "train": _stage_train, "export": stage_export}


def run_finetune_recipe(
    recipe: FinetuneRecipe,
    run_dir,
    stages: list[str] | None = None,
    redo: str | None = None,
    discard_checkpoints: bool = False,
) -> dict:
    """stages.run_recipe with the fine-tuning stages (weights -> train -> export): the same DONE markers,
    fingerprints, --redo and resuming. Returns {stage: summary}."""
    return run_recipe(recipe, run_dir, stages, redo=redo, discard_checkpoints=discard_checkpoints, runners=RUNNERS)
