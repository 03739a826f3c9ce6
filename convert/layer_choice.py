"""`--layers auto:N`: measure how much each attention layer of the teacher matters, convert the N that matter least.

    parts = training_parts()                        # train/choice_parts.py: what the scan borrows from training
    ranking = rank_layers(model, tokenizer, parts.load_documents(corpus), ChoiceSettings(), cache_dir, parts=parts)
    record = choice_record(ranking, n=15)           # {"chosen": [...], "scores": [...], ...}: config + model card

A layer is scored by ablation: its attention is cut to a sliding window of `window` tokens (what a linear-time mixer
keeps exactly; the far context it can only summarise), on probe prompts, with forward passes only:
- retrieval probes: corpus text with facts inserted at random depths and a question answered at the end, drawn by
  the training-side generator (train/retrieval_data.build_sample, handed in with TrainingParts), never the
  evaluation's needles or haystack; `retrieval` is the rise of the answer tokens' mean NLL (nats per token);
- plain corpus rows: `kl` is the rise of the mean KL from the unablated teacher's next-token distribution to the
  ablated model's (nats per token), over the positions a window can change (from `window` on).
score = max(retrieval, 0) + kl_weight * kl: a window that happens to lower the answer NLL (noise over a few answers,
or a distracting layer) counts as no harm rather than as a bonus, so the KL ranks the harmless layers. Layers
interact (two layers may each back up the other's retrieval), so the ranking is greedy over `rounds`: each round
scores the layers not yet ranked with those already ranked windowed, ranks its lowest-scoring share next, and
windows them for the rounds after. `auto:N` converts the first N of the
ranking; the ranking does not depend on N, so one scan serves every N.

With `ablation: mixer` a layer is scored by replacing its attention with the mixer it would be converted to, after
`fit_steps` steps of align that train the mixers of every layer at once on `fit_rows` corpus rows (a short run of
stage 1): the score then also counts how well a mixer can imitate the layer, which a window cannot see (a layer whose
far context matters little may still be one no mixer reproduces well). The greedy rounds run the ranked layers'
mixers. The fit costs one short align of all the layers, and the scan a mixer's forward where a window ran.

With `ablation: both` a layer's score is the sum of the two: its window's and its fitted mixer's (each
max(retrieval, 0) + kl_weight * kl). A mixer fitted on short probes imitates some retrieval layers well there and
still loses their far context at 4-8K, which the window's score sees; the window misses layers no mixer imitates,
which the mixer's sees. The greedy rounds run the ranked layers' mixers; the scan runs both ablations.

A scan (layer_scan.py) reuses the hidden states before the layer it changes (a layer's ablation runs only the layers
from it on). With `direction: restore` the scan runs the other way, for deep conversion, where few layers stay
attention: the base is the model with every layer ablated (its mixer, window or each in turn), and a layer is scored
by what restoring its attention recovers (the falls of the answer NLL and of the KL, the same parts, 0 where the NLL
rises). Each greedy round keeps its highest-scoring share restored for the rounds after, so the first layers kept
are the ones that recover most with the fewest others beside them (KL-guided layer selection restores softmax
layers so); the ranking is the order of restoring reversed, and `auto:N` still converts its first N.

A source that is a hybrid, converted further, is scanned as it is: its mixers stay in every pass, only its attention
layers are ranked (every ablation and direction works so), and `auto:N` converts the first N - k of them beside its
k converted layers (`fixed` in the record).

With `keep_copying: K` the K attention layers whose strongest head copies most (induction on random tokens
repeated: copying.py) move to the end of the ranking, so `auto:N` keeps them whatever their scores and the scan's
ranking chooses the rest. A deep hybrid loses the exact answers (words, codes, several values) that induction heads
copy, and a scan whose probes are answered by a single value can miss the layers that do it (docs/LAYER_CHOICE.md).

The ranking is cached as JSON in `cache_dir` under a key hashing the teacher's config and weights, the probe
tokens and the settings: the same teacher, corpus and settings never scan twice (keep_copying reorders the ranking
after the scan and is not in the key).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from raven_convert.copying import copying_scores, most_copying
from raven_convert.files import write_json
from raven_convert.layer_choice_report import format_table
from raven_convert.layer_scan import KINDS, score_layers
from raven_convert.layer_spec import auto_count
from raven_convert.sources import model_fingerprint

METHODS = {
    "window": "sliding-window ablation (see docs/LAYER_CHOICE.md)",
    "mixer": "replacement by briefly aligned mixers (see docs/LAYER_CHOICE.md)",
    "both": "sliding-window ablation plus replacement by briefly aligned mixers (see docs/LAYER_CHOICE.md)",
}
DIRECTIONS = {
    "cut": "each layer ablated in turn",
    "restore": "every layer ablated, each layer's attention restored in turn",
}
PROBE_FORMATS = ("single", "multi", "kv")  # the formats answered by one value at the very end
MIN_WORDS = 32  # distinct corpus words the probes need for keys and values
CACHE_VERSION = 1


@dataclass(frozen=True)
class TrainingParts:
    """What layer choice borrows from the training package, handed in by its caller (train/choice_parts.py builds
    it) so that this module imports nothing of train, which imports it: the corpus reader and its check, the
    retrieval-sample generator with its word pattern, word pool size and value kinds, and the aligner."""

    load_documents: Callable  # train.data.load_documents
    check_data_source: Callable  # train.data.check_data_source
    build_sample: Callable  # train.retrieval_data.build_sample
    word: re.Pattern  # train.retrieval_data.WORD
    pool_size: int  # train.retrieval_data.POOL_SIZE
    value_kinds: tuple[str, ...]  # train.retrieval_data.VALUE_KINDS
    align: Callable  # train.align.align on this process alone (choice_parts.align_alone)


class ChoiceSettings(BaseModel):
    """How `auto:N` scores the layers (recipe field layer_choice; convert's --choice-* flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    window: int = Field(64, ge=1, description="tokens an ablated layer still attends to")
    samples: int = Field(16, ge=1, description="retrieval probes")
    text_rows: int = Field(8, ge=0, description="plain corpus rows for the KL part")
    seq_len: int = Field(1024, ge=16, description="tokens per probe")
    rounds: int = Field(3, ge=1, description="greedy rounds; 1 ranks every layer by its ablation alone")
    round_sizes: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        description="instead of rounds: the layers each greedy round ranks, in turn (the last round ranks all that "
        "are left), e.g. [1, 1, 1, 1, 1, 1, 1, 1] keeps the first 8 restored layers one at a time",
    )
    kl_weight: float = Field(1.0, ge=0, description="score = max(NLL rise, 0) + kl_weight * KL rise")
    batch_size: int = Field(4, ge=1)
    seed: int = 0
    ablation: Literal["window", "mixer", "both"] = Field(
        "window",
        description="what replaces a scored layer's attention: a window, its briefly aligned mixer, or each in turn "
        "(both: the two scores summed)",
    )
    direction: Literal["cut", "restore"] = Field(
        "cut",
        description="cut: score a layer by what ablating it costs the teacher; restore: by what restoring its "
        "attention recovers in the model with every layer ablated (for deep conversion, where few layers stay)",
    )
    fit_steps: int = Field(100, ge=1, description="with ablation mixer or both: align steps that fit the mixers")
    fit_rows: int = Field(64, ge=1, description="with ablation mixer or both: corpus rows of seq_len tokens")
    fit_batch_size: int = Field(8, ge=1, description="with ablation mixer or both: rows per align step")
    fit_lr: float = Field(1e-3, gt=0, description="with ablation mixer or both: align's learning rate")
    keep_copying: int = Field(
        0,
        ge=0,
        description="the attention layers of the strongest induction heads (copying.py) kept as attention whatever "
        "their scores; the scan's ranking fills the rest",
    )

    @property
    def fits(self) -> bool:
        """Whether the scan needs fitted mixers."""
        return "mixer" in KINDS[self.ablation]

    def key_fields(self) -> dict:
        """The settings as the cache key hashes them (the default direction and round sizes left out: older caches
        stay valid; keep_copying too, which reorders a scan's ranking after it and never changes the scan)."""
        defaults = {"keep_copying"} | ({"direction"} if self.direction == "cut" else set())
        return self.model_dump(exclude=defaults | ({"round_sizes"} if self.round_sizes is None else set()))

    def schedule(self, layers: int) -> list[int]:
        """How many layers each greedy round ranks, the last taking the rest: `round_sizes`, or `rounds` rounds of an
        equal share."""
        if self.round_sizes is None:
            share = math.ceil(layers / self.rounds)
            sizes = [share] * math.ceil(layers / share)
        else:
            sizes = list(self.round_sizes) + [layers]
        out, left = [], layers
        for size in sizes:
            if left <= 0:
                break
            out.append(min(size, left))
            left -= out[-1]
        return out


