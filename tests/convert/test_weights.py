"""weights.py: a hybrid's weight files written as their tensors come (ShardWriter), as a model held in shards is
saved while it is gathered: the same files whatever the order, at most one file a group waiting in memory for
tensors in state-dict order, a link where an earlier model's file holds the same bytes, and an error naming the
tensor for one the model does not save, one that comes twice or with another size, and one that never comes."""

import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.weights import INDEX, ShardWriter, _holds, linkable, saved_names, shard_files
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
