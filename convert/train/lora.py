"""What stage 2 trains of a model (`trainable` of a stage2_config.TrainConfig, the `config` below), and LoRA's adapters:
injected in place on the layers that kept attention (of every layer in a plain model), and merged back into the
base weights for export.

    params = select_trainable(hybrid, config)   # sets requires_grad; injects LoRA for "mixers+lora" and "lora"
    groups = lr_groups(hybrid, config)          # AdamW's groups: the new weights at lr, the pretrained ones scaled
    merge_lora(hybrid); hybrid.save_pretrained(out)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from raven_convert.train.common import attention_layers, is_hybrid, mixer_parameters, mixer_prefixes

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_layer_type():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def add_lora(model, config) -> None:
    """Inject LoRA adapters (in place) on `lora_targets`: of the layers that kept attention in a hybrid, of every
    module so named in any other model (ValueError naming the targets when none is found); no-op if present. The
    adapters are drawn from `config.seed` alone, so every process of a launch starts from the same ones (fsdp shards
    them as each process drew them; ddp would broadcast the main process's), and the random state is left as it
    was."""
    from peft import LoraConfig, inject_adapter_in_model

    if any(isinstance(m, _lora_layer_type()) for m in model.modules()):
        return
    names = "|".join(re.escape(t) for t in config.lora_targets)
    if is_hybrid(model):
        kept = [str(i) for i in attention_layers(model)]
        if not kept:
            return
        target = rf"model\.layers\.({'|'.join(kept)})\.(self_attn|mlp)\.({names})"
    else:
        target = rf"(.*\.)?({names})"  # peft matches the whole module name
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        if not set(config.lora_targets) & set(linear):
            raise ValueError(
                f"lora_targets {config.lora_targets} name no module of {type(model).__name__}; its linear layers "
                f"are named {linear}"
            )
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=target)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(config.seed)
        inject_adapter_in_model(lora, model)


def lora_modules(model) -> dict[str, nn.Module]:
    """{name: module} of the modules of `model` that LoRA wrapped (peft's LoraLayer)."""
    lora_type = _lora_layer_type()
    return {name: module for name, module in model.named_modules() if isinstance(module, lora_type)}


def merged(module: nn.Module) -> nn.Module:
    """The base module of a LoRA-wrapped one with its adapters folded into its weights."""
    module.merge()
    return module.get_base_layer()


def merge_lora(model) -> nn.Module:
    """Fold every LoRA adapter into its base weight and put the plain base module back (for save_pretrained)."""
    for name, module in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, merged(module))
    return model


def is_lora(name: str) -> bool:
    """Whether a parameter name is one of peft's LoRA adapter weights (not a mixer's own low-rank weights)."""
    return re.search(r"\.lora_(A|B)\.", name) is not None


def select_trainable(model, config) -> list[nn.Parameter]:
    """Set requires_grad per `config.trainable` (injecting LoRA if asked) and return the trainable parameters.
    ValueError when the choice fits no part of the model: mixers of a model that is not a hybrid, patterns that
    match no parameter name."""
    if config.trainable.startswith("mixers") and not is_hybrid(model):
        raise ValueError(
            f"trainable = {config.trainable!r} trains a converted hybrid's mixers, and {type(model).__name__} is not "
            "a hybrid; choose 'all', 'patterns' (with trainable_patterns) or 'lora' (with lora_targets)"
        )
    if config.trainable == "all":
        chosen = set(id(p) for p in model.parameters())
    elif config.trainable == "patterns":
        found = [re.compile(p) for p in config.trainable_patterns]
        chosen = {id(p) for n, p in model.named_parameters() if any(r.search(n) for r in found)}
        if not chosen:
            names = [n for n, _ in model.named_parameters()][:4]
            raise ValueError(
                f"trainable_patterns {config.trainable_patterns} match no parameter of {type(model).__name__} "
                f"(its names look like {names})"
            )
    else:
        chosen = {id(p) for p in mixer_parameters(model)} if config.trainable.startswith("mixers") else set()
        if config.uses_lora:
            add_lora(model, config)
            chosen |= {id(p) for n, p in model.named_parameters() if is_lora(n)}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    return [p for p in model.parameters() if p.requires_grad]


def lr_groups(model, config) -> list[dict]:
    """AdamW's parameter groups of `model`'s trainable parameters (after select_trainable, and after sharding, which
    keeps the names): the new weights (a hybrid's mixers, LoRA's adapters) at `config.lr`, the pretrained ones (every
    other: kept attention, MLPs, norms, embeddings) at `config.pretrained_lr_scale` of it. Each group carries its
    `lr_scale`, which graphs.set_lr applies to the schedule's rate; groups without parameters are left out. At a
    scale of 1 all are one group, as before the setting existed, so that older checkpoints resume."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.pretrained_lr_scale == 1:
        return [{"params": [p for _, p in trainable], "lr": config.lr, "lr_scale": 1.0}]
    prefixes = mixer_prefixes(model) if is_hybrid(model) else ()
    new, pretrained = [], []
    for name, p in trainable:
        (new if is_lora(name) or name.startswith(prefixes) else pretrained).append(p)
    scales = [(new, 1.0), (pretrained, config.pretrained_lr_scale)]
    return [{"params": ps, "lr": config.lr * scale, "lr_scale": scale} for ps, scale in scales if ps]
