"""weights.py: a hybrid's weight files written as their tensors come (ShardWriter), as a model held in shards is
saved while it is gathered: the same files whatever the order, at most one file a group waiting in memory for
tensors in state-dict order, a link where an earlier model's file holds the same bytes, and an error naming the
tensor for one the model does not save, one that comes twice or with another size, and one that never comes."""

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.weights import INDEX, ShardWriter, _holds, _maps, linkable, saved_names, shard_files
from tests.helpers import read_weights

SMALL = "20KB"  # several files a group for the tiny model


@pytest.fixture
def model(tiny_sources):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["qwen2"]).eval()  # tied embeddings and head
    return build_hybrid(teacher, plan_layers([("sila", "1"), ("raven", "2")], 4), {})


def pairs(model) -> list[tuple[str, torch.Tensor]]:
    state = model.state_dict()
    return [(saved, state[name]) for name, saved in saved_names(model).items()]


def write(folder, files, tensors, **kwargs) -> ShardWriter:
    folder.mkdir()
    writer = ShardWriter(folder, files, **kwargs)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()
    return writer


def test_the_files_are_the_same_whatever_order_the_tensors_come_in(model, tmp_path):
    files = shard_files(model, saved_names(model), SMALL)
    assert sum(file.startswith("model-mixers-") for file in files) > 1 and sum("base-" in f for f in files) > 1
    assert "lm_head.weight" not in {name for sizes in files.values() for name in sizes}  # tied: saved once
    shuffled = pairs(model)
    random.Random(0).shuffle(shuffled)
    write(tmp_path / "ordered", files, pairs(model))
    write(tmp_path / "shuffled", files, shuffled)
    for file in [*files, INDEX]:
        assert (tmp_path / "ordered" / file).read_bytes() == (tmp_path / "shuffled" / file).read_bytes(), file
    saved = read_weights(tmp_path / "ordered")
    assert set(saved) == {name for name, _ in pairs(model)}
    for name, tensor in pairs(model):
        assert torch.equal(saved[name], tensor), name


def test_tensors_in_state_dict_order_wait_one_file_a_group_at_most(model, tmp_path):
    files = shard_files(model, saved_names(model), SMALL)
    (tmp_path / "out").mkdir()
    writer = ShardWriter(tmp_path / "out", files)
    most = 0
    for name, tensor in pairs(model):
        writer.add(name, tensor)
        most = max(most, len(writer.waiting))
    writer.close()
    assert most <= 2 and writer.done == set(files)


def test_a_file_an_earlier_model_holds_with_the_same_bytes_is_linked(model, tmp_path):
    files = shard_files(model, saved_names(model), SMALL)
    write(tmp_path / "earlier", files, pairs(model))
    changed = next(name for name, _ in pairs(model) if name.startswith("model.layers.1.self_attn."))
    later = [(name, tensor + 1 if name == changed else tensor) for name, tensor in pairs(model)]
    links = linkable(files, tmp_path / "earlier", tmp_path)
    assert links == set(files)  # every file holds the same names: each may be linked, once its bytes are checked
    write(tmp_path / "later", files, later, links=links, earlier=tmp_path / "earlier")
    for file, sizes in files.items():
        same = (tmp_path / "later" / file).stat().st_ino == (tmp_path / "earlier" / file).stat().st_ino
        assert same == (changed not in sizes), file


