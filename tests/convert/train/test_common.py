"""What align and train share (convert/train/common.py): the layers they train, a batch's inputs, the schedule."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.common import (
    attention_layers,
    converted_layers,
    document_mask,
    lr_at,
    mixer_parameters,
    model_inputs,
    teacher_mask,
)
from raven_layers.masks import find_packed_documents
from tests.conftest import tiny_config


def test_layers_and_mixer_parameters():
    source = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hybrid = build_hybrid(source, plan_layers([("raven", "0"), ("sila", "2")], 4), {})
    assert converted_layers(hybrid) == [0, 2] and attention_layers(hybrid) == [1, 3]
    names = {n for n, p in hybrid.named_parameters() if any(p is q for q in mixer_parameters(hybrid))}
    assert names == {
        n
        for n, _ in hybrid.named_parameters()
        if n.startswith(("model.layers.0.self_attn.", "model.layers.2.self_attn."))
    }


def test_model_inputs_of_packed_and_padded_rows():
    ids, positions, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 0]]), torch.ones(1, 3, dtype=torch.long)
    packed = model_inputs({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    assert set(packed) == {"input_ids", "position_ids"} and packed["position_ids"] is positions  # no copy
    padded = model_inputs({"input_ids": ids, "attention_mask": mask}, torch.device("meta"))
    assert set(padded) == {"input_ids", "attention_mask"} and padded["attention_mask"].device.type == "meta"
    assert model_inputs({"input_ids": ids}, "cpu") == {"input_ids": ids, "attention_mask": None}


def test_lr_warms_up_then_follows_a_cosine_to_a_tenth_or_stays():
    lr = lambda step, schedule="cosine": lr_at(step, 1.0, steps=12, warmup_steps=2, schedule=schedule)  # noqa: E731
    assert [lr(0), lr(1)] == [0.5, 1.0]  # linear warmup, reaching lr at its last step
    assert lr(2) == 1.0 and lr(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr(12) == pytest.approx(0.1) and lr(50) == pytest.approx(0.1)  # after `steps`: stays at 10%
    assert [lr(0, "constant"), lr(11, "constant")] == [0.5, 1.0]
    assert lr_at(0, 3e-4, steps=1) == 3e-4  # no warmup, one step
    with pytest.raises(ValueError, match="schedule = 'linear'"):
        lr_at(5, 1.0, 10, schedule="linear")


def test_one_schedule_drives_align_and_train():
    from raven_convert.train import align, stage2

    assert align.lr_at is stage2.lr_at is lr_at
    assert align.model_inputs is stage2.model_inputs is model_inputs


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_teacher_mask_is_ready_made_for_packed_documents_under_sdpa_only(attention):
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=attention)
    positions = torch.cat([torch.arange(n) for n in (5, 1, 10)]).repeat(2, 1)  # [2, 16]
    packed = find_packed_documents(positions)
    padding = torch.ones(2, 16, dtype=torch.long)
    got = teacher_mask(teacher, packed)
    if attention == "sdpa":  # transformers would read the position ids back to build it
        assert got.shape == (2, 1, 16, 16) and torch.equal(got, document_mask(packed[0]))
        assert got[0, 0, 6].tolist() == [False] * 6 + [True] + [False] * 9  # a one-token document sees itself
    else:  # the eager attention builds its own from the position ids
        assert got is None
    assert teacher_mask(teacher, None, padding) is padding and teacher_mask(teacher, False) is None
