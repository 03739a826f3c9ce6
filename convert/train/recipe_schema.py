"""The recipe schema: the validated settings of one YAML recipe, section by section (recipe.py loads and checks it;
stages.py runs it).

A recipe with `layers` (Recipe) converts the teacher in `source` (or, with `start_from`, converts a hybrid it made
further, `source` staying the teacher) and trains the hybrid back through STAGES. A recipe
without `layers` is a fine-tuning recipe (FinetuneRecipe, run by finetune.run_finetune_recipe): the model in `source`
is trained as it is, in its own class, with token weights from a `reference` Transformer (weights -> train ->
export). Each stage's fingerprint hashes the fields `stage_fields` names (run_state.fingerprints).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raven_convert.evaluate.settings import EvaluateSettings
from raven_convert.layer_choice import ChoiceSettings, auto_assignment
from raven_convert.layer_spec import ACCEPTED_FORMS, AUTO_FORM, LayerSpecError, auto_count, parse_layer_spec
from raven_convert.train.compiling import CompileSetting
from raven_convert.train.distributed import DistributedSettings
from raven_convert.train.retrieval_data import RetrievalMix
from raven_convert.train.schema import CompileParts
from raven_convert.train.stage2_config import MixedPrecision, TrainConfig
from raven_layers import get_mixer, resolve_mixer

STAGES = ("convert", "align", "weights", "train", "extend", "evaluate", "export")
GRAPHED_STAGES = ("align", "train", "extend")  # the stages whose steps can be CUDA graphs (cuda_graphs)
FINETUNE_STAGES = ("weights", "train", "export")


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
    start_from: str | None = Field(
        None,
        min_length=1,
        description="a hybrid this toolkit saved (its model directory), converted further: convert keeps its mixers "
        "and converts more of its attention layers, align imitates it; source stays the teacher of the other stages",
    )
    mixer_settings: dict[str, dict] = Field(default_factory=dict)
    sliding_window: int | None = Field(None, ge=1)
    window_layers: str | None = None
    attention_sinks: int | None = Field(
        None,
        ge=0,
        description="windowed kept layers also attend to each sequence's first S tokens (None: start_from's, or 0)",
    )
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
