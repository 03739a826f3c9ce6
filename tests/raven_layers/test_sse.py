"""SSE: the masking and varlen forms agree with the recurrence; decode, padding, balance loss and settings behave."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from raven_layers.sse import SSEMixer, SSESettings
from raven_layers.sse_forms import chunk_gla_reference, gla_recurrent, sse_masking, sse_recurrent, sse_varlen


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_gla(B, T, H, G, K, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, G, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    log_g = F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=dtype)) / 4
    return q, k, v, log_g


def random_sse(B, T, H, G, c, d, N, k, k_read, shared, dtype=torch.float32, seed=0):
    """Inputs as the mixer builds them: top-max(k, k') routed entries best first, then the shared partition N."""
    g = torch.Generator().manual_seed(seed)
    m = max(k, k_read)
    idx = torch.rand(B, T, H, N, generator=g).topk(m, dim=-1).indices  # [B, T, H, m], distinct
    slot = torch.arange(m)
    write, read = (slot < k).to(dtype)[:, None], (slot < k_read).to(dtype)[:, None]
    q = torch.randn(B, T, H, G, m, c, generator=g, dtype=dtype) * read
    keys = torch.randn(B, T, H, m, c, generator=g, dtype=dtype).softmax(-1) / k * write
    log_g = F.logsigmoid(torch.randn(B, T, H, 1, c, generator=g, dtype=dtype)) / 4 * write
    if shared:
        q = torch.cat([q, torch.randn(B, T, H, G, 1, c, generator=g, dtype=dtype)], dim=4)
        keys = torch.cat([keys, torch.randn(B, T, H, 1, c, generator=g, dtype=dtype).softmax(-1)], dim=3)
        log_g = torch.cat([log_g, F.logsigmoid(torch.randn(B, T, H, 1, c, generator=g, dtype=dtype)) / 4], dim=3)
        idx = torch.cat([idx, torch.full_like(idx[..., :1], N)], dim=3)
    v = torch.randn(B, T, H, d, generator=g, dtype=dtype)
    return q, keys, v, log_g, idx, N + int(shared)


PARALLEL = {"masking": sse_masking, "varlen": sse_varlen}


@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(("N", "k", "k_read"), [(4, 1, 1), (4, 2, 3), (3, 3, 1)])
@pytest.mark.parametrize("shared", [False, True])
def test_parallel_forms_match_recurrent(T, chunk_size, with_state, N, k, k_read, shared):
    B, H, G, c, d = 2, 2, 2, 8, 6
    q, keys, v, log_g, idx, P = random_sse(B, T, H, G, c, d, N, k, k_read, shared, seed=T + N + k)
    state = torch.randn(B, H, P, c, d) if with_state else None
    o_ref, s_ref = sse_recurrent(q, keys, v, log_g, idx, P, 0.35, state)
    assert o_ref.shape == (B, T, H, G, d) and s_ref.shape == (B, H, P, c, d)
    for name, fn in PARALLEL.items():
        o, s = fn(q, keys, v, log_g, idx, P, 0.35, state, chunk_size=chunk_size)
        assert rel_err(o, o_ref) < 1e-5, name
        assert rel_err(s, s_ref) < 1e-5, name


def test_parallel_forms_are_stable_under_strong_decay():
    q, keys, v, log_g, idx, P = random_sse(1, 40, 2, 2, 8, 6, 4, 2, 2, True)
    log_g = log_g * 200  # whole partitions wiped within a chunk
    o_ref, _ = sse_recurrent(q, keys, v, log_g, idx, P, 0.35)
    for name, fn in PARALLEL.items():
        o, _ = fn(q, keys, v, log_g, idx, P, 0.35, chunk_size=16)
        assert torch.isfinite(o).all() and rel_err(o, o_ref) < 1e-5, name


def test_gradients_agree():
    B, T, H, G, c, d, N = 2, 13, 2, 2, 4, 3, 4
    inputs = random_sse(B, T, H, G, c, d, N, 2, 3, True, dtype=torch.float64)
    idx, P = inputs[4], inputs[5]
    state = torch.randn(B, H, P, c, d, dtype=torch.float64)
    grads = []
    for fn in (sse_recurrent, lambda *a: sse_masking(*a, chunk_size=4), lambda *a: sse_varlen(*a, chunk_size=4)):
        leaves = [x.clone().requires_grad_() for x in (*inputs[:4], state)]
        q, keys, v, log_g, s0 = leaves
        o, s = fn(q, keys, v, log_g, idx, P, 0.5, s0)
        (o.sin().sum() + (s**2).sum()).backward()
        grads.append([x.grad for x in leaves])
    for g_par in grads[1:]:
        for name, g_rec, g in zip(["q", "k", "v", "log_g", "state"], grads[0], g_par):
            assert rel_err(g, g_rec) < 1e-10, name


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunk_gla_matches_its_recurrence(chunk_size):
    q, k, v, log_g = random_gla(2, 21, 3, 2, 8, 5)
    state = torch.randn(2, 3, 8, 5)
    o_ref, s_ref = gla_recurrent(q, k, v, log_g, 0.3, state)
    o, s = chunk_gla_reference(q, k, v, log_g, 0.3, state, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_chunk_gla_varlen_equals_each_segment_alone():
    lengths = [5, 0, 17, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, log_g = random_gla(1, sum(lengths), 2, 2, 8, 5, seed=1)
    state = torch.randn(len(lengths), 2, 8, 5)
    o, s = chunk_gla_reference(q, k, v, log_g, 0.3, state, cu_seqlens=cu, chunk_size=4)
    o_rec, s_rec = gla_recurrent(q, k, v, log_g, 0.3, state, cu_seqlens=cu)
    assert rel_err(o, o_rec) < 1e-5 and rel_err(s, s_rec) < 1e-5
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = (x[:, lo:hi] for x in (q, k, v, log_g))
        if hi == lo:  # an empty segment keeps its initial state
            assert torch.equal(s[i], state[i])
            continue
        o_i, s_i = chunk_gla_reference(*alone, 0.3, state[i : i + 1], chunk_size=4)
        assert rel_err(o[:, lo:hi], o_i) < 1e-5 and rel_err(s[i : i + 1], s_i) < 1e-5


def test_unselected_partitions_are_untouched():
    q, keys, v, log_g, idx, P = random_sse(1, 5, 1, 1, 4, 3, 4, 1, 1, True)
    idx[..., 0] = torch.where(idx[..., 0] == 2, 3, idx[..., 0])  # partition 2 never selected
    state = torch.randn(1, 1, P, 4, 3)
    for fn in (sse_recurrent, sse_masking, sse_varlen):
        _, s = fn(q, keys, v, log_g, idx, P, 1.0, state)
        assert torch.equal(s[:, :, 2], state[:, :, 2])


class FakeCache:
    def __init__(self):
        self.state, self.num_tokens = None, 0

    def get_mixer_state(self, layer_idx):
        return self.state

    def set_mixer_state(self, layer_idx, state, num_tokens):
        self.state, self.num_tokens = state, self.num_tokens + num_tokens


CONFIG = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def tiny_mixer(**settings) -> SSEMixer:
    torch.manual_seed(0)
    mixer = SSEMixer(CONFIG, 0, SSESettings(**{"lora_rank": 4, "chunk_size": 4, **settings}))
    with torch.no_grad():  # trained-looking parameters, so the test sees every one of them
        for name in ("q_lora_b", "k_lora_b", "decay_up", "gate_weight"):
            if hasattr(mixer, name):  # no gate_weight without the output gate
                getattr(mixer, name).normal_(std=0.3)
        mixer.partition_weight.normal_(std=0.5)
    return mixer.eval()


@pytest.mark.parametrize(
    "settings", [{}, {"num_partitions": 3, "top_k": 2, "read_top_k": 3, "shared_partition": False}]
)
def test_prefill_then_decode_equals_full_forward(settings):
    mixer = tiny_mixer(**settings)
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        full, _ = mixer(x)
        cache = FakeCache()
        steps = [mixer(x[:, :9], cache=cache)[0]]
        shape = cache.state[0].shape
        assert shape == (2, 2, mixer.num_partitions, 8, 8) and cache.state[0].dtype == torch.float32
        for t in range(9, 13):
            before = cache.state[0]
            steps.append(mixer(x[:, t : t + 1], cache=cache)[0])
            assert cache.state[0].shape == shape  # constant size
            changed = (cache.state[0] != before).flatten(3).any(-1).sum(-1)  # [B, H_kv] partitions touched
            assert (changed <= mixer.settings.top_k + int(mixer.settings.shared_partition)).all()
    assert cache.num_tokens == 13
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["masking", "varlen"])
def test_left_padding_does_not_touch_the_state(implementation):
    mixer = tiny_mixer(implementation=implementation)
    x = torch.randn(1, 7, 32)
    cache = FakeCache()
    alone, _ = mixer(x, cache=cache)
    padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 7])
    padded_cache = FakeCache()
    out, _ = mixer(padded, cache=padded_cache, padding_mask=mask)
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_cache.state[0], cache.state[0], rtol=1e-5, atol=1e-6)


