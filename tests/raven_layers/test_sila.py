"""SILA: phi, the chunked form against the recurrence, store/recall decoupling, decoding, padding and settings."""

import math

import pytest
import torch
from transformers import LlamaConfig

from raven_layers.sila import SILAMixer, SILASettings, l2_normalize, sila_chunked, sila_phi, sila_recurrent


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_inputs(B, T, H, G, d, dtype=torch.float32, seed=0):
    """q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, M_0; gates spread over both sides of phi's kink."""
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, G, d, generator=g, dtype=dtype)).to(dtype)
    k = l2_normalize(torch.randn(B, T, H, d, generator=g, dtype=dtype)).to(dtype)
    v = torch.randn(B, T, H, d, generator=g, dtype=dtype)
    alpha = torch.rand(B, T, H, G, generator=g, dtype=dtype)
    beta_x = torch.randn(B, T, H, generator=g, dtype=dtype)
    gamma_x = 2 * torch.randn(B, T, H, generator=g, dtype=dtype) - 1
    w_beta = torch.randn(H, d, generator=g, dtype=dtype)
    w_gamma = torch.randn(H, d, generator=g, dtype=dtype)
    state = 0.3 * torch.randn(B, H, d, d, generator=g, dtype=dtype)
    return q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state


def test_phi_reaches_one_and_has_finite_gradients():
    x = torch.tensor([-1e4, -80.0, -3.0, -0.5, -1e-3, 0.0, 1e-3, 2.0, 1e4], dtype=torch.float64, requires_grad=True)
    y = sila_phi(x)
    y.sum().backward()
    assert torch.equal(y[5:], torch.ones(4, dtype=torch.float64))  # exactly 1 at 0 and above: no decay
    neg = x.detach()[:5]
    torch.testing.assert_close(y[:5], 2 / (neg.exp() + (-neg).exp()), rtol=1e-12, atol=0)
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[6:], torch.zeros(3, dtype=torch.float64))
    assert abs(x.grad[5].item()) < 1e-12  # sech'(0) = 0: phi is smooth at the kink
    torch.testing.assert_close(x.grad[2:5], -torch.tanh(neg[2:]) / torch.cosh(neg[2:]), rtol=1e-10, atol=0)
    x32 = torch.tensor([-1e4, -80.0, 0.0, 1e4], requires_grad=True)  # float32: e^80 alone would overflow
    sila_phi(x32).sum().backward()
    assert torch.isfinite(x32.grad).all()


@pytest.mark.parametrize("T", [1, 7, 16, 33])
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_chunked_matches_recurrent(T, chunk_size, with_state, with_mask):
    q, k, v, alpha, bx, gx, wb, wg, state = random_inputs(2, T, 2, 3, 8, seed=T)
    state = state if with_state else None
    mask = (torch.rand(2, T, generator=torch.Generator().manual_seed(1)) > 0.3) if with_mask else None
    o_ref, m_ref = sila_recurrent(q, k, v, alpha, bx, gx, wb, wg, state, mask)
    o, m = sila_chunked(q, k, v, alpha, bx, gx, wb, wg, state, mask, chunk_size=chunk_size)
    assert o.shape == (2, T, 2, 3, 8) and m.shape == (2, 2, 8, 8) and m.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(m, m_ref) < 1e-5


