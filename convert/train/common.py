"""What align (stage 1, align.py) and train (stage 2, stage2.py) share: whether a model is a hybrid, which layers
were converted and their parameters, the model inputs of a batch, and the learning-rate schedule.

    is_hybrid(model)                                        # False for a plain causal LM (finetune.py trains those)
    layers = converted_layers(hybrid)                       # [0, 2, 5]: the layers whose attention became a mixer
    layers = aligned_layers(teacher, hybrid)                # those whose attention the teacher still runs
    outputs = model(**model_inputs(batch, device))          # packed rows by position_ids, padded ones by their mask
    teacher(**inputs, **teacher_inputs(teacher, packed))    # packed documents' mask, built on the device
    lr = lr_at(step, lr=1e-3, steps=200, warmup_steps=10)   # linear warmup, then cosine to 10% (or constant)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from raven_convert.surgery import start_kinds


def is_hybrid(model) -> bool:
    """Whether `model` is a converted hybrid (its config lists each layer's mixer), not a plain causal LM."""
    return getattr(model.config, "layer_mixers", None) is not None


def converted_layers(model) -> list[int]:
    """Indices of the layers whose attention became a mixer."""
    return [i for i, kind in enumerate(model.config.layer_mixers) if kind != "attention"]


def aligned_layers(teacher, hybrid) -> list[int]:
    """The converted layers of `hybrid` that align trains: those whose attention `teacher` runs. A Transformer
    teacher runs every one; a hybrid teacher, the start of a further conversion, has its own mixers in some layers,
    which the hybrid took over trained."""
    kinds = start_kinds(teacher.config)
    return [i for i in converted_layers(hybrid) if kinds[i] == "attention"]


def attention_layers(model) -> list[int]:
    """Indices of the layers that kept the source attention."""
    return [i for i, kind in enumerate(model.config.layer_mixers) if kind == "attention"]


def mixers(model) -> list[nn.Module]:
    """The converted layers' mixers, in layer order."""
    return [model.model.layers[i].self_attn for i in converted_layers(model)]


def mixer_parameters(model, layers: list[int] | None = None) -> list[nn.Parameter]:
    """Every parameter of the converted layers' mixers (train's "mixers"), or of those of `layers` (what align
    trains)."""
    chosen = mixers(model) if layers is None else [model.model.layers[i].self_attn for i in layers]
    return [p for mixer in chosen for p in mixer.parameters()]


def mixer_prefixes(model) -> tuple[str, ...]:
    """The state-dict prefixes of the mixers ("model.layers.1.self_attn."): the tensors that align changes."""
    found = {id(mixer) for mixer in mixers(model)}
    return tuple(f"{name}." for name, module in model.named_modules() if id(module) in found)


def model_inputs(batch: dict, device=None) -> dict:
    """The model inputs of a batch, on `device` (None: where they are): rows of packed documents go in as
    transformers' packed sequences (input_ids, position_ids restarting at each document), padded rows with their
    attention_mask (None when the batch has none)."""
    names = ("input_ids", "position_ids") if "position_ids" in batch else ("input_ids", "attention_mask")
    inputs = {name: batch.get(name) for name in names}
    if device is None:
        return inputs
    return {name: None if value is None else value.to(device) for name, value in inputs.items()}


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal attention within each packed document (documents [B, T]: document ids), the
    mask transformers builds for sdpa from packed position ids, built here without reading anything back."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()  # [T, T]
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def teacher_mask(model, packed, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The attention_mask for a plain model's forward (the teacher): with packed documents found ahead (`packed`,
    (documents [B, T], cu_seqlens) as find_packed_documents returns them) and sdpa attention, their mask ready-made
    (`document_mask`), which transformers would build by reading the position ids back; else `attention_mask`."""
    if isinstance(packed, tuple) and model.config._attn_implementation == "sdpa":
        return document_mask(packed[0])
    return attention_mask


def teacher_inputs(model, packed, attention_mask: torch.Tensor | None = None) -> dict:
    """The mask arguments of a frozen model's forward (align's teacher) with packed documents found ahead (`packed`:
    (documents, cu_seqlens), or None): a plain model's attention_mask (`teacher_mask`); a hybrid, the start of a
    further conversion, takes the documents as the student does (packed_documents, False: none), so that neither
    reads the position ids back."""
    if is_hybrid(model):
        return {"attention_mask": attention_mask, "packed_documents": packed if isinstance(packed, tuple) else False}
    return {"attention_mask": teacher_mask(model, packed, attention_mask)}


def to_device(tensors: dict, device) -> dict:
    """{name: tensor or None} on `device`. To a GPU from the host through pinned memory without blocking: the copy
    queues behind the GPU's work, where a copy from pageable memory would make the host wait for that work."""
    device = torch.device(device)

    def move(v):
        if v is None or device.type != "cuda" or v.device.type != "cpu":
            return None if v is None else v.to(device)
        return v.pin_memory().to(device, non_blocking=True)

    return {k: move(v) for k, v in tensors.items()}


def lr_at(step: int, lr: float, steps: int, warmup_steps: int = 0, schedule: str = "cosine") -> float:
    """Learning rate of (0-based) optimizer step `step` of `steps`: linear warmup over `warmup_steps`, then a cosine
    to 10% of `lr` at `steps` ("cosine") or `lr` ("constant"). A function of the step alone, so nothing about it
    needs saving; a resumed run must use the same `steps` for the same curve."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"schedule = {schedule!r} is not allowed; expected 'cosine' or 'constant'")
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
