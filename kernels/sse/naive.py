"""PyTorch references of the SSE kernels (they live beside the mixer, in raven_layers/sse_forms.py)."""

from raven_layers.sse_forms import (
    chunk_gla_entries_reference,
    chunk_gla_reference,
    gla_recurrent,
    sse_masking,
    sse_recurrent,
    sse_varlen,
)

__all__ = [
    "chunk_gla_entries_reference",
    "chunk_gla_reference",
    "gla_recurrent",
    "sse_masking",
    "sse_recurrent",
    "sse_varlen",
]
