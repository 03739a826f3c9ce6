"""The hybrid model: decoding with the cache equals a full forward; padding, batching and beams are exact."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from convert import build_hybrid, plan_layers

SPEC = {"llama": "0,2", "qwen3": "0-23:5", "mistral": "1-3:2", "qwen2": "-1"}
SETTINGS = {"raven": {"num_slots": 16, "top_k": 4, "chunk_size": 4}}


@pytest.fixture(scope="module", params=sorted(SPEC))
def hybrid(request, tiny_sources):
    source = AutoModelForCausalLM.from_pretrained(tiny_sources[request.param]).eval()
    kinds = plan_layers([("raven", SPEC[request.param])], source.config.num_hidden_layers)
    model = build_hybrid(source, kinds, SETTINGS)
    with torch.no_grad():  # untrained gates are the identity; perturb them so the test sees every parameter
        for name, p in model.named_parameters():
            if "gate_weight" in name or "decay_weight" in name:
                p.normal_(std=0.05)
    return model


def test_prefill_then_decode_equals_full_forward(hybrid):
    ids = torch.randint(3, 100, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hybrid(ids).logits
        out = hybrid(ids[:, :11], use_cache=True)  # 11 > the mistral window of 8, and not a chunk multiple
        steps, cache = [out.logits], out.past_key_values
        for t in range(11, 19):
            out = hybrid(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


def test_left_padding_changes_nothing_for_real_tokens(hybrid):
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = hybrid(ids).logits
        together = hybrid(padded, attention_mask=mask).logits[:, 4:]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_batched_generation_with_left_padding_equals_one_at_a_time(hybrid, num_beams):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (5, 12, 9)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=num_beams, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        batched = hybrid.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
        for i, p in enumerate(prompts):
            single = hybrid.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
            assert torch.equal(batched[i], single[0, len(p) :]), f"prompt {i}"


def test_mixer_state_is_constant_while_kv_cache_grows(hybrid):
    ids = torch.randint(3, 100, (1, 6))
    sizes = []
    with torch.no_grad():
        for n in (4, 16):
            out = hybrid.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  return_dict_in_generate=True, pad_token_id=0)
            sizes.append(out.past_key_values.state_bytes())
    assert sizes[0]["mixer"] == sizes[1]["mixer"] > 0
    window = hybrid.model.windows[hybrid.config.layer_mixers.index("attention")]
    if window is None:
        assert sizes[1]["attention"] > sizes[0]["attention"] > 0
    else:  # a sliding-window layer keeps its last window - 1 tokens, however long the generation
        n_attention = hybrid.config.layer_mixers.count("attention")
        cfg = hybrid.config
        assert sizes[1]["attention"] == sizes[0]["attention"] == n_attention * 2 * 2 * (window - 1) * cfg.head_dim * 4
    n_raven = hybrid.config.layer_mixers.count("raven")
    cfg = hybrid.config
    assert sizes[0]["mixer"] == n_raven * 2 * cfg.num_key_value_heads * 16 * cfg.head_dim * 4  # 2 x [H_kv, M, d] fp32


def test_training_forward_backward_reaches_mixer_parameters(hybrid):
    hybrid.train()
    try:
        ids = torch.randint(3, 100, (2, 10))
        loss = hybrid(ids, labels=ids, use_cache=False).loss
        loss.backward()
        layer = hybrid.config.layer_mixers.index("raven")
        mixer = hybrid.model.layers[layer].self_attn
        for name in ("router_weight", "decay_weight", "decay_log_scale", "gate_weight", "q_proj.weight"):
            grad = mixer.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    finally:
        hybrid.zero_grad()
        hybrid.eval()


def test_gradient_checkpointing(hybrid):
    # transformers 5.23 renamed it; 5.17 has only the old name
    enable = getattr(hybrid, "activation_checkpointing_enable", None) or hybrid.gradient_checkpointing_enable
    disable = getattr(hybrid, "activation_checkpointing_disable", None) or hybrid.gradient_checkpointing_disable
    enable()
    hybrid.train()
    try:
        ids = torch.randint(3, 100, (1, 9))
        hybrid(ids, labels=ids, use_cache=False).loss.backward()
        assert all(p.grad is not None for n, p in hybrid.named_parameters() if "router_weight" in n)
    finally:
        disable()
        hybrid.zero_grad()
        hybrid.eval()


def test_model_from_config_gets_the_mixer_initialisation(tiny_sources):
    from transformers import AutoConfig

    from raven_layers import HybridConfig, HybridForCausalLM

    source_config = AutoConfig.from_pretrained(tiny_sources["llama"])
    model = HybridForCausalLM(HybridConfig.from_source(source_config, ["raven", "attention"] * 2, SETTINGS))
    mixer = model.model.layers[0].self_attn
    assert torch.equal(mixer.gate_weight, torch.zeros_like(mixer.gate_weight))
    torch.testing.assert_close(mixer.decay_bias, torch.full_like(mixer.decay_bias, 0.5413248546129181))
    assert 0.01 < mixer.router_weight.std().item() < 0.03


def test_rejects_a_foreign_cache_and_a_bad_mask(hybrid):
    from transformers import DynamicCache

    ids = torch.randint(3, 100, (1, 4))
    with pytest.raises(TypeError, match="past_key_values must be a HybridCache, got DynamicCache"):
        hybrid(ids, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match=r"attention_mask must be a 2D padding mask of shape .* = \[1, 4\], got \(1, 3\)"):
        hybrid(ids, attention_mask=torch.ones(1, 3, dtype=torch.long))