def test_implementations_agree_in_the_mixer():
    x = torch.randn(2, 11, 32)
    outs = [tiny_mixer(implementation=impl)(x)[0] for impl in ("masking", "varlen")]
    assert rel_err(outs[1], outs[0]) < 1e-5


def test_initial_partitions_equal_the_attention_projections():
    mixer = SSEMixer(CONFIG, 0, SSESettings(lora_rank=4, num_partitions=4, top_k=2))
    assert torch.equal(mixer.q_lora_b, torch.zeros_like(mixer.q_lora_b))
    assert torch.equal(mixer.k_lora_b, torch.zeros_like(mixer.k_lora_b))
    assert torch.equal(mixer.gate_weight, torch.zeros_like(mixer.gate_weight))
    x = torch.randn(1, 5, 32)
    q, k, _, idx, _ = mixer.partition_inputs(x, torch.randn(1, 5, 2, 4), None)
    expected = F.softmax(mixer.k_proj(x).view(1, 5, 2, 1, 8), dim=-1)
    torch.testing.assert_close(k[..., :2, :], expected.expand(1, 5, 2, 2, 8) / 2)  # 1/k softmax, no LoRA yet
    torch.testing.assert_close(k[..., 2, :], expected[..., 0, :])  # shared: plain softmax
    assert (idx[..., 2] == 4).all()
    retention = (F.logsigmoid(mixer.decay_bias) / 16).exp()
    assert 0.969 < retention.min() and retention.max() < 0.9991  # long memory at start


