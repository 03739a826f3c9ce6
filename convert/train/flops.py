"""Model FLOPs per token of the training stages and their model FLOPs utilisation (MFU), for the stage summaries.

    per_token = train_flops(student, seq_len, teacher)   # student forward and backward, teacher forward under kd
    per_token = align_flops(teacher, hybrid, seq_len)    # teacher forward, the mixers' forward and backward
    mfu(tokens_per_second * per_token, device)           # share of the device's dense bf16 peak (None: unknown)

The count follows PaLM's (Chowdhery et al. 2022, Appendix B): a forward pass costs 2 FLOPs per weight of every
matrix product (the linear layers, the output head included, the embedding lookup not) plus 4 n_heads d_head T per
token in each layer that attends over T tokens (scores and values, the causal mask not discounted; a sliding-window
layer attends over min(window, T)); a backward pass costs twice its forward. The mixers count their linear layers
only: their state updates grow with T like a window of their state's size, small beside the projections at these
widths. MFU is the model's FLOPs per second over the GPU's dense bf16 peak, so recomputation (gradient
checkpointing) and padding count as waste, as in PaLM.
"""

from __future__ import annotations

import torch
from torch import nn

from raven_convert.train.common import aligned_layers, is_hybrid

# dense bf16 tensor-core peak, FLOP/s, by a name the device reports (torch.cuda.get_device_name)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "4090": 165e12}


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _attention_layers(model) -> list[int | None]:
    """The window (None: all T tokens) of every layer of `model` that attends over its past."""
    config = model.config
    if not is_hybrid(model):
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        return [window] * config.num_hidden_layers
    windows = getattr(model.model, "windows", None) or [None] * config.num_hidden_layers
    return [w for kind, w in zip(config.layer_mixers, windows) if kind == "attention"]


def forward_flops(model, seq_len: int) -> float:
    """FLOPs of one forward pass per token of rows of `seq_len` tokens (see the module docstring). A model whose
    config names no attention heads (a custom recurrent model, say) counts its linear layers only."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 2 * _linear_weights(model)
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    attention = sum(4 * width * min(w or seq_len, seq_len) for w in _attention_layers(model))
    return 2 * _linear_weights(model) + attention


def train_flops(student, seq_len: int, teacher=None) -> float:
    """Per token of stage 2 (or a fine-tune): the student's forward and backward, and the teacher's forward when it
    distils (teacher given)."""
    return 3 * forward_flops(student, seq_len) + (0 if teacher is None else forward_flops(teacher, seq_len))


def align_flops(teacher, hybrid, seq_len: int) -> float:
    """Per token of align: the teacher's forward without its output head (align needs its layers' inputs and
    outputs, and has the head compute one position per row) and each aligned mixer's forward and backward on its
    layer's input."""
    mixers = sum(_linear_weights(hybrid.model.layers[i].self_attn) for i in aligned_layers(teacher, hybrid))
    head = teacher.get_output_embeddings()
    head_flops = 2 * head.weight.numel() if isinstance(head, nn.Linear) else 0
    return forward_flops(teacher, seq_len) - head_flops + 3 * 2 * mixers


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak of a CUDA device whose name PEAK_BF16 knows, else None."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def mfu(flops_per_second: float, device: torch.device | str, processes: int = 1) -> float | None:
    """flops_per_second (of all `processes`, one GPU each) over their summed peak; None where the peak is unknown."""
    peak = peak_flops(device)
    return None if peak is None else flops_per_second / (peak * processes)


def mfu_text(value: float | None) -> str:
    """ " | MFU 12.3%" for a progress line, "" where the peak is unknown."""
    return "" if value is None else f" | MFU {value:.1%}"
