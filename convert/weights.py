"""A hybrid's weights on disk: the mixers' tensors in their own safetensors file (model-mixers.safetensors), the rest
in another (model-base.safetensors), both listed by a standard model.safetensors.index.json, so that any Hugging Face
loader reads the directory as usual. A stage that changed only the mixers (align; train with trainable: mixers)
hard-links the other file from the model directory it started from instead of writing a second copy of it.

The files are written as their tensors come, so that a model held in shards (fsdp) is saved while it is gathered,
never whole in one process's memory:

    names = saved_names(model)                    # {state-dict name: the name it is saved under}
    files = shard_files(model, names, "2GB")      # {file: {saved name: bytes}}, a group over max_shard_size split
                                                  # into model-base-00001-of-00002...
    links = linkable(files, earlier, folder)      # the files the model directory `earlier` may lend unchanged
    writer = ShardWriter(folder, files, links, earlier)
    for name, tensor in tensors:                  # any order: a file is written (or linked) once its last tensor came
        writer.add(name, tensor)
    writer.close()                                # the index
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import save_file

from raven_convert.files import link_or_copy, mappings, write_json
from raven_convert.train.common import mixer_prefixes
from raven_convert.train.distributed import full_tensor
from raven_convert.train.lora import is_lora

INDEX = "model.safetensors.index.json"


def tied_copies(model) -> set[str]:
    """The state-dict names of weights tied to another one (lm_head to the embeddings): the same parameter under a
    second name, saved once under the first (loading ties it back, as save_pretrained does)."""
    tied = set()
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        try:
            if model.get_parameter(target) is model.get_parameter(source):
                tied.add(target)
        except AttributeError:  # a name this model does not have
            continue
    return tied


def saved_names(model) -> dict[str, str]:
    """{state-dict name: the name it is saved under} of the tensors a model directory holds, in state-dict order: a
    LoRA-wrapped linear's base weights under the plain linear's names (what merging the adapters leaves), the
    adapters' own weights and tied copies left out."""
    skip = tied_copies(model)
    return {
        name: name.replace(".base_layer.", ".")
        for name in model.state_dict(keep_vars=True)
        if name not in skip and not is_lora(name)
    }


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` takes in a file: a sharded one (DTensor) counted whole."""
    return tensor.numel() * tensor.element_size()


def shard_files(model, names: dict[str, str], max_shard_size: int | str = "2GB") -> dict[str, dict[str, int]]:
    """{file: {saved name: bytes}} for the tensors `names` saves: the mixers' in model-mixers*.safetensors, the others
    in model-base*.safetensors, each group split at `max_shard_size` in state-dict order (as huggingface_hub splits
    a state dict; a tensor over the size gets a file of its own)."""
    prefixes = mixer_prefixes(model)
    state = model.state_dict(keep_vars=True)
    groups = {"mixers": {}, "base": {}}
    for name, saved in names.items():
        groups["mixers" if saved.startswith(prefixes) else "base"][saved] = state[name]
    files = {}
    for group, tensors in groups.items():
        if tensors:
            pattern = f"model-{group}{{suffix}}.safetensors"
            split = split_state_dict_into_shards_factory(
                tensors, get_storage_size=nbytes, filename_pattern=pattern, max_shard_size=max_shard_size
            )
            files |= {file: {n: nbytes(tensors[n]) for n in keys} for file, keys in split.filename_to_tensors.items()}
    return files


def linkable(files: dict[str, dict[str, int]], earlier: str | Path | None, folder: str | Path) -> set[str]:
    """The files that the model directory `earlier` (None: none) holds under the same name with the same tensor
    names, when it lies on the file system of `folder` (where a link can point to it): the files that may be linked
    rather than written, once their tensors are found unchanged. Reads the files' headers only."""
    if earlier is None or Path(earlier).stat().st_dev != Path(folder).stat().st_dev:
        return set()
    found = set()
    for file, sizes in files.items():
        path = Path(earlier) / file
        if path.is_file():
            with safe_open(path, "pt") as f:
                if set(f.keys()) == set(sizes):
                    found.add(file)
    return found


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _holds(path: Path, tensors: dict[str, torch.Tensor], chunk: int = 1 << 26) -> bool:
    """Whether the safetensors file `path` holds exactly `tensors`, byte for byte (so -0.0 is not 0.0, NaN is NaN).
    A tensor that is the file's own bytes, mapped in place at its entry and unwritten since (_file_views: a model
    read from this file by safetensors), holds without being read: touching it would bring the whole file into this
    process's resident memory (the 8B plan's align: docs/SCALE_OUT.md). Any other is compared with the file, read
    `chunk` bytes at a time, not mapped: its pages stay in the page cache, not in this process. A dtype without a
    safetensors name here counts as changed: the file is written afresh."""
    views = _file_views(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        if set(header) != set(tensors):
            return False
        buffer = bytearray(chunk)
        for name, tensor in tensors.items():
            entry = header[name]
            if entry["dtype"] != SAFETENSORS_DTYPES.get(tensor.dtype) or entry["shape"] != list(tensor.shape):
                return False
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes], as many as the entry holds
            start = 8 + length + entry["data_offsets"][0]
            if data.device.type == "cpu" and _maps(views, data.data_ptr(), data.numel(), start):
                continue
            f.seek(start)
            for offset in range(0, data.numel(), chunk):
                want = min(chunk, data.numel() - offset)
                if f.readinto(memoryview(buffer)[:want]) != want:  # a file cut short
                    return False
                read = torch.frombuffer(buffer, dtype=torch.uint8, count=want)
                if not torch.equal(read, data[offset : offset + want]):
                    return False
    return True


def _file_views(path: Path) -> list[tuple[int, int, int]]:
    """(start address, end address, file offset of start) of this process's mappings of the file at `path` whose
    every page still reads as the file: shared ones, and private ones without a page of their own (a write to a
    private mapping copies the page: smaps' Anonymous, or Swap once such a page is swapped out). Sorted by address;
    none off Linux (files.mappings)."""
    stat = Path(path).stat()
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
    return sorted(
        (m["start"], m["end"], m["offset"])
        for m in mappings()
        if m["device"] == device
        and m["inode"] == stat.st_ino
        and (m["shared"] or m.get("Anonymous", 0) + m.get("Swap", 0) == 0)
    )


def _maps(views: list[tuple[int, int, int]], address: int, size: int, offset: int) -> bool:
    """Whether the `size` bytes at `address` are, through `views` (_file_views), the file's bytes at `offset`."""
    end = address + size
    for start, stop, at in views:
        if start <= address < stop:
            if at + (address - start) != offset:
                return False
            offset += stop - address
            address = stop
            if address >= end:
                return True
    return size == 0


def whole_tensors(model, here: bool = True):
    """(state-dict name, tensor) of every tensor of `model` but tied copies, one at a time, so that the host never
    holds the model whole: a shard (fsdp) gathered whole as it comes (every process of the launch must run this to
    the end), on the CPU where `here`, None elsewhere (the processes that only take part in the gathers)."""
    tied = tied_copies(model)
    for name, tensor in model.state_dict().items():
        if name not in tied:
            whole = full_tensor(tensor)
            yield name, whole.detach().cpu() if here else None


def own_tensors(model, names: dict[str, str]):
    """(saved name, tensor on the CPU) of a model held whole in this process, one tensor at a time (whole_tensors).
    ValueError for a model with LoRA adapters, whose base weights alone are not what it computes: merge them first
    (raven_convert.train.lora.merge_lora)."""
    if any(is_lora(name) for name in model.state_dict(keep_vars=True)):
        raise ValueError(f"{type(model).__name__} has LoRA adapters: merge them into its weights before saving it")
    return ((names[name], tensor) for name, tensor in whole_tensors(model) if name in names)


class ShardWriter:
    """The weight files `files` ({file: {saved name: bytes}}, shard_files) written into the new folder `folder` as
    their tensors come: a file as soon as its last tensor came, as a hard link to `earlier`'s file of that name
    when it is one of `links` (linkable) and holds the same bytes, afresh otherwise. Only the tensors of files not
    yet complete wait in memory: one file a group for tensors that come in state-dict order."""

    def __init__(self, folder: str | Path, files: dict, links: set[str] = frozenset(), earlier=None):
        self.folder, self.files, self.links, self.earlier = Path(folder), files, links, earlier
        self.file_of = {name: file for file, sizes in files.items() for name in sizes}
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}
        self.done: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take the tensor saved as `name` (on the CPU); write its file if it was the last one missing."""
        file = self.file_of.get(name)
        if file is None or name in self.waiting.get(file, {}) or file in self.done:
            raise ValueError(f"tensor {name!r} is not one this model saves, or came twice")
        if nbytes(tensor) != self.files[file][name]:
            expected = self.files[file][name]
            raise ValueError(f"tensor {name!r} has {nbytes(tensor):,} bytes; the model's own has {expected:,}")
        tensors = self.waiting.setdefault(file, {})
        tensors[name] = tensor.detach().contiguous()
        if len(tensors) == len(self.files[file]):
            self._write(file, self.waiting.pop(file))

    def _write(self, file: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.folder / file
        path.unlink(missing_ok=True)  # a new file: never write through a link into another model's file
        if file in self.links and _holds(Path(self.earlier) / file, tensors):
            link_or_copy(str(Path(self.earlier) / file), str(path))
        else:
            save_file(tensors, path, metadata={"format": "pt"})
        self.done.add(file)

    def close(self) -> None:
        """Write the index; ValueError naming a tensor that never came."""
        waiting = {name for tensors in self.waiting.values() for name in tensors}
        missing = [name for name in self.file_of if self.file_of[name] not in self.done and name not in waiting]
        if missing:
            raise ValueError(f"{len(missing)} of the model's tensors never came to be saved, among them {missing[0]!r}")
        weight_map = {name: file for file, sizes in self.files.items() for name in sorted(sizes)}
        total = sum(sum(sizes.values()) for sizes in self.files.values())
        write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, self.folder / INDEX)
