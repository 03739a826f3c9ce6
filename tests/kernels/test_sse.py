"""SSE kernels against the PyTorch references: chunked GLA, the masking and varlen SSE forms, the decode step, and
the mixer under the triton and torch backends. The CPU tests run the kernels under the Triton interpreter (small
sizes, exact float32 products); on a CUDA host they run with TRITON_INTERPRET=1, and the `gpu` tests on the GPU:

    TRITON_INTERPRET=1 python -m pytest -q -m "not gpu" tests/kernels/test_sse.py   # on a CUDA host
    python -m pytest -q -m gpu tests/kernels/test_sse.py
"""

import os

import pytest
import torch

import raven_kernels.sse
from raven_kernels import chunked
from raven_kernels.chunked import RANGE_NATS, needs_exact
from raven_kernels.sse import chunk as chunk_module
from raven_kernels.sse import chunk_gla, fused_recurrent_sse, fused_recurrent_sse_decode
from raven_kernels.sse.naive import chunk_gla_reference, gla_recurrent, sse_masking, sse_recurrent, sse_varlen
from raven_layers.backend import use_backend
from raven_layers.sse_forms import sse_parallel
from tests.kernels.decode_steps import steps_on_both_backends
from tests.raven_layers.test_sse import CONFIG, FakeCache, random_gla, random_sse, tiny_mixer


@pytest.fixture(autouse=True)
def poison(monkeypatch, request):
    if request.node.get_closest_marker("gpu") is None and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the Triton interpreter: on a CUDA host, run with TRITON_INTERPRET=1")
    monkeypatch.setattr(chunk_module, "POISON", True)  # kernel outputs start as NaN: an unwritten element fails
    monkeypatch.setattr(chunk_module, "FAST_FLOAT32", True)  # the interpreter's products are exact float32
    for name in chunk_module.BLOCK_K:  # so K = 32 at these sizes still runs two key blocks
        monkeypatch.setitem(chunk_module.BLOCK_K, name, 16)


@pytest.fixture(params=["split-fast", "sequential-exact"])
def forms(request, monkeypatch):
    """Both state scans and both output kernels: per-chunk contributions and the shared scan with the one-product
    output kernel, or the sequential scan with the per-sub-chunk exact one (chosen on the GPU by size and decay)."""
    split = request.param == "split-fast"
    monkeypatch.setattr(chunk_module, "split_scan", lambda programs: split)
    monkeypatch.setattr(chunk_module, "needs_exact", lambda gl: lambda: not split)
    return request.param


