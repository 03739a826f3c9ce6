"""Recipes: loading one YAML file into its schema (recipe_schema.py) and the checks before a run starts.

    recipe = load_recipe("recipes/smollm2-raven.yaml")
    run_recipe(recipe, "runs/smollm2-raven")                      # convert -> align -> weights -> train -> ...

Relative paths in a recipe (source, reference and data.source when they exist as local paths, start_from,
data.cache_dir, token_weights.cache_dir, export.dir, evaluate.haystack_dir, the folders of evaluate.haystacks,
evaluate.ppl_data)
are resolved against the current working directory when the recipe is loaded, not against the recipe file's
directory. Names that do not exist locally (Hub ids such as Qwen/Qwen3-0.6B) are kept as given. The shipped
recipes name no local paths but a further conversion's start_from (the model a shipped recipe exports into its run
directory): the inputs come from INPUT_FLAGS (--src, --start-from, --reference, --data, --haystack, --ppl-data;
named haystacks from --set evaluate.haystacks.NAME=DIR), and check_inputs says which flag or field to set when one
is missing or does not exist. The schema's classes and names are importable from here too.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from raven_convert.layer_choice import auto_assignment, check_keep_copying
from raven_convert.train.recipe_schema import (  # noqa: F401
    FINETUNE_STAGES,
    GRAPHED_STAGES,
    NAMES,
    STAGES,
    AlignSettings,
    DataSettings,
    ExportSettings,
    ExtendSettings,
    FinetuneRecipe,
    FinetuneTrain,
    FinetuneWeights,
    LayerAssignment,
    Recipe,
    TokenWeightSettings,
    TrainSettings,
    WeightSettings,
    graphs_demanded,
    uses_data,
)
from raven_layers.common import did_you_mean

# The fields naming inputs from outside the repository, each with the `python -m raven_convert.train` flag that sets it
# (sugar for --set FIELD=VALUE), its metavar and help.
INPUT_FLAGS = {
    "source": ("--src", "MODEL", "the teacher (of a fine-tuning recipe: the model trained): Hub id, directory, .gguf"),
    "start_from": ("--start-from", "DIR", "a hybrid this toolkit saved, to convert further (source stays the teacher)"),
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
    if r.start_from:
        r.start_from = _local(r.start_from, base)
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


def check_start(start_from: str, teacher) -> None:
    """start_from names a hybrid this toolkit saved, converted from a model of the teacher's (`teacher`, a Source)
    architecture and shape: ValueError naming the field and its flag otherwise (configs read, no weights)."""
    from raven_convert.sources import hybrid_config

    try:
        start = hybrid_config(start_from, "start_from")
    except ValueError as err:
        raise ValueError(f"{err}; {how_to_set('start_from')}") from None
    config = teacher.load_config()
    shape = ("num_hidden_layers", "hidden_size", "vocab_size")
    if start.base_model_type != config.model_type or any(getattr(start, k) != getattr(config, k) for k in shape):

        def described(model_type, c) -> str:
            return f"{model_type} ({', '.join(f'{k} {getattr(c, k)}' for k in shape)})"

        raise ValueError(
            f"start_from {start_from}: a hybrid of a {described(start.base_model_type, start)}, but the teacher "
            f"(source) is a {described(config.model_type, config)}: start from a hybrid converted from the teacher"
        )


def check_inputs(recipe: Recipe | FinetuneRecipe, stages: list[str]) -> None:
    """Before any of `stages` (those left to run) starts: each input they read is set and exists, else a
    ValueError naming the field and the flag that sets it. The data source is also sampled (check_data_source),
    data.cache_dir must be writable, and a stage demanding CUDA graphs (cuda_graphs: true) must run where they can
    (one process on a CUDA GPU; under ddp on several, graphs.holds_collectives)."""
    import os

    from raven_convert.evaluate.needles import HAYSTACK_ENV, haystack_files, split_task
    from raven_convert.files import check_writable
    from raven_convert.sources import Source
    from raven_convert.train.data import check_data_source
    from raven_convert.train.distributed import on_cpu, world_size
    from raven_convert.train.graphs import holds_collectives, launch_obstacles

    device = "cpu" if on_cpu() else "cuda"
    strategy = recipe.distributed.strategy if isinstance(recipe, Recipe) else "ddp"  # a fine-tune: one model
    for stage in (s for s in GRAPHED_STAGES if s in stages and graphs_demanded(recipe, s)):
        found = launch_obstacles(device, world_size(), holds_collectives(stage, strategy))
        if found:
            raise ValueError(
                f"{stage}.cuda_graphs = true cannot be honoured: {'; '.join(found)}; use 'auto' (graphs where "
                f"they can run) or false (--set {stage}.cuda_graphs=auto)"
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
    start = getattr(recipe, "start_from", None)
    if start and ("convert" in stages or ("align" in stages and uses_data(recipe, "align"))):
        check_start(start, source)
    if choosing:  # N against the model's layers, from its config (no weights loaded)
        from raven_convert.sources import hybrid_config
        from raven_convert.surgery import start_kinds

        config = source.load_config()
        assignments = [(a.mixer, a.layers) for a in recipe.layers]
        auto = auto_assignment(assignments, config.num_hidden_layers, recipe.window_layers, NAMES)
        converted = hybrid_config(start, "start_from") if start else config  # what convert starts from
        check_keep_copying(start_kinds(converted), auto, recipe.layer_choice.keep_copying)
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
