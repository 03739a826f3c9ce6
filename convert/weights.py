"""A hybrid's weights on disk: the mixers' tensors in their own safetensors file (model-mixers.safetensors), the rest
in another (model-base.safetensors), both listed by a standard model.safetensors.index.json, so that any Hugging Face
loader reads the directory as usual. A stage that changed only the mixers (align; train with trainable: mixers)
hard-links the other file from the model directory it started from instead of writing a second copy of it.

    shards = weight_shards(model, "2GB")                  # {file name: {tensor name: tensor}}, a group over
                                                          # max_shard_size split into model-base-00001-of-00002...
    linked = unchanged_shards(shards, earlier, folder)    # the files `earlier` holds with the same tensors
    write_weights(shards, folder, linked, earlier)        # the index, the links and the new files
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from raven_convert.files import link_or_copy, write_json
from raven_convert.train.common import mixer_prefixes

INDEX = "model.safetensors.index.json"


def weight_shards(model, max_shard_size: int | str = "2GB") -> dict[str, dict[str, torch.Tensor]]:
    """The tensors `model` saves, by file: the mixers' in model-mixers*.safetensors, the others in
    model-base*.safetensors, each group split at `max_shard_size`. A tied weight (lm_head tied to the embeddings) is
    saved once, under the name loading expects, as save_pretrained does."""
    state = model.state_dict()
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        if target in state and source in state and _storage(state[target]) == _storage(state[source]):
            del state[target]  # safetensors refuses aliased tensors; loading ties it back
    prefixes = mixer_prefixes(model)
    groups = {"mixers": {}, "base": {}}
    for name, tensor in state.items():
        groups["mixers" if name.startswith(prefixes) else "base"][name] = tensor.detach().cpu().contiguous()
    shards = {}
    for group, tensors in groups.items():
        if tensors:
            pattern = f"model-{group}{{suffix}}.safetensors"
            split = split_torch_state_dict_into_shards(tensors, filename_pattern=pattern, max_shard_size=max_shard_size)
            shards |= {file: {n: tensors[n] for n in names} for file, names in split.filename_to_tensors.items()}
    return shards


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def shard_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def unchanged_shards(shards: dict, earlier: str | Path | None, folder: str | Path) -> set[str]:
    """The files of `shards` that the model directory `earlier` (None: none) holds with the same tensors (names,
    dtypes, shapes, bytes), when it lies on the file system of `folder` (where a link can point to it). A read of
    those files, never a write."""
    if earlier is None or os.stat(earlier).st_dev != os.stat(folder).st_dev:
        return set()
    return {file for file, tensors in shards.items() if _holds(Path(earlier) / file, tensors)}


def _holds(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the safetensors file `path` holds exactly `tensors`, byte for byte (so -0.0 is not 0.0, NaN is NaN)."""
    if not path.is_file():
        return False
    with safe_open(path, "pt") as f:
        if set(f.keys()) != set(tensors):
            return False
        for name, tensor in tensors.items():
            saved = f.get_tensor(name)
            if saved.dtype != tensor.dtype or saved.shape != tensor.shape:
                return False
            if not torch.equal(saved.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)):
                return False
    return True


def write_weights(shards: dict, folder: str | Path, linked: set[str] = frozenset(), earlier=None) -> None:
    """Write `shards` and their index into the new folder `folder`: the files in `linked` as hard links to those of
    `earlier` (a copy where links are not allowed), the others afresh."""
    folder = Path(folder)
    for file, tensors in shards.items():
        (folder / file).unlink(missing_ok=True)  # a new file: never write through a link into another model's file
        if file in linked:
            link_or_copy(str(Path(earlier) / file), str(folder / file))
        else:
            save_file(tensors, folder / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in sorted(tensors)}
    total = sum(shard_bytes(tensors) for tensors in shards.values())
    write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, folder / INDEX)