def test_chunked_is_stable_under_strong_decay():
    q, k, v, alpha, bx, gx, wb, wg, state = random_inputs(1, 40, 2, 2, 8)
    gx = -60 * torch.rand(1, 40, 2, generator=torch.Generator().manual_seed(1))  # gamma down to ~1e-26 per step
    o_ref, m_ref = sila_recurrent(q, k, v, alpha, bx, gx, wb, wg, state)
    o, m = sila_chunked(q, k, v, alpha, bx, gx, wb, wg, state, chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(m).all()
    assert rel_err(o, o_ref) < 1e-5 and rel_err(m, m_ref) < 1e-5


def test_gradients_agree():
    inputs = random_inputs(2, 13, 2, 2, 4, dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :3] = False
    grads = []
    for fn in (sila_recurrent, lambda *a: sila_chunked(*a, chunk_size=4)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, m = fn(*leaves, mask)
        (o.sin().sum() + (m**2).sum()).backward()
        grads.append([x.grad for x in leaves])
    names = ["q", "k", "v", "alpha", "beta_x", "gamma_x", "w_beta", "w_gamma", "M_0"]
    for name, g_rec, g_chunk in zip(names, *grads):
        assert g_rec.abs().sum() > 0, name
        assert rel_err(g_chunk, g_rec) < 1e-10, name


@pytest.mark.parametrize("fn", [sila_recurrent, sila_chunked])
def test_recall_reads_the_memory_before_the_write(fn):
    q, k, v, alpha, bx, gx, wb, wg, state = random_inputs(1, 5, 2, 2, 8, dtype=torch.float64)
    # zero memory: the first output is the current-token term alone
    o, _ = fn(q, k, v, alpha, bx, gx, wb, wg)
    expected = alpha[:, 0, ..., None] * torch.einsum("bhgd,bhd->bhg", q[:, 0], k[:, 0])[..., None] * v[:, 0, :, None]
    torch.testing.assert_close(o[:, 0], expected, rtol=1e-12, atol=1e-12)
    # alpha = 0: o_t depends on v_t not at all, on v_{t-1} (stored in M_{t-1}) yes
    v = v.clone().requires_grad_()
    o, _ = fn(q, k, v, torch.zeros_like(alpha), bx, gx, wb, wg, state)
    (grad_v,) = torch.autograd.grad(o[:, 3].sum(), v)
    assert torch.equal(grad_v[:, 3:], torch.zeros_like(grad_v[:, 3:]))
    assert grad_v[:, 2].abs().sum() > 0


@pytest.mark.parametrize("fn", [sila_recurrent, sila_chunked])
def test_gates_depend_on_the_memory(fn):
    """One step by hand (eqs. 5 and 7): beta and gamma read M_0 k_1 through W_b1 and W_g1."""
    q, k, v, alpha, bx, gx, wb, wg, _ = random_inputs(1, 1, 2, 1, 4, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    betas = []
    for _ in range(2):
        state = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64)
        recalled = torch.einsum("bhvk,bhk->bhv", state, k[:, 0])
        beta = torch.sigmoid((recalled * wb).sum(-1) + bx[:, 0])
        gamma = sila_phi((recalled * wg).sum(-1) + gx[:, 0])
        expected = gamma[..., None, None] * state - beta[..., None, None] * torch.einsum(
            "bhv,bhk->bhvk", recalled - v[:, 0], k[:, 0]
        )
        _, memory = fn(q, k, v, alpha, bx, gx, wb, wg, state)
        torch.testing.assert_close(memory, expected, rtol=1e-12, atol=1e-12)
        betas.append(beta)
    assert not torch.allclose(betas[0], betas[1])


def test_padding_steps_leave_the_memory_untouched():
    q, k, v, alpha, bx, gx, wb, wg, state = random_inputs(1, 6, 2, 2, 4)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    for fn in (sila_recurrent, sila_chunked):
        _, memory = fn(q, k, v, alpha, bx, gx, wb, wg, state, mask)
        assert torch.equal(memory, state)


class FakeCache:
    def __init__(self):
        self.state, self.num_tokens = None, 0

    def get_mixer_state(self, layer_idx):
        return self.state

    def set_mixer_state(self, layer_idx, state, num_tokens):
        self.state, self.num_tokens = state, self.num_tokens + num_tokens


def config(**kwargs):
    return LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kwargs)


def tiny_mixer(source_has_qk_norm=False, **settings) -> SILAMixer:
    torch.manual_seed(0)
    mixer = SILAMixer(config(), 0, SILASettings(**{"chunk_size": 4, **settings}), source_has_qk_norm)
    with torch.no_grad():  # untrained gates are constants; perturb them so the tests see every parameter
        for name in mixer.fresh_parameter_names() - {"beta_bias", "gamma_bias", "alpha_bias"}:
            getattr(mixer, name).add_(0.2 * torch.randn_like(getattr(mixer, name)))
    return mixer.eval()


@pytest.mark.parametrize(("conv_size", "prompt"), [(4, 2), (4, 5), (1, 5), (4, 9)])
def test_prefill_then_decode_equals_full_forward(conv_size, prompt):
    mixer = tiny_mixer(conv_size=conv_size)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        full, _ = mixer(x)
        cache = FakeCache()
        steps = [mixer(x[:, :prompt], cache=cache)[0]]
        sizes = {tuple(s.shape) for s in cache.state}
        for t in range(prompt, 11):
            steps.append(mixer(x[:, t : t + 1], cache=cache)[0])
            sizes |= {tuple(s.shape) for s in cache.state}
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)
    assert cache.num_tokens == 11
    assert sizes == {(2, 2, 8, 8), (2, conv_size - 1, (4 + 2 * 2) * 8)}  # constant whatever the length
    assert cache.state[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_convolution_is_the_convolutions_last_output(dtype):
    mixer = tiny_mixer().to(dtype)
    x = torch.randn(3, 6, 64, dtype=dtype)  # [B, T, (H + 2 H_kv) d]
    with torch.no_grad():
        whole, tail = mixer.short_conv(x, None)
        _, before = mixer.short_conv(x[:, :5], None)
        step, after = mixer.short_conv(x[:, 5:], before)
    assert step.dtype == dtype and torch.equal(after, tail)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(step, whole[:, 5:], rtol=tolerance, atol=tolerance)


def test_left_padding_gives_the_unpadded_outputs():
    mixer = tiny_mixer()
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        alone, _ = mixer(x)
        padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
        mask = torch.tensor([[False] * 3 + [True] * 7])
        cache = FakeCache()
        out, _ = mixer(padded, cache=cache, padding_mask=mask)
        # and decoding after the padded prompt continues as after the unpadded one
        nxt = torch.randn(1, 1, 32)
        step, _ = mixer(nxt, cache=cache, padding_mask=torch.ones(1, 1, dtype=torch.bool))
        reference, _ = mixer(torch.cat([x, nxt], dim=1))
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(step, reference[:, -1:], rtol=1e-5, atol=1e-6)


def test_first_token_is_the_current_token_term():
    """With zero memory, o_0 = o_proj(gate * alpha (k.q) v), computed here from the module's own weights."""
    mixer = tiny_mixer()
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        out, _ = mixer(x)
        x0 = x[:, 0]
        tap = mixer.conv_weight[:, -1]  # at t = 0 the convolution sees only the current token
        q = torch.nn.functional.silu(mixer.q_proj(x0) * tap[:32]).view(1, 2, 2, 8)
        k = torch.nn.functional.silu(mixer.k_proj(x0) * tap[32:48]).view(1, 2, 8)
        v = torch.nn.functional.silu(mixer.v_proj(x0) * tap[48:]).view(1, 2, 8)
        q, k = l2_normalize(q), l2_normalize(k)
        alpha = torch.sigmoid(x0 @ mixer.alpha_weight.T + mixer.alpha_bias).view(1, 2, 2)
        o = (alpha * torch.einsum("bhgd,bhd->bhg", q, k))[..., None] * v[:, :, None]
        o = o.reshape(1, 32) * 2 * torch.sigmoid(x0 @ mixer.gate_weight.T)
        torch.testing.assert_close(out[:, 0], mixer.o_proj(o), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("source_has_qk_norm", [False, True])
def test_recurrence_inputs_are_what_the_forward_runs(source_has_qk_norm):
    """`recurrence_inputs` (what the analysis reads) gives back the mixer's output through the recurrence, and the
    convolution tail it returns continues the sequence as the cache does."""
    mixer = tiny_mixer(source_has_qk_norm)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected, _ = mixer(x)
        inputs, tail = mixer.recurrence_inputs(x[:, :5])
        later, _ = mixer.recurrence_inputs(x[:, 5:], tail)
        whole = [torch.cat(pair, dim=1) for pair in zip(inputs, later)]
        o, _ = sila_recurrent(*whole, mixer.beta_state_weight, mixer.gamma_state_weight)
        got, _ = mixer.project_out(o.to(x.dtype).reshape(2, 9, -1), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert tail.shape == (2, mixer.settings.conv_size - 1, (4 + 2 * 2) * 8)


@pytest.mark.parametrize("source_has_qk_norm", [False, True])
def test_gradients_reach_every_parameter_from_initialisation(source_has_qk_norm):
    """Unperturbed init: no parameter is dead (gamma's bias is below phi's flat region on purpose)."""
    torch.manual_seed(0)
    mixer = SILAMixer(config(), 0, SILASettings(chunk_size=4), source_has_qk_norm)
    if source_has_qk_norm:
        with torch.no_grad():
            mixer.q_norm.weight.uniform_(0.5, 1.5)
            mixer.k_norm.weight.uniform_(0.5, 1.5)
    out, _ = mixer(torch.randn(2, 9, 32))
    out.pow(2).sum().backward()
    assert mixer.aux_loss is None
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_parameters_and_initial_values():
    mixer = SILAMixer(config(), 0, SILASettings())
    attention = {f"{p}_proj.weight" for p in "qkvo"}
    assert {n for n, _ in mixer.named_parameters()} == attention | mixer.fresh_parameter_names()
    with_norms = SILAMixer(config(), 0, SILASettings(output_gate=False), source_has_qk_norm=True)
    names = {n for n, _ in with_norms.named_parameters()}
    assert names == attention | {"q_norm.weight", "k_norm.weight"} | with_norms.fresh_parameter_names()
    assert with_norms.q_norm.weight.shape == (8,) and "gate_weight" not in names
    assert torch.equal(mixer.conv_weight[:, :-1], torch.zeros(64, 3))  # identity convolution: last tap 1
    assert torch.equal(mixer.conv_weight[:, -1], torch.ones(64))
    assert torch.equal(mixer.gate_weight, torch.zeros_like(mixer.gate_weight))
    torch.testing.assert_close(torch.sigmoid(mixer.beta_bias), torch.full((2,), 0.25))
    torch.testing.assert_close(sila_phi(mixer.gamma_bias), torch.full((2,), 0.999))
    assert (mixer.gamma_bias < 0).all()
    torch.testing.assert_close(torch.sigmoid(mixer.alpha_bias), torch.full((4,), 0.9))
    # parameters loaded from a checkpoint are kept
    with torch.no_grad():
        mixer.alpha_bias.fill_(-5.0)
    mixer.alpha_bias._is_hf_initialized = True
    mixer.reset_mixer_parameters()
    assert torch.equal(mixer.alpha_bias, torch.full((4,), -5.0))


def test_bfloat16_forward_is_finite():
    mixer = tiny_mixer().to(torch.bfloat16)
    x = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    cache = FakeCache()
    out, _ = mixer(x, cache=cache)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert cache.state[0].dtype == torch.float32 and cache.state[1].dtype == torch.bfloat16


def test_settings_round_trip():
    settings = SILASettings(conv_size=2, feature_map="identity", output_gate=False, chunk_size=8)
    assert SILASettings.from_dict(settings.to_dict()) == settings
    assert math.isclose(SILAMixer.INIT_GAMMA, 0.999)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"conv_size": 0}, "sila.conv_size = 0 is not allowed; expected an integer >= 1"),
        ({"conv_size": True}, "sila.conv_size = True is not allowed; expected an integer >= 1"),
        ({"chunk_size": 2.5}, "sila.chunk_size = 2.5 is not allowed; expected an integer >= 1"),
        ({"feature_map": "relu"}, "sila.feature_map = 'relu' is not allowed; expected one of ['silu', 'identity']"),
        ({"output_gate": "yes"}, "sila.output_gate = 'yes' is not allowed; expected true or false"),
        (
            {"no_decay_heads": -1},
            "sila.no_decay_heads = -1 is not allowed; expected an integer >= 0 (at most the layer's memories: "
            "state_heads)",
        ),
        (
            {"no_decay_heads": True},
            "sila.no_decay_heads = True is not allowed; expected an integer >= 0 (at most the layer's memories: "
            "state_heads)",
        ),
        (
            {"state_heads": "q"},
            "sila.state_heads = 'q' is not allowed; expected one of ['kv', 'query']",
        ),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError) as err:
        SILASettings(**settings)
    assert str(err.value) == message


