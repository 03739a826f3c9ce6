"""Packed sequences cut into chunks for chunk-parallel kernels, laid out without a host sync.

A chunk-parallel grid needs, per program, its sequence and its chunk within that sequence. The exact chunk count,
sum_s ceil(len_s / chunk), lives on the GPU; reading it back would stall the host once per layer and pass. So the
grid has a bound instead, ceil(num_tokens / chunk) + S chunks (each sequence adds at most one partial chunk): the
programs past the last real chunk get the last sequence and a chunk index past its end, and the kernels return at
once for them (their first row is at or past the sequence's length).
"""

from __future__ import annotations

import torch
import triton


def chunk_layout(cu_seqlens: torch.Tensor, num_tokens: int, chunk: int, total: int | None = None):
    """For sequences packed at offsets cu_seqlens [S + 1] (num_tokens tokens in all): each program's sequence and
    chunk within it ([C] int32 each), each sequence's first chunk [S + 1] int32, and C (`total`, or the bound
    ceil(num_tokens / chunk) + S). The last sequence takes the spare programs, with chunk indices past its end."""
    S = cu_seqlens.numel() - 1
    counts = (cu_seqlens.diff() + chunk - 1) // chunk  # [S]
    first = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))  # [S + 1]
    if total is None:
        total = triton.cdiv(num_tokens, chunk) + S if S else 0
    chunks = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    seq = torch.searchsorted(first[1:], chunks, right=True, out_int32=True).clamp_max_(max(S - 1, 0))
    return seq, chunks - first.gather(0, seq.long()), first, total
