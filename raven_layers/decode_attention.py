"""Attention of one new token per row over a `StaticHybridCache` buffer: what a kept attention layer runs when it
decodes.

transformers' SDPA path expands the key/value heads to the query heads (`repeat_kv`) and reads every slot of the
preallocated buffer under a mask, which at batch 32 and 16K reads and writes several times the cache per step.
Here each key/value head is read once for its group of query heads, and the Triton kernel (`raven_kernels.attention`)
reads only the slots written so far, split over the GPU (flash-decoding). The PyTorch form below is the
reference, and what runs where the kernels are not installed; it must import nothing but torch and transformers.

The hybrid selects it for the decode steps of a static cache only (`static_decode_attention`, under the
implementation name `DECODE_ATTENTION`); prefill keeps the model's own attention implementation.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers import AttentionInterface

from .backend import kernel_module

DECODE_ATTENTION = "raven_static_decode"
KERNELS = "raven_kernels.attention"  # the Triton decode-attention kernel (see backend.py)


class DecodeSlots(NamedTuple):
    """The attention mask of a decode step over a buffer of S slots."""

    valid: torch.Tensor  # [B, S] bool: the slot holds a real token of the row (the new one included)
    step: torch.Tensor  # [1] long: tokens written before this step; slots [0, min(step + 1, S)) may be valid


def decode_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, step: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, 1, d], k and v [B, Hkv, S, d], valid [B, S] -> o [B, 1, Hq, d] in q's dtype (softmax in float32).

    Query head h reads key/value head h // (Hq / Hkv), as `repeat_kv` maps them; `step` is unused (the kernel's
    bound on the slots to read; `valid` already excludes the others).
    """
    B, Hq, _, d = q.shape
    Hkv, dtype = k.shape[1], q.dtype
    q = q.reshape(B, Hkv, Hq // Hkv, d).float()  # [B, Hkv, G, d]
    scores = torch.einsum("bhgd,bhsd->bhgs", q, k.float()) * scale  # [B, Hkv, G, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), v.float())  # [B, Hkv, G, d]
    return o.reshape(B, 1, Hq, d).to(dtype)


def static_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [B, Hq, 1, d], key and value the layer's buffers
    [B, Hkv, S, d], attention_mask a `DecodeSlots`. Returns (o [B, 1, Hq, d], None)."""
    if not isinstance(attention_mask, DecodeSlots) or query.shape[2] != 1:
        raise ValueError(f"{DECODE_ATTENTION} attention runs decode steps over a StaticHybridCache only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernels = kernel_module(KERNELS, query)
    run = kernels.decode_attention if kernels is not None else decode_attention_torch
    return run(query, key, value, attention_mask.valid, attention_mask.step, scale), None


AttentionInterface.register(DECODE_ATTENTION, static_decode_attention)


@contextmanager
def decode_attention(config):
    """Within the block, the kept attention layers (which read `config._attn_implementation` when they run) call
    `static_decode_attention`; the model's own implementation is restored after."""
    previous = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