def test_unknown_setting_lists_the_allowed_ones_and_suggests_the_closest():
    with pytest.raises(ValueError) as err:
        SILASettings.from_dict({"qk_norm": True, "conv": 3})
    allowed = "['conv_size', 'feature_map', 'output_gate', 'chunk_size', 'no_decay_heads', 'state_heads']"
    hint = "'conv': did you mean 'conv_size'?"  # qk_norm is near no SILA setting: no guess for it
    assert str(err.value) == f"unknown SILA setting(s) ['conv', 'qk_norm']; {hint} allowed: {allowed}"


def test_more_no_decay_heads_than_the_source_has_is_named():
    with pytest.raises(ValueError) as err:
        SILAMixer(config(), 0, SILASettings(no_decay_heads=3))
    assert str(err.value) == (
        "sila.no_decay_heads = 3 is not allowed; expected an integer in [0, 2] (the layer's memories: "
        "num_key_value_heads=2 of the source, state_heads='kv')"
    )
    SILAMixer(config(), 0, SILASettings(no_decay_heads=3, state_heads="query"))  # 4 memories, one per query head


def test_a_memory_per_query_head_starts_as_the_kv_heads_memories_and_trains_apart():
    """A layer with state_heads "query" loaded from one with a memory per kv head (or from the source attention,
    whose k/v projections it widens the same way) computes the same outputs, prefill and decode steps alike, with
    4 memories where the narrow layer has 2; the copies of a kv head then get different gradients."""
    narrow = tiny_mixer(conv_size=4)
    wide = SILAMixer(config(), 0, SILASettings(chunk_size=4, state_heads="query")).eval()
    wide.load_state_dict(narrow.state_dict())
    assert wide.k_proj.weight.shape == (4 * 8, 32) and wide.beta_state_weight.shape == (4, 8)
    torch.testing.assert_close(wide.k_proj.weight[8:16], narrow.k_proj.weight[:8])  # query head 1 reads kv head 0
    torch.testing.assert_close(wide.k_proj.weight[16:24], narrow.k_proj.weight[8:16])
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected, _ = narrow(x)
        full, _ = wide(x)
        cache = FakeCache()
        steps = [wide(x[:, :5], cache=cache)[0]] + [wide(x[:, t : t + 1], cache=cache)[0] for t in range(5, 9)]
    torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-6)
    assert cache.state[0].shape == (2, 4, 8, 8) and wide.state_numel() == 4 * 64 + 3 * (4 + 2 * 4) * 8
    wide.train()
    wide(x)[0].square().mean().backward()
    grad = wide.k_proj.weight.grad.view(4, 8, 32)
    assert not torch.allclose(grad[0], grad[1])  # two query heads of kv head 0: their keys are trained apart
    again = SILAMixer(config(), 0, SILASettings(state_heads="query"))
    again.load_state_dict(wide.state_dict())  # as wide already: loaded as it is
    assert torch.equal(again.k_proj.weight, wide.k_proj.weight)


