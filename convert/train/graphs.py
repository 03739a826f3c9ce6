"""A training step replayed as a CUDA graph: align's whole step (the teacher's forward with its taps, every mixer's
forward and backward, clipping, the optimizer's update) captured once per input layout and replayed, so that a step
the host cannot launch fast enough (thousands of small kernels for a 135M model) costs the host one launch.

    steps = CapturedStep(run_step)          # run_step({name: device tensor}) -> a device tensor, no host sync
    out = steps(inputs)                     # eager for the first `warmup` steps of a layout, then a graph

What a graph needs of the step, and how align gives it:
- Nothing read back to the host and nothing decided on the host from the data: the mixers must say so in their
  declaration (`MixerSpec.graph_safe`: SILA's kernels lay packed documents out from shapes alone), the loss is read
  one step later from a copy, and a non-finite step's update is skipped on the device (fused AdamW's found_inf).
- The same shapes each time: rows are B x T already; the documents' offsets cu_seqlens [S + 1] vary with S, so they
  are padded with empty documents to a multiple of `DOCUMENT_BUCKET` (`pad_documents`), one graph per bucket.
- Tensors that outlive a replay at fixed addresses: gradients allocated once and zeroed in place, the optimizer's
  learning rate a device tensor (fill_ before each step), its state created by the eager warm-up steps.
Every graph shares one memory pool: they never run at once, and what one keeps (its output) stays referenced.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from raven_convert.train.common import mixers
from raven_convert.train.compiling import CompileSetting

DOCUMENT_BUCKET = 64  # documents per row layout are padded up to a multiple of this: a new graph every 64 documents


def pad_documents(cu_seqlens: torch.Tensor, bucket: int = DOCUMENT_BUCKET) -> torch.Tensor:
    """Offsets of S packed documents [S + 1] padded with empty documents at the end, to S' + 1 offsets where S' is
    the next multiple of `bucket` (the last offset repeated): the same tokens cut the same way, in fewer shapes."""
    if bucket < 1:
        raise ValueError(f"bucket = {bucket}; expected a positive number of documents")
    documents = cu_seqlens.numel() - 1
    extra = math.ceil(documents / bucket) * bucket - documents
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(extra)])


def resolve_graphs(setting: CompileSetting, model, device, world: int = 1) -> bool:
    """Whether align captures its steps as CUDA graphs: "auto" does where it can (a CUDA device, one process, every
    converted mixer declared `graph_safe`); True demands it and raises ValueError naming what stands in the way."""
    if setting not in ("auto", True, False):
        raise ValueError(f"cuda_graphs = {setting!r} is not allowed; expected 'auto', true or false")
    if setting is False:
        return False
    unsafe = sorted({type(m).__name__ for m in mixers(model) if not _spec_of(m).graph_safe})
    reasons = []
    if torch.device(device).type != "cuda":
        reasons.append(f"the device is {torch.device(device).type}, not cuda")
    if world != 1:
        reasons.append(f"the run has {world} processes (graphs are captured for one)")
    if unsafe:
        reasons.append(f"the mixers {unsafe} are not declared graph_safe (MixerSpec.graph_safe)")
    if reasons and setting is True:
        raise ValueError(f"cuda_graphs = true cannot be honoured: {'; '.join(reasons)}; use 'auto' or false")
    return not reasons


def _spec_of(mixer: nn.Module):
    from raven_layers.registry import get_mixer

    return get_mixer(mixer.settings.NAME)


def graph_optimizer(params: list[nn.Parameter], lr: float, weight_decay: float, device) -> torch.optim.AdamW:
    """Fused AdamW whose update a graph can hold: capturable, its learning rate a device tensor (`set_lr`), every
    gradient allocated now (zeroed in place by each step) so that replays find them where the capture did."""
    for p in params:
        p.grad = torch.zeros_like(p)
    lr_tensor = torch.tensor(lr, dtype=torch.float32, device=device)
    return torch.optim.AdamW(params, lr=lr_tensor, weight_decay=weight_decay, fused=True, capturable=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to `lr`: in place where it is a tensor (a graph reads it there), else assigned."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def restore_graph_settings(optimizer: torch.optim.Optimizer, device) -> None:
    """After load_state_dict, which takes the saved groups' `lr` and `capturable` (a checkpoint of an eager run has
    a float lr and capturable False): the graph optimizer's again."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        group["capturable"] = True


class CapturedStep:
    """`step` (a function of a dict of device tensors returning a device tensor, launching work without ever waiting
    for it) run eagerly for the first `warmup` calls with each layout of inputs (names, shapes, dtypes), on a side
    stream as CUDA graph capture wants; then captured once for that layout and replayed: the inputs are copied into
    the graph's own tensors and its output, the same tensor at every replay, is returned. Copy it before the next
    call with this layout."""

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], torch.Tensor], warmup: int = 1):
        if warmup < 1:
            raise ValueError(f"warmup = {warmup}; a layout needs at least one eager step before its capture")
        self.step, self.warmup = step, warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.seen: Counter = Counter()
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def layout(inputs: dict[str, torch.Tensor]) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items()))

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        key = self.layout(inputs)
        if key in self.graphs:
            graph, static, output = self.graphs[key]
            for name, tensor in inputs.items():
                static[name].copy_(tensor, non_blocking=True)
            graph.replay()
            return output
        if self.seen[key] < self.warmup:
            self.seen[key] += 1
            return self._eager(inputs)
        return self._capture(key, inputs)

    def _eager(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            output = self.step(inputs)
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()  # the step's temporaries, freed on the side stream, are done with before reuse
        return output

    def _capture(self, key: tuple, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        static = {name: tensor.clone() for name, tensor in inputs.items()}  # this step's inputs, outside the pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # records the step without running it
            output = self.step(static)
        self.graphs[key] = (graph, static, output)
        graph.replay()  # so this step runs once, as every other does
        return output
