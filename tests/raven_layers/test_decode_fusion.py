"""The decode step's projection fusion (decode_fusion.py): on the step dynamo traces, the linear layers that read
one input become one product whose parts equal the eager step's outputs; groups it cannot fuse are left alone."""

from __future__ import annotations

import contextlib
import copy
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.utils import run_and_get_code
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import StaticHybridCache, decode_fusion
from raven_layers.backend import use_backend
from raven_layers.decode_attention import decode_attention
from raven_layers.decode_fusion import (
    ALIGN_ROWS,
    FUSED_PROJECTIONS,
    FUSED_PROLOGUES,
    LINEAR,
    REDUCED_PRODUCTS,
    SHARED_PROJECTIONS,
    WIDTH_ROWS,
    default_decode_options,
    fuse_activations_into_linears,
    fuse_norms_into_linears,
    fuse_shared_input_linears,
    share_projection_storage,
)
from tests.conftest import tiny_config


def linears(graph: fx.Graph) -> int:
    return sum(node.op == "call_function" and node.target in LINEAR for node in graph.nodes)


def test_the_fused_step_equals_the_eager_step_with_fewer_products():
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=3)).eval()
    hybrid = build_hybrid(source, plan_layers([("sila", "1")], 3), {}).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    prefilled = StaticHybridCache(hybrid.config, batch_size=2, max_length=16)
    counts = []

    def fusing_backend(gm: torch.fx.GraphModule, example_inputs):
        before = linears(gm.graph)
        replaced = fuse_shared_input_linears(gm.graph)
        gm.recompile()
        counts.append((before, replaced, linears(gm.graph)))
        return gm

    with torch.no_grad(), use_backend("torch"):
        hybrid(ids[:, :8], cache=prefilled)
        steps = {}
        fused = torch.compile(hybrid.decode_logits, backend=fusing_backend)
        for name, step in [("eager", hybrid.decode_logits), ("fused", fused)]:
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config):
                steps[name] = step(ids[:, 8:], cache)
    # the two attention layers' q/k/v, the mixer's q/k/v with its three gates and output gate, and the three MLPs'
    # gate/up: 19 products become 6
    assert counts == [(26, 19, 13)]
    torch.testing.assert_close(steps["fused"], steps["eager"], rtol=1e-5, atol=1e-5)


def test_groups_it_cannot_fuse_are_left_alone():
    graph = fx.Graph()
    x, w1, w2, w3 = (graph.placeholder(n) for n in ("x", "w1", "w2", "w3"))
    for node, shape in [(x, (2, 1, 8)), (w1, (4, 8)), (w2, (4, 8)), (w3, (4, 8))]:
        node.meta["example_value"] = torch.zeros(shape)
    first = graph.call_function(F.linear, (x, w1))
    w4 = graph.call_function(torch.add, (w2, w3))  # a weight computed after the group's first product
    w4.meta["example_value"] = torch.zeros(4, 8)
    second = graph.call_function(F.linear, (x, w4))
    biased = graph.call_function(F.linear, (x, w3, w3))  # with a bias: not fused
    graph.output((first, second, biased))
    assert fuse_shared_input_linears(graph) == 0 and linears(graph) == 3


