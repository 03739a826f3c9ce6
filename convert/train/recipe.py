"""Recipes: one validated YAML file describing the whole distillation (the schema; stages.py runs it).

    recipe = load_recipe("recipes/smollm2-raven.yaml")
    run_recipe(recipe, "runs/smollm2-raven")                      # convert -> align -> weights -> train -> ...

A recipe without `layers` is a fine-tuning recipe (FinetuneRecipe, run by finetune.run_finetune_recipe): the model
in `source` is trained as it is, in its own class, with token weights from a `reference` Transformer
(weights -> train -> export).

Relative paths in a recipe (source, reference and data.source when they exist as local paths, data.cache_dir,
token_weights.cache_dir, export.dir, evaluate.haystack_dir, the folders of evaluate.haystacks, evaluate.ppl_data)
are resolved against the current working directory when the recipe is loaded, not against the recipe file's
directory. Names that do not exist locally (Hub ids such as Qwen/Qwen3-0.6B) are kept as given. The shipped
recipes name no local paths: the inputs come from INPUT_FLAGS (--src, --reference, --data, --haystack, --ppl-data;
named haystacks from --set evaluate.haystacks.NAME=DIR), and check_inputs says which flag or field to set when one
is missing or does not exist.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raven_convert.evaluate.settings import EvaluateSettings
from raven_convert.layer_choice import ChoiceSettings, auto_assignment
from raven_convert.layer_spec import ACCEPTED_FORMS, AUTO_FORM, LayerSpecError, auto_count, parse_layer_spec
from raven_convert.train.compiling import CompileSetting
from raven_convert.train.distributed import DistributedSettings
from raven_convert.train.retrieval_data import RetrievalMix
from raven_convert.train.schema import CompileParts
from raven_convert.train.stage2_config import MixedPrecision, TrainConfig
from raven_layers import get_mixer, resolve_mixer
from raven_layers.common import did_you_mean

STAGES = ("convert", "align", "weights", "train", "extend", "evaluate", "export")
GRAPHED_STAGES = ("align", "train", "extend")  # the stages whose steps can be CUDA graphs (cuda_graphs)
FINETUNE_STAGES = ("weights", "train", "export")
# The fields naming inputs from outside the repository, each with the `python -m raven_convert.train` flag that sets it
# (sugar for --set FIELD=VALUE), its metavar and help.
INPUT_FLAGS = {
    "source": ("--src", "MODEL", "the teacher (of a fine-tuning recipe: the model trained): Hub id, directory, .gguf"),
    "reference": ("--reference", "MODEL", "fine-tuning recipes: the Transformer whose attention gives token weights"),
    "data.source": ("--data", "PATH", "training text: .txt/.jsonl(.gz)/.parquet file or folder, or a Hub dataset"),
    "evaluate.haystack_dir": ("--haystack", "DIR", "folder of *.txt essays the needle tasks hide needles in"),
    "evaluate.ppl_data": ("--ppl-data", "PATH", ".txt/.jsonl(.gz) file or folder for perplexity (unset: skipped)"),
}


def how_to_set(field: str) -> str:
    """'pass --data PATH or set data.source in the recipe': the advice that ends an error about an input."""
    flag, metavar, _ = INPUT_FLAGS[field]
    return f"pass {flag} {metavar} or set {field} in the recipe"


def input_overrides(args) -> list[str]:
    """The INPUT_FLAGS an argparse namespace holds (dest: the field, e.g. `data.source`) as the --set overrides they
    stand for (applied before any --set); the value is quoted so that a path reads as a string, never as YAML (`yes`,
    `1e3`, `a: b`)."""
    return [f"{f}={json.dumps(getattr(args, f))}" for f in INPUT_FLAGS if getattr(args, f, None) is not None]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LayerAssignment(_Strict):
    """One `--mixer M --layers SPEC` pair of `convert`: M is a registered mixer's name or the import path of a
    declaration, mypkg.module:NAME (see raven_layers.registry)."""

    mixer: str
    layers: str

    @field_validator("mixer")
    @classmethod
    def _mixer(cls, value: str) -> str:
        try:
            resolve_mixer(value)  # registers a mixer named by import path, so that its settings validate
        except TypeError as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("layers")
    @classmethod
    def _spec(cls, value: str) -> str:
        if auto_count(value, option="layers") is not None:  # N's range is checked once the model's config is read
            return value
        return _fixed_spec(value)


def _fixed_spec(value: str) -> str:
    try:
        parse_layer_spec(value, 1 << 20)  # syntax only; ranges are checked against the model at convert
    except LayerSpecError:
        raise ValueError(f"{value!r} is not a layer spec; accepted forms: {ACCEPTED_FORMS}, or {AUTO_FORM}") from None
    return value


class DataSettings(_Strict):
    source: str | None = Field(
        None, description="local .txt/.jsonl(.gz)/.parquet file or directory, or a Hub dataset id"
    )
    text_field: str = "text"
    max_skipped: float = Field(
        0.05, ge=0, le=1, description="share of records without text_field that may be skipped; more stops the run"
    )
    seq_len: int = Field(1024, ge=2)
    max_documents: int | None = Field(None, ge=1)
    validation_fraction: float = Field(0.01, ge=0, lt=1)
    cache_dir: str | None = Field(None, description="packed-row cache; default RUN_DIR/cache")
    seed: int = 0
    retrieval: RetrievalMix | None = Field(None, description="mix synthetic retrieval samples into the data")


class AlignSettings(_Strict):
    steps: int = Field(0, ge=0, description="0 skips stage 1")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = Field(0, description="data order, and the random numbers of a fresh run (Raven's router noise)")
    log_every: int = Field(10, ge=0)
    mixed_precision: MixedPrecision = "no"
    compile: CompileParts = "auto"
    cuda_graphs: CompileSetting = Field(
        "auto",
        description="replay each step as a CUDA graph (graphs.py); auto: where it can (CUDA, one process, mixers "
        "declared graph_safe); true: or fail",
    )
    save_every: int = Field(100, ge=1, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="how many of the newest checkpoints stay on disk")


class WeightSettings(_Strict):
    """How token_weights.weight_table computes SILA's token weights (tau, lam: Algorithm 1's threshold and scale)."""

    tau: float = Field(0.2, ge=0, le=1)
    lam: float = Field(0.5, ge=0)
    batch_size: int = Field(8, ge=1)
    query_block: int = Field(256, ge=1)
    save_every: int = Field(100, ge=1, description="batches between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="how many of the newest checkpoints stay on disk")
    kernel: Literal["auto", "triton", "compiled", "eager"] = Field(
        "auto",
        description="how each layer's attention distance is computed (token_weights.token_weights): the fused Triton "
        "kernel, PyTorch blocks of queries through torch.compile, or eagerly; auto: triton on CUDA, else eager",
    )
    precision: Literal["float32", "bf16"] = Field(
        "float32",
        description="the reference's forward in float32 or under bf16 autocast (faster; the weights move slightly: "
        "token_weights.PRECISIONS)",
    )


class TokenWeightSettings(WeightSettings):
    enabled: bool = False
    reference: Literal["teacher"] = "teacher"


class TrainSettings(TrainConfig):
    """stage2_config.TrainConfig, except that steps 0 skips stage 2."""

    steps: int = Field(0, ge=0, description="optimizer steps; 0 skips stage 2")


class ExtendSettings(TrainConfig):
    """A second stage-2 phase at a longer context (SILA: 1K, then 4K), continuing from the train stage's model.

    Its rows are the same documents packed to `seq_len`, with `retrieval`'s samples mixed in (data.retrieval's
    unless set: e.g. facts placed far from their questions, past a sliding window); with token weights enabled,
    each batch's weights are computed from the teacher at that length as the batch is drawn (no precomputed
    table)."""

    seq_len: int = Field(ge=2, description="tokens per packed row in this phase")
    steps: int = Field(ge=1, description="optimizer steps of this phase")
    retrieval: RetrievalMix | None = Field(None, description="this phase's retrieval samples; None: data.retrieval")


class ExportSettings(_Strict):
    dir: str | None = Field(None, description="where the final model goes; None: RUN_DIR/model, outside every stage")


class Recipe(_Strict):
    stages: ClassVar[tuple[str, ...]] = STAGES
    # The recipe fields each stage reads (its own settings and what shapes its inputs); stages.py fingerprints them.
    stage_fields: ClassVar[dict[str, tuple[str, ...]]] = {
        "convert": ("source", "layers", "mixer_settings", "sliding_window", "window_layers", "dtype", "seed"),
        "align": ("data", "align"),
        # the weights stage weights the rows train reads: those its steps, global batch and seed draw
        "weights": ("data", "token_weights", "train.steps", "train.batch_size", "train.grad_accum", "train.seed"),
        "train": ("data", "train"),
        "extend": ("data", "token_weights", "extend"),
        "evaluate": ("evaluate",),
        "export": ("export",),
    }
    source: str = Field(description="teacher: Hub id, model directory or .gguf file")
    layers: list[LayerAssignment] = Field(min_length=1)
    mixer_settings: dict[str, dict] = Field(default_factory=dict)
    sliding_window: int | None = Field(None, ge=1)
    window_layers: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    layer_choice: ChoiceSettings | None = Field(None, description="how layers: auto:N scores them (None: defaults)")
    data: DataSettings = Field(default_factory=DataSettings)
    align: AlignSettings = Field(default_factory=AlignSettings)
    token_weights: TokenWeightSettings = Field(default_factory=TokenWeightSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    extend: ExtendSettings | None = None
    evaluate: EvaluateSettings | None = None
    export: ExportSettings | None = None
    distributed: DistributedSettings = Field(
        default_factory=DistributedSettings, description="how the processes of a multi-process launch share the work"
    )

    @field_validator("mixer_settings")
    @classmethod
    def _settings(cls, value: dict[str, dict]) -> dict[str, dict]:
        """Keyed by mixer name; validated after `layers`, which registers the mixers named by import path."""
        for mixer, values in value.items():
            settings = get_mixer(mixer).settings
            try:
                settings.from_dict(values)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{mixer}: {err}") from None
        return value

    @field_validator("window_layers")
    @classmethod
    def _window_spec(cls, value: str | None) -> str | None:
        if value is not None:
            _fixed_spec(value)
        return value

    @model_validator(mode="after")
    def _auto(self) -> Recipe:
        self.auto()  # auto:N alone, and not beside window_layers
        return self

    @model_validator(mode="after")
    def _answers(self) -> Recipe:
        """answer_weight weights the answers of synthetic retrieval samples: a stage that weights them has some."""
        for name in ("train", "extend"):
            settings = getattr(self, name)
            mix = getattr(settings, "retrieval", None) or self.data.retrieval
            if settings is not None and settings.answer_weight != 1 and (mix is None or mix.ratio == 0):
                where = "extend.retrieval or data.retrieval" if name == "extend" else "data.retrieval"
                raise ValueError(
                    f"{name}.answer_weight = {settings.answer_weight:g} weights the answers of synthetic retrieval "
                    f"samples, and {name} has none: set {where} (ratio > 0), or answer_weight 1"
                )
        return self

    @model_validator(mode="after")
    def _graphs(self) -> Recipe:
        demanded = [s for s in GRAPHED_STAGES if graphs_demanded(self, s)]
        unsafe = sorted({a.mixer for a in self.layers if not resolve_mixer(a.mixer).graph_safe})
        if demanded and unsafe:
            raise ValueError(
                f"{demanded[0]}.cuda_graphs = true needs mixers declared graph_safe; {', '.join(unsafe)} is not "
                "(their kernels read values back to the host); use 'auto' (graphs where they can run) or false"
            )
        return self

    def auto(self) -> tuple[str, int] | None:
        """(mixer, N) when `layers` asks for auto:N, else None."""
        return auto_assignment([(a.mixer, a.layers) for a in self.layers], None, self.window_layers, NAMES)


NAMES = ("layers", "window_layers")  # the recipe fields auto:N's errors name


class FinetuneWeights(WeightSettings):
    enabled: bool = Field(True, description="false: a plain, uniformly weighted fine-tune")
    cache_dir: str | None = Field(
        None, description="weight tables, keyed by reference and data (shared by runs); default data.cache_dir"
    )


class FinetuneTrain(TrainConfig):
    """stage2_config.TrainConfig for a model that is not a hybrid: everything, named parameters, or LoRA trains."""

    trainable: Literal["all", "patterns", "lora"] = "all"


class FinetuneRecipe(_Strict):
    """A recipe without `layers`: fine-tune `source` in its own class (no conversion), its loss weighted by token
    weights from `reference`'s attention, which must share the source's tokenizer."""

    stages: ClassVar[tuple[str, ...]] = FINETUNE_STAGES
    stage_fields: ClassVar[dict[str, tuple[str, ...]]] = {
        # the weights stage weights the rows train reads: those its steps, global batch and seed draw
        "weights": (
            "source",
            "reference",
            "trust_remote_code",
            "dtype",
            "data",
            "token_weights",
            "train.steps",
            "train.batch_size",
            "train.grad_accum",
            "train.seed",
        ),
        "train": ("source", "trust_remote_code", "dtype", "data", "train"),
        "export": ("export",),
    }
    source: str = Field(description="the model to fine-tune: Hub id, model directory or .gguf file")
    reference: str | None = Field(None, description="the Transformer giving the token weights; None: source itself")
    trust_remote_code: bool = Field(False, description="load models whose class comes with their own code")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    data: DataSettings = Field(default_factory=DataSettings)
    token_weights: FinetuneWeights = Field(default_factory=FinetuneWeights)
    train: FinetuneTrain
    export: ExportSettings | None = None


# names people bring from other trainers, for the suggestion on an unknown field
FIELD_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "warmup": "warmup_steps"}


def _section_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The settings class that holds the field at `loc` (a validation error's location), or None."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int):  # a list item: its class was found with the list's field
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        candidates += [a for c in candidates for a in typing.get_args(c)]  # list[X] | None -> X
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _unknown_field(loc: tuple, root: type[BaseModel] = Recipe) -> str:
    """'not a recipe field', with the closest valid name when one is near and the names allowed there."""
    section = _section_at(root, loc)
    if section is None:
        return "not a recipe field"
    allowed = list(section.model_fields)
    where = ".".join(str(p) for p in loc[:-1]) or "the recipe"
    if root is FinetuneRecipe and len(loc) == 1 and loc[0] in Recipe.model_fields:
        where = "a fine-tuning recipe (one without `layers`; add `layers` to convert the model)"
    return f"not a field of {where}; {did_you_mean(loc[-1], allowed, FIELD_ALIASES)}allowed: {', '.join(allowed)}"


def format_validation_error(err: ValidationError, prefix: str = "", root: type[BaseModel] = Recipe) -> str:
    """One line per error: 'field.path: message (got VALUE)', the value shown when it is a plain one; an unknown
    field gets the closest valid name and the names allowed in its section (of `root`, the recipe's class)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(recipe)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{prefix}{loc}: {_unknown_field(e['loc'], root)}")
            continue
        value = e.get("input")
        shown = isinstance(value, (bool, int, float, str)) and e["type"] != "missing"
        lines.append(f"{prefix}{loc}: {e['msg']}" + (f" (got {value!r})" if shown else ""))
    return "\n".join(lines)


def _local(value: str, base: Path) -> str:
    path = (base / Path(value).expanduser()).resolve()
    return str(path)


def _if_exists(value: str, base: Path) -> str:
    path = base / Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def resolve_paths(recipe: Recipe | FinetuneRecipe, base: str | Path | None = None) -> Recipe | FinetuneRecipe:
    """A copy of `recipe` with relative paths resolved against `base` (default: the current directory)."""
    base = Path(base or Path.cwd())
    r = recipe.model_copy(deep=True)
    r.source = _if_exists(r.source, base)
    if r.data.source:
        r.data.source = _if_exists(r.data.source, base)
    if r.data.cache_dir:
        r.data.cache_dir = _local(r.data.cache_dir, base)
    if r.export and r.export.dir:
        r.export.dir = _local(r.export.dir, base)
    if isinstance(r, FinetuneRecipe):
        if r.reference:
            r.reference = _if_exists(r.reference, base)
        if r.token_weights.cache_dir:
            r.token_weights.cache_dir = _local(r.token_weights.cache_dir, base)
        return r
    if r.evaluate:
        if r.evaluate.haystack_dir:
            r.evaluate.haystack_dir = _local(r.evaluate.haystack_dir, base)
        r.evaluate.haystacks = {name: _local(folder, base) for name, folder in r.evaluate.haystacks.items()}
        if r.evaluate.ppl_data:
            r.evaluate.ppl_data = _local(r.evaluate.ppl_data, base)
    return r


def parse_recipe(data, base: str | Path | None = None, name: str = "recipe") -> Recipe | FinetuneRecipe:
    """Validate a recipe mapping (a FinetuneRecipe when it has no `layers`); ValueError with one
    'field.path: message' line per problem."""
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping of recipe fields, got {type(data).__name__}")
    kind = Recipe if "layers" in data else FinetuneRecipe
    try:
        recipe = kind.model_validate(data)
    except ValidationError as err:
        what = "recipe" if kind is Recipe else "fine-tuning recipe (it has no `layers`)"
        raise ValueError(f"{name} is not a valid {what}:\n{format_validation_error(err, root=kind)}") from None
    return resolve_paths(recipe, base)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of recipe mapping `data` with "dotted.key=YAML value" overrides applied (as torchtune's CLI does):
    `train.steps=20`, `evaluate=null`, `layers=[{mixer: sse, layers: "0-29:2"}]`. Validation comes after."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} is not of the form dotted.key=value (e.g. train.steps=20)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"override {item!r}: the value is not valid YAML: {err}") from None
        *parents, last = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # e.g. extend.steps=10 where the recipe has no extend
            node = node[part]
        node[last] = value
    return data


SHIPPED_RECIPES = Path(__file__).resolve().parents[2] / "recipes"  # in a checkout of the repository


def shipped_recipes() -> list[Path]:
    """The recipes of the repository this package runs from (none where it is installed without its checkout)."""
    return sorted(SHIPPED_RECIPES.glob("*.yaml")) if SHIPPED_RECIPES.is_dir() else []


def missing_recipe(path: Path) -> str:
    """What to say of a recipe path that names no file: the shipped recipes, and the closest name among them."""
    shipped = shipped_recipes()
    if not shipped:
        return f"{path}: no such recipe file (the shipped recipes are in the repository's recipes/ folder)"
    names = [p.name for p in shipped]
    hint = did_you_mean(path.name, names)
    return f"{path}: no such recipe file; {hint}the shipped recipes, in {SHIPPED_RECIPES}: {', '.join(names)}"


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe | FinetuneRecipe:
    """Read and validate a YAML recipe, after `overrides` (see apply_overrides); relative paths resolve against
    the current working directory."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(missing_recipe(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of recipe fields, got {type(data).__name__}")
    return parse_recipe(apply_overrides(data, list(overrides)), name=str(path))


def uses_data(recipe: Recipe | FinetuneRecipe, stage: str) -> bool:
    """Whether `stage` reads the training data under this recipe."""
    if isinstance(recipe, FinetuneRecipe):
        return {"weights": recipe.token_weights.enabled, "train": True}.get(stage, False)
    return {
        "align": recipe.align.steps > 0,
        "weights": recipe.token_weights.enabled,
        "train": recipe.train.steps > 0,
        "extend": recipe.extend is not None,
    }.get(stage, False)


def graphs_demanded(recipe, stage: str) -> bool:
    """Whether `stage`'s settings (absent for a skipped extend) ask for CUDA graphs outright (cuda_graphs: true)."""
    return getattr(getattr(recipe, stage, None), "cuda_graphs", None) is True


def check_inputs(recipe: Recipe | FinetuneRecipe, stages: list[str]) -> None:
    """Before any of `stages` (those left to run) starts: each input they read is set and exists, else a
    ValueError naming the field and the flag that sets it. The data source is also sampled (check_data_source),
    data.cache_dir must be writable, and a stage demanding CUDA graphs (cuda_graphs: true) must run where they can
    (one process on a CUDA GPU)."""
    import os

    from raven_convert.evaluate.needles import HAYSTACK_ENV, haystack_files, split_task
    from raven_convert.files import check_writable
    from raven_convert.sources import Source
    from raven_convert.train.data import check_data_source
    from raven_convert.train.distributed import on_cpu, world_size
    from raven_convert.train.graphs import launch_obstacles

    demanded = [s for s in GRAPHED_STAGES if s in stages and graphs_demanded(recipe, s)]
    found = launch_obstacles("cpu" if on_cpu() else "cuda", world_size()) if demanded else []
    if found:
        raise ValueError(
            f"{demanded[0]}.cuda_graphs = true cannot be honoured: {'; '.join(found)}; use 'auto' (graphs where "
            f"they can run) or false (--set {demanded[0]}.cuda_graphs=auto)"
        )
    choosing = "convert" in stages and recipe.auto() is not None  # auto:N measures the layers on the data
    reads_data = choosing or any(uses_data(recipe, s) for s in stages)
    if "convert" in stages or reads_data:  # the stages that load the teacher
        try:
            source = Source.resolve(recipe.source)
        except ValueError as err:
            raise ValueError(f"source: {err}") from None
    if isinstance(recipe, FinetuneRecipe) and recipe.reference and "weights" in stages and reads_data:
        try:
            Source.resolve(recipe.reference)
        except ValueError as err:
            raise ValueError(f"reference: {err}") from None
    if choosing:  # N against the model's layers, from its config (no weights loaded)
        layers = source.load_config().num_hidden_layers
        auto_assignment([(a.mixer, a.layers) for a in recipe.layers], layers, recipe.window_layers, NAMES)
    if reads_data:
        if recipe.data.source is None:
            raise ValueError(f"data.source is not set: {how_to_set('data.source')}")
        d = recipe.data
        check_data_source(d.source, d.text_field, hint=f"; {how_to_set('data.source')}", max_skipped=d.max_skipped)
        if recipe.data.cache_dir:
            check_writable(recipe.data.cache_dir, "data.cache_dir")
    evaluate = getattr(recipe, "evaluate", None)
    if "evaluate" not in stages or evaluate is None:
        return
    tasks = {task: split_task(task) for task in evaluate.tasks}  # task -> (spec, named haystack or None)
    essays = [t for t, (spec, named) in tasks.items() if spec.haystack != "noise" and named is None]
    haystack = evaluate.haystack_dir or os.environ.get(HAYSTACK_ENV)
    if essays and not haystack:
        raise ValueError(
            f"evaluate.haystack_dir is not set, and tasks {essays} hide their needles in essays (a folder of *.txt "
            f"files, e.g. Paul Graham's): {how_to_set('evaluate.haystack_dir')} (or set ${HAYSTACK_ENV})"
        )
    folders = {}  # what names the folder -> (the folder, how to set it)
    if essays:
        what = "evaluate.haystack_dir" if evaluate.haystack_dir else f"${HAYSTACK_ENV}"
        folders[what] = (haystack, how_to_set("evaluate.haystack_dir"))
    for name in dict.fromkeys(n for _, n in tasks.values() if n):
        field = f"evaluate.haystacks.{name}"
        folders[field] = (evaluate.haystacks[name], f"set it with --set {field}=DIR")
    for what, (folder, hint) in folders.items():
        try:
            haystack_files(folder, what)
        except FileNotFoundError as err:
            raise ValueError(f"{err}; {hint}") from None
    if evaluate.ppl_data and not Path(evaluate.ppl_data).exists():
        raise ValueError(
            f"evaluate.ppl_data {evaluate.ppl_data}: no such file or directory; {how_to_set('evaluate.ppl_data')}"
        )
    if not evaluate.ppl_data:
        print(
            f"[evaluate] evaluate.ppl_data is not set: perplexity is skipped ({how_to_set('evaluate.ppl_data')})",
            file=sys.stderr,
        )
