"""The hybrid on a CUDA device (run on the device machine: `python -m pytest -m gpu`)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import output_cache
from raven_layers.backend import use_backend
from tests.conftest import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ASSIGNMENTS = [("raven", "0-23:5"), ("sila", "1-23:6"), ("sse", "3,12,22")]
SETTINGS = {
    "raven": {"num_slots": 64, "top_k": 8},
    "sila": {},
    "sse": {"lora_rank": 16},
}


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    model = build_hybrid(source, plan_layers(ASSIGNMENTS, 24), SETTINGS, attention_windows=[None, 16] * 12)
    return model.cuda()


def _prefill_then_decode(model, ids, split: int) -> torch.Tensor:
    out = model(ids[:, :split], use_cache=True)
    steps, cache = [out.logits], output_cache(out)
    for t in range(split, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, dim=1)  # [B, T, V]


def test_prefill_then_decode_equals_full_forward_on_cuda(hybrid):
    """Exact in float32 on the PyTorch path, every mixer in one model."""
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (3, 45), device="cuda")
    with torch.no_grad(), use_backend("torch"):
        full = hybrid(ids).logits
        decoded = _prefill_then_decode(hybrid, ids, 37)
    assert ((decoded - full).norm() / full.norm()).item() < 1e-5


@pytest.mark.parametrize("mixer, layers", ASSIGNMENTS)
def test_kernels_prefill_and_decode_equal_the_pytorch_forward_on_cuda(mixer, layers):
    """One mixer at a time, so that a kernel's error is not hidden among the others': the kernels' matrix products
    run in tf32 (10-bit mantissa), which leaves each mixer about 1e-3 from the float32 PyTorch forward."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    model = build_hybrid(source, plan_layers([(mixer, layers)], 24), SETTINGS, attention_windows=[None, 16] * 12)
    model.cuda()
    ids = torch.randint(3, 100, (3, 45), device="cuda")
    with torch.no_grad():
        with use_backend("torch"):
            reference = model(ids).logits
        with use_backend("triton"):
            full, decoded = model(ids).logits, _prefill_then_decode(model, ids, 37)
    for name, logits in (("prefill", full), ("prefill then decode", decoded)):
        error = ((logits - reference).norm() / reference.norm()).item()
        assert error < 3e-3, f"{mixer} {name}: relative error {error:.2e} from the PyTorch forward"