def test_the_compiled_step_with_the_fusion_options_equals_the_eager_step():
    """Through `model.decode_compile_options` and Inductor (its CPU code here): the pass, and freezing with the
    weights handed over as parameters (dynamo's prepare_freezing, which the step sets), give the eager step's
    logits."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "attention"], {}).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=1, max_length=16)
    logits = {}
    with torch.no_grad():
        hybrid(ids[:, :8], cache=prefilled)
        for compiled in (False, True):
            hybrid.compile_decode, hybrid.decode_compile_options = compiled, FUSED_PROJECTIONS
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config):
                logits[compiled], code = run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    assert "_frozen_param" in "".join(code)  # the weights became constants: their concatenation is folded


def products(code: list[str]) -> int:
    text = "".join(code)
    return sum(text.count(f"extern_kernels.{op}(") for op in ("mm", "bmm", "addmm"))


def test_the_step_reading_the_weights_in_place_equals_the_eager_step_and_follows_weight_changes():
    """SHARED_PROJECTIONS through Inductor (its CPU code here): the products of each group (the attention's q/k/v,
    the SILA mixer's q/k/v with its gates, gate/up) read their weights in place, laid out one after another when the
    step compiles: the eager step's logits with 10 products fewer, and a weight changed after compiling is seen
    (nothing baked)."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "sila"], {}).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=1, max_length=16)

    def step(options):
        hybrid.compile_decode, hybrid.decode_compile_options = options is not None, options or {}
        cache = copy.deepcopy(prefilled)
        with cache.decoding_step(), decode_attention(hybrid.config):
            if options is None:
                return hybrid.decode_function()(ids[:, 8:], cache), []
            return run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)

    with torch.no_grad():
        hybrid(ids[:, :8], cache=prefilled)
        eager, _ = step(None)
        plain, plain_code = step({})
        shared, shared_code = step(SHARED_PROJECTIONS)
        torch.testing.assert_close(shared, eager, rtol=1e-5, atol=1e-5)
        # q/k/v -> 1 (attention), q/k/v + 3 gates + output gate -> 1 (SILA), gate/up -> 1 twice
        assert products(shared_code) == products(plain_code) - 10
        hybrid.model.layers[1].self_attn.k_proj.weight.add_(0.5)  # in place, as an optimizer step writes
        hybrid.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        hybrid.compile_decode = True
        cache = copy.deepcopy(prefilled)
        with cache.decoding_step(), decode_attention(hybrid.config):
            changed = hybrid.decode_function()(ids[:, 8:], cache)
        expected, _ = step(None)
    assert not torch.allclose(expected, eager, atol=1e-3)
    torch.testing.assert_close(changed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, reduced", [(1, True), (8, False)])
def test_a_small_batchs_products_as_reductions_equal_the_eager_step(batch, reduced):
    """REDUCED_PRODUCTS through Inductor (its CPU code here): at a batch of up to 4 rows every linear product, the
    fused ones and the LM head, becomes one of Inductor's reductions (no extern mm or addmm left; the batched
    products are the CPU's PyTorch attention) with the eager step's logits; a larger batch keeps its GEMMs."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "sila"], {}).eval()
    ids = torch.randint(3, 100, (batch, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=batch, max_length=16)
    with torch.no_grad():
        hybrid(ids[:, :8], cache=prefilled)
        steps = {}
        for options in (None, REDUCED_PRODUCTS):
            hybrid.compile_decode, hybrid.decode_compile_options = options is not None, options or {}
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config):
                steps[options is None] = run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)
    (reduced_logits, code), (eager, _) = steps[False], steps[True]
    torch.testing.assert_close(reduced_logits, eager, rtol=1e-5, atol=1e-5)
    linear_products = sum("".join(code).count(f"extern_kernels.{op}(") for op in ("mm", "addmm"))
    assert (linear_products == 0) == reduced


def test_laying_out_the_weights_changes_no_value_name_or_parameter(tmp_path):
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "sila"], {}).eval()
    before = {name: p.detach().clone() for name, p in hybrid.named_parameters()}
    objects = {name: id(p) for name, p in hybrid.named_parameters()}
    assert share_projection_storage(hybrid) == 4 and share_projection_storage(hybrid) == 0  # laid out once
    attention = hybrid.model.layers[0].self_attn
    q, k = attention.q_proj.weight, attention.k_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and k.storage_offset() == q.numel()
    assert {name: id(p) for name, p in hybrid.named_parameters()} == objects
    for name, p in hybrid.named_parameters():
        assert torch.equal(p, before[name]), name
    hybrid.save_pretrained(tmp_path)
    loaded = type(hybrid).from_pretrained(tmp_path)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_group_lays_out_3d_weights_as_their_rows(tmp_path):
    """SSE's LoRA factors [N, r, hidden] join its group as N r rows of the one buffer: still 3-D parameters with
    their values, saved and loaded as before."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "sse"], {"sse": {"lora_rank": 8, "num_partitions": 4}}).eval()
    before = {name: p.detach().clone() for name, p in hybrid.named_parameters()}
    share_projection_storage(hybrid)
    layer = hybrid.model.layers[1].self_attn
    group = [layer.get_parameter(name) for name in layer.shared_input_weights[0]]
    width, offset = group[0].shape[-1], group[0].storage_offset()
    for weight in group[:-1]:  # one after another in one buffer, each at a multiple of ALIGN_ROWS rows
        assert weight.untyped_storage().data_ptr() == group[0].untyped_storage().data_ptr() and weight.is_contiguous()
        assert weight.storage_offset() == offset
        offset += -(-weight.numel() // (ALIGN_ROWS * width)) * ALIGN_ROWS * width
    last = group[-1]  # an aligned one (the output gate), moved on to end the buffer at a multiple of WIDTH_ROWS
    end = last.storage_offset() + last.numel()
    assert last.shape[0] % ALIGN_ROWS == 0 and offset <= last.storage_offset() and end % (WIDTH_ROWS * width) == 0
    assert last.untyped_storage().data_ptr() == group[0].untyped_storage().data_ptr()
    assert end - offset - last.numel() < WIDTH_ROWS * width
    hidden = source.config.hidden_size
    assert layer.q_lora_a.shape == before["model.layers.1.self_attn.q_lora_a"].shape == (4, 8, hidden)
    for name, p in hybrid.named_parameters():
        assert torch.equal(p, before[name]), name
    hybrid.save_pretrained(tmp_path)
    for name, p in type(hybrid).from_pretrained(tmp_path).named_parameters():
        assert torch.equal(p, before[name]), name


def graph_of_weights(weights: dict[str, torch.Tensor]) -> tuple[fx.Graph, fx.Node, list[fx.Node]]:
    """A graph with an input x [2, 1, 8] and the named weights as placeholders (their values as example values)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.zeros(2, 1, 8)
    nodes = []
    for name, value in weights.items():
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["example_value"] = value
    return graph, x, nodes


def fuse_in_place_and_compare(graph: fx.Graph, weights: list[fx.Node], replaced: int) -> None:
    """Run the pass without copies on `graph` (from `graph_of_weights`): it replaces `replaced` linear nodes, and
    the graph's outputs are those before."""
    inputs = [torch.randn(2, 1, 8)] + [w.meta["example_value"] for w in weights]
    before = fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))(*inputs)
    assert fuse_shared_input_linears(graph, copy=False) == replaced
    after = fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b)


