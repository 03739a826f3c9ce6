"""Write a hybrid as a self-contained, hub-ready model directory, and push it to the Hub."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from raven_convert.bundle import write_code
from raven_convert.files import check_writable, normal_modes, replace_dir, room_for
from raven_convert.layer_choice_report import card_section, plot_choice
from raven_convert.weights import ShardWriter, linkable, own_tensors, saved_names, shard_files
from raven_layers import HybridForCausalLM

AUTO_MAP = {
    "AutoConfig": "configuration_hybrid.HybridConfig",
    "AutoModel": "modeling_hybrid.HybridModel",
    "AutoModelForCausalLM": "modeling_hybrid.HybridForCausalLM",
}


SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # what safetensors sharding understands


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to clobber a non-empty directory unless asked, or a folder this process cannot write in: checked
    before any heavy work."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it")
    check_writable(out, "--out", swapped=True)


def check_shard_size(size: str) -> None:
    """Refuse a --max-shard-size that save_pretrained cannot read, or one of less than a byte (ValueError)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]{2})\s*", str(size), re.IGNORECASE)
    if found is None or found[2].upper() not in SIZE_UNITS or float(found[1]) * SIZE_UNITS[found[2].upper()] < 1:
        raise ValueError(
            f"--max-shard-size {size!r} is not allowed; expected a positive size with a unit, such as 500MB or 2GB "
            f"(units: {', '.join(SIZE_UNITS)})"
        )


def save_hybrid(
    model: HybridForCausalLM,
    tokenizer,
    out_dir: str | Path,
    *,
    base_model: str,
    max_shard_size: str = "2GB",
    overwrite: bool = False,
    link_from: str | Path | None = None,
    tensors=None,
) -> Path:
    """Write `out_dir` atomically: config.json (with auto_map), safetensors shards (mixers and the rest apart, see
    weights.py), the modeling code (see bundle.py), tokenizer files, generation_config.json and a README.md model
    card. Exactly what `--push-to-hub` uploads. `link_from`: the model directory `model` was trained from; its
    weight files that hold the same tensors are hard-linked, not written again. `tensors`: (saved name, tensor on
    the CPU) pairs in any order, for a model whose weights are not whole in this process (sharded, or with LoRA
    adapters to merge: raven_convert.train.models.save_trained); default: the model's own, copied to the CPU one at
    a time. Each weight file is written as soon as its tensors came."""
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    names = saved_names(model)
    files = shard_files(model, names, max_shard_size)
    links = linkable(files, link_from, out.parent)  # linked where their tensors turn out unchanged
    written = sum(sum(sizes.values()) for file, sizes in files.items() if file not in links)
    with room_for(out.parent, written + (64 << 20), f"the model {out.name}"):  # a margin for tokenizer, code, card
        try:
            tmp.mkdir()
            model.config.auto_map = AUTO_MAP
            model.config.dtype = str(model.dtype).removeprefix("torch.")  # what save_pretrained records
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            writer = ShardWriter(tmp, files, links, link_from)
            for name, tensor in own_tensors(model, names) if tensors is None else tensors:
                writer.add(name, tensor)
            writer.close()
            write_code(model.config, tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "README.md").write_text(model_card(model, base_model))
            if getattr(model.config, "layer_choice", None):  # chosen by --layers auto:N: the scores' picture
                plot_choice(model.config.layer_choice, tmp / "layer_choice.png")
            normal_modes(tmp)
        except BaseException:  # a failure or Ctrl-C leaves no hidden half-written directory behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    replace_dir(tmp, out)  # the old directory disappears only once the new one is complete
    return out


