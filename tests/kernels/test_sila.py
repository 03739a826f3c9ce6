"""SILA Triton kernels against `sila_recurrent`: outputs, final memory and every gradient (interpreted on CPU)."""

import math

import pytest
import torch
from transformers import LlamaConfig

from raven_kernels.sila import fused_recurrent_sila, fused_recurrent_sila_decode, utils
from raven_kernels.sila.naive import naive_recurrent_sila
from raven_layers.backend import use_backend
from raven_layers.sila import SILAMixer, SILASettings, l2_normalize
from tests.kernels.decode_steps import steps_on_both_backends
from tests.raven_layers.test_sila import FakeCache

NAMES = ("q", "k", "v", "alpha", "beta_x", "gamma_x", "w_beta", "w_gamma", "initial_state")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Decode steps against the PyTorch path: on the GPU cuBLAS picks an algorithm per product shape, so the fused
# product of the Triton path and the PyTorch path's separate ones sum in different orders (~1e-6 each)
STEP_TOL = 1e-5 if DEVICE == "cpu" else 1e-4


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch, request):
    """Every buffer the kernels write starts as NaN (integers as -1), so an element left unwritten fails.

    Compiled on a GPU, the float32 tests take the chunk products in full float32 (the default, tf32, would blur
    gradients that vanish exactly, e.g. at gamma ~ 0), and so does the PyTorch path's short convolution (cuDNN
    takes tf32 by default); the bf16 tests keep the production setting.
    """
    if torch.cuda.is_available() and "gpu" not in request.keywords:
        monkeypatch.setattr(utils, "DOT_PRECISION", "ieee")
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    real = utils.new_output

    def poisoned(shape, like, dtype=None):
        out = real(shape, like, dtype)
        return out.fill_(math.nan if out.is_floating_point() else -1)

    monkeypatch.setattr(utils, "new_output", poisoned)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def random_inputs(B, T, H, G, d, seed=0, N=None, device=DEVICE, gate_scale=1.0):
    """q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, M_0 [N, H, d, d]; gates on both sides of phi's kink."""
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, G, d, generator=g))
    k = l2_normalize(torch.randn(B, T, H, d, generator=g))
    v = torch.randn(B, T, H, d, generator=g)
    alpha = torch.rand(B, T, H, G, generator=g)
    beta_x = torch.randn(B, T, H, generator=g)
    gamma_x = gate_scale * (2 * torch.randn(B, T, H, generator=g) - 1)
    w_beta = torch.randn(H, d, generator=g)
    w_gamma = gate_scale * torch.randn(H, d, generator=g)
    state = 0.3 * torch.randn(N or B, H, d, d, generator=g)
    return [x.to(device) for x in (q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state)]


def run_both(inputs, mask=None, cu_seqlens=None, with_state=True, chunk_size=16, dtype=None):
    """Outputs, final memory and gradients of a loss on both, from the kernel and from the reference."""
    results = []
    for kernel in (True, False):
        leaves = [x.clone().to(dtype or x.dtype).requires_grad_() for x in inputs]
        h0 = leaves[-1] if with_state else None
        if kernel:
            o, ht = fused_recurrent_sila(*leaves[:-1], h0, mask, True, cu_seqlens, chunk_size=chunk_size)
        else:
            args = [x.float() for x in leaves[:-1]]
            o, ht = naive_recurrent_sila(*args, None if h0 is None else h0.float(), mask, cu_seqlens)
        weights = torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)
        (o.float() * weights).sum().add((ht * ht.detach().sin()).sum()).backward()
        grads = [x.grad for x in (leaves if with_state else leaves[:-1])]
        results.append([o, ht, *grads])
    return results