def chunk_sse(*args, implementation="varlen", cu_seqlens=None):
    """SSE's parallel form on the kernels' GLA, as the mixer runs it."""
    return sse_parallel(implementation, raven_kernels.sse)(*args, cu_seqlens=cu_seqlens)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_with_grads(fn, inputs, state):
    """Outputs of fn and the gradients of every input (and the initial state) under a loss using both results."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    s0 = None if state is None else state.clone().requires_grad_()
    o, s = fn(*leaves, s0)
    (o.sin().sum() + (s**2).sum()).backward()
    return o, s, [x.grad for x in leaves] + ([] if s0 is None else [s0.grad])


def assert_all_close(got, ref, tol, grad_tol=None, names=("q", "k", "v", "log_g", "initial_state")):
    o, s, grads = got
    o_ref, s_ref, grads_ref = ref
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
    assert len(grads) == len(grads_ref)
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert torch.isfinite(g).all() and rel_err(g, g_ref) < (grad_tol or tol), name


@pytest.mark.parametrize(
    ("B", "T", "H", "G", "K", "V", "with_state"),
    [(1, 1, 1, 1, 16, 16, True), (1, 70, 2, 2, 16, 32, True), (1, 65, 1, 3, 32, 16, False), (2, 33, 1, 1, 8, 5, True)],
)
def test_chunk_gla_matches_recurrence(B, T, H, G, K, V, with_state, forms):
    q, k, v, log_g = random_gla(B, T, H, G, K, V, seed=T)
    state = torch.randn(B, H, K, V) if with_state else None
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], output_final_state=True), (q, k, v, log_g), state)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:4], 0.3, a[4]), (q, k, v, log_g), state)
    assert got[0].shape == (B, T, H, G, V) and got[1].shape == (B, H, K, V) and got[1].dtype == torch.float32
    assert_all_close(got, ref, 1e-5)


@pytest.mark.parametrize("with_state", [True])
def test_chunk_gla_varlen_with_empty_and_single_token_segments(with_state, forms):
    lengths = [5, 0, 1, 66, 0, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, log_g = random_gla(1, sum(lengths), 1, 2, 16, 16, seed=1)
    state = torch.randn(len(lengths), 1, 16, 16) if with_state else None
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], True, cu), (q, k, v, log_g), state)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:4], 0.3, a[4], cu), (q, k, v, log_g), state)
    assert_all_close(got, ref, 1e-5)
    if with_state:  # an empty segment passes its state and the state's gradient through
        assert torch.equal(got[1][1], state[1])
        assert torch.equal(got[2][4][1], 2 * state[1])


def test_chunk_gla_is_stable_under_strong_decay():
    q, k, v, log_g = random_gla(1, 70, 1, 1, 16, 16, seed=2)
    log_g = log_g * 200  # whole channels wiped within a sub-chunk
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], True), (q, k, v, log_g), None)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:4], 0.3, a[4]), (q, k, v, log_g), None)
    assert_all_close(got, ref, 1e-5, grad_tol=1e-3)  # d log_g = q dq - k dk cancels: float32 rounding shows


@pytest.mark.parametrize(("reach", "exact"), [(0.95, False), (1.2, True)])
def test_chunk_gla_output_kernel_follows_the_decay_range(monkeypatch, reach, exact):
    # the strongest chunk decays by reach x RANGE_NATS in one channel: within the range the one-product output kernel
    # runs with factors up to e^(RANGE_NATS / 2), past it the exact one; both match the recurrence
    q, k, v, log_g = random_gla(1, 128, 1, 1, 16, 16, seed=4)
    log_g = log_g * (reach * RANGE_NATS / -log_g.view(2, 64, 16).sum(1).min())
    chosen = []

    def record(gl):
        answer = needs_exact(gl)()
        chosen.append(answer)
        return lambda: answer

    monkeypatch.setattr(chunk_module, "needs_exact", record)
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], True), (q, k, v, log_g), None)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:4], 0.3, a[4]), (q, k, v, log_g), None)
    assert chosen == [exact]
    assert_all_close(got, ref, 1e-5, grad_tol=1e-3)


@pytest.mark.parametrize(("reach", "exact"), [(0.95, False), (3.0, True)])
def test_chunk_gla_output_kernels_chosen_on_the_device(monkeypatch, reach, exact):
    # inside a CUDA graph nothing is read back: both output kernels are queued and each program reads whether the
    # decay leaves the range; at 3 x RANGE_NATS the one-product kernel's factors overflow, and with POISON an output
    # neither kernel writes stays NaN, so only the right choice matches the recurrence
    monkeypatch.setattr(chunked, "FORCE_DEVICE_CHOICE", True)
    monkeypatch.setattr(chunk_module, "needs_exact", lambda gl: pytest.fail("the choice was read back to the host"))
    flags = []
    monkeypatch.setattr(chunk_module, "exceeds_range", lambda gl: flags.append(chunked.exceeds_range(gl)) or flags[-1])
    q, k, v, log_g = random_gla(1, 128, 1, 1, 16, 16, seed=4)
    log_g = log_g * (reach * RANGE_NATS / -log_g.view(2, 64, 16).sum(1).min())
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], True), (q, k, v, log_g), None)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:4], 0.3, a[4]), (q, k, v, log_g), None)
    assert [bool(f) for f in flags] == [exact]
    assert_all_close(got, ref, 1e-5, grad_tol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_gla_float32_keeps_the_exact_output_kernel(monkeypatch, dtype):
    # on a GPU the one-product kernel rounds the diagonal scores to tf32: float32 asks for more and never takes it
    monkeypatch.setattr(chunk_module, "FAST_FLOAT32", False)
    asked = []
    monkeypatch.setattr(chunk_module, "needs_exact", lambda gl: asked.append(gl) or needs_exact(gl))
    q, k, v, log_g = random_gla(1, 70, 1, 1, 16, 16, seed=3)
    o, _ = chunk_gla(q.to(dtype), k.to(dtype), v.to(dtype), log_g, 0.3)
    assert len(asked) == (dtype != torch.float32)
    if dtype == torch.float32:  # bf16 values: the GPU tests (the interpreter returns nonsense for bf16 q, k, v)
        assert rel_err(o, gla_recurrent(q, k, v, log_g, 0.3)[0]) < 1e-5


def test_chunk_gla_bf16_gates():
    # a bf16 log_g: its gradient leaves in bf16, through a float32 buffer of the in-chunk sums
    q, k, v, log_g = random_gla(1, 70, 1, 1, 16, 16, seed=3)
    log_g = log_g.bfloat16()
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], 0.3, a[4], True), (q, k, v, log_g), None)
    ref = run_with_grads(lambda *a: gla_recurrent(*a[:3], a[3].float(), 0.3, a[4]), (q, k, v, log_g), None)
    assert got[2][3].dtype == torch.bfloat16
    assert_all_close(got, ref, 1e-5, grad_tol=1e-2)


def test_chunk_gla_without_final_state():
    q, k, v, log_g = random_gla(1, 9, 1, 1, 16, 16)
    o, final = chunk_gla(q, k, v, log_g, 0.5)
    assert final is None and rel_err(o, gla_recurrent(q, k, v, log_g, 0.5)[0]) < 1e-5


def test_chunk_gla_names_bad_inputs():
    q, k, v, log_g = random_gla(2, 4, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="cu_seqlens needs a batch of 1"):
        chunk_gla(q, k, v, log_g, 1.0, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"q.dtype = torch.float64 is not supported"):
        chunk_gla(q.double(), k, v, log_g, 1.0)


@pytest.mark.parametrize("implementation", ["varlen", "masking"])
@pytest.mark.parametrize(("N", "k", "k_read", "shared", "with_state"), [(4, 1, 1, True, True), (3, 2, 3, False, False)])
def test_chunk_sse_matches_recurrence(implementation, N, k, k_read, shared, with_state):
    B, T, H, G, c, d = 2, 19, 1, 2, 16, 16
    q, keys, v, log_g, idx, P = random_sse(B, T, H, G, c, d, N, k, k_read, shared, seed=N + k)
    state = torch.randn(B, H, P, c, d) if with_state else None

    def kernel(*a):
        return chunk_sse(*a[:4], idx, P, 0.35, a[4], implementation=implementation)

    got = run_with_grads(kernel, (q, keys, v, log_g), state)
    ref = run_with_grads(lambda *a: sse_recurrent(*a[:4], idx, P, 0.35, a[4]), (q, keys, v, log_g), state)
    assert_all_close(got, ref, 1e-5)


def test_chunk_sse_varlen_packed_documents_span_chunks(forms):
    # segments of up to 70 entries cross the kernels' 64-row chunks; an empty document keeps its state
    lengths = [70, 0, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, keys, v, log_g, idx, P = random_sse(1, sum(lengths), 1, 2, 16, 16, 2, 1, 1, True, seed=5)
    state = torch.randn(len(lengths), 1, P, 16, 16)

    def kernel(*a):
        return chunk_sse(*a[:4], idx, P, 0.35, a[4], implementation="varlen", cu_seqlens=cu)

    got = run_with_grads(kernel, (q, keys, v, log_g), state)
    ref = run_with_grads(lambda *a: sse_varlen(*a[:4], idx, P, 0.35, a[4], cu_seqlens=cu), (q, keys, v, log_g), state)
    assert_all_close(got, ref, 1e-5)
    assert torch.equal(got[1][1], state[1])


def test_chunk_sse_names_a_bad_implementation():
    q, keys, v, log_g, idx, P = random_sse(1, 3, 1, 1, 16, 16, 4, 1, 1, True)
    with pytest.raises(ValueError, match=r"implementation = 'dense' is not allowed; allowed: \['masking', 'varlen'\]"):
        chunk_sse(q, keys, v, log_g, idx, P, 1.0, implementation="dense")


def test_chunk_gla_entries_names_bad_inputs():
    q, keys, v, log_g, idx, P = random_sse(1, 3, 1, 1, 16, 16, 4, 1, 1, True)
    with pytest.raises(ValueError, match=r"chunk_gla_entries: q.dtype = torch.float64 is not supported"):
        chunk_sse(q.double(), keys, v, log_g, idx, P, 1.0)


@pytest.mark.parametrize(("T", "G", "c", "d"), [(1, 1, 16, 16), (1, 3, 8, 40), (5, 2, 16, 16)])
def test_fused_recurrent_sse_matches_recurrence(T, G, c, d):
    q, keys, v, log_g, idx, P = random_sse(2, T, 2, G, c, d, 4, 2, 3, True, seed=T)
    state = torch.randn(2, 2, P, c, d)
    o_ref, s_ref = sse_recurrent(q, keys, v, log_g, idx, P, 0.35, state)
    o, s = fused_recurrent_sse(q, keys, v, log_g, idx, P, 0.35, state.clone())
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    touched = torch.zeros(2, 2, P, dtype=torch.bool)
    touched.scatter_(2, idx.transpose(1, 2).flatten(2), True)
    assert torch.equal(s[~touched], state[~touched])  # partitions no token selected are untouched
    o_zero, s_zero = fused_recurrent_sse(q, keys, v, log_g, idx, P, 0.35, None)
    o_zero_ref, s_zero_ref = sse_recurrent(q, keys, v, log_g, idx, P, 0.35)
    assert rel_err(o_zero, o_zero_ref) < 1e-5 and rel_err(s_zero, s_zero_ref) < 1e-5


def test_fused_recurrent_sse_updates_the_state_in_place():
    q, keys, v, log_g, idx, P = random_sse(1, 1, 1, 1, 16, 16, 4, 1, 1, True)
    state = torch.randn(1, 1, P, 16, 16)
    _, s = fused_recurrent_sse(q, keys, v, log_g, idx, P, 1.0, state)
    assert s is state


@pytest.mark.parametrize("implementation", ["masking", "varlen"])
def test_mixer_runs_the_kernels_like_the_torch_forms(implementation):
    torch.manual_seed(0)
    x = torch.randn(1, 13, CONFIG.hidden_size)  # one row: test_chunk_sse_matches_recurrence runs batches of two
    results = {}
    for backend in ("torch", "triton"):
        # 2 partitions + the shared one, not 4 + 1: fewer heads to interpret, the same parameters and paths
        mixer = tiny_mixer(implementation=implementation, num_partitions=2).train()
        with use_backend(backend):
            out, _ = mixer(x)
            out.square().sum().backward()
        results[backend] = out, {name: p.grad for name, p in mixer.named_parameters()}
    out_ref, grads_ref = results["torch"]
    out, grads = results["triton"]
    assert rel_err(out, out_ref) < 1e-5
    for name, g_ref in grads_ref.items():
        assert rel_err(grads[name], g_ref) < 1e-4, name


def test_mixer_prefill_and_decode_with_the_kernels():
    mixer = tiny_mixer()
    torch.manual_seed(0)
    x = torch.randn(2, 11, CONFIG.hidden_size)
    outs = {}
    for backend in ("torch", "triton"):
        cache = FakeCache()
        with use_backend(backend), torch.no_grad():
            steps = [mixer(x[:, :8], cache=cache)[0]]
            steps += [mixer(x[:, t : t + 1], cache=cache)[0] for t in range(8, 11)]
        outs[backend] = torch.cat(steps, dim=1), cache.state[0]
    assert rel_err(outs["triton"][0], outs["torch"][0]) < 1e-5
    assert rel_err(outs["triton"][1], outs["torch"][1]) < 1e-5


@pytest.mark.parametrize(
    "settings, padded",
    [
        ({}, False),
        ({"num_partitions": 3, "top_k": 2, "read_top_k": 3, "shared_partition": False, "output_norm": False,
          "output_gate": False}, True),
        ({"top_k": 2, "read_top_k": 1, "rows_per_partition": 4}, True),
    ],
)  # fmt: skip
def test_mixer_decode_steps_in_one_kernel_update_the_state_in_place(settings, padded, monkeypatch):
    """The mixer's decode steps on the Triton kernels route, project (LoRA), gate, update, read and gate the read in
    one kernel that updates the cache's state where it lies, and give the PyTorch path's outputs and state: the
    paper's n4k1 with the shared partition, more partitions written than read and the reverse, no shared partition,
    norm or gate, c rows per partition other than the head dim, padding (a padded token neither writes nor decays)."""
    steps = []
    one_kernel = raven_kernels.sse.fused_recurrent_sse_decode
    monkeypatch.setattr(
        raven_kernels.sse, "fused_recurrent_sse_decode", lambda *a, **kw: steps.append(1) or one_kernel(*a, **kw)
    )
    runs = steps_on_both_backends(tiny_mixer(**settings), padded, "cpu")
    assert len(steps) == 4  # every decode step of the Triton run
    for a, b in zip(runs["triton"], runs["torch"]):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5


def test_decode_step_warps_follow_the_partition_and_the_programs():
    """Past 64 x 64 partitions the step takes 8 warps (fewer spill at head dim 128); at 64 x 64 and under, 4 while
    its (row, head) programs fit one to an SM and 2 once they queue (the interpreter counts 8 SMs)."""
    from raven_kernels.sse.fused_recurrent import step_warps

    cpu = torch.device("cpu")
    assert step_warps(128, 128, 3, cpu) == step_warps(128, 128, 384, cpu) == 8
    assert step_warps(64, 64, 3, cpu) == step_warps(64, 64, 8, cpu) == step_warps(32, 64, 8, cpu) == 4
    assert step_warps(64, 64, 9, cpu) == step_warps(64, 64, 384, cpu) == 2


def test_decode_step_kernel_reads_row_views_and_names_bad_arguments():
    """The products may be row views of one fused product (the compiled step's), and the step's values do not
    depend on its warps (`DECODE_WARPS`, which sweep_sse_decode.py sets); wrong shapes, a state that is not
    contiguous float32, a top-k out of range and gradients are refused by name."""
    from raven_kernels.sse.fused_recurrent import DECODE_WARPS

    mixer = tiny_mixer()
    H, G, c, d, N, r, B = 2, 2, 8, 8, 4, mixer.q_lora_b.shape[-1], 3
    g = torch.Generator().manual_seed(0)
    sizes = [H * G * c, H * c, H * d, H * N, 16, N * r, N * r, H * G * d]
    q, k, v, scores, decay, qa, ka, gate = torch.randn(B, 1, sum(sizes), generator=g).split(sizes, dim=-1)
    state = torch.randn(B, H, N + 1, c, d, generator=g)
    lora_b = mixer.q_lora_b, mixer.k_lora_b

    def step(*products, lora_x=(qa, ka), state=state, top_k=1, **kwargs):
        with torch.no_grad():
            return fused_recurrent_sse_decode(
                *products, lora_x, lora_b, mixer.decay_up, mixer.decay_bias, state.clone(), c**-0.5, top_k, 1, 16.0,
                out_norm=mixer.o_norm.weight, out_gate=gate, **kwargs,
            )  # fmt: skip

    views = step(q, k, v, scores, decay)
    assert views.shape == (B, 1, H * G * d)
    contiguous = step(*(t.contiguous() for t in (q, k, v, scores, decay)), lora_x=(qa.contiguous(), ka.contiguous()))
    assert torch.equal(views, contiguous)
    for warps in (1, 2, 4):
        with DECODE_WARPS.use(warps):
            torch.testing.assert_close(step(q, k, v, scores, decay), views, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scores must have shape"):
        step(q, k, v, scores[..., :3], decay)
    with pytest.raises(ValueError, match="lora_x k must have shape"):
        step(q, k, v, scores, decay, lora_x=(qa, ka[..., 1:]))
    with pytest.raises(ValueError, match="contiguous float32"):
        step(q, k, v, scores, decay, state=state.double())
    with pytest.raises(ValueError, match="top_k = 5"):
        step(q, k, v, scores, decay, top_k=5)
    with pytest.raises(ValueError, match="computes no gradients"):
        fused_recurrent_sse_decode(
            q, k, v, scores, decay, (qa, ka), lora_b, mixer.decay_up, mixer.decay_bias, state, c**-0.5, 1, 1, 16.0
        )  # the mixer's parameters require gradients


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_chunk_gla_bf16_on_gpu(varlen):
    B, T, H, G, K, V = (1, 3000, 4, 2, 128, 128) if varlen else (2, 1000, 4, 2, 128, 128)
    q, k, v, log_g = (x.cuda() for x in random_gla(B, T, H, G, K, V, seed=3))
    q, k = q * K**-0.5, k * K**-0.5
    cu = torch.tensor([0, 0, 1, 700, 701, 2100, 2100, 3000], device="cuda") if varlen else None
    S = B if cu is None else cu.numel() - 1
    state = torch.randn(S, H, K, V, device="cuda")
    bf = [x.bfloat16() for x in (q, k, v)] + [log_g]
    got = run_with_grads(lambda *a: chunk_gla(*a[:4], K**-0.5, a[4], True, cu), bf, state)
    ref = run_with_grads(lambda *a: chunk_gla_reference(*a[:4], K**-0.5, a[4], cu), [x.float() for x in bf], state)
    o, s, grads = got
    assert rel_err(o, ref[0]) < 5e-3 and rel_err(s, ref[1]) < 5e-3
    for name, g, g_ref in zip(("q", "k", "v", "log_g", "initial_state"), grads, ref[2]):
        assert rel_err(g, g_ref) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("implementation", ["varlen", "masking"])
def test_chunk_sse_bf16_on_gpu(implementation):
    B, T, H, G, c, d = 2, 1000, 4, 1, 128, 128
    q, keys, v, log_g, idx, P = (
        x.cuda() if torch.is_tensor(x) else x for x in random_sse(B, T, H, G, c, d, 4, 1, 1, True)
    )
    state = torch.randn(B, H, P, c, d, device="cuda")
    bf = [q.bfloat16(), keys.bfloat16(), v.bfloat16(), log_g]

    def ref_fn(*a):
        return (sse_varlen if implementation == "varlen" else sse_masking)(*a[:4], idx, P, c**-0.5, a[4])

    got = run_with_grads(lambda *a: chunk_sse(*a[:4], idx, P, c**-0.5, a[4], implementation=implementation), bf, state)
    ref = run_with_grads(ref_fn, [x.float() for x in bf], state)
    o, s, grads = got
    assert rel_err(o, ref[0]) < 5e-3 and rel_err(s, ref[1]) < 5e-3
    for name, g, g_ref in zip(("q", "k", "v", "log_g", "initial_state"), grads, ref[2]):
        assert rel_err(g, g_ref) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
def test_chunk_sse_varlen_never_waits_on_the_device(packed):
    # a host sync would stall every layer's launches behind the device's queue
    B, T = (1, 600) if packed else (2, 300)
    q, keys, v, log_g, idx, P = (
        x.cuda() if torch.is_tensor(x) else x for x in random_sse(B, T, 2, 1, 64, 64, 4, 1, 1, True)
    )
    cu = torch.tensor([0, 250, 250, 600], device="cuda") if packed else None
    leaves = [x.bfloat16().requires_grad_() for x in (q, keys, v)] + [log_g.requires_grad_()]
    chunk_sse(*leaves, idx, P, 0.125, cu_seqlens=cu)[0].sum().backward()  # compiled outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, _ = chunk_sse(*leaves, idx, P, 0.125, cu_seqlens=cu)
        o.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("reach", "exact"), [(0.95, False), (3.0, True)])
def test_chunk_gla_output_kernels_chosen_on_the_device_on_gpu(monkeypatch, reach, exact):
    # as inside a CUDA graph: both output kernels queued, each program reading the flag, nothing read back; at
    # 3 x RANGE_NATS the one-product kernel's factors overflow, so only the exact kernel's outputs match
    monkeypatch.setattr(chunked, "FORCE_DEVICE_CHOICE", True)
    monkeypatch.setattr(chunk_module, "needs_exact", lambda gl: pytest.fail("the choice was read back to the host"))
    B, T, H, G, K, V = 1, 2048, 2, 2, 64, 64
    q, k, v, log_g = (x.cuda() for x in random_gla(B, T, H, G, K, V, seed=5))
    q, k = q * K**-0.5, k * K**-0.5
    log_g = log_g * (reach * RANGE_NATS / -log_g.view(T // 64, 64, H, K).sum(1).min())
    flags = []
    monkeypatch.setattr(chunk_module, "exceeds_range", lambda gl: flags.append(chunked.exceeds_range(gl)) or flags[-1])
    bf = [x.bfloat16() for x in (q, k, v)] + [log_g]
    run_with_grads(lambda *a: chunk_gla(*a[:4], K**-0.5, a[4], True), bf, None)  # compiled outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run_with_grads(lambda *a: chunk_gla(*a[:4], K**-0.5, a[4], True), bf, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = run_with_grads(lambda *a: chunk_gla_reference(*a[:4], K**-0.5, a[4]), [x.float() for x in bf], None)
    assert [bool(f) for f in flags] == [exact, exact]
    o, s, grads = got
    assert rel_err(o, ref[0]) < 5e-3 and rel_err(s, ref[1]) < 5e-3
    for name, g, g_ref, tol in zip(("q", "k", "v", "log_g"), grads, ref[2], (1e-2, 1e-2, 1e-2, 5e-2)):
        assert rel_err(g, g_ref) < tol, name  # d log_g = q dq - k dk cancels under strong decay


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_recurrent_sse_on_gpu():
    q, keys, v, log_g, idx, P = (
        x.cuda() if torch.is_tensor(x) else x for x in random_sse(64, 1, 16, 1, 128, 128, 4, 1, 1, True)
    )
    state = torch.randn(64, 16, P, 128, 128, device="cuda")
    o_ref, s_ref = sse_recurrent(q, keys, v, log_g, idx, P, 128**-0.5, state)
    o, s = fused_recurrent_sse(q, keys, v, log_g, idx, P, 128**-0.5, state)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