def state_sizes(model: HybridForCausalLM) -> dict[str, int]:
    """Bytes per sequence: each mixer kind's constant state per layer, and an attention layer's KV cache per 1K
    tokens (a sliding-window layer stops growing at its window)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    sizes = {"attention_kv_per_1k_tokens": 2 * config.num_key_value_heads * head_dim * dtype_bytes * 1024}
    for layer, kind in zip(model.model.layers, config.layer_mixers):
        if kind != "attention":
            sizes[f"{kind}_state"] = layer.self_attn.state_numel() * 4  # counted as float32
    return sizes


def model_card(model: HybridForCausalLM, base_model: str) -> str:
    config = model.config
    kinds = config.layer_mixers
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    sizes = state_sizes(model)
    sinks = f", {model.model.sinks()} sinks" if model.model.sinks() else ""  # only where a kept layer is windowed
    table = "\n".join(
        f"| {i} | {k} |" if w is None else f"| {i} | {k} (sliding window {w}{sinks}) |"
        for i, (k, w) in enumerate(zip(kinds, model.model.windows))
    )
    settings = json.dumps(config.mixer_settings, indent=2, sort_keys=True)
    lines = [f"- Attention layer: KV cache of {sizes.pop('attention_kv_per_1k_tokens') / 1024:.0f} KiB per 1K tokens"]
    for key, size in sizes.items():
        kind = key.removesuffix("_state")
        state = config.mixer_spec(kind).state
        lines.append(f"- {kind} layer: constant state of {size / 1024:.0f} KiB (per key/value head: {state})")
    sizes_text = "\n".join(lines)
    n_params = sum(p.numel() for p in model.parameters())
    choice = "\n" + card_section(config.layer_choice) if getattr(config, "layer_choice", None) else ""
    steps = "\n" + _steps_section(config.converted_from) if getattr(config, "converted_from", None) else ""
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "base_model": base_model,
        "tags": ["raven-hybrid", "hybrid", "linear-attention", *sorted(set(kinds) - {"attention"}), "custom_code"],
    }
    front_yaml = "\n".join(
        f"{k}:\n" + "\n".join(f"- {x}" for x in v) if isinstance(v, list) else f"{k}: {v}" for k, v in front.items()
    )
    return f"""---
{front_yaml}
---

# Hybrid of {base_model}

`{base_model}` ({config.base_model_type} architecture, {len(kinds)} layers) with chosen attention layers replaced
by linear-time mixers: {", ".join(f"{n} {k}" for k, n in counts.items())}. {n_params / 1e6:.1f} M parameters.
Mixer layers start from the attention projections they replace; until they are trained, expect text of lower
quality than the base model's.

## Load and generate

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("THIS_REPO_OR_DIR", trust_remote_code=True)
# trust_remote_code here too: the tokenizer reads config.json, whose model type lives in the shipped code, and
# without it transformers stops to ask (a 15-second prompt in a terminal)
tokenizer = AutoTokenizer.from_pretrained("THIS_REPO_OR_DIR", trust_remote_code=True)
inputs = tokenizer("The capital of France is", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32)[0]))
```

Only `transformers` and `torch` are needed: the modeling code ships with the weights.

## Memory per sequence during generation

{sizes_text}

## Hyper-parameters

```json
{settings}
```

## Layer map

| layer | mixer |
| --- | --- |
{table}
{steps}{choice}"""


def _steps_section(chain: list[dict]) -> str:
    """The model card's account of a conversion in steps: the hybrids it was converted further from, oldest first."""
    rows = [
        f"- `{step['model']}`, which had converted layers "
        + ", ".join(f"{i} ({kind})" for i, kind in enumerate(step["layer_mixers"]) if kind != "attention")
        for step in chain
    ]
    return (
        "## Converted in steps\n\nThis hybrid was converted further from the last hybrid below, keeping its mixers "
        "with their trained\nweights; each was converted from the one before it:\n\n" + "\n".join(rows) + "\n"
    )


def push_to_hub(out_dir: str | Path, repo_id: str, *, private: bool = False, token: str | None = None, api=None):
    """Upload the exported directory as a model repository (created if missing)."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    return api.upload_folder(
        folder_path=str(out_dir), repo_id=repo_id, repo_type="model", commit_message="Upload hybrid model"
    )
