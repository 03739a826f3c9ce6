"""The decode step's projection fusion (decode_fusion.py): on the step dynamo traces, the linear layers that read
one input become one product whose parts equal the eager step's outputs; groups it cannot fuse are left alone."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.utils import run_and_get_code
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import StaticHybridCache
from raven_layers.backend import use_backend
from raven_layers.decode_attention import decode_attention
from raven_layers.decode_fusion import FUSED_PROJECTIONS, LINEAR, fuse_shared_input_linears
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
    # the two attention layers' q/k/v and the three MLPs' gate/up: 12 products become 5
    assert counts == [(24, 12, 17)]
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