def test_only_the_adjacent_weights_of_a_group_are_read_as_one_view():
    """Five products of one input, three of whose weights lie one after another in one buffer: those three become
    one product over a view of the buffer; the others stay, and nothing is concatenated where copying is refused."""
    joint = torch.randn(12, 8)
    graph, x, weights = graph_of_weights({"a": joint[:4], "b": joint[4:8], "c": joint[8:], "d": torch.randn(4, 8)})
    computed = graph.call_function(torch.mul, (weights[3], 2.0))
    computed.meta["example_value"] = torch.zeros(4, 8)
    outs = [graph.call_function(F.linear, (x, w)) for w in [weights[2], weights[0], weights[3], computed, weights[1]]]
    graph.output(tuple(outs))
    fuse_in_place_and_compare(graph, weights, replaced=3)
    assert linears(graph) == 3
    assert sum(node.target is torch.as_strided for node in graph.nodes) == 1
    assert not any(node.target is torch.cat for node in graph.nodes)


def test_weights_a_few_rows_apart_are_read_as_one_view_and_the_rows_between_dropped():
    """Weights laid out at aligned rows (share_projection_storage) have up to WIDTH_ROWS - 1 rows between them: one
    product reads them and the rows between, whose outputs are dropped; weights further apart are products of their
    own."""
    joint = torch.randn(90, 8)  # a at rows 0-2, b at 8-15 (5 rows between), c at 80-89 (64 rows between)
    graph, x, weights = graph_of_weights({"a": joint[:3], "b": joint[8:16], "c": joint[80:]})
    graph.output(tuple(graph.call_function(F.linear, (x, w)) for w in weights))
    fuse_in_place_and_compare(graph, weights, replaced=2)
    views = [node for node in graph.nodes if node.target is torch.as_strided]
    assert linears(graph) == 2 and len(views) == 1 and views[0].args[1] == (16, 8)  # a, 5 rows between, b


