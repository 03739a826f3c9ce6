"""Raven kernels against the step-by-step reference: outputs, final states and every gradient; decode steps; the
mixer under the Triton and the PyTorch backends. On CPU the kernels run in the Triton interpreter."""

import math

import pytest
import torch
from transformers import LlamaConfig

from raven_kernels import chunked, split
from raven_kernels.raven import chunk as raven_chunk
from raven_kernels.raven import chunk_raven, fused_recurrent_raven, fused_recurrent_raven_decode, route, topk_slots
from raven_kernels.raven.fused_recurrent import StepSplit, step_split
from raven_kernels.raven.naive import naive_raven
from raven_layers import RavenMixer, RavenSettings
from raven_layers.backend import use_backend
from tests.kernels.decode_steps import TinyCache, steps_on_both_backends
from tests.kernels.gpu_rounding import round_dots_as_a_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cpu" else 5e-3  # float32 inputs: exact under the interpreter, tf32 tl.dot on the GPU
GPU_TOL = 5e-3  # the interpreter rounding its products as the GPU does (gpu_rounding.py)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every float tensor the kernels allocate starts as NaN, so an element they forget to write fails the test."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty

    def nan_fill(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan_fill(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **kw: nan_fill(new_empty(*a, **kw)))


@pytest.fixture(params=["exact", "gpu"])
def rounding(request, monkeypatch) -> float:
    """Strong decay's cases twice on CPU: exact products, and rounded as the GPU's tensor cores round float32
    operands (where one tf32 product per state gradient lost whole digits); on a GPU only the hardware's. Returns
    the tolerance."""
    if request.param == "exact":
        return TOL
    if DEVICE == "cuda":
        pytest.skip("the GPU rounds its own products")
    round_dots_as_a_gpu(monkeypatch)
    return GPU_TOL


@pytest.fixture(params=["split", "sequential"])
def scan_form(request, monkeypatch):
    """Both ways to the chunk states: contributions and a scan (long sequences), and the sequential kernels."""
    monkeypatch.setattr(raven_chunk, "split_scan", lambda *shape: request.param == "split")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_inputs(B, T, H, G, d, M, K, dtype=torch.float32, decay=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, G, d, generator=g)
    k = torch.randn(B, T, H, d, generator=g)
    v = torch.randn(B, T, H, d, generator=g)
    a = -decay * torch.rand(B, T, H, generator=g)
    idx = torch.rand(B, T, H, M, generator=g).topk(K, dim=-1).indices
    r = torch.rand(B, T, H, K, generator=g)
    r = r / r.sum(-1, keepdim=True)
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    return q, k, v, a.to(DEVICE), idx.to(DEVICE), r.to(DEVICE)


def random_state(N, H, M, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(N, H, M, d, generator=g).to(DEVICE) for _ in range(2))


def run_both(inputs, scale, M, state, cu_seqlens=None, checkpoint_level=2):
    """Kernel and float64 reference on the same leaves; the same random loss on both. Returns outputs and grads."""
    q, k, v, a, idx, r = inputs
    results = []
    for fn, dtype in ((chunk_raven, None), (naive_raven, torch.float64)):
        leaves = [x.detach().clone().to(dtype or x.dtype).requires_grad_() for x in (q, k, v, a, r)]
        h0 = None if state is None else tuple(s.detach().clone().to(dtype or s.dtype).requires_grad_() for s in state)
        if fn is chunk_raven:
            o, (hk, hv) = fn(*leaves[:4], idx, leaves[4], scale, M, h0, True, cu_seqlens, checkpoint_level)
        else:
            o, (hk, hv) = fn(*leaves[:4], idx, leaves[4], scale, h0, cu_seqlens, num_slots=M)
        torch.manual_seed(7)
        w_o, w_k = (torch.randn(x.shape, device=DEVICE).to(x.dtype) for x in (o, hk))
        loss = (o * w_o).sum() + (hk * w_k).sum() + (hv.pow(2)).sum()
        loss.backward()
        grads = [x.grad for x in leaves] + ([s.grad for s in h0] if h0 is not None else [])
        results.append((o, hk, hv, grads))
    return results


def assert_match(results, tol=TOL):
    (o, hk, hv, grads), (o_ref, hk_ref, hv_ref, grads_ref) = results
    assert torch.isfinite(o).all()
    for name, x, ref in [("o", o, o_ref), ("S^k", hk, hk_ref), ("S^v", hv, hv_ref)]:
        assert rel_err(x, ref) < tol, name
    for name, x, ref in zip(["q", "k", "v", "a", "r", "S^k_0", "S^v_0"], grads, grads_ref):
        assert rel_err(x, ref) < tol, f"grad {name}"


@pytest.mark.parametrize(
    "T, G, M, K, with_state",
    # lengths not multiples of the chunk (64) or sub-chunk (16); M = 80: two 64-slot blocks, the last one partial
    [(70, 1, 32, 4, True), (37, 2, 16, 3, False), (70, 1, 80, 6, False)],
)
def test_chunk_matches_reference(T, G, M, K, with_state, scan_form):
    B, H, d = 2, 1, 16
    inputs = random_inputs(B, T, H, G, d, M, K, seed=T)
    state = random_state(B, H, M, d) if with_state else None
    assert_match(run_both(inputs, 0.4, M, state))


def test_chunk_is_stable_under_strong_decay(rounding):
    # whole slots wiped within a sub-chunk: no exponent the kernels take may overflow
    inputs = random_inputs(1, 40, 1, 1, 16, 16, 8, decay=60.0)
    assert_match(run_both(inputs, 0.4, 16, None), rounding)


def test_chunk_mixes_fast_and_exact_paths(rounding):
    # the middle chunk decays too strongly for the factored (fast) in-chunk path, its neighbours do not
    q, k, v, a, idx, r = random_inputs(1, 150, 1, 1, 16, 16, 4, seed=9)
    a[:, 64:128] *= 200.0
    assert_match(run_both((q, k, v, a, idx, r), 0.4, 16, random_state(1, 1, 16, 16)), rounding)


def test_chunk_varlen_matches_reference_per_sequence(scan_form):
    lengths = [5, 66, 17]
    cu_seqlens = torch.tensor([0, 5, 71, 88], device=DEVICE)
    H, G, d, M, K = 1, 2, 16, 16, 4
    inputs = random_inputs(1, sum(lengths), H, G, d, M, K, seed=3)
    assert_match(run_both(inputs, 0.3, M, random_state(len(lengths), H, M, d), cu_seqlens))


def test_chunk_varlen_empty_sequences_as_graphs_pad_them(scan_form):
    # empty documents between and after the real ones (a CUDA graph's layout pads the offsets so): their states pass
    # through; the chunk list's spare entries (its length a bound, no host sync) change nothing
    lengths = [5, 0, 66, 17, 0, 0]
    cu_seqlens = torch.tensor([0, 5, 5, 71, 88, 88, 88], device=DEVICE)
    H, G, d, M, K = 1, 2, 16, 16, 4
    inputs = random_inputs(1, sum(lengths), H, G, d, M, K, seed=4)
    assert_match(run_both(inputs, 0.3, M, random_state(len(lengths), H, M, d), cu_seqlens))
    chunks = raven_chunk.prepare_chunks(cu_seqlens, 1, 88, DEVICE)
    assert chunks["bos"].numel() == 2 + 6 and chunks["len"].tolist()[4:] == [0] * 4  # 4 real chunks, 4 spare


@pytest.mark.parametrize("strong", [False, True])
def test_chunk_exact_forms_chosen_on_the_device(monkeypatch, strong, rounding):
    # inside a CUDA graph nothing is read back: the kernels take their exact forms, which pick the fast one per slot
    # block, and match the reference whether or not a chunk decays past the range
    monkeypatch.setattr(chunked, "FORCE_DEVICE_CHOICE", True)
    monkeypatch.setattr(raven_chunk, "needs_exact", lambda gl: pytest.fail("the choice was read back to the host"))
    q, k, v, a, idx, r = random_inputs(1, 150, 1, 1, 16, 16, 4, seed=9)
    a[:, 64:128] *= 200.0 if strong else 1.0
    cu_seqlens = torch.tensor([0, 30, 150], device=DEVICE)
    assert_match(run_both((q, k, v, a, idx, r), 0.4, 16, random_state(2, 1, 16, 16), cu_seqlens), rounding)


@pytest.mark.parametrize("level", [0, 1])
def test_chunk_checkpoint_levels_match_reference(level, scan_form):
    # the gates and states the forward keeps serve the backward as their recomputation would, final states included
    cu_seqlens = torch.tensor([0, 70, 93], device=DEVICE)
    inputs = random_inputs(1, 93, 1, 2, 16, 16, 4, seed=5)
    assert_match(run_both(inputs, 0.3, 16, random_state(2, 1, 16, 16), cu_seqlens, checkpoint_level=level))


def test_kept_final_states_survive_decoding():
    # decoding goes on from the returned final states, updating them in place, before the backward runs
    q, k, v, a, idx, r = random_inputs(1, 21, 1, 1, 16, 16, 4, seed=8)
    grads = []
    for level in (2, 0):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, a, r)]
        o, (hk, hv) = chunk_raven(*leaves[:4], idx, leaves[4], 0.5, 16, None, True, checkpoint_level=level)
        loss = o.sum() + (hk * torch.linspace(-1, 1, hk.numel(), device=DEVICE).view_as(hk)).sum()
        with torch.no_grad():
            step = (x[:, -1:].detach() for x in (q, k, v, a, idx, r))
            fused_recurrent_raven(*step, 0.5, 16, (hk.detach(), hv.detach()))
        loss.backward()
        grads.append([x.grad for x in leaves])
    for x, ref in zip(*grads):
        assert rel_err(x, ref) < 1e-6


