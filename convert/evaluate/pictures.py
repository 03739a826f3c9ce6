"""The evaluation report's pictures of a hybrid's mixer layers, on a passkey prompt.

A mixer's declaration names the function that draws its pictures (`MixerSpec.pictures`, "module:function"); the
report calls it for the first layer of that mixer as `function(context, layer)`, with a `PictureContext`, and it
returns {picture: file name} of the PNGs it wrote into `context.out`. The built-in mixers' functions are below; a
mixer declared elsewhere names its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import analysis
from .analysis_plots import (
    plot_effective_sequence_length,
    plot_gate_trace,
    plot_partition_usage,
    plot_slot_allocation,
    plot_state_entropy,
)
from .retrieval import build_samples


@dataclass
class Prompt:
    """One passkey prompt: token ids [T] on the model's device, their strings, and the needles' token spans."""

    ids: torch.Tensor
    tokens: list[str]
    needle_spans: list[tuple[int, int]]

    @property
    def needle_mask(self) -> torch.Tensor:
        """[T] bool (CPU), True on the needles' tokens."""
        mask = torch.zeros(self.ids.numel(), dtype=torch.bool)
        for start, end in self.needle_spans:
            mask[start:end] = True
        return mask

    @property
    def needle_positions(self) -> list[int]:
        return [t for start, end in self.needle_spans for t in range(start, end)]


class PictureContext:
    """What a pictures function draws from: the model and its tokenizer, where the PNGs go, and the passkey prompts
    of the evaluation request (`picture_length` tokens, needle at half depth, the request's seed and template)."""

    def __init__(self, model, tokenizer, out: Path, length: int, seed: int, chat_template: bool | None):
        self.model, self.tokenizer, self.out = model, tokenizer, Path(out)
        self.sample_args = dict(lengths=[length], depths=[0.5], samples_per_cell=1, seed=seed)
        self.sample_args |= dict(chat_template=chat_template)
        self._prompts: dict[str, Prompt] = {}

    def passkey(self, variant: str = "standard") -> Prompt:
        """The passkey prompt of `variant` ("standard", "no_inst", "strong_inst"; see retrieval.py)."""
        if variant not in self._prompts:
            sample = build_samples("passkey", self.tokenizer, variant=variant, **self.sample_args)[0]
            add_special_tokens = sample.meta["add_special_tokens"]
            encoded = self.tokenizer(sample.prompt, add_special_tokens=add_special_tokens, return_tensors="pt")
            ids = encoded.input_ids[0].to(self.model.device)
            spans = [tuple(needle["token_span"]) for needle in sample.meta["needles"]]
            self._prompts[variant] = Prompt(ids, self.tokenizer.convert_ids_to_tokens(ids.tolist()), spans)
        return self._prompts[variant]


def raven_pictures(context: PictureContext, layer: int) -> dict[str, str]:
    """Raven's effective sequence length per slot, and the slot allocation around the passkey."""
    prompt = context.passkey()
    writes = analysis.raven_slot_writes(context.model, prompt.ids, layer)
    esl = analysis.effective_sequence_length(writes)
    title = f"layer {layer}"
    return {
        "raven_esl": plot_effective_sequence_length(esl, context.out / "raven_esl.png", title=title).name,
        "raven_slot_allocation": plot_slot_allocation(
            writes, prompt.needle_mask, context.out / "raven_slot_allocation.png", title=title
        ).name,
    }


def sila_pictures(context: PictureContext, layer: int) -> dict[str, str]:
    """SILA's input gate per token, without and with a strong instruction to remember the passkey."""
    traces, marks = {}, {}
    for variant in ("no_inst", "strong_inst"):
        prompt = context.passkey(variant)
        traces[variant] = (prompt.tokens, analysis.sila_input_gate_trace(context.model, prompt.ids, layer))
        marks[variant] = prompt.needle_positions
    path = context.out / "sila_input_gate.png"
    return {"sila_input_gate": plot_gate_trace(traces, path, marks=marks, title=f"layer {layer}").name}


def sse_pictures(context: PictureContext, layer: int) -> dict[str, str]:
    """SSE's partition usage, and the singular value entropy of every partition's final state."""
    ids = context.passkey().ids
    usage = analysis.sse_partition_usage(context.model, ids, layer)
    entropy = analysis.state_singular_value_entropy(context.model, ids, layer)
    shared = context.model.model.layers[layer].self_attn.settings.shared_partition
    title = f"layer {layer}"
    return {
        "sse_partition_usage": plot_partition_usage(usage, context.out / "sse_usage.png", title=title).name,
        "sse_state_entropy": plot_state_entropy(
            {title: entropy}, context.out / "sse_state_entropy.png", shared_partition=shared
        ).name,
    }