def read_corpus(documents: Iterable[str], chars: int) -> list[str]:
    """The first documents of `documents`, about `chars` characters in all."""
    kept, total = [], 0
    for text in documents:
        kept.append(text)
        total += len(text)
        if total >= chars:
            break
    return kept


def build_probes(documents: Iterable[str], tokenizer, settings: ChoiceSettings, parts: TrainingParts) -> dict:
    """{"retrieval": [(ids, answer_start)], "text": [ids]}: `samples` retrieval prompts of at most seq_len tokens
    whose answer tokens are ids[answer_start:], and up to `text_rows` rows of seq_len corpus tokens; with fitted
    mixers (ablation "mixer" or "both") also "fit": up to `fit_rows` rows they align on. The first part of the
    corpus gives the plain rows, the next the fit rows, the rest the retrieval fillers; `seed` decides the rest."""
    rng = random.Random(f"layer-choice:{settings.seed}")
    fitting = settings.fit_rows if settings.fits else 0
    docs = read_corpus(documents, (settings.samples + settings.text_rows + fitting) * settings.seq_len * 6)
    words = list(dict.fromkeys(w for d in docs for w in parts.word.findall(d)))[: parts.pool_size]
    if len(words) < MIN_WORDS:
        raise ValueError(
            f"the probe corpus has {len(words)} distinct words of 4-12 letters; layer choice needs at least {MIN_WORDS}"
        )
    text = "\n\n".join(docs)
    ids = tokenizer(text[:2_000_000], add_special_tokens=False)["input_ids"]
    chars_per_token = min(len(text), 2_000_000) / max(len(ids), 1)
    # at most half the corpus goes to rows, the plain ones first
    rows = min(settings.text_rows + fitting, len(ids) // (2 * settings.seq_len))
    cut = [ids[i * settings.seq_len : (i + 1) * settings.seq_len] for i in range(rows)]
    plain, fit = cut[: settings.text_rows], cut[settings.text_rows :]
    used = int(rows * settings.seq_len * chars_per_token)
    corpus = " ".join(text[used:].split()) or " ".join(text.split())
    retrieval = []
    for _ in range(settings.samples):
        size = int((settings.seq_len - 48) * chars_per_token)
        for _ in range(4):  # a longer tokenisation than estimated shrinks the filler
            size = max(1, min(len(corpus), size))
            start = rng.randint(0, len(corpus) - size)
            fmt, kind = rng.choice(PROBE_FORMATS), rng.choice(parts.value_kinds)
            sample, (answer,) = parts.build_sample(rng, fmt, kind, words, corpus[start : start + size], max_facts=8)
            prompt = tokenizer(sample[: -sample.answer_chars])["input_ids"]
            tail = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
            if len(prompt) + len(tail) <= settings.seq_len:
                break
            size = int(size * 0.9 * settings.seq_len / (len(prompt) + len(tail)))
        prompt = prompt[max(0, len(prompt) + len(tail) - settings.seq_len) :]  # still too long: keep the end
        retrieval.append((prompt + tail, len(prompt)))
    probes = {"retrieval": retrieval, "text": plain}
    if settings.fits:
        if not fit:
            raise ValueError(f"the probe corpus is too short for any fit row of {settings.seq_len} tokens")
        probes["fit"] = fit
    return probes


def auto_assignment(
    assignments: list[tuple[str, str]],
    num_layers: int | None,
    window_layers: str | None = None,
    names: tuple[str, str] = ("--layers", "--window-layers"),
) -> tuple[str, int] | None:
    """(mixer, N) where the assignments ask for `auto:N`, else None. ValueError, naming the option or recipe field
    of `names`, for an N out of 1..num_layers-1 (only N >= 1 without num_layers), an auto:N beside other
    assignments, or one beside window_layers (which would name layers not chosen yet)."""
    layers, windows = names
    autos = [(mixer, auto_count(spec, num_layers, layers)) for mixer, spec in assignments]
    autos = [(mixer, n) for mixer, n in autos if n is not None]
    if not autos:
        return None
    if len(assignments) > 1:
        given = ", ".join(repr(spec) for _, spec in assignments)
        raise ValueError(f"{layers} auto:N chooses every converted layer, so it must come alone; got {given}")
    if window_layers is not None:
        raise ValueError(
            f"{windows} {window_layers!r} cannot name kept layers before {layers} auto:N has chosen them; leave it "
            "out (the sliding window then applies to every kept attention layer)"
        )
    return autos[0]


def stage_summary(model_dir: Path, run_dir: Path) -> dict:
    """The convert stage's record of an auto:N choice in `model_dir` (chosen layers, ranking, scores, the picture
    relative to `run_dir`), or {}."""
    record = json.loads((Path(model_dir) / "config.json").read_text()).get("layer_choice")
    if not record:
        return {}
    keys = ("chosen", "order", "score", "retrieval", "kl", "cache_key", *(("fixed",) if "fixed" in record else ()))
    return {
        "layer_choice": {k: record[k] for k in keys},
        "picture": str(model_dir.relative_to(run_dir) / "layer_choice.png"),
    }


def default_cache_dir() -> Path:
    """Where `convert` keeps the layer scores: $XDG_CACHE_HOME/raven_convert/layer_choice (~/.cache by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raven_convert" / "layer_choice"


def check_choice_data(source: str | None, text_field: str, parts: TrainingParts) -> None:
    """The probe corpus of auto:N is given and readable (ValueError naming --choice-data otherwise)."""
    if source is None:
        raise ValueError(
            "--layers auto:N measures the layers on corpus text: pass --choice-data PATH (a .txt/.jsonl(.gz)/.parquet "
            "file or folder, or a Hub dataset); a recipe uses data.source"
        )
    try:
        parts.check_data_source(source, text_field, hint="; pass another --choice-data")
    except ValueError as err:  # its messages name the recipe's field
        raise ValueError(str(err).replace("data.source", "--choice-data", 1)) from None


def first_kinds(start: list[str], auto: tuple[str, int]) -> list[str]:
    """The kinds `auto` = (mixer, N) stands for before the layers are measured, which the mixer's settings are
    checked on: the layers `start` converted (a hybrid's, converted further, which N counts) and its first attention
    layers, N in all. ValueError where N does not exceed the layers `start` converted."""
    from raven_convert.surgery import listed_layers, plan_layers

    (mixer, n), free = auto, [i for i, kind in enumerate(start) if kind == "attention"]
    fixed = len(start) - len(free)
    if n <= fixed:
        raise ValueError(
            f"auto:{n} counts every converted layer, the {fixed} the source hybrid converted among them (layers "
            f"{listed_layers(start)}): N must be above {fixed} (and at most {len(start) - 1})"
        )
    chosen = sorted([i for i, kind in enumerate(start) if kind != "attention"] + free[: n - fixed])
    return plan_layers([(mixer, ",".join(map(str, chosen)))], len(start))


def check_keep_copying(start: list[str], auto: tuple[str, int], keep: int) -> None:
    """`keep` (layer_choice.keep_copying) fits beside `auto` = (mixer, N): auto:N leaves at least `keep` attention
    layers (`start`: the source's kinds, a hybrid's converted layers counted in N); ValueError naming the field."""
    n, attention = auto[1], start.count("attention")
    left = attention - (n - (len(start) - attention))
    if keep > left:
        raise ValueError(
            f"layer_choice.keep_copying (--choice-keep-copying) {keep}: auto:{n} keeps {left} of the {len(start)} "
            f"layers as attention, so at most {left} can be kept for copying"
        )


def keep_copying_layers(result: dict, scores: list[float | None], keep: int) -> dict:
    """`result` (rank_layers') with the `keep` layers of the highest copying scores (copying.copying_scores, per
    layer) moved to the end of its ranking, so that auto:N converts them last, and the scores and those layers
    recorded ("copying", "kept_copying")."""
    kept = most_copying(scores, keep)
    ranking = [row for row in result["ranking"] if row["layer"] not in kept]
    ranking += [row for row in result["ranking"] if row["layer"] in kept]
    copying = [None if score is None else round(score, 6) for score in scores]
    return {**result, "ranking": ranking, "copying": copying, "kept_copying": kept}


def choose_kinds(
    model, tokenizer, auto: tuple[str, int], request, parts: TrainingParts, log=print
) -> tuple[list[str], dict]:
    """Per-layer kinds with `auto` = (mixer, N) on the N layers that matter least (a hybrid's converted layers among
    them, where `model` is one, converted further; never the choice settings' keep_copying layers that copy most),
    and the record of the choice (see choice_record). `request` is
    the ConvertRequest (choice_data, choice_text_field, choice_settings, choice_cache, and mixer_settings, which the
    fitted mixers are built with); the table goes to `log`."""
    from raven_convert.surgery import start_kinds

    documents = parts.load_documents(request.choice_data, request.choice_text_field)
    cache = request.choice_cache or default_cache_dir()
    mixer = (auto[0], request.mixer_settings.get(auto[0], {}))
    settings = request.choice_settings
    result = rank_layers(model, tokenizer, documents, settings, cache, log, mixer, parts=parts)
    if settings.keep_copying:
        result = keep_copying_layers(result, copying_scores(model, device=_device()), settings.keep_copying)
        strongest = ", ".join(f"{i} ({result['copying'][i]:.2f})" for i in result["kept_copying"])
        log(f"layer choice: kept as attention for copying, by their strongest induction head: {strongest}")
    record = choice_record(result, auto[1])
    log(format_table(record))
    kinds = start_kinds(model.config)
    for i in record["chosen"]:
        if kinds[i] == "attention":
            kinds[i] = auto[0]
    return kinds, record


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def fit_mixers(
    model, teacher, mixer: tuple[str, dict], rows: list[list[int]], settings: ChoiceSettings, log=print, *, align
):
    """A hybrid of `model` (the source) whose every attention layer is `mixer` (name, settings; a hybrid source's
    mixers stay), those mixers aligned by `align` (train.align.align) for `fit_steps` steps on `rows` to the attention
    of `teacher` (the hybrid the scan runs), on the teacher's device; in eval mode."""
    from raven_convert.surgery import build_hybrid, start_kinds

    device = next(teacher.parameters()).device
    kinds = [mixer[0] if kind == "attention" else kind for kind in start_kinds(model.config)]
    L = sum(kind == "attention" for kind in start_kinds(model.config))  # the mixers aligned
    fitted = build_hybrid(model, kinds, {mixer[0]: mixer[1]}).to(device)
    data = torch.tensor(rows)  # [R, seq_len]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(settings.seed))

    def batches(first: int):
        for s in range(first, settings.fit_steps):
            pick = order[[(s * settings.fit_batch_size + j) % len(rows) for j in range(settings.fit_batch_size)]]
            yield {"input_ids": data[pick]}

    log(
        f"layer choice: aligning {L} {mixer[0]} mixers for {settings.fit_steps} steps of {settings.fit_batch_size} "
        f"rows x {len(rows[0])} tokens on {device.type} (progress below as [align] steps)"
    )
    clock = time.perf_counter()
    history = align(
        teacher,
        fitted,
        batches,
        steps=settings.fit_steps,
        lr=settings.fit_lr,
        warmup_steps=min(10, settings.fit_steps // 10),
        log_every=max(1, settings.fit_steps // 10),  # a step of every layer's mixer takes seconds on a CPU: an ETA
        mixed_precision="bf16" if device.type == "cuda" else "no",
        compile=False,  # a first-step compile would cost more than a hundred steps save
        seed=settings.seed,
    )
    log(
        f"layer choice: {L} {mixer[0]} mixers aligned for {settings.fit_steps} steps in "
        f"{time.perf_counter() - clock:.1f} s (MSE summed over layers {history[0]['loss']:.4g} -> "
        f"{history[-1]['loss']:.4g})"
    )
    return fitted.eval()


def rank_layers(
    model, tokenizer, documents: Iterable[str], settings: ChoiceSettings, cache_dir, log=print, mixer=None, *, parts
) -> dict:
    """{"key", "teacher", "settings", "seconds", "ranking"} for the attention layers of `model` (a transformers
    causal LM, or a hybrid converted further: then also "fixed", its converted layers, which are not ranked), read
    from `cache_dir` when this teacher, probe set and settings were scanned before, else scanned (on CUDA when there
    is one) and saved there. Ablations "mixer" and "both" need `mixer`, (name, settings): the mixer to fit.
    `parts`: what the probes and the fit borrow from training (TrainingParts)."""
    from raven_convert.surgery import build_hybrid, start_kinds

    if settings.fits and mixer is None:
        raise ValueError(f"layer choice with ablation {settings.ablation!r} needs the mixer to fit; none was given")
    probes = build_probes(documents, tokenizer, settings, parts)
    teacher = model_fingerprint(model)[:16]
    fit = {"name": mixer[0], "settings": dict(mixer[1])} if settings.fits else None
    key_text = json.dumps([CACHE_VERSION, teacher, settings.key_fields(), probes, fit], sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{key}.json"
    if path.is_file():
        log(f"layer choice: scores read from {path}")
        return json.loads(path.read_text())
    kinds = start_kinds(model.config)
    fixed = [i for i, kind in enumerate(kinds) if kind != "attention"]
    L = len(kinds) - len(fixed)
    log(
        f"layer choice: scoring {L} layers on {len(probes['retrieval'])} retrieval probes and {len(probes['text'])} "
        f"text rows of up to {settings.seq_len} tokens, window {settings.window}, {len(settings.schedule(L))} "
        f"round(s), {DIRECTIONS[settings.direction]}"
        + (f"; the source's {len(fixed)} converted layers stay mixers" if fixed else "")
    )
    clock = time.perf_counter()
    hybrid = build_hybrid(model, kinds, {}).to(_device())  # the source as a hybrid, the scan's own model
    if hybrid.config._attn_implementation not in ("sdpa", "eager"):  # flash kernels would not see the masks' windows
        hybrid.config._attn_implementation = "sdpa"
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    fitted = (
        fit_mixers(model, hybrid, mixer, probes["fit"], settings, log, align=parts.align) if settings.fits else None
    )
    ranking = score_layers(hybrid, probes, settings, eos, log, fitted)
    del hybrid, fitted
    result = {
        "key": key,
        "teacher": teacher,
        "settings": settings.model_dump(),
        **({"mixer": fit} if fit else {}),
        "seconds": round(time.perf_counter() - clock, 2),
        "device": str(_device()),
        "ranking": ranking,
        **({"fixed": fixed} if fixed else {}),
    }
    write_json(result, path)
    log(f"layer choice: scored in {result['seconds']:.1f} s on {result['device']}; saved to {path}")
    return result


def choice_record(result: dict, n: int) -> dict:
    """What the converted model's config records (`layer_choice`): the N layers converted and every layer's score
    parts, as lists indexed by layer; a source hybrid's converted layers ("fixed", counted in N) score None."""
    ranking, fixed = result["ranking"], result.get("fixed", [])
    if n <= len(fixed):
        raise ValueError(f"n = {n} does not exceed the {len(fixed)} layers the scanned hybrid had converted")
    by_layer = {row["layer"]: row for row in ranking}
    rows = [by_layer.get(i) for i in range(len(ranking) + len(fixed))]

    def per_layer(value) -> list:
        return [None if row is None else value(row) for row in rows]

    return {
        "method": METHODS[result["settings"].get("ablation", "window")],  # scores cached before mixers: windows
        "direction": result["settings"].get("direction", "cut"),
        **({"mixer": result["mixer"]} if "mixer" in result else {}),
        "n": n,
        **({"fixed": fixed} if fixed else {}),
        "chosen": sorted(fixed + [row["layer"] for row in ranking[: n - len(fixed)]]),
        "order": [row["layer"] for row in ranking],
        "score": per_layer(lambda row: round(row["score"], 6)),
        "retrieval": per_layer(lambda row: round(row["retrieval"], 6)),
        "kl": per_layer(lambda row: round(row["kl"], 6)),
        **(
            {"parts": {kind: per_layer(lambda row, k=kind: round(row["parts"][k], 6)) for kind in ranking[0]["parts"]}}
            if "parts" in ranking[0]
            else {}
        ),
        "round": per_layer(lambda row: row["round"]),
        **({"copying": result["copying"], "kept_copying": result["kept_copying"]} if "copying" in result else {}),
        "seed": result["settings"]["seed"],
        "probes": result["settings"],
        "cache_key": result["key"],
    }