def forget_gates(mixer, x):
    """gamma [B, T, H_kv] of the mixer on x with its memory-dependent term, from the exact token-by-token memory."""
    (q, k, v, alpha, beta_x, gamma_x), _ = mixer.recurrence_inputs(x)
    gammas, memory = [], None
    for t in range(x.shape[1]):
        step = slice(t, t + 1)
        recalled = 0.0 if memory is None else torch.einsum("bhvk,bhk->bhv", memory, k[:, t])
        gammas.append(sila_phi((recalled * mixer.gamma_state_weight).sum(-1) + gamma_x[:, t]))
        args = (q[:, step], k[:, step], v[:, step], alpha[:, step], beta_x[:, step], gamma_x[:, step])
        _, memory = sila_recurrent(*args, mixer.beta_state_weight, mixer.gamma_state_weight, memory)
    return torch.stack(gammas, dim=1)


def test_no_decay_heads_keep_gamma_at_one_through_training():
    """The first no_decay_heads kv heads forget nothing (gamma = 1 exactly, memory term included) and stay so under
    training: no gradient reaches their forget-gate parameters, while the other heads' gates learn."""
    torch.manual_seed(0)
    mixer = SILAMixer(config(), 0, SILASettings(chunk_size=4, no_decay_heads=1))
    assert mixer.gamma_bias[0] == SILAMixer.NO_DECAY_BIAS and mixer.gamma_bias[1] < 0
    start = {n: getattr(mixer, n).detach().clone() for n in ("gamma_bias", "gamma_weight", "gamma_state_weight")}
    optimizer = torch.optim.Adam(mixer.parameters(), lr=1e-2)
    x, target = torch.randn(2, 13, 32), torch.randn(2, 13, 32)
    for _ in range(5):
        optimizer.zero_grad()
        out, _ = mixer(x)
        (out - target).pow(2).mean().backward()
        assert mixer.gamma_bias.grad[0] == 0 and mixer.gamma_bias.grad[1] != 0
        optimizer.step()
    for name, before in start.items():
        after = getattr(mixer, name)
        assert torch.equal(after[0], before[0]), name  # the no-decay head's row is untouched
        assert not torch.equal(after[1], before[1]), name  # the other head's gate learned
    with torch.no_grad():
        gamma = forget_gates(mixer, torch.randn(2, 9, 32))  # [B, T, H_kv]
    assert torch.equal(gamma[..., 0], torch.ones_like(gamma[..., 0]))
    assert (gamma[..., 1] < 1).any()