def test_partition_scores_are_the_routers_logits_in_float32():
    mixer = tiny_mixer()
    x = torch.randn(2, 5, 32)
    scores = mixer.partition_scores(x)
    N = mixer.settings.num_partitions
    torch.testing.assert_close(scores, (x @ mixer.partition_weight.T).view(2, 5, mixer.num_kv_heads, N))
    assert mixer.to(torch.bfloat16).partition_scores(x.bfloat16()).dtype == torch.float32


def test_loaded_parameters_are_not_reset():
    mixer = tiny_mixer()
    mixer.partition_weight._is_hf_initialized = True
    before = mixer.partition_weight.clone()
    mixer.reset_mixer_parameters()
    assert torch.equal(mixer.partition_weight, before)
    assert torch.equal(mixer.q_lora_b, torch.zeros_like(mixer.q_lora_b))


@pytest.mark.parametrize("rows", [None, 6])
def test_fresh_parameters_are_those_attention_lacks(rows):
    mixer = SSEMixer(CONFIG, 0, SSESettings(lora_rank=4, rows_per_partition=rows))
    attention = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    assert mixer.fresh_parameter_names() == {n for n, _ in mixer.named_parameters()} - attention | (
        {"q_proj.weight", "k_proj.weight"} if rows else set()
    )
    assert mixer.q_proj.weight.shape == (4 * (rows or 8), 32) and mixer.k_proj.weight.shape == (2 * (rows or 8), 32)


