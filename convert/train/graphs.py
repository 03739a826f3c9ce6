"""A training step replayed as a CUDA graph: align's (the teacher's forward with its taps, every mixer's forward and
backward) or stage 2's (the student's forward, loss and backward), with clipping and the optimizer's update,
captured once per input layout and replayed, so that a step the host cannot launch fast enough (thousands of small
kernels for a 135M model) costs the host one launch.

    steps = CapturedStep(run_step)          # run_step({name: device tensor}) -> a device tensor, no host sync
    out = steps(inputs)                     # eager for the first `warmup` steps of a layout, then a graph

What a graph needs of the step, and how align and stage 2 give it:
- Nothing read back to the host and nothing decided on the host from the data: the mixers must say so in their
  declaration (`MixerSpec.graph_safe`: SILA's kernels lay packed documents out from shapes alone), the loss is read
  one step later from a copy, and a non-finite step's update is skipped on the device (fused AdamW's found_inf).
- The same shapes each time: rows are B x T already; the documents' offsets cu_seqlens [S + 1] vary with S, so they
  are padded with empty documents: stage 2, whose batches are known before it starts, to the most any of its
  batches holds (`document_slots`), one graph; align to a multiple of `DOCUMENT_BUCKET` (`pad_documents`), one
  graph per bucket; rows of one document each are documents too. Each new layout costs an eager step, a capture
  and, for the compiled parts, a compilation.
- Tensors that outlive a replay at fixed addresses: gradients zeroed in place (never set to None) and the
  optimizer's state, both made by the eager warm-up step, and its learning rate a device tensor (`optimizer_mode`,
  filled before each step by `set_lr`).
Every graph shares one memory pool: they never run at once, and what one keeps (its output) stays referenced.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from raven_convert.train.common import is_hybrid, mixers, to_device
from raven_convert.train.compiling import CompileSetting
from raven_convert.train.data import PackedDataset, batch_rows
from raven_kernels.chunked import choosing_on_device
from raven_layers.masks import document_starts, find_packed_documents

DOCUMENT_BUCKET = 64  # documents per row layout are padded up to a multiple of this: a new graph every 64 documents


def pad_documents(cu_seqlens: torch.Tensor, bucket: int = DOCUMENT_BUCKET, slots: int | None = None) -> torch.Tensor:
    """Offsets of S packed documents [S + 1] padded with empty documents at the end (the last offset repeated), the
    same tokens cut the same way in fewer shapes: to `slots` + 1 offsets where given and S <= slots (one shape for a
    whole run), else to S' + 1 where S' is the next multiple of `bucket`."""
    if bucket < 1:
        raise ValueError(f"bucket = {bucket}; expected a positive number of documents")
    documents = cu_seqlens.numel() - 1
    size = slots if slots is not None and documents <= slots else math.ceil(documents / bucket) * bucket
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(size - documents)])


def documents_per_row(position_ids: torch.Tensor) -> torch.Tensor:
    """How many documents each row [N, T] of position ids (any integer dtype) opens, as find_packed_documents cuts
    them [N] (`document_starts`). Blocks of rows at a time, so that a large dataset's rows are never all widened at
    once."""
    counts = [document_starts(b).sum(1) for b in position_ids.split(1024)]
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long)


def document_slots(held: torch.Tensor, bucket: int = DOCUMENT_BUCKET) -> int:
    """The document slots that fit every batch of a run, from the documents of each of its rows `held` [steps, B]:
    the most documents one batch holds, rounded up to a multiple of `bucket`, so that every step has one layout."""
    return math.ceil(int(held.sum(1).max()) / bucket) * bucket


def host_documents(batch: dict, bucket: int | None = None, slots: int | None = None):
    """find_packed_documents of a host batch's position ids (None without them, or with one document per row), the
    offsets padded to `slots` or else to a multiple of `bucket` documents when either is given (`pad_documents`),
    and then rows of one document each are documents too, so that every batch a graph replays has the same layout
    (a batch without documents would need a capture of its own, and its glue compiled again): found on the host, so
    that no step reads the position ids back from the GPU."""
    if "position_ids" not in batch:
        return None
    found = find_packed_documents(batch["position_ids"])
    if bucket is None and slots is None:
        return found
    if found is None:
        B, T = batch["position_ids"].shape
        found = torch.zeros(B, T, dtype=torch.long), torch.arange(0, B * T + 1, T, dtype=torch.int32)
    return found[0], pad_documents(found[1], bucket or DOCUMENT_BUCKET, slots)


def run_document_slots(dataset, batch_size: int, seed: int, micro_batches: int, processes: int = 1) -> int | None:
    """The document slots every graphed step of a stage 2 run pads its documents to (`document_slots` over every
    process's `batch_size` rows of the `micro_batches` global batches the run reads with `seed`): one layout, one
    graph, the same on every process without a collective, as graphs holding NCCL collectives need. None for a
    dataset that is not a PackedDataset, whose steps are padded to buckets (a graph each)."""
    if not isinstance(dataset, PackedDataset):
        return None
    batches = batch_rows(len(dataset), batch_size * processes, seed, micro_batches).view(-1, batch_size)  # [shares, B]
    read, where = batches.unique(return_inverse=True)  # the rows read, once each
    return document_slots(documents_per_row(dataset.tensors["position_ids"][dataset.rows[read]])[where])


def graph_inputs(batch: dict, token_weights, device, slots: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """A host micro-batch as a step graph's inputs on `device`, copied without blocking: its fields but "index",
    the documents packed in its rows ("documents" and "cu_seqlens", padded to `slots`, or else to a bucket:
    host_documents), its token weights ("weights": its rows of a table, or a function's weights of it,
    computed eagerly on `device` before the step's replay, as the extend stage's teacher does); and its real
    tokens, counted on the host."""
    tensors = {k: v for k, v in batch.items() if k != "index"}
    found = host_documents(batch, DOCUMENT_BUCKET, slots)
    if found is not None:
        tensors["documents"], tensors["cu_seqlens"] = found
    if torch.is_tensor(token_weights):
        tensors["weights"] = token_weights[batch["index"]]
    tensors = to_device(tensors, device)
    if callable(token_weights):
        tensors["weights"] = token_weights(tensors).float()
    return tensors, int(batch["attention_mask"].sum())


class StepInputs:
    """A graphed stage 2's step inputs, laid out one step ahead: `prepare` draws the next host micro-batch from
    `batches` and lays it out (`graph_inputs`); `take` hands the prepared inputs to the step (preparing them first
    where nothing is). With token weights computed from each batch (extend's teacher forward and attention
    distances), `prepare` runs on a side CUDA stream, so that its kernels run beside the step graph launched just
    before it instead of after it: a SILA step's recurrences occupy one SM per sequence and head and leave the rest
    idle (docs/lab/2026-12-01-round-23-every-layer-and-extends-step.md). Elsewhere, or with `beside=False` (for a
    profile of what the overlap buys), it runs in place."""

    def __init__(self, batches, token_weights, device, slots: int | None = None, beside: bool = True):
        self.batches, self.token_weights, self.slots = batches, token_weights, slots
        self.device = torch.device(device)
        beside = beside and callable(token_weights) and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if beside else None
        self.ready: tuple | None = None  # (inputs, real tokens, the side stream's event once they are done)
        self.fence: torch.cuda.Event | None = None  # the main stream's work the next preparation comes after

    def prepare(self) -> None:
        host = next(self.batches)
        if self.stream is None:
            self.ready = (*graph_inputs(host, self.token_weights, self.device, self.slots), None)
            return
        main = torch.cuda.current_stream(self.device)
        # after what the main stream had queued when the last inputs were taken (at first: everything, such as the
        # teacher's weights cast for the loop), not after the step it has just launched
        if self.fence is not None:
            self.stream.wait_event(self.fence)
        else:
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            tensors, tokens = graph_inputs(host, self.token_weights, self.device, self.slots)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ready = (tensors, tokens, done)

    def take(self) -> tuple[dict[str, torch.Tensor], int]:
        if self.ready is None:
            self.prepare()
        tensors, tokens, done = self.ready
        self.ready = None
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            for tensor in tensors.values():  # made on the side stream, read on the main one: not reused before
                tensor.record_stream(main)
            self.fence = torch.cuda.Event()
            self.fence.record(main)
        return tensors, tokens


def resolve_graphs(setting: CompileSetting, model, device, world: int = 1, collectives: bool = False) -> bool:
    """Whether a training stage captures its steps as CUDA graphs: "auto" does where it can (a CUDA device, every
    converted mixer declared `graph_safe`, one process or a step that makes its processes' reductions itself:
    `collectives`, holds_collectives); True demands it and raises ValueError naming what stands in the way. Under
    ddp the graphs pay for every stage: train 4.14x one GPU's tokens/s on four against 3.36x eager, align 1.51x
    on two at the same global batch against 1.26x (docs/SCALE_OUT.md)."""
    if setting not in ("auto", True, False):
        raise ValueError(f"cuda_graphs = {setting!r} is not allowed; expected 'auto', true or false")
    if setting is False:
        return False
    converted = mixers(model) if is_hybrid(model) else []
    unsafe = sorted({type(m).__name__ for m in converted if not _spec_of(m).graph_safe})
    reasons = launch_obstacles(device, world, collectives)
    if unsafe:
        reasons.append(f"the mixers {unsafe} are not declared graph_safe (MixerSpec.graph_safe)")
    if reasons and setting is True:
        raise ValueError(f"cuda_graphs = true cannot be honoured: {'; '.join(reasons)}; use 'auto' or false")
    return not reasons


def launch_obstacles(device, world: int, collectives: bool = False) -> list[str]:
    """What about the launch stands in the way of CUDA graphs (each a phrase; none: they can run). Several processes
    do only with `collectives`: a stage whose step makes its all-reduces itself, each captured in the graph (NCCL
    collectives), and whose processes capture and replay the same layouts at the same steps (align, train and
    extend under ddp; `agreed_slots`, `run_document_slots`)."""
    reasons = []
    if torch.device(device).type != "cuda":
        reasons.append(f"the device is {torch.device(device).type}, not cuda")
    if world != 1 and not collectives:
        reasons.append(f"the run has {world} processes (graphs are captured for one; on several only under ddp)")
    return reasons


def holds_collectives(stage: str, strategy: str) -> bool:
    """Whether `stage`'s step makes its processes' all-reduces itself under `strategy`, so that its graphs can hold
    them (`launch_obstacles`): under ddp, align averages the mixers' gradients without a DistributedDataParallel
    wrapper (Parallel.average_gradients), and stage 2 (train, extend) does so too when it replays its steps as
    graphs, training its model unwrapped."""
    return stage in ("align", "train", "extend") and strategy == "ddp"


def agreed_slots(batch: dict, world: int, bucket: int = DOCUMENT_BUCKET) -> int | None:
    """The document slots every process pads its share of a global host batch to (its `world` equal slices of
    rows): the most documents one share holds, rounded up to a multiple of `bucket`, the same on every process
    without a collective, so that all capture and replay one layout at one step, as graphs holding NCCL
    collectives must. None without position ids (no documents)."""
    if "position_ids" not in batch:
        return None
    held = documents_per_row(batch["position_ids"]).view(world, -1)  # [processes, rows each]
    return document_slots(held, bucket)


def _spec_of(mixer: nn.Module):
    from raven_layers.registry import get_mixer

    return get_mixer(mixer.settings.NAME)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to `lr` times its `lr_scale` (1 where it has none; lora.lr_groups): in place where
    it is a tensor (a graph reads it there), else assigned."""
    for group in optimizer.param_groups:
        rate = lr * group.get("lr_scale", 1.0)
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate


def optimizer_mode(optimizer: torch.optim.Optimizer, graphs: bool, device) -> None:
    """Every param group as a graph holds its update (a fused AdamW's, capturable, its learning rate a device
    tensor that `set_lr` fills in place) or as an eager step runs it (a float, not capturable). Again after
    load_state_dict, which takes the saved groups' values: a checkpoint of either mode resumes in the other."""
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device) if graphs else lr
        group["capturable"] = graphs


