"""What the hybrid relies on in transformers' cache API, checked against the installed release.

CI runs these under the newest transformers and again under the oldest one pyproject.toml accepts
(scripts/dev/test_oldest_transformers.sh); every failure names the release, so a breaking change is found by version.
"""

import dataclasses
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging as hf_logging

from raven_convert import build_hybrid, plan_layers
from raven_layers import ARCHITECTURES, HybridCache, output_cache
from raven_layers.cache import OUTPUT_CACHE_FIELD, cache_argument
from raven_layers.common import one_cache

pytestmark = pytest.mark.transformers_api
RELEASE = f"transformers {transformers.__version__}"
SETTINGS = {"raven": {"num_slots": 8, "top_k": 2, "chunk_size": 4}, "sila": {"chunk_size": 4}}


@pytest.fixture(scope="module")
def hybrid(tiny_sources):
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    kinds = plan_layers([("raven", "0"), ("sila", "2")], source.config.num_hidden_layers)
    return build_hybrid(source, kinds, SETTINGS, seed=0).eval()


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_decoder_layers_hand_the_cache_to_the_mixer_under_the_name_we_pass(tiny_sources, model_type):
    # a spy in place of self_attn sees what the source's own decoder layer passes on
    from tests.conftest import tiny_config

    config = tiny_config(model_type)
    layer = ARCHITECTURES[model_type].cls("DecoderLayer")(config, 0)
    seen = {}

    def spy(hidden_states, **kwargs):
        seen.update(kwargs)
        return torch.zeros_like(hidden_states), None

    layer.self_attn.forward = spy
    name, cache = cache_argument(type(layer).forward), object()
    x = torch.zeros(1, 2, config.hidden_size)
    cos_sin = (torch.ones(1, 2, config.head_dim), torch.zeros(1, 2, config.head_dim))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x, attention_mask=None, position_embeddings=cos_sin, **{name: cache})
    passed = [key for key in ("cache", "past_key_values") if seen.get(key) is cache]
    assert passed, f"{RELEASE}: {type(layer).__name__} passed the cache to its attention under no known name: {seen}"
    assert one_cache(seen.get("cache"), seen.get("past_key_values")) is cache, RELEASE
    assert not [w for w in caught if "deprecated" in str(w.message)], f"{RELEASE}: {[str(w.message) for w in caught]}"


def test_model_outputs_carry_the_cache_in_the_field_we_write():
    for output in (CausalLMOutputWithPast, GenerateDecoderOnlyOutput):
        names = {f.name for f in dataclasses.fields(output)}
        assert OUTPUT_CACHE_FIELD in names, f"{RELEASE}: {output.__name__} has no field {OUTPUT_CACHE_FIELD}: {names}"


def test_generate_hands_back_the_cache_the_model_returned(hybrid):
    caches = []
    forward = hybrid.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        caches.append((one_cache(kwargs.get("cache"), kwargs.get("past_key_values")), output_cache(out)))
        return out

    hybrid.forward = spy
    try:
        with torch.no_grad():
            out = hybrid.generate(torch.tensor([[5, 17, 33, 2, 9]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        del hybrid.forward
    assert out.shape == (1, 9) and len(caches) == 4
    assert all(isinstance(returned, HybridCache) for _, returned in caches), RELEASE
    for (_, returned), (given, _) in zip(caches, caches[1:]):
        assert given is returned, f"{RELEASE}: generate() did not pass the step's cache back to the next step"


def test_cached_decoding_warns_about_nothing(hybrid, caplog):
    # transformers warns once per process: forget earlier warnings so this test sees them
    hf_logging.get_logger("transformers").warning_once.cache_clear()
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 8]])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        hf_logging.enable_propagation()
        try:
            with torch.no_grad():
                out = hybrid(ids[:, :4], use_cache=True)
                hybrid(ids[:, 4:5], cache=output_cache(out), use_cache=True)
                hybrid(ids[:, 5:6], past_key_values=output_cache(out), use_cache=True)
                hybrid.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        finally:
            hf_logging.disable_propagation()
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "deprecated" in m or "cache" in m.lower()], f"{RELEASE}: {messages}"


def test_two_different_caches_are_refused(hybrid):
    ids = torch.tensor([[5, 17, 33]])
    with pytest.raises(ValueError, match="two different caches were passed"):
        hybrid(ids, cache=HybridCache(hybrid.config), past_key_values=HybridCache(hybrid.config))
