"""Several processes under `accelerate launch` (or torchrun): the recipe's `distributed` section, the process group,
sharding of the student and the frozen teacher, checkpoints that resume on any number of processes, and the
gathers of the tensors the main process saves (raven_convert.train.models.save_trained).

    parallel = Parallel(recipe.distributed)        # the process group: gloo on CPU, nccl on GPUs
    teacher = parallel.frozen(teacher)             # fsdp: sharded per decoder layer; ddp: a full copy per process
    parallel.save(folder, model, optimizer)        # torch.distributed.checkpoint: resumable on another process count
    whole = full_tensor(tensor)                    # a shard gathered whole (every process calls it)

Strategies (recipe `distributed.strategy`):

- ddp: every process holds the whole model; gradients are averaged (DistributedDataParallel, or an all-reduce of
  the mixers' gradients in align). Where the model fits one GPU, the fastest.
- fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) on every decoder layer and the model: parameters, gradients and
  optimizer state are split across processes and gathered one layer at a time; the frozen teacher is sharded the
  same way. The same code runs on CPU (gloo) and GPUs (nccl), so the CPU tests check the path GPUs take; accelerate's
  own FSDP plugin is not used because it refuses CPU processes.

On one process both strategies are plain single-process training. Each process works on its slice of the global
batch and gradients are averaged, so N processes with batch_size B reach the parameters one process reaches with
batch_size N * B (float tolerance): the strategy changes memory and speed, not results, and is left out of the
stages' fingerprints. Checkpoints are torch.distributed.checkpoint folders (the trained parameters and the optimizer
state by parameter name, plus each process's random-number state), which load on a different number of processes
and under the other strategy.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

STRATEGIES = ("ddp", "fsdp")
T = TypeVar("T")


class DistributedSettings(BaseModel):
    """The recipe's `distributed` section: how several processes of a launch share the work."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="ddp: a full model per process; fsdp: FSDP2 shards")
    reshard_after_forward: bool = Field(
        True, description="fsdp: free each layer's gathered parameters after its forward (less memory, more traffic)"
    )
    cpu_offload: bool = Field(False, description="fsdp: keep the parameter shards and optimizer state in CPU memory")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def on_cpu() -> bool:
    """Whether the processes run on the CPU (gloo): accelerate needs to be told so, else it runs them unconnected."""
    return not torch.cuda.is_available()


def wait_for(path: Path, poll: float = 1.0) -> None:
    """Block until the main process has written `path` (a stage's DONE). Polling, not a barrier: a long stage the main
    process runs alone (convert, evaluate) cannot time the others' collective out; the launcher ends them if it
    fails."""
    while not Path(path).is_file():
        time.sleep(poll)


