"""What identifies a loaded model for the caches (raven_convert.sources.model_fingerprint)."""

import shutil

import torch
from transformers import AutoModelForCausalLM

from raven_convert.sources import model_fingerprint


def test_the_same_weights_from_another_path_hash_the_same(tiny_sources, tmp_path):
    moved = shutil.copytree(tiny_sources["llama"], tmp_path / "elsewhere")
    here = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    there = AutoModelForCausalLM.from_pretrained(moved)
    assert model_fingerprint(here) == model_fingerprint(there)
    with torch.no_grad():
        there.model.layers[0].mlp.up_proj.weight.view(-1)[0] += 1e-3  # the first value is always sampled
    assert model_fingerprint(here) != model_fingerprint(there)
    assert model_fingerprint(here) != model_fingerprint(here.to(torch.bfloat16))
