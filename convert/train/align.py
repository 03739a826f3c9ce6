"""Stage 1: align every converted layer with the teacher's attention (SILA Appendix C.3; LoLCATs' attention
transfer, RADLADS' step 1).

The teacher is frozen. One teacher forward per batch records, for each converted layer, the input its attention
received and the output it produced; each mixer then sees that same input and is trained to reproduce that output
(mean squared error over real tokens). All converted layers train together and only mixer parameters change. In a
further conversion the teacher is the hybrid it started from (its hidden states are what the new mixers will see),
and only the layers it still runs as attention are aligned (common.aligned_layers); the mixers it had stay as they
are.

    history = align(teacher, hybrid, batches, steps=200, lr=1e-3)   # per-step, per-layer losses
"""

from __future__ import annotations

import inspect
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.profiler import record_function

from raven_convert.console import eta
from raven_convert.train.checkpoint import latest_checkpoint, save_checkpoint
from raven_convert.train.common import (
    aligned_layers,
    lr_at,
    mixer_parameters,
    model_inputs,
    teacher_inputs,
    to_device,
)
from raven_convert.train.compiling import CompileSetting, compiled_parts, resolve_compile
from raven_convert.train.distributed import (
    Parallel,
    full_optimizer_state,
    full_tensor,
    shard_like,
    sharded_optimizer_state,
)
from raven_convert.train.flops import align_flops, mfu, mfu_text
from raven_convert.train.graphs import (
    DOCUMENT_BUCKET,
    CapturedStep,
    agreed_slots,
    holds_collectives,
    host_documents,
    optimizer_mode,
    read_back,
    read_later,
    resolve_graphs,
    set_lr,
    untimed_steps,
)
from raven_convert.train.losses import alignment_mse, mixers_aux_loss
from raven_convert.train.precision import frozen_linears_in
from raven_layers.masks import find_packed_documents


