"""Stage 2's settings (`TrainConfig`): what stage2.train reads, and what the recipe's train, extend and fine-tune
sections are (recipe_schema.py); every field validated, with its allowed range in the error.

    config = TrainConfig(steps=2000, batch_size=8, lr=3e-4, trainable="mixers+lora", kd_weight=1.0)
    config.tau_tokens(run_tokens)   # the token-weight schedule's tau for a run of that many tokens
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from raven_convert.train.compiling import CompileSetting
from raven_convert.train.lora import LORA_TARGETS
from raven_convert.train.schema import CompileParts, omit_at_default

# "no" or "bf16"; YAML reads a bare `no` as false, which means "no" here
MixedPrecision = Annotated[Literal["no", "bf16"], BeforeValidator(lambda v: "no" if v is False else v)]


class TrainConfig(BaseModel):
    """Stage 2 settings; unknown keys, out-of-range and non-finite values are refused with the field's name."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    steps: int = Field(ge=1, description="optimizer steps in all (a resumed run counts the ones already done)")
    batch_size: int = Field(8, ge=1, description="rows per micro-batch per process")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; None: no clipping")
    trainable: Literal["mixers", "mixers+lora", "all", "patterns", "lora"] = "mixers"
    trainable_patterns: list[str] = Field(
        default_factory=list, description="with trainable 'patterns': regular expressions of parameter names"
    )
    pretrained_lr_scale: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the learning rate of the pretrained weights `trainable` trains ('all', 'patterns': kept "
        "attention, MLPs, norms, embeddings) as a share of lr; the new ones (mixers, LoRA's adapters) train at lr",
    )
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    kd_weight: float = Field(0.0, ge=0)
    kd_temperature: float = Field(1.0, gt=0)
    answer_weight: float = Field(
        1.0,
        ge=1,
        description="the cross-entropy weight of the answers of synthetic retrieval samples (data.retrieval), "
        "against 1 for every other token",
    )
    token_weight_tau: float | None = Field(
        None, gt=0, description="tokens (see schedule_weights); None: token_weight_tau_fraction of the run's tokens"
    )
    token_weight_tau_fraction: float = Field(
        0.1, gt=0, description="tau as a share of the run's training tokens, when token_weight_tau is None"
    )
    mixed_precision: MixedPrecision = "no"
    compile: CompileParts = "auto"
    cuda_graphs: CompileSetting = Field(
        "auto",
        description="replay each step as a CUDA graph (graphs.py); auto: where it can (one CUDA GPU, a hybrid whose "
        "mixers are graph_safe, grad_accum 1, no gradient checkpointing, a distilling teacher with sdpa attention); "
        "true: or fail; false: eager steps, which hold less GPU memory",
    )
    gradient_checkpointing: bool = False
    save_every: int = Field(500, ge=1, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="how many of the newest checkpoints stay on disk")
    eval_every: int = Field(0, ge=0, description="steps between validation passes; 0: only at the end")
    eval_batches: int = Field(8, ge=1, description="validation micro-batches per pass")
    seed: int = Field(0, description="data order, and the random numbers of a fresh run (Raven's router noise)")
    log_every: int = Field(10, ge=0, description="steps between progress lines; 0: none")

    # the stages' fingerprints from before these fields stay valid
    _dump = omit_at_default("answer_weight", "pretrained_lr_scale")

    @model_validator(mode="after")
    def _one_tau(self):
        if self.token_weight_tau is not None and "token_weight_tau_fraction" in self.model_fields_set:
            raise ValueError(
                "token_weight_tau and token_weight_tau_fraction are both set; set one: token_weight_tau in tokens, "
                "or token_weight_tau_fraction of the run's training tokens"
            )
        return self

    @model_validator(mode="after")
    def _graphs(self):
        if self.cuda_graphs is True and self.graph_obstacles():
            raise ValueError(f"cuda_graphs = true cannot be honoured: {'; '.join(self.graph_obstacles())}")
        return self

    def graph_obstacles(self) -> list[str]:
        """What in these settings keeps a step from being one CUDA graph (none: it can be)."""
        found = [f"grad_accum = {self.grad_accum} (a graph holds one micro-batch)"] if self.grad_accum != 1 else []
        if self.gradient_checkpointing:
            found.append("gradient_checkpointing = true")
        return found

    @model_validator(mode="after")
    def _patterns_with_their_mode(self):
        if self.trainable == "patterns" and not self.trainable_patterns:
            raise ValueError(
                "trainable = 'patterns' needs trainable_patterns: regular expressions of parameter names, e.g. "
                "['mlp', 'norm']"
            )
        if self.trainable_patterns and self.trainable != "patterns":
            raise ValueError(f"trainable_patterns only apply with trainable = 'patterns', not {self.trainable!r}")
        if self.pretrained_lr_scale != 1 and self.trainable not in ("all", "patterns"):
            raise ValueError(
                f"pretrained_lr_scale = {self.pretrained_lr_scale:g} applies where trainable trains pretrained "
                f"weights ('all' or 'patterns'), and trainable = {self.trainable!r} trains none of them"
            )
        return self

    @property
    def uses_lora(self) -> bool:
        return self.trainable in ("mixers+lora", "lora")

    def tau_tokens(self, run_tokens: int) -> float:
        """tau of schedule_weights in tokens. Relative to a run of `run_tokens` training tokens by default (0.1: the
        uniform part falls below 1% at half the run, so every run ends purely weighted); the paper's 1e9 tokens
        (Appendix C.3) is a fixed token_weight_tau."""
        if self.token_weight_tau is not None:
            return self.token_weight_tau
        return self.token_weight_tau_fraction * run_tokens

    @field_validator("lora_targets")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)]
        if bad:
            raise ValueError(f"lora_targets must be module names such as 'q_proj', got {bad}")
        return value

    @field_validator("trainable_patterns")
    @classmethod
    def _regexes(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{pattern!r} is not a regular expression: {err}") from None
        return value
