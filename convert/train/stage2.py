"""Stage 2: continued training of the hybrid on packed text (next-token loss, optional token weights, optional
distillation from the teacher's logits), resumable and runnable unchanged under `accelerate launch`.

    config = TrainConfig(steps=2000, batch_size=8, lr=3e-4, trainable="mixers+lora", kd_weight=1.0)
    history = train(hybrid, teacher, train_rows, config, "runs/stage2")   # resumes from runs/stage2 if it can
    merge_lora(hybrid); hybrid.save_pretrained("hybrid-stage2")           # fold LoRA in for export

Choices:

- A step is one optimizer step: `grad_accum` micro-batches of `batch_size` rows on every process. Micro-batch m
  (m = step * grad_accum + a) is batch m of `batch_iterator(dataset, batch_size * num_processes, seed)`, and each
  process takes its own slice of it, so the data order depends on (seed, step) alone and a resumed run continues it
  exactly. Steps are counted from 1: checkpoint `step_k` holds the state after k optimizer steps.
- Rows are packed documents. Student and teacher get them as transformers' packed sequences (position_ids
  restarting at 0 at each document, no attention_mask), so no attention and no mixer state crosses a document
  boundary; the last token of a document does not predict the first of the next (no CE or KD there). Rows
  without "position_ids" run as padded sequences under their "attention_mask".
- Loss = CE + kd_weight * KD + aux. CE is the next-token cross-entropy; with token weights w [B, T] (w[:, t] weights
  the prediction made at position t, see token_weights.py) each token's CE is multiplied by
  schedule_weights(w, tokens_seen, tau) (tau from `TrainConfig.tau_tokens`: a share of the run's tokens unless
  token_weight_tau fixes it) and the sum is divided by the number of predicted tokens (so
  the schedule's 1 + w start is an up-weighting, not a renormalisation). `token_weights` is a tensor
  [len(dataset), T] (row i of the dataset as it is indexed, i.e. `dataset[i]`) or a callable batch -> [B, T]
  (e.g. `lambda b: token_weights(teacher, b["input_ids"])`). Dataset items cannot carry the weights themselves,
  since batch_iterator casts every field to int64. KD = T^2 * KL(teacher || student) of the logits at temperature
  T, averaged over real tokens. aux is the student's own `aux_loss` (already weighted). With `answer_weight` a,
  the CE of each answer token of a synthetic retrieval sample (the rows' "answers", data.pack_documents) counts a
  times (on top of any token weight; KD is not weighted): a fact's answer is a few tokens in a row of thousands.
- What trains (`trainable`): "mixers" (the converted layers' mixers), "mixers+lora" (and LoRA on the kept attention
  layers), "all", "patterns" (the parameters whose names match one of the regular expressions
  `trainable_patterns`, re.search) or "lora" (LoRA only). The mixer choices need a converted hybrid; the others
  train any causal LM (finetune.py: a plain or trust_remote_code model, with token weights from a reference).
- LoRA ("mixers+lora", "lora"): peft's `inject_adapter_in_model` adds adapters in place (the model keeps its class
  and weight names, plus `lora_A`/`lora_B`) on the modules named in `lora_targets`: of the attention layers only in
  a hybrid, of every layer in any other model; `train` leaves them unmerged (a resumed run re-injects and reloads
  them), and `merge_lora` folds them into the base weights.
- Learning rate: linear warmup over `warmup_steps`, then cosine to 10% of `lr` at `steps` or constant; a function
  of the step alone, so nothing about it needs saving. A resumed run must use the same `steps` for the same curve.
- A non-finite loss part or gradient raises FloatingPointError naming the step before the optimizer step and before
  any checkpoint of it (the check is reduced over processes, so that every process raises together).
- `cuda_graphs` replays each step, update included, as a CUDA graph (graphs.py; one micro-batch; a distilling
  teacher's forward inside it, its packed documents' mask built on the device): the batch is laid out on the host
  and, with its token weights, prepared while the step before replays (graphs.StepInputs), the step's losses are
  read during the next step, and a non-finite step's update is skipped on the device, its
  error raised before the next update. On one GPU where it can (`auto`), and on several under ddp: the model
  is then trained without a DistributedDataParallel wrapper, its trainable weights broadcast
  from the main process at the start and its gradients averaged inside the step (all-reduces the graph holds),
  and every process pads its rows' documents to one layout (graphs.run_document_slots).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import record_function

from raven_convert.console import eta
from raven_convert.train.checkpoint import latest_checkpoint, save_checkpoint
from raven_convert.train.common import is_hybrid, lr_at, model_inputs, teacher_mask, to_device
from raven_convert.train.compiling import compiled_parts, resolve_compile
from raven_convert.train.data import batch_iterator
from raven_convert.train.distributed import Parallel, on_cpu
from raven_convert.train.flops import mfu, mfu_text, train_flops
from raven_convert.train.graphs import (
    CapturedStep,
    StepInputs,
    holds_collectives,
    optimizer_mode,
    read_back,
    read_later,
    resolve_graphs,
    run_document_slots,
    set_lr,
    untimed_steps,
)
from raven_convert.train.lora import lr_groups, select_trainable
from raven_convert.train.losses import answer_weighted, aux_loss, ce_loss, kd_loss, prediction_mask, training_loss
from raven_convert.train.precision import frozen_linears_in
from raven_convert.train.stage2_config import TrainConfig
from raven_convert.train.stage2_rows import (
    answer_summary,
    check_weight_table,
    device_documents,
    micro_batches,
    with_index,
)
from raven_convert.train.token_weights import schedule_uniform, scheduled


def _save(parallel, model, optimizer, out_dir, step: int, tokens_seen: int, config: TrainConfig) -> None:
    """The trainable weights and optimizer state (sharded under fsdp) in a checkpoint (see checkpoint.save_checkpoint),
    pruned to config.keep_checkpoints."""
    meta = {"step": step, "tokens_seen": tokens_seen, "config": config.model_dump(), "processes": parallel.world}
    save_checkpoint(
        out_dir,
        step,
        lambda folder: parallel.save(folder, model, optimizer),
        meta,
        config.keep_checkpoints,
        main=parallel.is_main,
        barrier=parallel.barrier,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process (FSDP2's parameters and gradients), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def step_graphs(
    config: TrainConfig, student, token_weights, device, processes: int, teacher=None, collectives: bool = False
) -> bool:
    """Whether `train` replays its steps as CUDA graphs (`config.cuda_graphs`): where graphs.resolve_graphs allows
    (a CUDA device, one process or, with `collectives`, several under ddp; mixers declared graph_safe) for
    a hybrid whose settings allow it (`TrainConfig.graph_obstacles`) and, distilling, a teacher whose packed
    documents' mask is built on the device (sdpa: common.teacher_mask). With True, ValueError naming what stands
    in the way."""
    if config.cuda_graphs is False:
        return False
    found = config.graph_obstacles()
    if not is_hybrid(student):
        found.append(f"{type(student).__name__} is not a hybrid")
    attention = getattr(getattr(teacher, "config", None), "_attn_implementation", None)
    if config.kd_weight > 0 and attention != "sdpa":
        found.append(f"the distilling teacher's attention is {attention!r} (graphs take sdpa's ready-made mask)")
    if found and config.cuda_graphs is True:
        raise ValueError(f"cuda_graphs = true cannot be honoured: {'; '.join(found)}")
    return not found and resolve_graphs(config.cuda_graphs, student, device, processes, collectives)


@torch.no_grad()
def validation_ce(model, dataset, config: TrainConfig, accelerator) -> float:
    """Mean next-token CE (unweighted) over the first `eval_batches` global micro-batches of `dataset` (the same
    rows at every pass), each process scoring its slice; the model is in eval mode meanwhile."""
    n, rank = accelerator.num_processes, accelerator.process_index
    b = min(config.batch_size, len(dataset) // n)  # a small validation set still gives one batch
    if b < 1:
        raise ValueError(f"the validation set has {len(dataset)} rows, fewer than the {n} processes")
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=accelerator.device)  # [sum of CE * predictions, predictions]
    try:
        for i, batch in enumerate(batch_iterator(dataset, b * n, config.seed, epochs=1)):
            if i == config.eval_batches:
                break
            batch = {k: v[rank * b : (rank + 1) * b].to(accelerator.device) for k, v in batch.items()}
            mask = prediction_mask(batch)
            with accelerator.autocast():
                logits = model(**model_inputs(batch), use_cache=False).logits
            count = mask[:, :-1].sum()
            total += torch.stack([ce_loss(logits, batch["input_ids"], mask) * count, count.float()])
    finally:
        model.train(was_training)
    total = accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1].clamp(min=1)).item()


class Stage2Trainer:
    """One stage-2 run in the shape of torchtune's recipes: `setup` (the accelerator, the trainable model and its
    optimizer, the data, resumed by `load_checkpoint`), one optimizer step (`eager_step` over its micro-batches, or
    `graph_step` replaying it as a CUDA graph), `finish_step` (record and log it, `evaluate` and `save_checkpoint`
    where due), `run` (the loop) and `cleanup`. `train` builds one and runs it; its docstring says what a run does."""

    parts_names = ("ce", "kd", "aux", "loss")  # what a step records, summed on the device over its micro-batches

    def __init__(self, student, teacher, dataset, config, out_dir, token_weights=None, validation=None, parallel=None):
        config = config if isinstance(config, TrainConfig) else TrainConfig(**config)
        if config.kd_weight > 0 and teacher is None:
            raise ValueError("kd_weight > 0 needs a teacher")
        if isinstance(token_weights, torch.Tensor) and tuple(token_weights.shape[:1]) != (len(dataset),):
            raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, expected [{len(dataset)}, T]")
        self.student, self.teacher, self.dataset, self.config = student, teacher, dataset, config
        self.out_dir, self.token_weights, self.validation = Path(out_dir), token_weights, validation
        found = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        self.tracker = "tensorboard" if found else None
        self.parallel = parallel or Parallel()
        self.history: list[dict] = []

    def setup(self) -> None:
        """The accelerator, the trainable parameters and their optimizer, the frozen teacher, the state of the newest
        checkpoint, this process's micro-batches from there, and the CUDA graph of a step where it replays."""
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import AutocastKwargs
        from torch.distributed.fsdp import FSDPModule

        config, student, dataset, parallel = self.config, self.student, self.dataset, self.parallel
        # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with another mixed
        # precision (train without, extend with): start it afresh, keeping the launch's process group (its PartialState)
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = accelerator = Accelerator(
            cpu=on_cpu(),
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.grad_accum,
            project_dir=str(self.out_dir),
            log_with=self.tracker,
            kwargs_handlers=[AutocastKwargs(cache_enabled=False)],  # a graph cannot keep the cache's casts
        )
        if self.tracker:
            accelerator.init_trackers("stage2", config={k: str(v) for k, v in config.model_dump().items()})
        self.device = device = accelerator.device
        processes = accelerator.num_processes
        collectives = holds_collectives("train", parallel.settings.strategy)
        self.graphs = step_graphs(config, student, self.token_weights, device, processes, self.teacher, collectives)
        # graphs on several processes: the step averages its gradients itself (no DistributedDataParallel wrapper),
        # an all-reduce each graph holds
        self.own_reduce = self.graphs and processes > 1
        self.hybrid = is_hybrid(student)

        resumed = latest_checkpoint(self.out_dir, warn=self.note)
        if resumed is None:  # a fresh run draws the same random numbers every time (LoRA's initial weights, Raven's
            torch.manual_seed(config.seed + accelerator.process_index)  # router noise); a resumed one gets them back
        self.params = select_trainable(student, config)
        if config.gradient_checkpointing:
            if hasattr(student, "activation_checkpointing_enable"):  # transformers >= 5's name
                student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.train()
        distilling = config.kd_weight > 0
        self.per_token = train_flops(student, len(dataset[0]["input_ids"]), self.teacher if distilling else None)
        if parallel.sharded:  # FSDP2 replaces the parameters by their shards: the optimizer holds the shards
            self.model = parallel.shard(student)
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            adamw = torch.optim.AdamW(lr_groups(self.model, config), lr=config.lr, weight_decay=config.weight_decay)
            self.optimizer = accelerator.prepare(adamw)
        else:  # a graph holds a fused AdamW's update
            adamw = torch.optim.AdamW(
                lr_groups(student, config), lr=config.lr, weight_decay=config.weight_decay, fused=self.graphs or None
            )
            if self.own_reduce:
                self.model, self.optimizer = student.to(device), accelerator.prepare(adamw)
            else:
                self.model, self.optimizer = accelerator.prepare(student, adamw)
        if distilling and not isinstance(self.teacher, FSDPModule):
            self.teacher = parallel.frozen(self.teacher)

        self.tau = None
        if self.token_weights is not None:
            row_tokens = len(dataset[0]["input_ids"])
            run_tokens = config.steps * config.grad_accum * config.batch_size * processes * row_tokens
            self.tau = config.tau_tokens(run_tokens)
            self.note(
                f"token weights: tau = {self.tau:,.0f} tokens ({self.tau / run_tokens:.3g} of the run's {run_tokens:,})"
            )
        if config.answer_weight != 1:
            self.note(f"answer tokens weighted x{config.answer_weight:g}: {answer_summary(dataset)}")
        self.load_checkpoint(resumed)
        if self.own_reduce:  # as a DistributedDataParallel wrapper would: one start on every process
            parallel.broadcast_(self.params)
        optimizer_mode(self.optimizer, self.graphs, device)  # after a resume too: the checkpoint's groups may differ
        if isinstance(self.token_weights, torch.Tensor):
            check_weight_table(self.token_weights, dataset, config, processes)
            data = with_index(dataset)
        else:
            data = dataset
        self.batches = micro_batches(data, config, accelerator, self.start_step)
        micro_steps = config.steps * config.grad_accum
        self.slots = None
        if self.graphs:  # every process's share of every step in one layout (the same on all of them)
            self.slots = run_document_slots(dataset, config.batch_size, config.seed, micro_steps, processes)
        if self.own_reduce and self.slots is None and "position_ids" in dataset[0]:
            raise ValueError(  # per-step layouts could make one process capture while another replays
                f"cuda_graphs = true on {processes} processes needs packed rows (a PackedDataset, one document "
                f"layout for every process and step); got {type(dataset).__name__}: use 'auto' or false"
            )
        if self.slots is not None:
            self.note(f"CUDA graphs: documents padded to {self.slots} per step, one layout")

        self.inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the torch one
        if self.graphs:  # a step whose loss or gradient is not finite changes nothing (fused AdamW's found_inf)
            self.inner.found_inf = torch.zeros((), device=device)
        self.uniform = torch.zeros((), device=device)  # the token-weight schedule's uniform part at this step (graphs)
        # frozen linear weights in bf16 while the loop runs (exact under bf16 autocast; precision.py)
        self.casts = [accelerator.unwrap_model(self.model), self.teacher if distilling else None]
        self.bf16 = config.mixed_precision == "bf16" and not parallel.sharded
        self.fuse = resolve_compile(config.compile, device, parallel.sharded)  # small operations compiled
        self.captured = CapturedStep(self.whole_step) if self.graphs else None
        self.inputs = StepInputs(self.batches, self.token_weights, device, self.slots) if self.graphs else None
        self.counted_after = self.start_step + untimed_steps(self.captured)  # the rate counts from this step's end

    def note(self, message: str) -> None:
        self.accelerator.print(f"[stage2] {message}", file=sys.stderr)

    def load_checkpoint(self, resumed: tuple[Path, dict] | None) -> None:
        """The trained weights, optimizer state, step and tokens seen of checkpoint `resumed` (latest_checkpoint's
        (path, meta)); None starts at step 0."""
        self.start_step, self.tokens_seen = 0, 0
        if resumed is None:
            return
        path, meta = resumed
        self.parallel.load(path, self.accelerator.unwrap_model(self.model), self.optimizer)
        self.start_step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.note(f"resumed from {path} (step {self.start_step}, {self.tokens_seen:,} tokens)")

    def save_checkpoint(self, step: int) -> None:
        model = self.accelerator.unwrap_model(self.model)
        _save(self.parallel, model, self.optimizer, self.out_dir, step, self.tokens_seen, self.config)

    def micro_step(self, batch: dict, w: torch.Tensor | None, uniform_part) -> dict[str, torch.Tensor]:
        """Forward and backward of one micro-batch (device tensors; "packed_documents" as the hybrid takes them, w
        its raw token weights [B, T] or None): its loss parts, each process's share of the global mean."""
        config, accelerator, parallel, teacher = self.config, self.accelerator, self.parallel, self.teacher
        mask = prediction_mask(batch)
        inputs = model_inputs(batch) | {"use_cache": False}
        student_inputs = inputs | (
            {"packed_documents": batch["packed_documents"]} if "packed_documents" in batch else {}
        )
        # autocast here too: a model an earlier Accelerator prepared is not wrapped again
        with record_function("train.student_forward"), accelerator.autocast():
            out = self.model(**student_inputs)
        weights = None if w is None else scheduled(w.float(), uniform_part, batch["attention_mask"])
        if config.answer_weight != 1:  # the rows mark answers: answer_summary checked them
            weights = answer_weighted(weights, batch["answers"], config.answer_weight)
        # each process's mean weighted by its share of the predictions: the processes' mean is the global one
        parts = {"ce": ce_loss(out.logits, batch["input_ids"], mask, weights) * parallel.share(mask[:, :-1].sum())}
        if config.kd_weight > 0:
            given = teacher_mask(teacher, batch.get("packed_documents"), inputs.get("attention_mask"))
            with torch.no_grad(), accelerator.autocast(), record_function("train.teacher_forward"):
                teacher_logits = teacher(**inputs | {"attention_mask": given}).logits  # nothing read back
            kd = kd_loss(out.logits, teacher_logits, config.kd_temperature, mask)
            parts["kd"] = kd * parallel.share(mask.sum())
        aux = aux_loss(out)
        if aux is not None:
            parts["aux"] = aux
        total = training_loss(parts, config.kd_weight)
        with record_function("train.backward"):
            accelerator.backward(total)
        return parts | {"loss": total}

    def gradient_norm(self) -> torch.Tensor:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]  # this process's shards: finite or not
        return torch.stack([g.float().norm() for g in grads]).norm() if grads else torch.zeros((), device=self.device)

    def update(self) -> None:
        with record_function("train.optimizer"):
            if self.config.grad_clip:
                self.accelerator.clip_grad_norm_(self.params, self.config.grad_clip)
            self.optimizer.step()

    def eager_step(self, step: int) -> tuple[dict[str, float], int]:
        """Optimizer step `step` over its grad_accum micro-batches: its loss parts (checked, see `checked`) and the
        global batch's token count."""
        config, device, token_weights = self.config, self.device, self.token_weights
        sums = {k: torch.zeros((), device=device) for k in self.parts_names}
        local_tokens = torch.zeros((), device=device)
        for micro in range(config.grad_accum):
            host = next(self.batches)
            w = token_weights[host["index"]] if torch.is_tensor(token_weights) else None  # on the host
            batch = to_device(host, device)
            found = device_documents(host, device) if self.hybrid else None
            if found is not None:
                batch["packed_documents"] = found
            if callable(token_weights):
                w = token_weights(batch)
            w = None if w is None else w.to(device)
            sync = micro == config.grad_accum - 1
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model):
                parts = self.micro_step(
                    batch, w, schedule_uniform(self.tokens_seen, self.tau) if w is not None else 0.0
                )
            for name, value in parts.items():
                sums[name] += value.detach().float() / config.grad_accum
            local_tokens += batch["attention_mask"].sum()
        sums, step_tokens = self.step_totals(sums, self.gradient_norm(), local_tokens, step)
        self.update()
        self.optimizer.zero_grad(set_to_none=True)
        return sums, step_tokens

    def whole_step(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step of one micro-batch as a graph holds it: gradients zeroed in place, forward and backward, the
        update skipped on the device when a loss part or the gradient norm is not finite; returns [ce, kd, aux,
        loss, gradient norm]."""
        self.optimizer.zero_grad(set_to_none=False)
        batch = dict(tensors)
        if "cu_seqlens" in batch:
            batch["packed_documents"] = (batch.pop("documents"), batch.pop("cu_seqlens"))
        else:
            batch["packed_documents"] = False
        w = batch.pop("weights", None)
        parts = self.micro_step(batch, w, self.uniform)
        if self.own_reduce:
            self.parallel.average_gradients(self.params)
        zero = torch.zeros((), device=self.device)
        stacked = [parts.get(k, zero).detach().float() for k in self.parts_names] + [self.gradient_norm().float()]
        stacked = self.parallel.sum_(torch.stack(stacked))  # as step_totals sums them: every process skips alike
        self.inner.found_inf.copy_(~torch.isfinite(stacked).all())
        self.update()
        return stacked

    def graph_step(self, step: int, lr: float, pending: tuple | None) -> tuple:
        """Optimizer step `step` of one micro-batch, replayed as a CUDA graph; the step before (`pending`) is read
        back, and stopped on, before this one's update; the next step's inputs are prepared while this one replays
        (`StepInputs`). Returns this step's `pending`, read during the next."""
        tensors, step_tokens = self.inputs.take()
        if self.own_reduce:  # this process's share of packed rows, times N (no host sync for the global count)
            step_tokens *= self.parallel.world
        if pending is not None:
            self.finish_pending(pending)
        self.uniform.fill_(schedule_uniform(self.tokens_seen, self.tau) if self.token_weights is not None else 0.0)
        pending = (step, lr, *read_later(self.captured(tensors)), step_tokens)
        self.tokens_seen += step_tokens
        if step < self.config.steps:
            self.inputs.prepare()
        return pending

    def finish_pending(self, pending: tuple) -> None:
        step, lr, values, event, step_tokens = pending
        self.finish_step(step, lr, self.checked(read_back(values, event), step), step_tokens)

    def step_totals(self, sums: dict[str, torch.Tensor], norm: torch.Tensor, tokens: torch.Tensor, step: int):
        """The global batch's loss parts and token count from every process's sums, in one reduction and one host
        sync per step; a loss part or the gradient norm that is not finite (on any process: sums carry it) stops
        the run before the optimizer applies anything."""
        local = torch.stack([sums[k] for k in self.parts_names] + [norm.float(), tokens.float()])
        values = self.accelerator.reduce(local, reduction="sum").tolist()
        return self.checked(values[:-1], step), int(values[-1])

    def checked(self, values: list[float], step: int) -> dict[str, float]:
        """{part: value} of a step's [ce, kd, aux, loss, gradient norm] summed over the processes; FloatingPointError
        naming what is not finite."""
        names = self.parts_names
        bad_loss = [k for k, v in zip(names[:-1], values) if not math.isfinite(v)]
        if bad_loss:
            raise FloatingPointError(f"loss not finite at step {step} ({', '.join(bad_loss)}); nothing applied")
        if not math.isfinite(values[len(names)]):
            raise FloatingPointError(f"gradient not finite at step {step} (gradient norm); nothing applied")
        world = self.accelerator.num_processes  # loss parts: the processes' mean is the global batch's
        return {k: v / world for k, v in zip(names, values)}

    def finish_step(self, step: int, lr: float, sums: dict[str, float], step_tokens: int) -> None:
        """Record and log a finished step, then evaluate and checkpoint where due."""
        config = self.config
        self.timed_tokens += step_tokens
        elapsed = max(time.perf_counter() - self.clock, 1e-9)
        rate = self.timed_tokens / elapsed
        if step <= self.counted_after:
            self.clock, self.timed_tokens = time.perf_counter(), 0
        utilisation = mfu(rate * self.per_token, self.device, self.parallel.world)
        record = {"step": step, **sums, "lr": lr, "tokens_per_second": rate, "mfu": utilisation}
        self.history.append(record)
        if self.tracker:
            self.accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)
        if config.log_every and (step % config.log_every == 0 or step == config.steps):
            left = (config.steps - step) * elapsed / max(step - self.counted_after, 1)
            self.note(
                f"step {step}/{config.steps} loss {sums['loss']:.4g} (ce {sums['ce']:.4g}"
                f" kd {sums['kd']:.4g} aux {sums['aux']:.4g}) lr {lr:.3g} | {rate:,.0f} tok/s"
                f"{mfu_text(utilisation)} | {eta(left)}"
            )
        due = step == config.steps or (config.eval_every and step % config.eval_every == 0)
        if self.validation is not None and due:
            self.evaluate(record)
        if step % config.save_every == 0 or step == config.steps:
            self.save_checkpoint(step)

    def evaluate(self, record: dict) -> None:
        """The validation CE into the step's `record` ("val_ce"); its time is not training throughput."""
        paused = time.perf_counter()
        record["val_ce"] = validation_ce(self.model, self.validation, self.config, self.accelerator)
        self.clock += time.perf_counter() - paused
        self.note(f"step {record['step']} validation CE {record['val_ce']:.4g}")
        if self.tracker:
            self.accelerator.log({"val_ce": record["val_ce"]}, step=record["step"])

    def run(self) -> list[dict]:
        """The steps from the resumed one to config.steps; the history of those run."""
        config, pending = self.config, None  # graphs: the step whose losses are read back during the next one
        self.clock, self.timed_tokens = time.perf_counter(), 0
        with (
            frozen_linears_in(self.casts, torch.bfloat16, enabled=self.bf16),
            compiled_parts(self.casts, enabled=self.fuse),
        ):
            for step in range(self.start_step + 1, config.steps + 1):
                lr = lr_at(step - 1, config.lr, config.steps, config.warmup_steps, config.schedule)
                set_lr(self.optimizer, lr)
                if self.captured is not None:  # one micro-batch, its step a graph
                    pending = self.graph_step(step, lr, pending)
                    continue
                sums, step_tokens = self.eager_step(step)
                self.tokens_seen += step_tokens
                self.finish_step(step, lr, sums, step_tokens)
            if pending is not None:
                self.finish_pending(pending)
        if self.captured is not None and self.history:  # each layout costs an eager step and a capture
            self.history[-1]["graph_layouts"] = len(self.captured.graphs)  # one, where slots pad
        if self.graphs:
            self.optimizer.zero_grad(set_to_none=True)  # the gradients held for the graphs
        return self.history

    def cleanup(self) -> None:
        if self.tracker:
            for open_tracker in self.accelerator.trackers:  # not end_training(), which ends the launch's process group
                open_tracker.finish()


