"""Stage 2's settings: bad values are refused naming the field; tau follows the run unless fixed; patterns need their
mode, and a rate for the pretrained weights needs them to train (graphs' obstacles: test_graphs.py)."""

import re

import pytest
from pydantic import ValidationError

from raven_convert.train.stage2_config import TrainConfig


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"stepz": 3}, "stepz"),
        ({"steps": 0}, "steps"),
        ({"lr": 0}, "lr"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"schedule": "linear"}, "schedule"),
        ({"trainable": "adapters"}, "trainable"),
        ({"trainable": "patterns", "trainable_patterns": ["("]}, "trainable_patterns"),
        ({"kd_weight": -1}, "kd_weight"),
        ({"kd_temperature": 0}, "kd_temperature"),
        ({"answer_weight": 0.5}, "answer_weight"),
        ({"trainable": "all", "pretrained_lr_scale": 0}, "pretrained_lr_scale"),
        ({"trainable": "all", "pretrained_lr_scale": 2}, "pretrained_lr_scale"),
        ({"mixed_precision": "fp16"}, "mixed_precision"),
        ({"save_every": 0}, "save_every"),
        ({"lora_targets": ["q proj"]}, "lora_targets"),
    ],
)
def test_config_rejects_bad_values(bad, field):
    with pytest.raises(ValidationError, match=field):
        TrainConfig(**{"steps": 1, **bad})
    assert TrainConfig(steps=1, grad_clip=None).grad_clip is None


def test_tau_is_a_share_of_the_run_unless_fixed():
    assert TrainConfig(steps=3).tau_tokens(1000) == pytest.approx(100.0)  # default: 0.1 of the run
    assert TrainConfig(steps=3, token_weight_tau_fraction=0.5).tau_tokens(1000) == pytest.approx(500.0)
    assert TrainConfig(steps=3, token_weight_tau=7.0).tau_tokens(1000) == 7.0
    with pytest.raises(ValidationError, match="token_weight_tau and token_weight_tau_fraction are both set"):
        TrainConfig(steps=3, token_weight_tau=7.0, token_weight_tau_fraction=0.2)


def test_patterns_need_their_mode():
    with pytest.raises(ValidationError, match="needs trainable_patterns"):
        TrainConfig(steps=1, trainable="patterns")
    with pytest.raises(ValidationError, match="only apply with trainable = 'patterns'"):
        TrainConfig(steps=1, trainable="all", trainable_patterns=["mlp"])
    assert TrainConfig(steps=1, trainable="lora").uses_lora and not TrainConfig(steps=1).uses_lora


def test_a_pretrained_rate_needs_pretrained_weights_to_train():
    for trainable in ("mixers", "mixers+lora", "lora"):
        with pytest.raises(ValidationError, match=re.escape(f"trainable = '{trainable}' trains none of them")):
            TrainConfig(steps=1, trainable=trainable, pretrained_lr_scale=0.1)
    assert TrainConfig(steps=1, trainable="all", pretrained_lr_scale=0.1).pretrained_lr_scale == 0.1
    assert "pretrained_lr_scale" not in TrainConfig(steps=1).model_dump()  # older runs' fingerprints stand
