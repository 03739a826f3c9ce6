"""Linear layers that read the same input, fused into one product for the compiled decode step.

At batch 1 a decode step's projections each read a few hundred KB of weights, and each is a kernel of its own
whatever its size: seven per Llama layer (q, k, v, o, gate, up, down), more in a mixer layer.
`fuse_shared_input_linears` is an Inductor pre-grad pass: it finds the linear layers of a traced graph that read one
tensor (q, k and v; gate and up; a mixer's projections of its input) and replaces them by one linear over their
concatenated weights, split after, so the step launches one product where it launched several. Under Inductor's
`freezing` (the decode step is inference) the concatenation is folded into a constant when the step compiles.

    model.decode_compile_options = FUSED_PROJECTIONS   # or with other Inductor options: {**FUSED_PROJECTIONS, ...}

Inductor's own `batch_linear_lhs` fusion does the same for 2-D inputs only; a decode step's are [B, 1, hidden].
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

LINEAR = (torch._C._nn.linear, F.linear)


def _argument(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def fuse_shared_input_linears(graph: fx.Graph) -> int:
    """Fuse each group of two or more bias-free linear nodes that read the same input node; returns how many linear
    nodes were replaced. A group is left alone where a weight is computed after the group's first linear (it could
    not be concatenated before it) or the weights differ in dtype or input width."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in LINEAR and _argument(node, 2, "bias") is None:
            source = _argument(node, 0, "input")
            if isinstance(source, fx.Node) and isinstance(_argument(node, 1, "weight"), fx.Node):
                groups.setdefault(source, []).append(node)
    replaced = 0
    for source, nodes in groups.items():
        weights = [_argument(node, 1, "weight") for node in nodes]
        values = [w.meta.get("example_value") for w in weights]
        if len(nodes) < 2 or any(order[w] > order[nodes[0]] for w in weights):
            continue
        if any(v is None or v.dim() != 2 for v in values) or len({(v.dtype, v.shape[1]) for v in values}) > 1:
            continue
        sizes = [v.shape[0] for v in values]
        with graph.inserting_before(nodes[0]):
            joined = graph.call_function(torch.cat, (weights,), {"dim": 0})  # [sum(out), in]
            joined.meta["example_value"] = torch.cat(values, dim=0)
            fused = graph.call_function(torch._C._nn.linear, (source, joined))
            if "example_value" in source.meta:
                fused.meta["example_value"] = F.linear(source.meta["example_value"], joined.meta["example_value"])
            parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
            for i, node in enumerate(nodes):
                part = graph.call_function(operator.getitem, (parts, i))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
        for node in nodes:
            graph.erase_node(node)
        replaced += len(nodes)
    return replaced


class SharedInputLinears(CustomGraphPass):
    """`fuse_shared_input_linears` as Inductor takes a pre-grad pass; its uuid (this file's hash) keys Inductor's
    cache of compiled graphs."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_shared_input_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


# The decode step's Inductor options with the fusion. Freezing folds the weights' concatenation into a constant (the
# weights are baked in: set the options again after changing them, which recompiles the step).
FUSED_PROJECTIONS = {"freezing": True, "pre_grad_custom_pass": SharedInputLinears()}