def test_chunk_scans_many_chunks_per_sequence(scan_form):
    # 9 chunks: the long-sequence scan combines a few chunks per step and carries between steps, both directions
    lengths = [520, 81]
    cu_seqlens = torch.tensor([0, 520, 601], device=DEVICE)
    H, G, d, M, K = 1, 1, 16, 16, 2
    inputs = random_inputs(1, sum(lengths), H, G, d, M, K, decay=0.05, seed=4)
    assert_match(run_both(inputs, 0.3, M, random_state(len(lengths), H, M, d), cu_seqlens))


@pytest.mark.parametrize("programs", [1, 64])
def test_decode_steps_match_reference(programs, monkeypatch):
    """One program per head, and the slots split over as many as there are slot blocks (merged after)."""
    monkeypatch.setattr(split, "programs_wanted", lambda device, per_sm=2: programs)
    B, T, H, G, d, M, K = 2, 5, 2, 2, 16, 16, 4
    q, k, v, a, idx, r = random_inputs(B, T, H, G, d, M, K, seed=5)
    state = random_state(B, H, M, d)
    o_ref, (hk_ref, hv_ref) = naive_raven(q, k, v, a, idx, r, 0.5, state, num_slots=M)
    live = tuple(s.clone() for s in state)
    outputs = []
    for t in range(T):  # one token at a time, the state updated in place
        o, final = fused_recurrent_raven(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            a[:, t : t + 1],
            idx[:, t : t + 1],
            r[:, t : t + 1],
            0.5,
            M,
            live,
            output_final_state=True,
        )
        assert final[0] is live[0]
        outputs.append(o)
    assert rel_err(torch.cat(outputs, 1), o_ref) < 1e-5
    assert rel_err(live[0], hk_ref) < 1e-5 and rel_err(live[1], hv_ref) < 1e-5