def test_balance_loss_is_differentiable_and_over_real_tokens():
    mixer = tiny_mixer(num_partitions=4, top_k=2).train()
    x = torch.randn(2, 9, 32)
    out, _ = mixer(x)
    assert mixer.aux_loss.dim() == 0
    mixer.aux_loss.backward()
    assert mixer.partition_weight.grad.abs().sum() > 0
    loss = mixer.aux_loss.detach()
    mixer(torch.cat([torch.randn(2, 4, 32), x], dim=1), padding_mask=torch.arange(13).expand(2, 13) >= 4)
    torch.testing.assert_close(mixer.aux_loss, loss)
    assert tiny_mixer(balance_coef=0.0)(x)[0] is not None and tiny_mixer(balance_coef=0.0).aux_loss is None


def test_balance_loss_is_lower_for_balanced_routing():
    N, alpha = 4, 0.01
    mixer = tiny_mixer(num_partitions=N, top_k=1, balance_coef=alpha)
    with torch.no_grad():
        mixer.partition_weight.zero_()
        mixer.partition_weight.view(2, N, 32)[:, :, :N] = 8 * torch.eye(N)  # feature i routes to partition i
    tokens = torch.arange(32)
    balanced = F.one_hot(tokens % N, 32).float()[None]  # every partition gets a quarter of the tokens
    collapsed = F.one_hot(tokens * 0, 32).float()[None]  # every token picks partition 0
    mixer(balanced)
    low = mixer.aux_loss.item()
    mixer(collapsed)
    high = mixer.aux_loss.item()
    assert low == pytest.approx(alpha, rel=1e-3) and high == pytest.approx(alpha * N, rel=1e-2)
    with torch.no_grad():
        mixer.partition_weight.zero_()  # uniform probabilities: exactly alpha whatever the (tied) top-k
    mixer(torch.randn(1, 10, 32))
    assert mixer.aux_loss.item() == pytest.approx(alpha)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_partitions": 0}, "sse.num_partitions = 0 is not allowed; expected an integer >= 1"),
        ({"top_k": 5}, "sse.top_k = 5 is not allowed; expected an integer in [1, num_partitions=4]"),
        ({"top_k": 0}, "sse.top_k = 0 is not allowed; expected an integer >= 1"),
        (
            {"rows_per_partition": 0},
            "sse.rows_per_partition = 0 is not allowed; expected null (the source head_dim) or an integer >= 1",
        ),
        ({"lora_rank": -1}, "sse.lora_rank = -1 is not allowed; expected an integer >= 1"),
        (
            {"read_top_k": 5},
            "sse.read_top_k = 5 is not allowed; expected null (top_k) or an integer in [1, num_partitions=4]",
        ),
        ({"balance_coef": -0.1}, "sse.balance_coef = -0.1 is not allowed; expected a number >= 0"),
        ({"gate_normalizer": 0}, "sse.gate_normalizer = 0 is not allowed; expected a number > 0"),
        ({"gate_low_rank": 0}, "sse.gate_low_rank = 0 is not allowed; expected an integer >= 1"),
        ({"shared_partition": 1}, "sse.shared_partition = 1 is not allowed; expected true or false"),
        (
            {"implementation": "loop"},
            "sse.implementation = 'loop' is not allowed; expected one of ['auto', 'masking', 'varlen']",
        ),
        ({"chunk_size": 2.5}, "sse.chunk_size = 2.5 is not allowed; expected an integer >= 1"),
        (
            {"router_init": "fitted"},
            "sse.router_init = 'fitted' is not allowed; expected one of ['random', 'centred']",
        ),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError) as err:
        SSESettings(**settings)
    assert str(err.value) == message


