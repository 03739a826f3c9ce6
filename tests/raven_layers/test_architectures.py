"""The architecture adapters: each supported source's attention, read through its adapter, is the attention."""

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from raven_layers import ARCHITECTURES
from tests.conftest import tiny_config


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_queries_keys_give_back_the_attention_output(model_type):
    """softmax(q k^T * scaling) v through o_proj, with the adapter's q and k, is the module's own (causal) output."""
    architecture = ARCHITECTURES[model_type]
    config = tiny_config(model_type, initializer_range=0.2, sliding_window=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = architecture.cls("Attention")(config, 0).eval()
    rotary = architecture.cls("RotaryEmbedding")(config=config)
    if architecture.qk_norm:  # norms that are not the identity, so that leaving them out would show
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    B, T = 2, 7
    x = torch.randn(B, T, config.hidden_size)
    rope = rotary(x, torch.arange(T).expand(B, T))
    causal = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings=rope, attention_mask=causal)
        q, k = architecture.queries_keys(attn, x, rope)  # [B, H, T, d], [B, Hkv, T, d]
        v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        group = config.num_attention_heads // config.num_key_value_heads
        probs = torch.softmax(q @ repeat_kv(k, group).transpose(-1, -2) * attn.scaling + causal, dim=-1)
        got = attn.o_proj((probs @ repeat_kv(v, group)).transpose(1, 2).reshape(B, T, -1))
    assert q.shape == (B, config.num_attention_heads, T, attn.head_dim)
    assert k.shape == (B, config.num_key_value_heads, T, attn.head_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
