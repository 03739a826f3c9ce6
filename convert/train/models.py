"""The models of the recipe's stages: the frozen teacher and the hybrid, loaded and placed for this launch, the
trained model gathered whole, and saved as a model directory.

    teacher = load_teacher(recipe, parallel)            # sharded under fsdp, a full copy per process else
    start = load_teacher(recipe, parallel, recipe.start_from)   # align's teacher in a further conversion
    student = load_hybrid(model_dir, "cpu")             # the toolkit's own HybridForCausalLM
    whole = whole_model(parallel, student, model_dir)   # on the main process, None on the others
    save_model(whole, model_dir, out, base_model)       # atomic: weights (unchanged files linked), code, tokenizer
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


def whole_model(parallel: Parallel, model, model_dir: Path, lora=None):
    """The trained `model` whole on the main process, None on the others. Under fsdp its shards are gathered into a
    copy of `model_dir`'s model built on the meta device (with LoRA adapters added as `lora`, a TrainConfig, says)
    that takes the gathered tensors as they are: the host holds the model once, not the gathered state and a
    second copy read from disk. Every process must call it."""
    if not parallel.sharded:
        return model if parallel.is_main else None
    state = parallel.full_state_dict(model)
    if not parallel.is_main:
        return None
    from raven_layers import HybridConfig

    return hybrid_from_state(HybridConfig.from_pretrained(str(model_dir)), state, model, lora)


def hybrid_from_state(config, state: dict, buffers_from, lora=None):
    """A HybridForCausalLM of `config` built on the meta device that takes the tensors of `state` as they are (so
    the host holds them once), with LoRA adapters added first as `lora` (a TrainConfig) says, the buffers no state
    dict holds (RoPE's inverse frequencies) copied from the model `buffers_from`; in eval mode, as from_pretrained
    gives a model."""
    from raven_layers import HybridForCausalLM

    with torch.device("meta"):
        fresh = HybridForCausalLM(config)
    if lora is not None and lora.uses_lora:
        from raven_convert.train.lora import add_lora

        add_lora(fresh, lora)
    fresh.load_state_dict(state, assign=True)
    for name, buffer in list(fresh.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            fresh.get_submodule(owner)._buffers[leaf] = buffers_from.get_buffer(name).detach().cpu()
    fresh.tie_weights()  # assign=True gave tied weights (embeddings and head) tensors of their own
    return fresh.eval()


def save_model(model, model_dir_from: Path, out: Path, base_model: str) -> None:
    """A complete model dir at `out` (atomic): weights of `model`, code and tokenizer of `model_dir_from`, whose
    weight files `model` left unchanged (the non-mixer one after align or trainable: mixers) are hard-linked."""
    from transformers import AutoTokenizer

    from raven_convert.export import save_hybrid

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir_from))
    save_hybrid(model.cpu(), tokenizer, out, base_model=base_model, overwrite=True, link_from=model_dir_from)