@pytest.mark.parametrize("chunk", [1 << 26, 7])  # one read a tensor; reads that cut tensors at odd bytes
def test_a_file_holds_tensors_only_byte_for_byte(chunk, tmp_path):
    """_holds reads the file (not mapped) and compares bytes: -0.0 is not 0.0, a NaN is its own bytes, and another
    dtype, shape, name set, or a file cut short is not the same; a dtype safetensors names not here counts as
    changed."""
    tensors = {
        "a": torch.tensor([0.0, 1.5, float("nan")], dtype=torch.bfloat16),
        "b": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        "c": torch.zeros(0, 5),
        "d": torch.tensor([True, False]),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    assert _holds(path, tensors, chunk)
    assert _holds(path, {k: v.clone() for k, v in tensors.items()}, chunk)
    assert not _holds(path, tensors | {"a": torch.tensor([-0.0, 1.5, float("nan")], dtype=torch.bfloat16)}, chunk)
    assert not _holds(path, tensors | {"b": tensors["b"].reshape(6, 4)}, chunk)  # same bytes, another shape
    assert not _holds(path, tensors | {"b": tensors["b"].view(torch.int32)}, chunk)  # same bytes, another dtype
    assert not _holds(path, tensors | {"b": tensors["b"] + (torch.arange(24).reshape(2, 3, 4) == 23)}, chunk)
    assert not _holds(path, {k: v for k, v in tensors.items() if k != "d"}, chunk)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-3])
    assert not _holds(cut, tensors, chunk)
    complex_ = {"z": torch.zeros(2, dtype=torch.complex64)}
    save_file(complex_, tmp_path / "z.safetensors")
    assert not _holds(tmp_path / "z.safetensors", complex_, chunk)


def _rss_file_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_tensor_the_file_maps_in_place_holds_unread_and_a_written_one_is_compared(tmp_path):
    """A model read by safetensors is the file mapped in place: _holds takes those tensors as the file's bytes
    without touching them (which would bring the whole file into this process), but once a tensor is written to
    (its page copied), or where a mapped tensor is another entry's bytes, it compares."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(16, 1024, 256), "b": torch.arange(1000.0)}, path)  # a: 16 MiB
    mapped = load_file(path)
    before = _rss_file_kib()
    assert _holds(path, mapped)
    assert _rss_file_kib() - before < 4096  # read, the 16 MiB would be resident now

    mapped["b"][999] = -1.0  # a private mapping: the page is this process's own from now on
    assert not _holds(path, mapped)
    mapped["b"][999] = 999.0  # the file's bytes again, in a page of its own: compared, they hold
    assert _holds(path, mapped)

    other = load_file(path)  # a's bytes where b's entry is: b's dtype and shape, mapped, but at a's offset
    assert not _holds(path, {"a": other["a"], "b": other["a"].reshape(-1)[:1000]})
    assert _holds(path, {"a": other["a"], "b": other["b"]})


def test_maps_follows_a_range_across_adjacent_views_of_a_file():
    views = [(0x1000, 0x2000, 0), (0x2000, 0x3000, 0x1000), (0x5000, 0x6000, 0x4000)]  # (start, end, file offset)
    assert _maps(views, 0x1800, 0x1000, 0x800)  # across the first two, which continue the file
    assert not _maps(views, 0x1800, 0x1000, 0x900)  # another offset of the file
    assert not _maps(views, 0x2800, 0x1000, 0x1800)  # runs into the gap after the second
    assert not _maps(views, 0x8000, 16, 0x7000)  # not a view of the file
    assert _maps(views, 0x5000, 0x1000, 0x4000) and _maps([], 0x5000, 0, 0)


def test_a_stream_that_is_not_the_models_is_refused_naming_the_tensor(model, tmp_path):
    files = shard_files(model, saved_names(model), SMALL)
    (tmp_path / "out").mkdir()
    writer = ShardWriter(tmp_path / "out", files)
    name, tensor = pairs(model)[0]
    with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight' is not one this model saves"):
        writer.add("model.layers.9.mlp.up_proj.weight", tensor)
    with pytest.raises(ValueError, match=rf"{name!r} has {tensor.numel() * 2:,} bytes; the model's own has"):
        writer.add(name, tensor.half())
    writer.add(name, tensor)
    with pytest.raises(ValueError, match="came twice"):
        writer.add(name, tensor)
    with pytest.raises(ValueError, match=rf"{len(pairs(model)) - 1} of the model's tensors never came"):
        writer.close()