def train(
    student,
    teacher,
    dataset,
    config: TrainConfig | dict,
    out_dir,
    token_weights: torch.Tensor | Callable[[dict], torch.Tensor] | None = None,
    validation=None,
    parallel: Parallel | None = None,
) -> list[dict]:
    """Train `student` (a HybridForCausalLM; any causal LM with trainable "all", "patterns" or "lora") on `dataset`
    (a PackedDataset or a dataset of row dicts) for `config.steps` optimizer steps, checkpointing into
    out_dir/checkpoints (see checkpoint.py) and resuming from the newest intact checkpoint there. `teacher`
    (frozen) is only run when config.kd_weight > 0 and may then not be None.

    Returns one record per step run by this call: {"step", "loss", "ce", "kd", "aux", "lr", "tokens_per_second",
    "mfu"} ("step" is 1-based; loss parts are means over the step's micro-batches and processes; the rate counts from
    the end of the first step, which compiles kernels, and leaves out validation; "mfu" is flops.py's model FLOPs
    utilisation, None off known GPUs), plus "val_ce" at the
    steps where `validation` (held-out rows, like `dataset`) was scored: every `eval_every` steps and at the end.

    Under a launch of N processes (see distributed.py; `parallel` says how, default ddp) each process trains on its
    slice of every global micro-batch; under fsdp `student` and `teacher` are sharded in place, and the trained
    student is saved a gathered tensor at a time (`models.save_trained`).
    """
    trainer = Stage2Trainer(student, teacher, dataset, config, out_dir, token_weights, validation, parallel)
    trainer.setup()
    history = trainer.run()
    trainer.cleanup()
    return history