def test_decode_varlen_several_tokens():
    cu_seqlens = torch.tensor([0, 3, 4], device=DEVICE)
    q, k, v, a, idx, r = random_inputs(1, 4, 1, 1, 16, 32, 8, seed=6)
    o_ref, (hk_ref, _) = naive_raven(q, k, v, a, idx, r, 0.5, None, cu_seqlens, num_slots=32)
    o, (hk, _) = fused_recurrent_raven(q, k, v, a, idx, r, 0.5, 32, None, True, cu_seqlens)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(hk, hk_ref) < 1e-5


def test_bad_arguments_are_named():
    q, k, v, a, idx, r = random_inputs(1, 4, 1, 1, 16, 16, 4)
    with pytest.raises(ValueError, match="top-K = 4"):
        chunk_raven(q, k, v, a, idx, r, 1.0, 3)
    with pytest.raises(ValueError, match="initial state S\\^k"):
        chunk_raven(q, k, v, a, idx, r, 1.0, 16, (torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 16)))
    with pytest.raises(ValueError, match="checkpoint_level = 3"):
        chunk_raven(q, k, v, a, idx, r, 1.0, 16, checkpoint_level=3)
    with pytest.raises(ValueError, match="contiguous float32"):
        state = random_state(1, 1, 16, 16)
        fused_recurrent_raven(q, k, v, a, idx, r, 1.0, 16, (state[0].double(), state[1]), True)