class CapturedStep:
    """`step` (a function of a dict of device tensors returning a device tensor, launching work without ever waiting
    for it) run eagerly for the first `warmup` calls with each layout of inputs (names, shapes, dtypes), on a side
    stream as CUDA graph capture wants and with the kernels choosing their forms on the device as they will inside
    the capture; then captured once for that layout and replayed: the inputs are copied into
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
        with torch.cuda.stream(side), choosing_on_device():  # the capture's kernel variants compile here, not in it
            output = self.step(inputs)
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()  # the step's temporaries, freed on the side stream, are done with before reuse
        torch.cuda.empty_cache()  # blocks cached for the side stream would serve neither the main stream nor a graph
        return output

    def _capture(self, key: tuple, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        static = {name: tensor.clone() for name, tensor in inputs.items()}  # this step's inputs, outside the pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # records the step without running it
            output = self.step(static)
        self.graphs[key] = (graph, static, output)
        graph.replay()  # so this step runs once, as every other does
        return output


def untimed_steps(captured: CapturedStep | None) -> int:
    """Steps a stage's tokens/s leaves out: the first (it compiles kernels and allocates) and, with graphs, the
    warm-up steps and the capture of the first layout."""
    return 1 + (captured.warmup if captured is not None else 0)


def read_later(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of a step's device values the host can read once the returned event has passed (`read_back`; on the
    CPU: the tensor itself, and no event), so that queuing the copy does not wait for the step."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def read_back(host: torch.Tensor, copied: torch.cuda.Event | None) -> list[float]:
    """The values `read_later` copied, once they have arrived."""
    if copied is not None:
        copied.synchronize()
    return host.tolist()