def test_a_step_whose_weights_moved_is_made_anew():
    """Weights given new tensors after the step compiled (`param.data = ...`) leave a step reading the old places
    (a captured graph, or the in-place fusion's view of one buffer): refresh_decode_step, which generate() calls,
    drops it, and the next step is laid out and compiled again; changes in place keep it."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, ["attention", "sila"], {}).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=1, max_length=16)

    def step(compiled: bool):
        hybrid.compile_decode = compiled
        cache = copy.deepcopy(prefilled)
        with cache.decoding_step(), decode_attention(hybrid.config):
            return hybrid.decode_function()(ids[:, 8:], cache)

    with torch.no_grad():
        hybrid(ids[:, :8], cache=prefilled)
        hybrid.decode_compile_options = SHARED_PROJECTIONS
        step(True)
        first = hybrid.decode_function()
        hybrid.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # in place: the same step
        hybrid.refresh_decode_step()
        assert hybrid.decode_function() is first
        attention = hybrid.model.layers[0].self_attn
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            linear.weight.data = linear.weight.data.clone() * 1.1  # a tensor of its own each
        hybrid.refresh_decode_step()
        assert hybrid.decode_function() is not first
        torch.testing.assert_close(step(True), step(False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model_type, mixers",
    [("llama", ["attention", "sila"]), ("llama", ["raven", "sse"]), ("qwen3", ["sila", "attention"])],
)
def test_norms_fused_into_their_products_give_the_eager_step(model_type, mixers):
    """FUSED_PROLOGUES (Triton interpreted here): every decoder norm and the final one run inside the product that
    reads them, the residual adds before them too (add_norm_linear; the first layer's norm reads the embeddings
    alone), and each MLP's gated activation inside its down projection, with the eager step's logits; Qwen3's q/k
    norms, read by no product, stay as they are."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, mixers, {"sse": {"lora_rank": 8}}).eval()
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=2, max_length=16)
    logits = {}
    with use_backend("triton"), torch.no_grad():
        hybrid(ids[:, :8], cache=prefilled)
        hybrid.decode_compile_options = FUSED_PROLOGUES
        for compiled in (False, True):
            hybrid.compile_decode = compiled
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config):
                logits[compiled], code = run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    calls = re.findall(r"torch\.ops\.raven_hybrid\.(\w*_linear)\.default\(", "".join(code))
    assert sorted(calls) == ["add_norm_linear"] * 4 + ["norm_linear"] + ["silu_mul_linear"] * 2


def test_a_norm_or_activation_read_twice_or_computed_otherwise_is_left_alone():
    """Only the RMSNorm or gated activation that one product reads becomes part of it: a norm read twice (two
    products that were not fused), a norm of another form (a sum of squares) and an activation read twice keep
    their own kernels."""
    norm_weight = torch.nn.Parameter(torch.rand(16) + 0.5)
    w1, w2, w3 = (torch.nn.Parameter(torch.randn(8, 16)) for _ in range(3))

    def rms(h, mean=True):
        h32 = h.to(torch.float32)
        stat = h32.pow(2).mean(-1, keepdim=True) if mean else h32.pow(2).sum(-1, keepdim=True)
        return norm_weight * (h32 * torch.rsqrt(stat + 1e-6)).to(h.dtype)

    def step(x, r):
        h = x + r
        y = rms(h)
        gated = F.silu(x) * r
        products = F.linear(y, w1) + F.linear(y, w2) + F.linear(rms(h, mean=False), w3) + F.linear(rms(x), w3)
        return products + F.linear(gated, w1) + F.linear(gated, w2) + F.linear(F.silu(r) * x, w3)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    x, r = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, backend=capture, fullgraph=True)(x, r)
    (gm,) = graphs
    with use_backend("triton"):
        assert fuse_norms_into_linears(gm.graph) == 1  # only rms(x), read by one product
        assert fuse_activations_into_linears(gm.graph) == 1  # only silu(r) * x
    targets = [node.target for node in gm.graph.nodes]
    assert targets.count(torch.rsqrt) == 2 and targets.count(torch.ops.raven_hybrid.norm_linear.default) == 1
    assert targets.count(F.silu) == 1 and targets.count(torch.ops.raven_hybrid.silu_mul_linear.default) == 1
    assert sum(target in LINEAR for target in targets) == 5


