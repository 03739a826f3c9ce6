"""A model's decode step over a `StaticHybridCache`, captured once as a CUDA graph and replayed for every token.

Eager decoding launches a few hundred small kernels per token from Python; for a small model the GPU waits on the
host most of the time. A CUDA graph replays the same launches with one call. `DecodeGraph` captures
`step(input_ids [B, 1]) -> logits [B, 1, V]`, which reads the token ids from a buffer owned here and reads and
writes only the cache's preallocated buffers, so every replay continues from where the last one left off:

- the first call runs eagerly on a side stream: it compiles the Triton kernels and warms cuBLAS, and its result
  is the real step's result;
- the second call is captured, then replayed; every later call is a replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DecodeGraph:
    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], batch_size: int, device: torch.device):
        self.step = step
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, 1, V], written by every replay
        self.warm = False

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        if self.graph is None and not self.warm:
            side = torch.cuda.Stream(device=self.input_ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.step(self.input_ids)
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return logits
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step(self.input_ids)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the buffer; callers may keep what they got
