"""Raven: the chunked form agrees with the recurrence; routing, padding and settings behave as specified."""

import pytest
import torch
from transformers import LlamaConfig

from raven_layers import RavenMixer, RavenSettings, raven_chunked, raven_recurrent


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_inputs(B, T, H, G, d, M, K, dtype=torch.float32, strong=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, G, d, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, d, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, d, generator=g, dtype=dtype)
    # sparse top-K retention, as the router makes it: a_t * r_t <= 0 on K slots, 0 elsewhere
    idx = torch.rand(B, T, H, M, generator=g).topk(K, dim=-1).indices
    scale = 30.0 if strong else 1.0  # strong: whole slots wiped within a chunk, to stress the stable form
    vals = -scale * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    log_f = torch.zeros(B, T, H, M, dtype=dtype).scatter(-1, idx, vals)
    return q, k, v, log_f


@pytest.mark.parametrize("T", [1, 7, 16, 33])
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent(T, chunk_size, with_state):
    B, H, G, d, M, K = 2, 2, 3, 8, 16, 4
    q, k, v, log_f = random_inputs(B, T, H, G, d, M, K, seed=T)
    state = (torch.randn(B, H, M, d), torch.randn(B, H, M, d)) if with_state else None
    o_ref, (sk_ref, sv_ref) = raven_recurrent(q, k, v, log_f, 0.35, state)
    o, (sk, sv) = raven_chunked(q, k, v, log_f, 0.35, state, chunk_size=chunk_size)
    assert o.shape == (B, T, H, G, d)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(sk, sk_ref) < 1e-5 and rel_err(sv, sv_ref) < 1e-5


def test_chunked_is_stable_under_strong_decay():
    q, k, v, log_f = random_inputs(1, 40, 2, 2, 8, 16, 8, strong=True)
    o_ref, _ = raven_recurrent(q, k, v, log_f, 0.35)
    o, _ = raven_chunked(q, k, v, log_f, 0.35, chunk_size=16)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1e-5


def test_gradients_agree():
    B, T, H, G, d, M, K = 2, 13, 2, 2, 4, 8, 3
    inputs = random_inputs(B, T, H, G, d, M, K, dtype=torch.float64)
    state = (torch.randn(B, H, M, d, dtype=torch.float64), torch.randn(B, H, M, d, dtype=torch.float64))
    grads = []
    for fn in (raven_recurrent, lambda *a: raven_chunked(*a, chunk_size=4)):
        leaves = [x.clone().requires_grad_() for x in (*inputs, *state)]
        q, k, v, log_f, s_k, s_v = leaves
        o, (fk, fv) = fn(q, k, v, log_f, 0.5, (s_k, s_v))
        (o.sin().sum() + fk.cos().sum() + (fv**2).sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, g_rec, g_chunk in zip(["q", "k", "v", "log_f", "S^k", "S^v"], *grads):
        assert rel_err(g_chunk, g_rec) < 1e-10, name


def test_unselected_slots_are_frozen():
    q, k, v, log_f = random_inputs(1, 5, 1, 1, 4, 8, 2)
    log_f[..., 0] = 0.0  # slot 0 never written
    state = (torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4))
    _, (s_k, s_v) = raven_recurrent(q, k, v, log_f, 1.0, state)
    assert torch.equal(s_k[:, :, 0], state[0][:, :, 0]) and torch.equal(s_v[:, :, 0], state[1][:, :, 0])


def tiny_mixer(**settings) -> RavenMixer:
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    mixer = RavenMixer(config, 0, RavenSettings(**{"num_slots": 16, "top_k": 4, **settings}))
    with torch.no_grad():
        mixer.decay_weight.normal_(std=0.1)  # input-dependent decay, so the test sees it
        mixer.gate_weight.normal_(std=0.1)
    return mixer.eval()


def test_write_gates_are_top_k_and_sum_to_decay_over_alpha():
    mixer = tiny_mixer(alpha=2.0)
    x = torch.randn(2, 9, 32)
    log_f = mixer.write_gates(x, None)
    assert ((log_f < 0).sum(-1) == 4).all()
    a = -torch.nn.functional.softplus(x @ mixer.decay_weight.T + mixer.decay_bias) * mixer.decay_log_scale.exp()
    torch.testing.assert_close(log_f.sum(-1), a / 2.0)