def test_products_read_in_place_refuse_autotuned_gemms_by_name():
    """Inductor's GEMM autotuning benchmarks each input at its own extent, and the in-place product's view reaches
    past its first weight: the options are refused when set, naming the option and the way that works."""
    hybrid = build_hybrid(AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=1)), ["sila"], {})
    for options in ({**SHARED_PROJECTIONS, "max_autotune": True}, {**REDUCED_PRODUCTS, "max_autotune_gemm": 1}):
        with pytest.raises(ValueError, match=r"max_autotune(_gemm)?=(True|1) cannot autotune .* FUSED_PROJECTIONS"):
            hybrid.decode_compile_options = options
    hybrid.decode_compile_options = {**FUSED_PROJECTIONS, "max_autotune_gemm": True}  # concatenated: allowed
    hybrid.decode_compile_options = {**SHARED_PROJECTIONS, "max_autotune_gemm": False}
    assert hybrid.decode_compile_options == {**SHARED_PROJECTIONS, "max_autotune_gemm": False}


@pytest.mark.parametrize("mixer", ["raven", "sse", "sila"])
def test_each_mixers_products_of_its_input_read_their_weights_as_one(mixer):
    """A mixer's q/k/v, its `input_weights` and its output gate, laid out by share_projection_storage, are read by
    one product in place (the pass without copies, through dynamo): the eager step's logits."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=3)).eval()
    settings = {"sse": {"lora_rank": 8, "num_partitions": 4, "top_k": 2}}.get(mixer, {})  # sized for the tiny model
    hybrid = build_hybrid(source, plan_layers([(mixer, "1")], 3), {mixer: settings}).eval()
    layer = hybrid.model.layers[1].self_attn
    with torch.no_grad():  # untrained gates and routers start at zero: spread them so every product shows
        for name in layer.input_weights:
            layer.get_parameter(name).normal_(std=0.2)
    widths = []
    replaced, steps = eager_and_in_place_steps(hybrid, widths)
    group = 3 + len(layer.input_weights) + int(layer.settings.output_gate)
    assert replaced == [2 * 3 + 3 * 2 + group]  # two attention layers' q/k/v, three MLPs' gate/up, the mixer's group
    torch.testing.assert_close(steps["fused"], steps["eager"], rtol=1e-5, atol=1e-5)
    # every product's width aligned (cuBLAS's fast kernels) but the LM head's (vocab 100); the mixer's reads its
    # group's rows and the zeros between them, its last weight ending at a multiple of WIDTH_ROWS
    assert all(width % ALIGN_ROWS == 0 for width in widths[:-1])
    sizes = [layer.get_parameter(name).numel() // layer.q_proj.in_features for name in layer.shared_input_weights[0]]
    rows = sum(-(-n // ALIGN_ROWS) * ALIGN_ROWS for n in sizes)
    assert -(-rows // WIDTH_ROWS) * WIDTH_ROWS in widths


def test_products_with_biases_join_their_group_and_add_the_biases_after():
    """q/k/v with biases (attention_bias, as Qwen2 has) and a mixer's biased product fuse with the rest of their
    group: one product, each bias added to its part after the split; the eager step's logits."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2, attention_bias=True)).eval()
    hybrid = build_hybrid(source, ["attention", "raven"], {}).eval()
    layer = hybrid.model.layers[1].self_attn
    with torch.no_grad():  # biases and the router away from zero, so a lost bias shows
        for name, p in hybrid.named_parameters():
            if name.endswith("bias") or "router" in name or "decay_weight" in name:
                p.normal_(std=0.3)
    replaced, steps = eager_and_in_place_steps(hybrid)
    assert layer.q_proj.bias is not None and layer.decay_bias is not None
    # q/k/v of the attention layer, the Raven layer's q/k/v, router, decay and output gate, two MLPs' gate/up
    assert replaced == [3 + 6 + 2 * 2]
    torch.testing.assert_close(steps["fused"], steps["eager"], rtol=1e-5, atol=1e-5)