def assert_all_close(kernel, reference, tol=1e-4):
    for name, a, b in zip(("o", "final_state", *NAMES), kernel, reference):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name} has non-finite entries"
        assert rel_err(a, b) < tol, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize(
    "T, G, d, with_state, with_mask",
    [(37, 2, 16, True, True), (19, 1, 32, False, False), (33, 3, 16, True, False), (16, 1, 16, False, True)],
)
def test_matches_reference(T, G, d, with_state, with_mask):
    inputs = random_inputs(2, T, 2, G, d, seed=T)
    mask = None
    if with_mask:  # padding at the start of one row (left-padded batch) and scattered in the other
        mask = torch.rand(2, T, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[1, :5] = False
        mask = mask.to(DEVICE)
    kernel, reference = run_both(inputs, mask=mask, with_state=with_state)
    assert_all_close(kernel, reference)


def test_variable_length_sequences():
    cu_seqlens = torch.tensor([0, 5, 21, 21, 40], dtype=torch.int32, device=DEVICE)  # one empty sequence
    inputs = random_inputs(1, 40, 2, 2, 16, seed=3, N=4)
    kernel, reference = run_both(inputs, cu_seqlens=cu_seqlens)
    assert_all_close(kernel, reference)


def test_gates_near_the_kink_and_near_zero():
    inputs = random_inputs(1, 24, 2, 1, 16, seed=5, gate_scale=1e-3)  # pre-activations of gamma around 0
    gamma_x = inputs[5].clone()
    gamma_x[:, 12:] = -60.0  # then gamma ~ 1e-26: the memory is not invertible there
    inputs[5] = gamma_x
    kernel, reference = run_both(inputs)
    # gamma_x's gradient is small here (norm ~1e-2) against O(1) terms, so float32 rounding (~1e-6) is ~2e-4 of it
    assert_all_close(kernel, reference, tol=5e-4)


@pytest.mark.parametrize("with_grad", [False, True])
def test_decode_step(with_grad):
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state = random_inputs(3, 1, 2, 2, 16, seed=7)
    with torch.set_grad_enabled(with_grad):
        o, ht = fused_recurrent_sila(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state.requires_grad_(with_grad),
                                     output_final_state=True)  # fmt: skip
    o_ref, ht_ref = naive_recurrent_sila(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ht, ht_ref) < 1e-5


def test_rejects_bad_arguments():
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state = random_inputs(2, 4, 2, 1, 16)
    with pytest.raises(ValueError, match="k must have shape"):
        fused_recurrent_sila(q, k[:, :3], v, alpha, beta_x, gamma_x, w_beta, w_gamma)
    with pytest.raises(ValueError, match="B must be 1"):
        fused_recurrent_sila(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="power of two"):
        fused_recurrent_sila(q[..., :12], k[..., :12], v, alpha, beta_x, gamma_x, w_beta, w_gamma)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        fused_recurrent_sila(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        fused_recurrent_sila(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, chunk_size=24)


def test_mixer_triton_matches_torch():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=64, vocab_size=32)  # fmt: skip
    torch.manual_seed(0)
    mixer = SILAMixer(config, 0, SILASettings(chunk_size=8))
    with torch.no_grad():  # non-trivial gates: the fresh ones are constants
        for name in ("beta_state_weight", "gamma_state_weight", "beta_weight", "gamma_weight", "alpha_weight"):
            getattr(mixer, name).normal_(std=0.3)
    mixer.to(DEVICE)
    x = torch.randn(2, 21, 32, device=DEVICE)
    padding = torch.ones(2, 21, dtype=torch.bool, device=DEVICE)
    padding[1, :4] = False
    runs = {}
    for backend in ("triton", "torch"):
        mixer.zero_grad()
        with use_backend(backend):
            y, _ = mixer(x, padding_mask=padding)
            y.square().sum().backward()
        runs[backend] = (y.detach(), {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None})
    (y_t, g_t), (y_r, g_r) = runs["triton"], runs["torch"]
    assert rel_err(y_t, y_r) < 1e-4
    assert g_t.keys() == g_r.keys() and "gamma_state_weight" in g_t
    for name in g_r:
        assert rel_err(g_t[name], g_r[name]) < 1e-4, name


@pytest.mark.parametrize(
    "settings, qk_norm, padded",
    [({}, False, False), ({}, True, True), ({"conv_size": 1, "feature_map": "identity"}, False, True),
     ({"conv_size": 2, "output_gate": False}, False, False), ({"conv_size": 3}, False, True),
     ({"conv_size": 5}, True, False), ({"state_heads": "query"}, True, True)],
)  # fmt: skip
def test_mixer_decode_steps_in_one_kernel_update_the_state_in_place(settings, qk_norm, padded):
    """The mixer's decode steps on the Triton kernels run in one kernel that writes the cache's memory and
    convolution tail where they lie (the same tensors after each step), and give the PyTorch path's outputs and
    state: qk norms, padding (a padded token changes neither), a convolution of 1 and 2 taps, no feature map, no
    output gate, a memory per query head."""
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=64, vocab_size=32, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    mixer = SILAMixer(config, 0, SILASettings(chunk_size=8, **settings), source_has_qk_norm=qk_norm)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name in mixer.fresh_parameter_names() - {"gamma_bias"} or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    runs = steps_on_both_backends(mixer.to(DEVICE), padded, DEVICE)
    for i, (a, b) in enumerate(zip(runs["triton"], runs["torch"])):
        assert a.shape == b.shape and rel_err(a, b) < STEP_TOL, f"output {i}: relative error {rel_err(a, b):.2e}"


def test_a_decode_step_with_gradients_keeps_the_old_state():
    """A step that trains takes the out-of-place kernel: its backward pass needs the memory before the step."""
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=64, vocab_size=32)  # fmt: skip
    mixer = SILAMixer(config, 0, SILASettings(chunk_size=8)).to(DEVICE)
    x = torch.randn(2, 6, 32, device=DEVICE)
    cache = FakeCache()
    with torch.no_grad(), use_backend("triton"):
        mixer(x[:, :5], cache=cache)
    memory, kept = cache.state[0], cache.state[0].clone()
    with use_backend("triton"):
        mixer(x[:, 5:], cache=cache)[0].square().sum().backward()
    assert cache.state[0] is not memory and torch.equal(memory, kept) and mixer.gamma_state_weight.grad is not None