def test_lora_rank_larger_than_the_projection_is_named():
    with pytest.raises(ValueError) as err:
        SSEMixer(CONFIG, 0, SSESettings(lora_rank=17))  # k_proj: 32 -> 2 heads x 8 rows = 16 features
    assert str(err.value) == (
        "sse.lora_rank = 17 is not allowed; expected an integer in [1, 16] "
        "(the q/k projections map hidden_size=32 to 32 and 16 features)"
    )
    SSEMixer(CONFIG, 0, SSESettings(lora_rank=16))


def test_unknown_setting_lists_the_allowed_ones():
    expected = r"unknown SSE setting\(s\) \['partitions'\]; 'partitions': did you mean 'num_partitions'\? allowed: \["
    with pytest.raises(ValueError, match=expected):
        SSESettings.from_dict({"partitions": 3})
    assert SSESettings.from_dict(SSESettings(top_k=2).to_dict()) == SSESettings(top_k=2)


@pytest.mark.parametrize("form", sorted(PARALLEL))
def test_packed_documents_each_start_from_their_own_state(form):
    """cu_seqlens packs documents along T (batch 1): each equals sse_recurrent on that document alone, from its own
    initial state, with its own final state; 1-token documents included."""
    lengths = [5, 1, 12, 7]
    q, keys, v, log_g, idx, P = random_sse(1, sum(lengths), 2, 2, 8, 6, 4, 1, 1, True, seed=3)
    states = torch.randn(len(lengths), 2, P, 8, 6, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, final = PARALLEL[form](q, keys, v, log_g, idx, P, 0.3, states, chunk_size=4, cu_seqlens=cu)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[:, lo:hi] for x in (q, keys, v, log_g, idx)]
        o_ref, s_ref = sse_recurrent(*part, P, 0.3, states[i : i + 1])
        torch.testing.assert_close(o[:, lo:hi], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i : i + 1], s_ref, rtol=1e-5, atol=1e-5)


def test_router_gradient_trains_the_scorer_without_changing_outputs():
    # balance loss off: with router_gradient the output's loss alone reaches W_e; without it, W_e gets only the
    # rounding of the shift-invariant softmax (eq. 11)
    x = torch.randn(2, 11, 32)
    outs, grads = [], []
    for through in (True, False):
        mixer = tiny_mixer(balance_coef=0.0, router_gradient=through).train()
        o = mixer(x)[0]
        o.square().sum().backward()
        outs.append(o.detach())
        grads.append(mixer.partition_weight.grad)
    assert torch.equal(outs[0], outs[1])
    assert grads[1].abs().max() < 1e-4 * grads[0].abs().max()
    with torch.no_grad():  # inference skips the factor altogether
        assert torch.equal(tiny_mixer(router_gradient=True)(x)[0], outs[1])


def test_a_centred_scorer_balances_tokens_whose_inputs_share_a_direction():
    # random rows give every token the same offsets W_e mu: top-1 sends nearly all of them to one partition
    torch.manual_seed(0)
    mixer = SSEMixer(CONFIG, 0, SSESettings(lora_rank=4, router_init="centred")).eval()
    g = torch.Generator().manual_seed(0)
    x = 10 * torch.randn(CONFIG.hidden_size, generator=g) + torch.randn(1, 400, CONFIG.hidden_size, generator=g)

    def busiest_share() -> float:  # the largest share of the tokens one partition takes, over the heads
        top = mixer.partition_scores(x).argmax(-1)[0]  # [T, H_kv]
        counts = torch.stack([torch.bincount(top[:, h], minlength=4) for h in range(top.shape[1])])
        return (counts.max() / top.shape[0]).item()

    before = busiest_share()
    mixer.calibrate(x[0], mean=lambda t: t)
    assert before > 0.9 and busiest_share() < 0.5, (before, busiest_share())