def test_gumbel_noise_only_in_training():
    mixer = tiny_mixer()
    x = torch.randn(1, 6, 32)
    assert torch.equal(mixer.write_gates(x, None), mixer.write_gates(x, None))
    mixer.train()
    assert not torch.equal(mixer.write_gates(x, None), mixer.write_gates(x, None))
    mixer = tiny_mixer(gumbel=False).train()
    assert torch.equal(mixer.write_gates(x, None), mixer.write_gates(x, None))


def test_left_padding_does_not_touch_the_state():
    mixer = tiny_mixer()
    x = torch.randn(1, 7, 32)
    alone, _ = mixer(x)
    padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 7])
    out, _ = mixer(padded, padding_mask=mask)
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-5, atol=1e-6)


def slots_taken(mixer, x: torch.Tensor) -> int:
    """How many of a head's M slots the tokens x [1, T, hidden] route to (evaluation: no noise)."""
    _, idx, _ = mixer.route(x, None)  # [1, T, H_kv, K]
    return min(idx[0, :, h].unique().numel() for h in range(idx.shape[2]))


def test_a_centred_router_spreads_tokens_whose_inputs_share_a_direction():
    # a decoder layer's inputs are mostly one shared direction: random rows send every token to the same slots
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    mixer = RavenMixer(config, 0, RavenSettings(num_slots=32, top_k=4, router_init="centred")).eval()
    assert mixer.calibrates and not tiny_mixer().calibrates
    g = torch.Generator().manual_seed(0)
    shared = 10 * torch.randn(64, generator=g)
    x = shared + torch.randn(1, 400, 64, generator=g)  # [1, T, hidden]
    random_rows = slots_taken(mixer, x)
    mixer.calibrate(x[0], mean=lambda t: t)
    w = mixer.router_weight.detach()
    torch.testing.assert_close(w @ x[0].mean(0), torch.zeros(w.shape[0]), atol=1e-4, rtol=0)  # no offset left
    torch.testing.assert_close((x[0] @ w.T).std(0), torch.ones(w.shape[0]), atol=1e-2, rtol=0)  # unit spread
    assert random_rows <= 16 and slots_taken(mixer, x) == 32, (random_rows, slots_taken(mixer, x))


def test_initial_gate_is_identity():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    mixer = RavenMixer(config, 0, RavenSettings(num_slots=16, top_k=4))
    assert torch.equal(mixer.gate_weight, torch.zeros_like(mixer.gate_weight))
    assert (mixer.decay_log_scale.diff() > 0).all()  # heads spread over time scales


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_slots": 0}, "raven.num_slots = 0 is not allowed; expected an integer >= 1"),
        ({"num_slots": 8, "top_k": 9}, "raven.top_k = 9 is not allowed; expected an integer in [1, num_slots=8]"),
        ({"alpha": -1.0}, "raven.alpha = -1.0 is not allowed; expected a number > 0"),
        ({"feature_map": "relu"}, "raven.feature_map = 'relu' is not allowed; expected one of ['identity', 'silu']"),
        ({"chunk_size": 2.5}, "raven.chunk_size = 2.5 is not allowed; expected an integer >= 1"),
        ({"gumbel": "yes"}, "raven.gumbel = 'yes' is not allowed; expected true or false"),
        (
            {"router_init": "centered"},
            "raven.router_init = 'centered' is not allowed; expected one of ['random', 'centred']; "
            "did you mean 'centred'?",
        ),
        (
            {"checkpoint_level": 3},
            "raven.checkpoint_level = 3 is not allowed; "
            "expected 0 (fastest backward, most memory), 1 or 2 (least memory)",
        ),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError) as err:
        RavenSettings(**settings)
    assert str(err.value) == message


def test_unknown_setting_lists_the_allowed_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown Raven setting\(s\) \['slots'\]; 'slots': did you mean 'num_slots'\? allowed: \['num_slots'",
    ):
        RavenSettings.from_dict({"slots": 3})