def test_decode_kernel_reads_row_views_of_one_product_and_names_bad_arguments():
    """The projections may be row views of one fused product (the compiled step's); wrong shapes, a state that is
    not float32 or not contiguous, and gradients are refused by name."""
    H, G, d, B = 2, 2, 16, 3
    C = (G + 2) * H * d
    g = torch.Generator().manual_seed(0)
    product = torch.randn(B, 1, C + 2 * H + H * G + H * G * d, generator=g).to(DEVICE)  # q/k/v, 3 gates, output gate
    q, k, v, bx, gx, ax, og = product.split([H * G * d, H * d, H * d, H, H, H * G, H * G * d], dim=-1)
    biases = tuple(torch.randn(n, generator=g).to(DEVICE) for n in (H, H, H * G))
    conv = torch.randn(C, 4, generator=g).to(DEVICE)
    tail = torch.randn(B, 3, C, generator=g).to(DEVICE)
    w_beta, w_gamma = (torch.randn(H, d, generator=g).to(DEVICE) for _ in range(2))
    state = torch.randn(B, H, d, d, generator=g).to(DEVICE)
    args = (q, k, v, bx, gx, ax, biases, conv, tail, w_beta, w_gamma)
    o = fused_recurrent_sila_decode(*args[:8], tail.clone(), w_beta, w_gamma, state.clone(), out_gate=og)
    contiguous = [x.contiguous() for x in (q, k, v, bx, gx, ax)]
    # equal under the interpreter; compiled, Triton lays out a load by its pointers' alignment, and the strides
    # differ, so the sums may run in another order
    torch.testing.assert_close(o, fused_recurrent_sila_decode(*contiguous, biases, conv, tail.clone(), w_beta, w_gamma,
                                                              state.clone(), out_gate=og.contiguous()),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    ungated = fused_recurrent_sila_decode(*args[:8], tail.clone(), w_beta, w_gamma, state.clone())
    torch.testing.assert_close(o, ungated * 2 * torch.sigmoid(og).view_as(o))
    with pytest.raises(ValueError, match="k must have shape"):
        fused_recurrent_sila_decode(q, k[..., :8], *args[2:], state)
    with pytest.raises(ValueError, match="state must be float32"):
        fused_recurrent_sila_decode(*args, state.double())
    with pytest.raises(ValueError, match="state must be contiguous"):
        fused_recurrent_sila_decode(*args, state.transpose(-1, -2))
    with pytest.raises(ValueError, match="feature_map"):
        fused_recurrent_sila_decode(*args, state, feature_map="relu")
    with pytest.raises(ValueError, match="computes no gradients"):
        fused_recurrent_sila_decode(q.clone().requires_grad_(), *args[1:], state)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d, G", [(64, 3), (128, 2)])
def test_bf16_on_gpu(d, G):
    cu_seqlens = torch.tensor([0, 300, 700, 1000], dtype=torch.int32, device="cuda")
    inputs = random_inputs(1, 1000, 4, G, d, seed=11, N=3, device="cuda")
    kernel, reference = run_both(inputs, cu_seqlens=cu_seqlens, chunk_size=64, dtype=torch.bfloat16)
    for i, (name, a, b) in enumerate(zip(("o", "final_state", *NAMES), kernel, reference)):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < (5e-3 if i < 2 else 1e-2), f"{name}: relative error {rel_err(a, b):.2e}"


def test_the_decode_step_under_any_warps_the_sweep_tries_gives_the_same_step():
    """`decode_warps` sets the program's warps (sweep_sila_decode.py): the step's values do not depend on them."""
    from raven_kernels.sila.fused_recurrent import decode_warps

    H, G, d, B = 2, 2, 16, 3
    C = (G + 2) * H * d
    g = torch.Generator().manual_seed(4)
    product = torch.randn(B, 1, C + 2 * H + H * G, generator=g).to(DEVICE)
    q, k, v, bx, gx, ax = product.split([H * G * d, H * d, H * d, H, H, H * G], dim=-1)
    biases = tuple(torch.randn(n, generator=g).to(DEVICE) for n in (H, H, H * G))
    conv, tail = torch.randn(C, 4, generator=g).to(DEVICE), torch.randn(B, 3, C, generator=g).to(DEVICE)
    w_beta, w_gamma = (torch.randn(H, d, generator=g).to(DEVICE) for _ in range(2))
    state = torch.randn(B, H, d, d, generator=g).to(DEVICE)
    outs = []
    for warps in (None, 1, 2, 8):
        with decode_warps(warps):
            outs.append(fused_recurrent_sila_decode(q, k, v, bx, gx, ax, biases, conv, tail.clone(), w_beta, w_gamma,
                                                    state.clone()))  # fmt: skip
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("taps", [2, 4, 5])
def test_decode_step_is_repeatable_and_moves_the_tail_on_exactly(taps):
    """At SmolLM2's shapes a head's 64 values are held by more threads than there are values: every thread must
    read a tail row before any overwrites it. The same step from the same state gives the same bits every time,
    and the tail moves on by exactly one token (on the CPU: two rows, twice), with the tail in registers (up to 4
    taps) or moved a row at a time."""
    B, H, G, d = (128 if DEVICE == "cuda" else 2), 3, 3, 64
    C = (G + 2) * H * d
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, bx, gx, ax = (
        torch.randn(B, 1, n, device=DEVICE, generator=g) for n in (H * G * d, H * d, H * d, H, H, H * G)
    )
    biases = tuple(torch.randn(n, device=DEVICE, generator=g) for n in (H, H, H * G))
    conv = torch.randn(C, taps, device=DEVICE, generator=g)
    tail = torch.randn(B, taps - 1, C, device=DEVICE, generator=g)
    w_beta, w_gamma = (torch.randn(H, d, device=DEVICE, generator=g) for _ in range(2))
    state = torch.randn(B, H, d, d, device=DEVICE, generator=g)
    runs = []
    for _ in range(50 if DEVICE == "cuda" else 2):
        t, s = tail.clone(), state.clone()
        o = fused_recurrent_sila_decode(q, k, v, bx, gx, ax, biases, conv, t, w_beta, w_gamma, s)
        runs.append((o, t, s))
    assert torch.equal(runs[0][1], torch.cat([tail[:, 1:], torch.cat([q, k, v], -1)], 1))
    for o, t, s in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(t, runs[0][1]) and torch.equal(s, runs[0][2])
