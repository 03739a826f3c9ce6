"""Model FLOPs per token and MFU of the training stages (convert/train/flops.py), counted by hand on tiny models."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train import flops
from tests.conftest import tiny_config

T = 100


def linear_weights(module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"))
    plan = plan_layers([("raven", "0"), ("sila", "1")], 4)
    hybrid = build_hybrid(teacher, plan, {}, attention_windows=[None, 16] * 2)
    return teacher, hybrid


def test_forward_counts_matrix_products_and_attention(models):
    teacher, hybrid = models
    width = 4 * 16  # heads x head_dim of the tiny config
    # 4 attending layers over T tokens; lm_head (tied or not) is a product, the embedding lookup is not
    assert flops.forward_flops(teacher, T) == 2 * linear_weights(teacher) + 4 * width * T * 4
    # the hybrid attends in layers 2 (full) and 3 (window 16); its mixers count their linear layers
    assert flops.forward_flops(hybrid, T) == 2 * linear_weights(hybrid) + 4 * width * (T + 16)
    mistral = AutoModelForCausalLM.from_config(tiny_config("mistral"))  # every layer windowed at 8
    assert flops.forward_flops(mistral, T) == 2 * linear_weights(mistral) + 4 * width * 8 * 4


def test_a_model_without_attention_heads_counts_its_linear_layers(models):
    class Recurrent(nn.Module):
        config = type("Config", (), {"hidden_size": 8})()

        def __init__(self):
            super().__init__()
            self.mix, self.head = nn.Linear(8, 8), nn.Linear(8, 32)

    assert flops.forward_flops(Recurrent(), T) == 2 * (8 * 8 + 8 * 32)


def test_stage_counts(models):
    teacher, hybrid = models
    forward = flops.forward_flops(hybrid, T)
    assert flops.train_flops(hybrid, T) == 3 * forward
    assert flops.train_flops(hybrid, T, teacher) == 3 * forward + flops.forward_flops(teacher, T)
    mixers = linear_weights(hybrid.model.layers[0].self_attn) + linear_weights(hybrid.model.layers[1].self_attn)
    head = 2 * teacher.lm_head.weight.numel()  # align has the head compute one position per row
    assert mixers > 0 and flops.align_flops(teacher, hybrid, T) == flops.forward_flops(teacher, T) - head + 6 * mixers


def test_mfu_of_known_and_unknown_devices(monkeypatch):
    assert flops.peak_flops("cpu") is None and flops.mfu(1e12, "cpu") is None and flops.mfu_text(None) == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert flops.peak_flops("cuda:0") == 989e12
    assert flops.mfu(989e12, "cuda:0", processes=2) == pytest.approx(0.5)
    assert flops.mfu_text(0.1234) == " | MFU 12.3%"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert flops.mfu(1e12, "cuda:0") is None