def decoder_layers(model) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM (teacher or hybrid): the units FSDP gathers one at a time."""
    return list(model.base_model.layers)


class Parallel:
    """The processes of this launch (one without a launcher) and `settings`' way of spreading a model over them."""

    def __init__(self, settings: DistributedSettings | None = None):
        from accelerate import PartialState

        self.settings = settings or DistributedSettings()
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            raise ValueError(
                "accelerate's own FSDP (--use_fsdp, distributed_type: FSDP) is not used here: launch with "
                "recipes/accelerate/fsdp.yaml and set distributed.strategy=fsdp in the recipe (--set distributed."
                "strategy=fsdp); allowed strategies: " + ", ".join(STRATEGIES)
            )
        self.state = PartialState(cpu=on_cpu())  # joins the process group of a launch; nothing on one process
        self.rank, self.world = self.state.process_index, self.state.num_processes
        self.device = self.state.device
        self.is_main = self.state.is_main_process
        self.sharded = self.settings.strategy == "fsdp" and self.world > 1
        self._mesh = None

    @classmethod
    def alone(cls, device: torch.device | str | None = None) -> Parallel:
        """This process by itself (on `device`, by default its launch's), whatever the launch: its reductions, barriers
        and gathers wait on no other process. For work one process does while the others wait: convert's layer choice
        aligns its mixers on the main process, where a collective would wait on processes that never join it until the
        process group's timeout (NCCL's 10 minutes) ends the launch."""
        parallel = cls()
        parallel.rank, parallel.world, parallel.is_main, parallel.sharded = 0, 1, True, False
        if device is not None:
            parallel.device = torch.device(device)
        return parallel

    def barrier(self) -> None:
        if self.world > 1:
            self.state.wait_for_everyone()

    def print(self, message: str) -> None:
        """A progress line on stderr, from the main process only."""
        if self.is_main:
            print(message, file=sys.stderr, flush=True)

    def in_turn(self, load: Callable[[], T]) -> T:
        """`load()` on one process at a time, in rank order: a model read into host memory and placed (moved to the
        device or sharded) by one process before the next starts, so that the host holds one full copy at a time, not
        one per process. Every process must call it."""
        if self.world == 1:
            return load()
        if self.sharded:
            self._shard_kwargs()  # the device mesh is made by all processes together, before the turns
        result = None
        for turn in range(self.world):
            if turn == self.rank:
                result = load()
            self.barrier()
        return result

    def main_first(self, work: Callable[[], T], folder: Path) -> T:
        """`work()` on the main process, then on the others, which read what it cached (a corpus it tokenised).
        They poll for a file the main process writes in `folder` once its call returns, where a barrier would time
        out under a long call (NCCL's 10 minutes: a large corpus, or extend's far facts). Every process must call
        it; the file goes once all have returned. Should the main process fail, the launcher ends the others."""
        if self.world == 1:
            return work()
        token = self.gather(uuid.uuid4().hex)[0]  # the main's; all processes arrive here together
        ready = Path(folder) / f".ready-{token}"
        if self.is_main:
            result = work()
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.touch()
        else:
            wait_for(ready)
            result = work()
        self.barrier()  # the others' calls read a cache: short
        if self.is_main:
            ready.unlink()
        return result

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over the processes (itself on one)."""
        if self.world == 1:
            return values
        return self.sum_(values.to(self.device).clone()) / self.world

    def _shard_kwargs(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world,))
        offload = CPUOffloadPolicy() if self.settings.cpu_offload else OffloadPolicy()
        return {
            "mesh": self._mesh,
            "reshard_after_forward": self.settings.reshard_after_forward,
            "offload_policy": offload,
        }

    def shard(self, model: nn.Module, units: list[nn.Module] | None = None, root: bool = True) -> nn.Module:
        """FSDP2 on each of `units` (default: the decoder layers), then, with `root`, on `model` itself (what no unit
        holds: the embeddings, final norm and head). Parameters may be on the CPU: a unit whose parameters all are
        is made on the device from each process's own rows (_shard_from_host), others are moved to the device a unit
        at a time as they are split, so no process holds more than one unit's full weights on its device. In place."""
        from torch.distributed.fsdp import fully_shard

        kwargs = self._shard_kwargs()
        for unit in decoder_layers(model) if units is None else units:
            if not self._shard_from_host(unit, kwargs):
                fully_shard(unit, **kwargs)
        if root:
            fully_shard(model, **kwargs)
        return model

    def _shard_from_host(self, unit: nn.Module, kwargs: dict) -> bool:
        """FSDP2 on `unit` whose parameters are all on the CPU, each process reading only its own rows of each: the
        parameters become meta tensors, are sharded as such, made on the device and filled with this process's
        chunk (torch.chunk along dim 0, FSDP2's split). A model read from safetensors maps its files, so a process
        then touches about 1/N of them, not the whole model (host memory: docs/SCALE_OUT.md). False, doing nothing,
        where a parameter is elsewhere or shared (tied), or under cpu_offload: fully_shard moves it whole then."""
        from torch.distributed.fsdp import fully_shard

        named = list(unit.named_parameters(remove_duplicate=False))
        shared = len({id(p) for _, p in named}) != len(named)
        if (
            self.settings.cpu_offload
            or not named
            or shared
            or any(p.device.type != "cpu" or p.dim() == 0 for _, p in named)
        ):
            return False
        host = dict(named)
        buffers = {name: b.clone() for name, b in unit.named_buffers()}  # to_empty makes them afresh: kept values
        for module in unit.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                meta = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                setattr(module, name, meta)
        fully_shard(unit, **kwargs)
        unit.to_empty(device=self.device)
        with torch.no_grad():  # the local shards are views FSDP2 keeps: written in place
            for name, p in unit.named_parameters():
                chunks = torch.chunk(host[name], self.world, dim=0)
                if self.rank < len(chunks):  # a parameter of fewer rows than processes leaves the last ones empty
                    p.to_local().copy_(chunks[self.rank])
            for name, b in unit.named_buffers():
                b.copy_(buffers[name])
        return True

    def frozen(self, model: nn.Module) -> nn.Module:
        """A frozen causal LM (the teacher) in eval mode: sharded under fsdp, else a full copy on this process's
        device. Sharded, its decoder stack (`model.base_model`, which token weights call on their own) is the FSDP
        root and the rest (the head) a full copy on the device."""
        from torch.distributed.fsdp import FSDPModule

        model.eval().requires_grad_(False)
        if not self.sharded:
            return model.to(self.device)
        base = model.base_model
        if isinstance(base, FSDPModule):  # placed already (models.load_teacher before stage2.train)
            return model
        self.shard(base, decoder_layers(model))
        for child in model.children():
            if child is not base:
                child.to(self.device)
        return model

    def average_gradients(self, params: list[nn.Parameter]) -> None:
        """ddp without a DistributedDataParallel wrapper (align calls the mixers directly): the mean of every
        process's gradients, in place. fsdp averages its gradients itself, one process has nothing to do."""
        if self.world == 1 or self.sharded:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a parameter unused on one process still joins the mean
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():  # one all-reduce a dtype, not one a parameter (hundreds a step)
            flat = self.sum_(torch.cat([g.reshape(-1) for g in grads])).div_(self.world)
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def sum_(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the processes, in place (a captured step's reduction: no new tensor); itself on one."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def broadcast_(self, params: list[nn.Parameter]) -> None:
        """The main process's values of `params` on every process, in place: what a DistributedDataParallel wrapper
        does when it is made, for a stage that averages its gradients itself (`average_gradients`), whose processes
        may have drawn different initial weights (LoRA's, seeded per process)."""
        if self.world == 1 or self.sharded:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def share(self, count: torch.Tensor) -> torch.Tensor | float:
        """N * count / (the sum of count over the N processes): the factor that turns this process's mean over its
        `count` tokens into its part of the global mean, when the processes' losses are averaged. 1 on one process."""
        if self.world == 1:
            return 1.0
        import torch.distributed as dist

        total = count.detach().float().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return count.float() * self.world / total.clamp(min=1)

    def gather(self, value: object) -> list:
        """Every process's `value` (any picklable object), in process order."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def save(self, folder: Path, model: nn.Module, optimizer) -> None:
        """Write the trainable parameters and the optimizer state of `model` into `folder` (every process calls it;
        each writes its shards), and this process's random-number state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=True)
        model_state, optimizer_state = get_state_dict(model, _plain(optimizer), options=options)
        # a graphed run's learning rate is a device tensor (graphs.optimizer_mode): saved as the number it holds, so
        # the checkpoint has one layout and resumes in either mode (dcp loads into the layout of the groups it finds)
        optimizer_state["param_groups"] = [
            {k: v.item() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in group.items()}
            for group in optimizer_state["param_groups"]
        ]
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder), no_dist=self.world == 1
        )
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, Path(folder) / f"rng_{self.rank}.pt")

    def load(self, folder: Path, model: nn.Module, optimizer) -> None:
        """Read what `save` wrote, whatever the number of processes and the strategy that wrote it. The
        random-number state is this process's own where the writer had as many processes, else left as seeded."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        model_state, optimizer_state = get_state_dict(model, _plain(optimizer), options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(folder), no_dist=self.world == 1)
        set_state_dict(
            model,
            _plain(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
        rng = Path(folder) / f"rng_{self.rank}.pt"
        if rng.is_file():
            saved = torch.load(rng, weights_only=True)
            torch.set_rng_state(saved["cpu"])
            if saved["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(saved["cuda"])


def _plain(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (state_dict helpers need the plain one)."""
    return getattr(optimizer, "optimizer", optimizer)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered whole, any other tensor itself; every process must call it for a DTensor."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:  # a shard kept on the CPU (cpu_offload): NCCL gathers
        tensor = tensor.to(tensor.device_mesh.device_type)  # on the GPU, as torch's own state-dict gather does
    return tensor.full_tensor()


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` split as `param` is (its DTensor shard on this process), or `full` itself for a plain parameter."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements)


def full_optimizer_state(optimizer) -> dict:
    """optimizer.state_dict() with every sharded state tensor gathered whole, on the CPU: the same on any number of
    processes (every process must call it)."""
    state = optimizer.state_dict()
    state["state"] = {
        i: {k: full_tensor(v).detach().cpu() if torch.is_tensor(v) else v for k, v in values.items()}
        for i, values in state["state"].items()
    }
    return state


def sharded_optimizer_state(state: dict, optimizer) -> dict:
    """A full optimizer state (full_optimizer_state) split like `optimizer`'s parameters, for load_state_dict."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(state)
    state["state"] = {
        i: {k: shard_like(v, params[int(i)]) if torch.is_tensor(v) and v.dim() else v for k, v in values.items()}
        for i, values in state["state"].items()
    }
    return state