@contextmanager
def attention_taps(teacher, layers: list[int]) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Record {layer: (attention input [B, T, hidden], attention output [B, T, hidden])} during teacher forwards."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def record(module, args, kwargs, output):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[i] = (x.detach(), output[0].detach())

        return record

    handles = [teacher.model.layers[i].self_attn.register_forward_hook(hook(i), with_kwargs=True) for i in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_taps(
    teacher, layers: list[int], input_ids, attention_mask=None, position_ids=None, packed=None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (attention input [B, T, hidden], attention output [B, T, hidden])} of one teacher forward; `packed`
    as alignment_losses takes it, found already."""
    with attention_taps(teacher, layers) as captured:
        teacher(
            input_ids=input_ids,
            **teacher_inputs(teacher, packed, attention_mask),  # [B, 1, T, T] for packed documents (sdpa)
            position_ids=position_ids,
            use_cache=False,
            **_one_logit(teacher),
        )
    return captured


def resolved_packed(packed, position_ids):
    """`packed` as alignment_losses takes it, with "auto" resolved: the documents found in `position_ids` (None
    without them, or with one document per row)."""
    if packed == "auto":
        return None if position_ids is None else find_packed_documents(position_ids)
    return packed


def calibrate_mixers(teacher, hybrid, layers: list[int], batch: dict, parallel: Parallel) -> None:
    """Give the mixers of `layers` that fit initial parameters to their inputs (Mixer.calibrates) the teacher's
    inputs to their layers on this process's rows of `batch` (align's first), padding left out. Statistics are
    averaged over the processes, so every process fits the same values."""
    mixers = {i: hybrid.model.layers[i].self_attn for i in layers}
    wanting = [i for i, mixer in mixers.items() if mixer.calibrates]
    if not wanting:
        return
    inputs, packed = step_inputs(_share(batch, parallel), parallel.device)
    mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
    captured = teacher_taps(teacher, wanting, inputs["input_ids"], mask, positions, resolved_packed(packed, positions))
    for i in wanting:
        x = captured[i][0]  # [B, T, hidden]
        x = x.flatten(0, 1) if mask is None else x[mask.bool()]  # [N, hidden], real tokens only
        mixers[i].calibrate(x, parallel.mean)
    parallel.print(f"[align] fitted the initial parameters of layers {wanting} to the teacher's inputs")


def _one_logit(teacher) -> dict:
    """The keyword that has a causal LM compute its head for the last position only (transformers'
    `logits_to_keep`), where its forward takes it: the taps need the layers, not the [B, T, vocab] logits."""
    forward = inspect.signature(type(teacher).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in forward else {}


def step_inputs(
    batch: dict, device, bucket: int | None = None, slots: int | None = None
) -> tuple[dict, tuple[torch.Tensor, torch.Tensor] | None | str]:
    """(model inputs, `packed` of alignment_losses) of a batch on the host, on `device`: packed documents are found
    in the host's position ids and everything is copied without blocking, so that a step never waits for the GPU.
    `bucket`: the documents' offsets padded with empty documents to a multiple of it (or to `slots`), rows of one
    document each marked as documents too: one layout for a graph (graphs.host_documents)."""
    packed = "auto"  # padded rows: nothing to find
    if "position_ids" in batch and batch["position_ids"].device.type == "cpu":
        found = host_documents(batch, bucket, slots)
        layout = {} if found is None else dict(zip(("documents", "cu_seqlens"), found))
        packed = tuple(to_device(layout, device).values()) or None
    return to_device(model_inputs(batch), device), packed


def alignment_losses(
    teacher, hybrid, input_ids, attention_mask=None, position_ids=None, packed="auto", backward=False
) -> dict[int, torch.Tensor]:
    """Per aligned layer (common.aligned_layers), the MSE between its mixer and the teacher's attention on the
    teacher's own inputs.
    `backward`: each layer's loss (with its balance loss) is backpropagated as soon as it is computed, and returned
    detached, so only one layer's activations are held at a time; the gradients are those of the summed loss, as
    no parameter reaches two layers' losses.

    Padding (attention_mask == 0) counts neither as input to the mixers' states nor in the mean. Rows of packed
    documents come with position_ids restarting at each document and no attention_mask: the teacher's attention
    then stays within each document (transformers' packed-sequence masks) and so does every mixer's state.
    `packed`: find_packed_documents(position_ids) on the inputs' device, computed ahead (align reads it from the
    batch on the host, so that the step never waits for the GPU to find the documents); "auto": found here. With
    packed documents an sdpa teacher gets their mask ready-made (common.teacher_inputs), which transformers would
    find by reading the position ids back.
    """
    if attention_mask is not None and position_ids is not None:
        raise ValueError("pass attention_mask (padded rows) or position_ids (packed documents), not both")
    packed = resolved_packed(packed, position_ids)
    layers = aligned_layers(teacher, hybrid)
    with record_function("align.teacher"):
        captured = teacher_taps(teacher, layers, input_ids, attention_mask, position_ids, packed)
    real = None if attention_mask is None else attention_mask.bool()  # [B, T]
    extra = {"padding_mask": real} if packed is None else {"cu_seqlens": packed[1]}
    losses = {}
    with record_function("align.mixers"):
        for i in layers:
            x, y = captured[i]
            mixer = hybrid.model.layers[i].self_attn
            out, _ = mixer(x.to(hybrid.dtype), **extra)
            losses[i] = alignment_mse(out, y, real)
            if backward:
                aux = mixer.aux_loss
                (losses[i] if aux is None else losses[i] + aux.float()).backward()
                losses[i] = losses[i].detach()
    return losses


@torch.no_grad()
def validation_losses(teacher, hybrid, batches: Iterable[dict]) -> dict:
    """Mean alignment MSE over held-out batches: {"loss": sum over layers, "layers": {layer: mse}}."""
    was_training = hybrid.training
    hybrid.eval()
    sums, count = {}, 0
    try:
        for batch in batches:
            for i, loss in alignment_losses(teacher, hybrid, **model_inputs(batch, teacher.device)).items():
                sums[i] = sums.get(i, 0.0) + loss.item()
            count += 1
    finally:
        hybrid.train(was_training)
    if not count:
        raise ValueError("validation_losses needs at least one batch")
    layers = {i: v / count for i, v in sums.items()}
    return {"loss": sum(layers.values()), "layers": layers}


def _save(
    out_dir, step: int, params: dict[str, nn.Parameter], optimizer, history: list[dict], keep: int, parallel
) -> None:
    """A checkpoint of the state after `step` steps: mixer weights, optimizer, RNG states and the history so far,
    whole (gathered from the fsdp shards), so that it resumes on any number of processes."""
    weights = {name: full_tensor(p.detach()).cpu().contiguous() for name, p in params.items()}
    optimizer_state = full_optimizer_state(optimizer)

    def write(folder: Path) -> None:
        if not parallel.is_main:
            return
        save_file(weights, folder / "mixers.safetensors")
        torch.save(optimizer_state, folder / "optimizer.pt")
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, folder / "rng.pt")

    meta = {"step": step, "history": history, "processes": parallel.world}
    save_checkpoint(out_dir, step, write, meta, keep, main=parallel.is_main, barrier=parallel.barrier)


def _load(path: Path, params: dict[str, nn.Parameter], optimizer) -> None:
    weights = load_file(path / "mixers.safetensors")
    if set(weights) != set(params):
        raise ValueError(f"{path} holds weights of other mixers than this model's; delete it to start align over")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard_like(weights[name], p))
    optimizer.load_state_dict(sharded_optimizer_state(torch.load(path / "optimizer.pt", weights_only=True), optimizer))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _share(batch: dict, parallel) -> dict:
    """This process's rows of a global batch: the `rank`-th of `world` equal slices."""
    rows = len(batch["input_ids"])
    if rows % parallel.world:
        raise ValueError(f"align's batch of {rows} rows does not split evenly over {parallel.world} processes")
    size = rows // parallel.world
    return {k: v[parallel.rank * size : (parallel.rank + 1) * size] for k, v in batch.items()}