@pytest.mark.parametrize(
    "shape, k", [((2, 7, 3, 64), 8), ((1, 5, 2, 20), 5), ((3, 1, 1, 256), 32), ((4, 2, 1, 16), 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_slots_matches_torch_topk(shape, k, dtype):
    # a permutation per row, negatives and positives exact in bfloat16: torch.topk's choice and order are defined
    g, M = torch.Generator().manual_seed(k), shape[-1]
    rows = [torch.randperm(M, generator=g) - M // 2 for _ in range(math.prod(shape[:-1]))]
    logits = (torch.stack(rows).view(shape) * 0.25).to(DEVICE, dtype)
    assert torch.equal(topk_slots(logits, k), logits.topk(k).indices)


def test_topk_slots_over_several_programs(monkeypatch):
    # 30 rows of 16 slots in tiles of 4 rows: 8 programs, the last with 2 rows
    monkeypatch.setattr(route, "TILE_KEYS", 64)
    g = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randperm(16, generator=g) - 8.0 for _ in range(30)]).view(3, 5, 2, 16).to(DEVICE)
    assert torch.equal(topk_slots(logits, 6), logits.topk(6).indices)


def test_topk_slots_orders_ties_and_signed_zeros():
    logits = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, -2.0, 3.0, float("-inf")]], device=DEVICE)
    assert topk_slots(logits, 6).tolist() == [[1, 2, 6, 0, 4, 3]]  # equal values: the lower slot first
    with pytest.raises(ValueError, match="k = 9 must lie in"):
        topk_slots(logits, 9)


@pytest.mark.parametrize("level", [2, 0])
def test_mixer_triton_matches_torch(level):
    # prefill with gradients, one decode step updating the prefill's final state in place, then the backward
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    settings = RavenSettings(num_slots=16, top_k=4, checkpoint_level=level)
    mixer = RavenMixer(config, 0, settings).to(DEVICE).eval()
    with torch.no_grad():
        mixer.decay_weight.normal_(std=0.1)
        mixer.gate_weight.normal_(std=0.1)
    x = torch.randn(1, 19, 32, device=DEVICE)
    mask = torch.ones(1, 19, dtype=torch.bool, device=DEVICE)
    mask[:, :2] = False  # left padding
    results = []
    for backend in ("triton", "torch"):
        mixer.zero_grad()
        cache = TinyCache()
        with use_backend(backend):
            out, _ = mixer(x[:, :18], cache=cache, padding_mask=mask[:, :18])
            with torch.no_grad():
                step, _ = mixer(x[:, 18:], cache=cache)
        out.pow(2).sum().backward()
        results.append((out, step, {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}))
    (out, step, grads), (out_ref, step_ref, grads_ref) = results
    assert rel_err(out[:, 2:], out_ref[:, 2:]) < TOL and rel_err(step, step_ref) < TOL
    assert grads.keys() == grads_ref.keys() and "router_weight" in grads
    for name in grads:
        assert rel_err(grads[name], grads_ref[name]) < TOL, name


@pytest.mark.parametrize(
    "settings, qk_norm, padded, programs",
    [({}, False, False, 1), ({"feature_map": "silu"}, True, True, 64), ({"top_k": 1, "output_gate": False}, False,
     True, 64)],
)  # fmt: skip
def test_mixer_decode_steps_in_one_kernel_rewrite_the_state_in_place(settings, qk_norm, padded, programs, monkeypatch):
    """The mixer's decode steps on the Triton kernels route, update and read in one kernel (the slots split over
    several programs merged by the last of each row) that rewrites the cache's state where it lies, and give the
    PyTorch path's outputs and state: q/k norms and the SiLU map, padding (a padded token neither writes nor
    decays), top-1."""
    monkeypatch.setattr(split, "programs_wanted", lambda device, per_sm=2: programs)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    mixer = RavenMixer(config, 0, RavenSettings(**{"num_slots": 16, "top_k": 4, **settings}), qk_norm).to(DEVICE)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name.startswith(("decay", "gate", "q_norm", "k_norm")):
                p.add_(0.2 * torch.randn_like(p))
    runs = steps_on_both_backends(mixer.eval(), padded, DEVICE)
    for a, b in zip(runs["triton"], runs["torch"]):
        assert a.shape == b.shape and rel_err(a, b) < TOL


