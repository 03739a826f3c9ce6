"""SSE kernels: chunked GLA (`chunk_gla`), SSE's parallel forms on it (`chunk_sse`) and its decode step
(`fused_recurrent_sse`); `naive` holds the PyTorch references."""

from .chunk import chunk_gla, chunk_sse
from .fused_recurrent import fused_recurrent_sse

__all__ = ["chunk_gla", "chunk_sse", "fused_recurrent_sse"]