def eager_and_in_place_steps(hybrid, widths: list | None = None) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One decode step of `hybrid` after an 8-token prefill (2 rows), eager and with the pass reading the weights in
    place (laid out by share_projection_storage; through dynamo, no Inductor): the linear nodes the pass replaced,
    and both steps' logits; `widths` gets the outputs a row of each product of the fused step."""
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    prefilled = StaticHybridCache(hybrid.config, batch_size=2, max_length=16)
    replaced = []

    def in_place_backend(gm: torch.fx.GraphModule, example_inputs):
        replaced.append(fuse_shared_input_linears(gm.graph, copy=False))
        gm.recompile()
        if widths is not None:
            widths.extend(n.args[1].meta["example_value"].shape[0] for n in gm.graph.nodes if n.target in LINEAR)
        return gm

    with torch.no_grad(), use_backend("torch"):
        hybrid(ids[:, :8], cache=prefilled)
        share_projection_storage(hybrid)
        steps = {}
        for name, step in [
            ("eager", hybrid.decode_logits),
            ("fused", torch.compile(hybrid.decode_logits, backend=in_place_backend)),
        ]:
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config):
                steps[name] = step(ids[:, 8:], cache)
    return replaced, steps


def step_launches(mixer: str) -> int:
    """Kernel launches (Inductor's fused kernels, products, custom ops) of the compiled decode step of a 2-layer
    hybrid, attention then `mixer`, under the model's default options, its mixer on the kernels (interpreted)."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    settings = {"sse": {"lora_rank": 8, "num_partitions": 4, "top_k": 2}}.get(mixer, {})  # sized for the tiny model
    hybrid = build_hybrid(source, ["attention", mixer], {mixer: settings} if settings else {}).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = StaticHybridCache(hybrid.config, batch_size=1, max_length=16)
    with torch.no_grad(), use_backend("triton"), torch._inductor.config.patch(force_disable_caches=True):
        hybrid(ids[:, :8], cache=cache)
        with cache.decoding_step(), decode_attention(hybrid.config):
            _, code = run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)
    calls = r"^\s*(\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(\.default)?)\("
    return sum(bool(re.match(calls, line)) for line in "\n".join(code).splitlines())


def bf16_step(mixer: str, batch: int, parts_as_views: bool = True) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The logits of a 2-layer bf16 hybrid's decode step (attention, then `mixer` on the kernels, interpreted),
    eager and compiled under the default options (with `parts_as_views` or without it), and the compiled step's
    code."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    settings = {"sse": {"lora_rank": 8, "num_partitions": 4, "top_k": 2}}.get(mixer, {})
    hybrid = build_hybrid(source, ["attention", mixer], {mixer: settings} if settings else {}).eval()
    hybrid = hybrid.to(torch.bfloat16)
    ids = torch.randint(3, 100, (batch, 9), generator=torch.Generator().manual_seed(2))
    prefilled = StaticHybridCache(hybrid.config, batch_size=batch, max_length=16, dtype=torch.bfloat16)
    logits, code = {}, []
    without = mock.patch.object(decode_fusion, "parts_as_views", lambda graph: 0)
    with torch.no_grad(), use_backend("triton"), torch._inductor.config.patch(force_disable_caches=True):
        hybrid(ids[:, :8], cache=prefilled)
        for compiled in (False, True):
            hybrid.compile_decode, hybrid.decode_compile_options = compiled, default_decode_options()
            cache = copy.deepcopy(prefilled)
            with cache.decoding_step(), decode_attention(hybrid.config), contextlib.ExitStack() as stack:
                if not parts_as_views:
                    stack.enter_context(without)
                logits[compiled], code = run_and_get_code(hybrid.decode_function(), ids[:, 8:], cache)
    return logits[False], logits[True], "\n".join(code)


@pytest.mark.parametrize("mixer, op", [("sila", "sila_decode"), ("raven", "raven_decode_step"),
                                       ("sse", "sse_decode_step")])  # fmt: skip
def test_a_single_rows_fused_product_reaches_the_mixers_kernel_as_views_of_one_buffer(mixer, op):
    """At batch 1 the fused product is a reduction with a bf16 cast after it. Inductor would store each part of
    the cast in a buffer of its own (a copy kernel a layer on a GPU); with `parts_as_views` the mixer's decode op
    reads every part as a view of one buffer, and the logits stay the eager step's."""
    eager, compiled, code = bf16_step(mixer, batch=1)
    call = next(line for line in code.splitlines() if f"torch.ops.raven_hybrid.{op}.default(" in line)
    parts = re.findall(r"reinterpret_tensor\((buf\d+), ", call)
    assert len(parts) >= 5 and len(set(parts)) == 1, call
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-2)