def test_bfloat16_generation_and_training_step(hybrid):
    model = hybrid.to(torch.bfloat16)
    try:
        ids = torch.randint(3, 100, (2, 33), device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        assert out.sequences.shape == (2, 41)
        model.train()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        model.zero_grad()
        model.eval()
        model.float()


def mean_step_error(logits: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean over steps of the relative error of a step's logits; both [B, steps, V]."""
    return ((logits.float() - truth).norm(dim=(0, 2)) / truth.norm(dim=(0, 2))).mean().item()


@pytest.mark.parametrize("mixer", ["raven", "sila"])
def test_norms_inside_the_products_decode_as_the_eager_path(mixer):
    """FUSED_PROLOGUES (each RMSNorm and the residual add before it inside the product that reads it,
    raven_kernels.linear) on CUDA graphs decodes the eager path's tokens."""
    from raven_layers.decode_fusion import FUSED_PROLOGUES

    assert_graphed_tokens_are_the_eager_paths(mixer, FUSED_PROLOGUES)


def assert_graphed_tokens_are_the_eager_paths(mixer: str, options: dict):
    """A tiny float32 hybrid (`mixer` in layers 0 and 2 of 4) whose step compiles with `options`: the greedy tokens
    of 64 steps on CUDA graphs (left padding in one row) equal the eager dynamic path's, twice over one graph."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model = build_hybrid(source, plan_layers([(mixer, "0,2")], 4), {mixer: SETTINGS[mixer]}).cuda()
    model.decode_compile_options = options
    ids = torch.randint(3, 100, (3, 41), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    args = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, cache_implementation="dynamic", **args)
        for _ in range(2):
            assert torch.equal(model.generate(ids, **args), eager)


@pytest.mark.parametrize("mixer", ["raven", "sse", "sila"])
def test_dependent_launches_decode_as_the_eager_path(mixer):
    """Programmatic dependent launch (Inductor's `triton.enable_pdl`, and with it the toolkit's decode kernels: each
    launched before the kernel ahead ends, waiting for it before it touches memory) on CUDA graphs decodes the
    eager path's tokens."""
    from raven_layers.decode_fusion import default_decode_options

    assert_graphed_tokens_are_the_eager_paths(mixer, {**default_decode_options(), "triton.enable_pdl": True})


@pytest.mark.parametrize(("mixer", "sinks"), [("raven", 0), ("sse", 0), ("sila", 0), ("sila", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_static_decoding_equals_the_eager_path(mixer, sinks, dtype):
    """generate() on CUDA replays a compiled step in a CUDA graph over a static cache, with left padding and a
    sliding window that wraps (with attention sinks too). float32: the greedy tokens of 64 steps equal the eager
    dynamic path's. bfloat16: Inductor rounds differently from eager, and a near tie of random weights (or of a top-k
    routing choice) can fork the greedy path; so along the tokens the fast path chose, its logits must be as close to
    the float32 model's as the eager bfloat16 forward's are."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    windows = [None, 24, None, None]  # layer 1 a 24-token ring (it wraps), layer 3 full attention
    model = build_hybrid(
        source, plan_layers([(mixer, "0,2")], 4), {mixer: SETTINGS[mixer]}, attention_windows=windows,
        attention_sinks=sinks,
    )  # fmt: skip
    exact = copy.deepcopy(model).cuda()
    model = model.cuda().to(dtype)
    ids = torch.randint(3, 100, (3, 41), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    args = dict(attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, cache_implementation="dynamic", output_logits=True, return_dict_in_generate=True,
                               **args) if dtype == torch.float32 else None  # fmt: skip
        for _ in range(2):  # the second call reuses the cache and its captured graph
            fast = model.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
            cache = output_cache(fast)
            assert type(cache).__name__ == "StaticHybridCache" and cache.graph.graph is not None
            if dtype == torch.float32:
                assert torch.equal(fast.sequences, eager.sequences)
                error = max(((a - b).norm() / b.norm()).item() for a, b in zip(fast.logits, eager.logits))
                assert error < 1e-3
                continue
            assert_near_float32(fast, model, exact, mask)


def assert_near_float32(fast, model, exact, mask: torch.Tensor) -> None:
    """Inductor rounds bf16 differently from eager, and a near tie of random weights can fork the greedy path; so
    along the tokens the fast path (`fast`, generate()'s output with logits) chose, its logits must be as close to
    the float32 model's (`exact`) as the eager bf16 forward's (`model`) are."""
    steps = len(fast.logits)
    prompt = fast.sequences.shape[1] - steps
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    truth = exact(fast.sequences, attention_mask=full_mask).logits[:, prompt - 1 : -1]  # [B, steps, V] float32
    fast_error = mean_step_error(torch.stack(fast.logits, dim=1), truth)
    eager_error = mean_step_error(model(fast.sequences, attention_mask=full_mask).logits[:, prompt - 1 : -1], truth)
    assert fast_error < 2 * eager_error + 1e-3, f"fast path {fast_error:.2e}, eager bf16 {eager_error:.2e}"


@pytest.mark.parametrize("mixer", ["raven", "sse", "sila"])
def test_a_large_batch_of_wide_products_decodes_as_the_eager_path(mixer):
    """SmolLM2's widths in bf16 at batch 16, more rows than the default options turn into reductions: the products
    are GEMMs whose output rows Inductor pads on a GPU (SILA's 1,551 columns to 1,600), and the fast path's logits
    stay as close to the float32 model's as the eager bf16 forward's."""
    torch.manual_seed(0)
    widths = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", **widths)).eval()
    exact = build_hybrid(source, plan_layers([(mixer, "0,2")], 4), {mixer: SETTINGS[mixer]}).cuda()
    model = copy.deepcopy(exact).to(torch.bfloat16)
    ids = torch.randint(3, 100, (16, 33), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    args = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        fast = model.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
        assert type(output_cache(fast)).__name__ == "StaticHybridCache"
        assert_near_float32(fast, model, exact, mask)


PROMPTS = [
    "The printing press changed how ideas spread in Europe. Before it, every book was copied by hand, so",
    "Write a short note to a friend about a walk in the park.",
]


@pytest.mark.parametrize("mixer", ["raven", "sse", "sila"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_smollm2_fast_path_equals_the_eager_path(smollm2_dir, mixer, dtype):
    """The real SmolLM2-135M-Instruct converted at 0-29:2 (15 of 30 layers), left-padded real prompts, 64 greedy
    tokens. float32: the default path's tokens (static cache, compiled step replayed as a CUDA graph) equal the
    eager dynamic path's, every step's logits within 1e-3. bfloat16: the two paths round differently and fork
    within a few tokens on an untrained conversion (measured: at token 1-14), so along the fast path's own tokens
    its logits must be as close to the float32 model's as the eager bfloat16 forward's are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # the GGUF's tokenizer names no pad token
    source = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    torch.manual_seed(0)
    model = build_hybrid(source, plan_layers([(mixer, "0-29:2")], 30), {}).cuda().eval()
    exact = copy.deepcopy(model) if dtype != torch.float32 else model
    model = model.to(dtype)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    args = dict(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        fast = model.generate(output_logits=True, return_dict_in_generate=True, **args)
        assert type(output_cache(fast)).__name__ == "StaticHybridCache"
        if dtype == torch.float32:
            eager = model.generate(cache_implementation="dynamic", output_logits=True, return_dict_in_generate=True,
                                   **args)  # fmt: skip
            errors = [((a - b).norm() / b.norm()).item() for a, b in zip(fast.logits, eager.logits)]
            assert torch.equal(fast.sequences, eager.sequences), f"step errors before the fork: {errors}"
            assert max(errors) < 1e-3, f"largest step error {max(errors):.2e}"
            # plain greedy decoding (no processor, no EOS stop): each token chosen inside the graphed step
            plain = {key: value for key, value in args.items() if key != "min_new_tokens"} | {"eos_token_id": None}
            in_step = model.generate(**plain)
            token_graph = model._static_cache.token_graph
            assert token_graph is not None and token_graph.graph is not None, "greedy tokens chosen outside the step"
            assert torch.equal(in_step, model.generate(cache_implementation="dynamic", **plain))
            return
        prompt = batch.input_ids.shape[1]
        full_mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones(len(PROMPTS), 64)], dim=1)
        truth = exact(fast.sequences, attention_mask=full_mask).logits[:, prompt - 1 : -1].float()  # [B, 64, V]
        fast_error = mean_step_error(torch.stack(fast.logits, dim=1), truth)
        eager_error = mean_step_error(model(fast.sequences, attention_mask=full_mask).logits[:, prompt - 1 : -1], truth)
        assert fast_error < 2 * eager_error + 1e-3, f"fast path {fast_error:.2e}, eager bf16 {eager_error:.2e}"


@pytest.mark.parametrize("mixer", ["raven", "sse", "sila"])
def test_decode_loop_on_cuda_graphs_equals_transformers_loop(mixer):
    """generate()'s own loop (decode_loop.py) over replayed CUDA graphs: float32 greedy tokens chosen inside the
    graphed step, with rows that stop at their end token (twice: the second generate() replays the same graph),
    and sampled tokens from the same seed, equal transformers' loop over the same graphs."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model = build_hybrid(source, plan_layers([(mixer, "0,2")], 4), {mixer: SETTINGS[mixer]}).cuda()
    ids = torch.randint(3, 100, (3, 41), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0

    def both(seed=0, **kwargs):
        out = []
        for loop in (False, True):
            model.use_decode_loop = loop
            torch.manual_seed(seed)
            with torch.no_grad():
                out.append(model.generate(ids, attention_mask=mask, max_new_tokens=48, pad_token_id=0, **kwargs))
            assert model._static_cache.graph.graph is not None  # the steps were replayed graphs
        return out

    free, _ = both(do_sample=False)
    token_graph = model._static_cache.token_graph
    assert token_graph.graph is not None  # greedy: the tokens were chosen in a replayed graph
    eos = [int(free[row, 41 + step]) for row, step in ((0, 5), (1, 9), (2, 20))]
    for _ in range(2):
        theirs, ours = both(do_sample=False, eos_token_id=eos)
        assert torch.equal(ours, theirs) and ours.shape[1] < free.shape[1]
        assert model._static_cache.token_graph is token_graph  # captured once, its buffers refilled
    theirs, ours = both(seed=3, do_sample=True, top_k=30, temperature=0.8)
    assert torch.equal(ours, theirs)


def test_weights_given_new_tensors_between_generations_are_decoded_with():
    """A captured graph replays the addresses it captured: after `param.data = ...` (new tensors, as a conversion
    or a loaded adapter makes) generate() captures anew (refresh_decode_step) and decodes with the new weights."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    model = build_hybrid(source, plan_layers([("sila", "0,2")], 4), {"sila": {}}).cuda()
    ids = torch.randint(3, 100, (2, 17), device="cuda")
    args = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **args)
        for p in model.model.layers[1].parameters():
            p.data = p.data.clone() * 1.5  # tensors of their own, new values
        fast = model.generate(ids, **args)
        eager = model.generate(ids, cache_implementation="dynamic", **args)
    assert torch.equal(fast, eager)
