"""A model's decode step over a `StaticHybridCache`, captured once as a CUDA graph and replayed for every token.

Eager decoding launches a few hundred small kernels per token from Python; for a small model the GPU waits on the
host most of the time. A CUDA graph replays the same launches with one call. `DecodeGraph` captures
`step(input_ids [B, 1]) -> logits [B, 1, V]`, which reads the token ids from a buffer owned here and reads and
writes only the cache's preallocated buffers, so every replay continues from where the last one left off:

- the first call runs on a side stream: it compiles the step (torch.compile, when the model compiles it) and the
  Triton kernels and warms cuBLAS, and its result is the real step's result;
- the second call is captured, then replayed; every later call is a replay.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


class DecodeGraph:
    def __init__(
        self,
        step: Callable[[torch.Tensor], torch.Tensor],
        batch_size: int,
        device: torch.device,
        fallback: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """`fallback`: the step to capture instead if the first call of `step` raises (a compiled step whose
        compilation fails), with a warning that names the error."""
        self.step, self.fallback = step, fallback
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, 1, V], written by every replay
        self.warm = False

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.data_ptr() != self.input_ids.data_ptr():  # a step that wrote its next input there needs none
            self.input_ids.copy_(input_ids)
        if self.graph is None and not self.warm:
            side = torch.cuda.Stream(device=self.input_ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.warm_up()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return logits
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step(self.input_ids)
        self.graph.replay()
        return self.logits  # the graph's buffer, which the next replay overwrites: callers copy what they keep

    def warm_up(self) -> torch.Tensor:
        if self.fallback is None:
            return self.step(self.input_ids)
        try:
            return self.step(self.input_ids)  # compiles before it runs: a failure has changed no buffer
        except Exception as error:
            warnings.warn(
                f"compiling the decode step failed ({type(error).__name__}: {error}); decoding with CUDA graphs of "
                "the eager step instead (set model.compile_decode = False to skip compiling)",
                stacklevel=3,
            )
            self.step, self.fallback = self.fallback, None
            return self.step(self.input_ids)
