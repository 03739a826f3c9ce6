"""The models of the recipe's stages: the frozen teacher and the hybrid, loaded and placed for this launch, and the
trained model saved as a model directory, gathered a tensor at a time.

    teacher = load_teacher(recipe, parallel)            # sharded under fsdp, a full copy per process else
    start = load_teacher(recipe, parallel, recipe.start_from)   # align's teacher in a further conversion
    student = load_hybrid(model_dir, "cpu")             # the toolkit's own HybridForCausalLM
    save_trained(parallel, student, model_dir, out, base_model)   # every process; the main one writes, atomically
"""

from __future__ import annotations

from pathlib import Path

import torch

from raven_convert.train.distributed import Parallel
from raven_convert.train.recipe import Recipe


def load_teacher(recipe: Recipe, parallel: Parallel, model: str | None = None):
    """The frozen teacher (or `model`, read the same way: align's start hybrid, start_from), read on the CPU and then
    placed: sharded under fsdp, whole on this process's device else. The processes of a launch read it in turn, so
    the host holds one full copy at a time."""
    from raven_convert.sources import Source

    source = Source.resolve(model or recipe.source)
    return parallel.in_turn(lambda: parallel.frozen(source.load_model(recipe.dtype)))


def load_hybrid(model_dir: Path, device: torch.device | str | None = None):
    """The hybrid in `model_dir` as the toolkit's own HybridForCausalLM (its kernels, its mixer registry), whatever
    was imported or loaded before in this process: never the copy of the code the directory carries, which
    AutoModelForCausalLM with trust_remote_code would pick where nothing registered the toolkit's classes. On
    `device` (default: this process's), or "cpu" for a model sharded afterwards."""
    from raven_layers import HybridForCausalLM

    return HybridForCausalLM.from_pretrained(str(model_dir)).to(device or Parallel().device)


def save_trained(parallel: Parallel, model, model_dir: Path, out: Path, base_model: str, lora=None) -> None:
    """The trained `model` saved by the main process as a model directory at `out` (atomic), with the code and
    tokenizer of `model_dir`, the directory it was trained from, whose weight files it left unchanged are
    hard-linked. A tensor at a time: under fsdp each is gathered as it comes, else copied from its device, and a
    LoRA-wrapped linear (adapters added as `lora`, a TrainConfig, says) is merged once its tensors came; the host
    holds about a weight file of each group (mixers, the rest) at a time, never the model whole. Every process must
    call it (the gathers are collective)."""
    from transformers import AutoTokenizer

    from raven_convert.export import save_hybrid
    from raven_convert.weights import whole_tensors

    tensors = whole_tensors(model, here=parallel.is_main)
    try:
        if parallel.is_main:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            saved = _merged(tensors, model, lora)
            save_hybrid(
                model, tokenizer, out, base_model=base_model, overwrite=True, link_from=model_dir, tensors=saved
            )
    finally:
        for _ in tensors:  # the rest of the gathers, which the other processes wait in (after a failed save too)
            pass


def _merged(tensors, model, lora):
    """weights.whole_tensors' pairs under the names they are saved under: a LoRA-wrapped linear's tensors folded into
    its base weights as soon as they all came, in that module's copy in a model built on the meta device (peft's own
    merge, as merge_lora does); the others as they come."""
    from raven_convert.train.lora import add_lora, lora_modules, merged
    from raven_layers import HybridForCausalLM

    wrapped = lora_modules(model)
    if not wrapped:
        yield from tensors
        return
    if lora is None:
        raise ValueError(f"{type(model).__name__} has LoRA adapters: pass the TrainConfig that added them (lora)")
    with torch.device("meta"):
        fresh = HybridForCausalLM(model.config)
    add_lora(fresh, lora)
    copies = lora_modules(fresh)
    counts = {owner: len(module.state_dict(keep_vars=True)) for owner, module in copies.items()}
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        owner = next((p for p in _prefixes(name) if p in wrapped), None)
        if owner is None:
            yield name, tensor
            continue
        parts = held.setdefault(owner, {})
        parts[name[len(owner) + 1 :]] = tensor
        if len(parts) == counts[owner]:
            module = copies[owner]
            # copies: the merge adds to the base weight in place, which a model on the CPU would share
            module.load_state_dict({k: v.clone() for k, v in held.pop(owner).items()}, assign=True)
            for local, value in merged(module).state_dict().items():
                yield f"{owner}.{local}", value
            module.to("meta")  # the module's copy lets its tensors go once the writer has them


def _prefixes(name: str) -> list[str]:
    """The module names a parameter name lies under, nearest first ("a.b.w" -> ["a.b", "a"])."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def hybrid_from_state(config, state: dict, buffers_from):
    """A HybridForCausalLM of `config` built on the meta device that takes the tensors of `state` as they are (so
    the host holds them once), the buffers no state dict holds (RoPE's inverse frequencies) copied from the model
    `buffers_from`; in eval mode, as from_pretrained gives a model."""
    from raven_layers import HybridForCausalLM

    with torch.device("meta"):
        fresh = HybridForCausalLM(config)
    fresh.load_state_dict(state, assign=True)
    for name, buffer in list(fresh.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            fresh.get_submodule(owner)._buffers[leaf] = buffers_from.get_buffer(name).detach().cpu()
    fresh.tie_weights()  # assign=True gave tied weights (embeddings and head) tensors of their own
    return fresh.eval()