def place_mixers(hybrid, parallel, layers: list[int]) -> None:
    """Put the mixers of `layers` (common.aligned_layers), what align runs of `hybrid`, on this process's device:
    under fsdp each mixer sharded (a unit of its own). The rest of the model stays where it is. Once is enough; again
    does nothing."""
    from torch.distributed.fsdp import FSDPModule

    mixers = [hybrid.model.layers[i].self_attn for i in layers]
    if parallel.sharded and not any(isinstance(m, FSDPModule) for m in mixers):
        parallel.shard(hybrid, units=mixers, root=False)
    elif not parallel.sharded:
        for mixer in mixers:
            mixer.to(parallel.device)


def align(
    teacher,
    hybrid,
    batches: Iterable[dict] | Callable[[int], Iterable[dict]],
    steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    grad_clip: float | None = 1.0,
    warmup_steps: int = 0,
    log_every: int = 10,
    mixed_precision: str = "no",
    compile: CompileSetting = "auto",
    cuda_graphs: CompileSetting = "auto",
    out_dir=None,
    save_every: int = 100,
    keep_checkpoints: int = 2,
    seed: int | None = None,
    parallel: Parallel | None = None,
) -> list[dict]:
    """Train the mixers of `hybrid` (those of common.aligned_layers) to match `teacher`'s attention for `steps`
    batches ({"input_ids", and either "position_ids" for packed documents or an optional "attention_mask"}); returns
    one record per step: {"step", "loss", "layers": {layer: mse}, "tokens_per_second", "mfu" (flops.py; None off
    known GPUs), "lr", and "aux" where a mixer has a balance loss} (the rate counts from the end of the first step of
    this call, which compiles kernels). The loss is the layers' MSE plus the mixers' balance losses (SSE's, as in
    stage 2).

    Only mixer parameters receive gradients (others are frozen for the duration and restored after). The learning
    rate warms up linearly over `warmup_steps`, then follows a cosine to 10% of `lr`. A non-finite loss stops the
    run with an error naming the step and layers, and no optimiser step applies it: a step's losses are read back
    during the next step (the loop never waits for the GPU), its update skipped on the device when they are not
    finite (fused AdamW's found_inf), and the error raised before the next update (under fsdp, read at once).
    mixed_precision "bf16" runs the teacher and the mixers under bfloat16 autocast (weights and optimizer state stay
    in their own dtype).
    `compile` (True, False or "auto": on CUDA) runs the mixers' PyTorch work around their kernels and the decoder
    layers' norms and MLPs compiled (compiling.py). `cuda_graphs` (True, False or "auto": where it can) replays each
    step, optimizer update included, as a CUDA graph once its layout of packed documents has run eagerly
    (graphs.py: one process on CUDA, mixers declared graph_safe); the steps compute what the eager ones do.

    With `out_dir`, a checkpoint (see checkpoint.py) is written every `save_every` steps and at the end, the newest
    `keep_checkpoints` kept, and a call resumes after the newest intact one: its mixer weights, optimizer and RNG
    states are restored and the history returned covers every step. `batches` is then best a function of the first
    step to run (0-based) returning the batches from there, such as
    `lambda s: batch_iterator(rows, B, seed, start_step=s)`; an iterable is advanced past the steps already done.
    `seed` seeds torch's global generator (Raven's router noise draws from it) unless the run resumes, which restores
    the generator as it was saved; None leaves it as it is.

    Under a launch of N processes (`parallel`, see distributed.py) every batch is a global one: each process aligns
    on its 1/N of the rows (the teacher's layer outputs computed for those rows only) and the gradients are averaged,
    so the result is one process's on the same batches. The mixers go to this process's device (under fsdp, sharded);
    the rest of `hybrid` stays where it is.
    """
    for name, value, least in (
        ("steps", steps, 1),
        ("save_every", save_every, 1),
        ("keep_checkpoints", keep_checkpoints, 1),
    ):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} = {value!r} is not allowed; expected an integer >= {least}")
    if mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision = {mixed_precision!r} is not allowed; expected 'no' or 'bf16'")
    parallel = parallel or Parallel()
    collectives = holds_collectives("align", parallel.settings.strategy)
    graphs = resolve_graphs(cuda_graphs, hybrid, parallel.device, parallel.world, collectives)
    layers = aligned_layers(teacher, hybrid)
    if not layers:
        raise ValueError("align has no layer to align: the teacher runs none of the hybrid's mixer layers as attention")
    teacher.eval()
    resumed = None if out_dir is None else latest_checkpoint(out_dir, warn=lambda m: parallel.print(f"[align] {m}"))
    first = 0 if resumed is None else resumed[1]["step"]
    if resumed is None and seed is not None:
        torch.manual_seed(seed)
    batches = iter(batches(first) if callable(batches) else itertools.islice(batches, first, None))
    if resumed is None:  # a fresh run fits its mixers' data-dependent initial values, before they are placed
        head = next(batches, None)
        if head is not None:
            calibrate_mixers(teacher, hybrid, layers, head, parallel)
            batches = itertools.chain([head], batches)
    place_mixers(hybrid, parallel, layers)
    # no cache of cast weights: each is cast once per step anyway, and a graph cannot keep the cache's tensors
    autocast = torch.autocast(
        parallel.device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16", cache_enabled=False
    )
    was_training = hybrid.training
    hybrid.train()
    trainable = {id(p) for p in mixer_parameters(hybrid, layers)}
    frozen = [(p, p.requires_grad) for p in hybrid.parameters()]
    for p, _ in frozen:
        p.requires_grad_(id(p) in trainable)
    named = {n: p for n, p in hybrid.named_parameters() if id(p) in trainable}
    params = list(named.values())
    # a step's losses are read back one step later (no host sync in the step): the fused AdamW skips, on the GPU,
    # the update of a step whose loss is not finite (found_inf), and the next step raises before its own update
    lagged = not parallel.sharded
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=lagged or None)
    optimizer_mode(optimizer, graphs, parallel.device)
    if lagged:
        optimizer.found_inf = torch.zeros((), device=parallel.device)

    history = []
    if resumed is not None:
        path, meta = resumed
        _load(path, named, optimizer)
        optimizer_mode(optimizer, graphs, parallel.device)
        history = [r | {"layers": {int(i): v for i, v in r["layers"].items()}} for r in meta["history"]][:first]
        parallel.print(f"[align] resumed from {path} (step {first})")
    clock = {"start": time.perf_counter(), "tokens": 0, "first_step_seconds": 0.0}
    per_token = None  # model FLOPs per token, once the rows' length is seen
    pending = None  # the latest step whose losses are not read back yet
    has_aux = {}  # whether the mixers add a balance loss, seen at the first step

    def book(step: int, step_lr: float, stacked: torch.Tensor, copied=None) -> None:
        """Read back a step's global losses and token count (stacked [1 + layers (+ aux) + 1]; on the host once the
        event `copied` has passed), stop on a non-finite loss, record and log the step."""
        values = read_back(stacked, copied)
        values, step_tokens = values[:-1], round(values[-1] * parallel.world)
        bad = [i for i, loss in zip(layers, values[1:]) if not math.isfinite(loss)]
        if bad or not math.isfinite(values[0]):
            raise FloatingPointError(f"alignment loss is not finite at step {step + 1} in layer(s) {bad}")
        now = time.perf_counter()
        clock["tokens"] += step_tokens
        rate = clock["tokens"] / max(now - clock["start"], 1e-9)
        if step <= counted_after:
            clock.update(first_step_seconds=now - clock["start"], start=now, tokens=0)
        record = {"step": step, "loss": values[0], "layers": dict(zip(layers, values[1:]))}
        if has_aux["aux"]:
            record["aux"] = values[-1]
        utilisation = mfu(rate * per_token, parallel.device, parallel.world)
        history.append(record | {"tokens_per_second": rate, "mfu": utilisation, "lr": step_lr})
        if log_every and (step % log_every == 0 or step == steps - 1):
            since = step - counted_after
            per_step = (now - clock["start"]) / since if since > 0 else clock["first_step_seconds"]
            parallel.print(
                f"[align] step {step + 1}/{steps} loss {values[0]:.4g} | {rate:,.0f} tok/s"
                f"{mfu_text(utilisation)} | {eta((steps - step - 1) * per_step)}"
            )

    # eager and unsharded: one layer's backward at a time (alignment_losses' `backward`), so the step holds one
    # layer's activations, not every layer's (30 mixers of 8 x 1,024 tokens grew to 16 GB on a CPU); a graph or
    # FSDP's hooks take the summed loss's one backward
    per_layer = not graphs and not parallel.sharded

    def forward_backward(inputs: dict, packed) -> torch.Tensor:
        """The step's losses and their gradients; returns the global batch's losses and token count, reduced on the
        device ([total, each layer's, (aux,) tokens]): every process reads the same means, so all stop together."""
        if per_layer:
            optimizer.zero_grad(set_to_none=True)
        with autocast:
            losses = alignment_losses(teacher, hybrid, **inputs, packed=packed, backward=per_layer)
        aux = mixers_aux_loss(hybrid, losses)  # SSE's balance loss trains its router here too
        has_aux.setdefault("aux", aux is not None)
        total = torch.stack(list(losses.values())).sum() + (0.0 if aux is None else aux)
        if not per_layer:
            optimizer.zero_grad(set_to_none=not graphs)  # a graph's gradients stay where it found them
            with record_function("align.backward"):
                total.backward()
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"]  # the count by a fill, not a copy from the host (which a graph cannot hold)
        local = torch.full((), ids.numel(), device=ids.device) if mask is None else mask.sum()
        parts = [total, *losses.values()] + ([] if aux is None else [aux])
        return parallel.mean(torch.stack([v.detach().float() for v in parts] + [local.float()]))

    def update(stacked: torch.Tensor) -> None:
        if lagged:  # a step whose losses are not finite changes nothing
            optimizer.found_inf.copy_(~torch.isfinite(stacked[:-1]).all())
        with record_function("align.optimizer"):
            parallel.average_gradients(params)
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()

    def whole_step(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """forward_backward and update of one step's tensors (model inputs, and with packed documents their
        "documents" and "cu_seqlens"): what a graph holds."""
        packed = (tensors["documents"], tensors["cu_seqlens"]) if "cu_seqlens" in tensors else None
        inputs = {k: v for k, v in tensors.items() if k not in ("documents", "cu_seqlens")}
        stacked = forward_backward(inputs, packed)
        update(stacked)
        return stacked

    captured = CapturedStep(whole_step) if graphs else None
    counted_after = first + untimed_steps(captured) - 1  # the rate counts from this step's end (0-based steps)
    try:
        # the teacher's linear weights in bf16 while the loop runs (exact under bf16 autocast; precision.py)
        bf16 = mixed_precision == "bf16" and not parallel.sharded
        fuse = resolve_compile(compile, parallel.device, parallel.sharded)
        with (
            frozen_linears_in([teacher], torch.bfloat16, enabled=bf16),
            compiled_parts([teacher, hybrid], enabled=fuse),
        ):
            for step, batch in zip(range(first, steps), batches):
                step_lr = lr_at(step, lr, steps, warmup_steps)
                bucket = DOCUMENT_BUCKET if graphs else None
                share = _share(batch, parallel)
                # several processes' graphs hold collectives: every one pads its share to the same layout
                slots = agreed_slots(batch, parallel.world) if graphs and parallel.world > 1 else None
                inputs, packed = step_inputs(share, parallel.device, bucket, slots)
                if per_token is None:
                    per_token = align_flops(teacher, hybrid, inputs["input_ids"].shape[1])
                set_lr(optimizer, step_lr)  # a graph reads it in place, queued behind the step before
                if captured is not None:
                    if pending is not None:  # the step before, read before this one's update
                        book(*pending)
                        pending = None
                    layout = dict(zip(("documents", "cu_seqlens"), packed)) if isinstance(packed, tuple) else {}
                    tensors = {k: v for k, v in inputs.items() if v is not None} | layout
                    pending = (step, step_lr, *read_later(captured(tensors)))
                else:
                    stacked = forward_backward(inputs, packed)
                    if pending is not None:  # the step before: long done on the GPU, read before this one's update
                        book(*pending)
                        pending = None
                    if lagged:
                        pending = (step, step_lr, *read_later(stacked))
                    else:
                        book(step, step_lr, stacked)  # the step's one host sync, before the optimizer applies it
                    update(stacked)
                if out_dir is not None and ((step + 1) % save_every == 0 or step + 1 == steps):
                    if pending is not None:  # a checkpoint holds its steps' records
                        book(*pending)
                        pending = None
                    _save(out_dir, step + 1, named, optimizer, history, keep_checkpoints, parallel)
            if pending is not None:
                book(*pending)
            if captured is not None and history:  # each layout costs an eager step and a capture
                history[-1]["graph_layouts"] = len(captured.graphs)
    finally:
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
        if graphs:
            optimizer.zero_grad(set_to_none=True)  # the gradients held for the graphs
        hybrid.train(was_training)
    return history
