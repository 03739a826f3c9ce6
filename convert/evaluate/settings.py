"""What an evaluation runs, with its defaults and allowed values, in one schema: a recipe's `evaluate:` section is an
`EvaluateSettings`, and `raven-eval` (its flags' defaults) and `evaluate_model` take an `EvalRequest`, the same
settings plus the model, the report directory and the device.

    request = EvalRequest(model="runs/smollm2-raven/model", out="runs/smollm2-raven/eval", lengths=[1024, 4096])
    request = EvalRequest(model=..., out=..., tasks=["niah_word", "niah_word@papers"], haystacks={"papers": "papers/"})
    request = EvalRequest(model=..., out=..., tasks=["passkey", "niah_multikey"], lengths=[1024, 16384],
                          task_lengths={"niah_multikey": [1024, 8192]})
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from raven_layers.common import did_you_mean

from .needles import BUILT_IN_HAYSTACKS, VARIANTS, Sample, build_samples, essay_folder, haystack_files, split_task
from .speed import BATCHES

HAYSTACK_NAME = r"[a-z][a-z0-9_]{0,23}"  # a named haystack: short, and safe in a task string and a file name


class EvaluateSettings(BaseModel):
    """Every part but retrieval is optional. Lengths are in tokens of the model's tokenizer. Unknown fields,
    out-of-range and non-finite values are refused with the field's name."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # before tasks: their validator reads it
    haystacks: dict[str, str] = Field(
        default_factory=dict, description="further haystacks, name -> folder of *.txt; task TASK@NAME reads NAME's"
    )
    tasks: list[str] = Field(default_factory=lambda: ["passkey", "niah_single_2"], min_length=1)
    variants: list[Literal[VARIANTS]] = Field(default_factory=lambda: ["standard"])
    lengths: list[int] = Field(default_factory=lambda: [1024, 2048, 4096], min_length=1)
    task_lengths: dict[str, list[int]] = Field(
        default_factory=dict, description="TASK -> its lengths, in place of `lengths` for that task (one of tasks)"
    )
    depths: list[float] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], min_length=1)
    samples: int = Field(4, ge=1, description="prompts per (length, depth) cell")
    batch_size: int = Field(8, ge=1)
    haystack_dir: str | None = Field(None, description="essays the needles hide in; default: $RAVEN_HAYSTACK_DIR")
    # Plain completion prompts by default: SmolLM2-135M-Instruct inside its chat template answers the pass key at
    # 1K but drifts off at 2K (0% vs 95% plain, H100, 20 samples); None uses the tokenizer's template if any.
    chat_template: bool | None = False
    ppl_data: str | None = Field(None, description=".txt / .jsonl(.gz) file or directory; None skips perplexity")
    ppl_lengths: list[int] = Field(default_factory=lambda: [512, 2048])
    ppl_windows: int = Field(8, ge=1)
    speed_lengths: list[int] = Field(default_factory=list, description="empty skips the speed part")
    speed_batches: list[int] = Field(
        default_factory=lambda: list(BATCHES), description="batch sizes the speed part times generate() at"
    )
    pictures: bool = Field(True, description="the mixers' pictures, for hybrids")
    picture_length: int = Field(1024, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    attention_window: int | None = Field(
        None, ge=1, description="a hybrid's kept attention layers attend within this many tokens (None: as converted)"
    )

    @field_validator("haystacks")
    @classmethod
    def _haystacks(cls, value: dict[str, str]) -> dict[str, str]:
        for name, folder in value.items():
            if not re.fullmatch(HAYSTACK_NAME, name):
                raise ValueError(
                    f"haystack name {name!r} is not a short identifier: a lowercase letter, then up to 23 lowercase "
                    "letters, digits or _"
                )
            if name in BUILT_IN_HAYSTACKS:
                raise ValueError(
                    f"haystack name {name!r} is built in ({', '.join(BUILT_IN_HAYSTACKS)}); choose another"
                )
            if not folder.strip():
                raise ValueError(f"haystack {name!r} names no folder")
        return value

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for task in value:  # the haystack names are checked when haystacks is valid
            split_task(task, info.data.get("haystacks"))
        return value

    @field_validator("task_lengths")
    @classmethod
    def _task_lengths(cls, value: dict[str, list[int]], info: ValidationInfo) -> dict[str, list[int]]:
        tasks = info.data.get("tasks")
        if tasks is None:  # tasks failed its own check, which says why
            return value
        for task, lengths in value.items():
            if task not in tasks:
                raise ValueError(
                    f"task_lengths names {task!r}, which is not one of tasks {tasks}; "
                    f"{did_you_mean(task, tasks)}task_lengths sets the lengths of a task that runs"
                )
            if not lengths or any(n < 1 for n in lengths):
                raise ValueError(f"task_lengths of {task!r} must be lengths >= 1, got {lengths}")
        return value

    def lengths_of(self, task: str) -> list[int]:
        """The prompt lengths of `task`: its task_lengths entry, else `lengths`."""
        return self.task_lengths.get(task, self.lengths)

    def check_haystacks(self) -> None:
        """Every essay task has a haystack folder with *.txt files in it (ValueError or FileNotFoundError naming the
        task, the field and the folder): checked before a model is loaded."""
        for task in self.tasks:
            found = essay_folder(task, self.haystack_dir, self.haystacks)
            if found is not None:
                haystack_files(*found)

    def prompts(self, task: str, variant: str, tokenizer) -> list[Sample]:
        """The retrieval prompts of one task and variant: the same ones for the same settings and tokenizer."""
        return build_samples(
            task,
            tokenizer,
            self.lengths_of(task),
            self.depths,
            self.samples,
            self.seed,
            variant=variant,
            haystack_dir=self.haystack_dir,
            chat_template=self.chat_template,
            haystacks=self.haystacks,
        )

    @field_validator("lengths", "ppl_lengths", "speed_lengths")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value):
            raise ValueError(f"lengths must be >= 1, got {value}")
        return value

    @field_validator("speed_batches")
    @classmethod
    def _batches(cls, value: list[int]) -> list[int]:
        if not value or any(v < 1 for v in value):
            raise ValueError(f"speed_batches must be one or more batch sizes, integers >= 1; got {value}")
        return value

    @field_validator("depths")
    @classmethod
    def _depths(cls, value: list[float]) -> list[float]:
        if any(not 0 <= v <= 1 for v in value):
            raise ValueError(f"depths must lie in [0, 1], got {value}")
        return value


class EvalRequest(EvaluateSettings):
    """What `evaluate_model` evaluates: the settings, and which model, where the report goes, on which device."""

    model: str = Field(description="Hub id, model directory (teacher or exported hybrid) or .gguf file")
    out: Path = Field(description="the report directory: report.json and the PNGs")
    device: str | None = Field(None, description="cuda, cpu, ...; None: cuda when available")