@pytest.mark.parametrize(
    "split",
    [StepSplit(2, 1, 8), StepSplit(8, 2, 1), StepSplit(4, 4, 2), StepSplit(ranges=16), StepSplit(top_k_by="sort")],
)
def test_decode_step_gives_the_same_step_under_every_split(split):
    """However the step splits its slots (blocks, warps, ranges a head: the sweep's choices, up to more ranges than
    blocks) and finds its top-K (rounds of a max or a sort), it writes the same state and output."""
    H, G, d, M, B = 2, 2, 16, 16, 3
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 1, n, generator=g).to(DEVICE) for n in (H * G * d, H * d, H * d))
    logits, decay = torch.randn(B, 1, H * M, generator=g).to(DEVICE), torch.randn(B, 1, H, generator=g).to(DEVICE)
    bias, log_scale = (torch.randn(H, generator=g).to(DEVICE) for _ in range(2))
    state = random_state(B, H, M, d)
    runs = []
    for how in (StepSplit(), split):
        live = tuple(s.clone() for s in state)
        with step_split(how):
            o = fused_recurrent_raven_decode(q, k, v, logits, decay, bias, log_scale, live, 0.25, 4, 1.0)
        runs.append((o, *live))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_decode_step_kernel_reads_row_views_and_names_bad_arguments():
    """The projections may be row views of one fused product (the compiled step's); wrong shapes, a state that is not
    contiguous float32, a top-K out of range and gradients are refused by name."""
    H, G, d, M, B = 2, 2, 16, 16, 3
    g = torch.Generator().manual_seed(0)
    product = torch.randn(B, 1, H * G * d + 2 * H * d + H * M + H, generator=g).to(DEVICE)
    q, k, v, logits, decay = product.split([H * G * d, H * d, H * d, H * M, H], dim=-1)
    bias, log_scale = (torch.randn(H, generator=g).to(DEVICE) for _ in range(2))
    state = random_state(B, H, M, d)

    def step(*args, state=state, **kwargs):
        return fused_recurrent_raven_decode(*args, bias, log_scale, tuple(s.clone() for s in state), 0.25, 4, 1.0,
                                            **kwargs)  # fmt: skip

    views = step(q, k, v, logits, decay)
    assert torch.equal(views, step(*(x.contiguous() for x in (q, k, v, logits, decay))))
    with pytest.raises(ValueError, match="logits must have shape"):
        step(q, k, v, logits[..., :5], decay)
    with pytest.raises(ValueError, match="contiguous float32"):
        step(q, k, v, logits, decay, state=(state[0].double(), state[1]))
    with pytest.raises(ValueError, match="top_k"):
        fused_recurrent_raven_decode(q, k, v, logits, decay, bias, log_scale, state, 0.25, 17, 1.0)
    with pytest.raises(ValueError, match="computes no gradients"):
        step(q.clone().requires_grad_(), k, v, logits, decay)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("d, M, K", [(64, 64, 8), (128, 256, 32)])
@pytest.mark.parametrize("with_state, level", [(False, 2), (True, 2), (True, 0)])
def test_chunk_bf16_at_size(d, M, K, with_state, level):
    B, T, H, G = 2, 1000, 4, 1
    inputs = random_inputs(B, T, H, G, d, M, K, dtype=torch.bfloat16, seed=d)
    state = random_state(B, H, M, d) if with_state else None
    (o, hk, hv, grads), (o_ref, hk_ref, hv_ref, grads_ref) = run_both(inputs, d**-0.5, M, state, None, level)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(hk, hk_ref) < 5e-3 and rel_err(hv, hv_ref) < 5e-3
    for name, x, ref in zip(["q", "k", "v", "a", "r", "S^k_0", "S^v_0"], grads, grads_ref):
        assert rel_err(x, ref) < 1e-2, f"grad {name}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_at_size():
    B, H, G, d, M, K = 8, 4, 2, 128, 256, 32
    q, k, v, a, idx, r = random_inputs(B, 1, H, G, d, M, K, dtype=torch.bfloat16, seed=11)
    state = random_state(B, H, M, d)
    ref_in = (x.float() for x in (q, k, v))
    o_ref, (hk_ref, hv_ref) = naive_raven(*ref_in, a, idx, r, d**-0.5, state, num_slots=M)
    live = tuple(s.clone() for s in state)
    o, _ = fused_recurrent_raven(q, k, v, a, idx, r, d**-0.5, M, live)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(live[0], hk_ref) < 1e-5 and rel_err(live[1], hv_ref) < 1e-5


def test_a_step_split_names_a_bad_top_k_method():
    with pytest.raises(ValueError, match="top_k_by='heap'"):
        StepSplit(top_k_by="heap")


def test_a_block_smaller_than_the_program_shares_its_values():
    """Where a state block has fewer values than the program has threads, two threads hold each value, and the
    slot pass puts a barrier between their reads and writes (a split of the test above runs that path)."""
    from raven_kernels.raven.fused_recurrent import values_shared

    assert not values_shared(8, 64, 1) and not values_shared(2, 64, 4)  # SmolLM2's blocks: a value a thread or more
    assert values_shared(4, 16, 4) and values_shared(1, 16, 1)
