"""weights.py: a hybrid's weight files written as their tensors come (ShardWriter), as a model held in shards is
saved while it is gathered: the same files whatever the order, at most one file a group waiting in memory for
tensors in state-dict order, a link where an earlier model's file holds the same bytes, and an error naming the
tensor for one the model does not save, one that comes twice or with another size, and one that never comes."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.weights import INDEX, ShardWriter, linkable, saved_names, shard_files
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
