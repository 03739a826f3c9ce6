"""SSE kernels: chunked GLA (`chunk_gla`, under SSE's masking form), the same over SSE's varlen entries read in place
(`chunk_gla_entries`, under its varlen form), SSE's decode step (`fused_recurrent_sse`) and a generation step from the
layer's products in one kernel (`fused_recurrent_sse_decode`); naive.py holds the PyTorch references. The forms
themselves (`sse_masking`, `sse_varlen`) are the model's, in raven_layers/sse.py."""

from .chunk import chunk_gla, chunk_gla_entries
from .fused_recurrent import fused_recurrent_sse, fused_recurrent_sse_decode

__all__ = ["chunk_gla", "chunk_gla_entries", "fused_recurrent_sse", "fused_recurrent_sse_decode"]