def test_views_of_the_product_change_no_logit():
    """The step with the parts as views of one buffer computes what it computed with a buffer for each part."""
    _, with_views, _ = bf16_step("sila", batch=1)
    _, with_copies, code = bf16_step("sila", batch=1, parts_as_views=False)
    assert "torch.ops.raven_hybrid.sila_decode.default(buf" in code  # without the pass: a buffer of its own
    assert torch.equal(with_views, with_copies)


@pytest.mark.parametrize("aligned", [True, False])
def test_a_product_of_several_rows_is_read_as_views_only_at_strides_inductor_keeps(aligned):
    """Several rows: on a GPU Inductor may round a buffer's row stride up (SILA's 1,568 columns at batch 128 went
    to 1,600), which the graph's example value does not show, so views of them are taken only where the width is
    already a multiple of its alignment (share_projection_storage's WIDTH_ROWS); with a narrower layout the op reads
    Inductor's own parts."""
    with contextlib.ExitStack() as stack:
        if not aligned:
            stack.enter_context(mock.patch.object(decode_fusion, "WIDTH_ROWS", decode_fusion.ALIGN_ROWS))
        eager, compiled, code = bf16_step("sila", batch=2)
    call = next(line for line in code.splitlines() if "torch.ops.raven_hybrid.sila_decode.default(" in line)
    assert len(set(re.findall(r"reinterpret_tensor\((buf\d+), ", call))) == (1 if aligned else 0), call
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-2)


def test_the_unpadded_rule_follows_inductors_alignment():
    """A view is safe where every row stride is a multiple of Inductor's padding alignment, or there is one row."""
    bf16 = torch.bfloat16
    assert decode_fusion._unpadded(torch.empty(1, 1, 1568, dtype=bf16))
    assert decode_fusion._unpadded(torch.empty(128, 1, 1600, dtype=bf16))
    assert not decode_fusion._unpadded(torch.empty(128, 1, 1568, dtype=bf16))
    assert decode_fusion._unpadded(torch.empty(128, 1, 1568, dtype=torch.float32))  # 32 floats to 128 bytes


@pytest.mark.parametrize("mixer", ["sila", "raven", "sse"])
def test_a_mixer_layers_decode_step_launches_no_more_than_an_attention_layers(mixer):
    """The fused decode steps keep a mixer layer's launches at an attention layer's, counted in Inductor's CPU code:
    a product left out of its layer's fused product, or glue left outside the mixer's kernel, shows here before a
    GPU profile."""
    assert step_launches(mixer) <= step_launches("attention")


@pytest.mark.parametrize("options", [{"triton.enable_pdl": True, "combo_kernels": True}, {"combo_kernels": True}])
def test_the_step_launches_the_toolkits_kernels_dependent_where_inductors_are(monkeypatch, options):
    """With Inductor's programmatic dependent launch (`triton.enable_pdl`) the compiled step's calls, which launch
    the toolkit's decode kernels (its warm-up and its capture), run under raven_kernels.launch.DEPENDENT_LAUNCH;
    without it they do not, and the setting is off again after each call."""
    from raven_kernels.launch import DEPENDENT_LAUNCH

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the step as written: what it runs under
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2)).eval()
    hybrid = build_hybrid(source, plan_layers([("sila", "0")], 2), {})
    seen = []
    hybrid.decode_logits = lambda ids, cache: seen.append(DEPENDENT_LAUNCH.value) or ids
    hybrid.decode_compile_options = options
    with use_backend("triton"):
        hybrid.decode_function()(torch.zeros(1, 1, dtype=torch.long), None)
    assert seen == ["triton.enable_pdl" in options] and DEPENDENT_LAUNCH.value is False
