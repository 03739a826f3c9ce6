"""Linear layers that read the same input, fused into one product for the compiled decode step.

At batch 1 a decode step's projections each read a few hundred KB of weights, and each is a kernel of its own
whatever its size: seven per Llama layer (q, k, v, o, gate, up, down), more in a mixer layer.
`fuse_shared_input_linears` is an Inductor pre-grad pass: it finds the linear layers of a traced graph that read one
tensor (q, k and v; gate and up; a mixer's projections of its input) and replaces them by one linear over their
weights, split after, so the step launches one product where it launched several. The weights are read in place
where they lie one after another in one buffer (`share_projection_storage` lays them out so when a step compiles
with SHARED_PROJECTIONS), or concatenated (FUSED_PROJECTIONS: under Inductor's `freezing` the concatenation is
folded into a constant, a second copy of those weights baked into the step). REDUCED_PRODUCTS adds
`linears_as_reductions`: at a batch of a few rows the products become Inductor's own reductions instead of cuBLAS's
GEMVs, which Inductor can fuse with the work around them, and `parts_as_views`, so that a mixer's decode op reads
its layer's product from one buffer. FUSED_PROLOGUES adds `fuse_norms_into_linears` and
`fuse_activations_into_linears`: each RMSNorm (with the residual add before it) and each MLP's silu(gate) * up are
computed inside the product that reads them (raven_kernels.linear), not as kernels of their own.

    model.decode_compile_options = SHARED_PROJECTIONS   # or with other Inductor options: {**SHARED_PROJECTIONS, ...}

A model compiles its decode step with `default_decode_options()` (REDUCED_PRODUCTS and Inductor's combo kernels)
unless its `decode_compile_options` are set.

Inductor's own `batch_linear_lhs` fusion does the same for 2-D inputs only; a decode step's are [B, 1, hidden].
"""

from __future__ import annotations

import contextlib
import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .backend import kernel_module, preload

LINEAR = (torch._C._nn.linear, F.linear)

# Rows a group's weights start at multiples of (16 bytes of bf16 outputs): a fused product of an odd width (a
# mixer's q/k/v and gates, 1551 for SILA at SmolLM2's sizes) makes cuBLAS fall back to its unaligned kernels, twice
# as slow and with a split-K reduction. The product reads the zero rows between the weights too, and drops them.
ALIGN_ROWS = 8
# Rows a group's product is a multiple of, where its last weight's rows are a multiple of ALIGN_ROWS (128 bytes of
# bf16 outputs, the row alignment Inductor pads a GPU buffer's strides to): its last weight placed to end there, the
# product has the row stride Inductor gives it, so the op reading its parts can read them as views (parts_as_views).
WIDTH_ROWS = 64


def _argument(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _linears(graph: fx.Graph):
    """Each linear node of `graph` with its input, weight and bias (over a copy of the node list: the passes
    replace the nodes as they go)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in LINEAR:
            yield node, *(_argument(node, i, name) for i, name in enumerate(("input", "weight", "bias")))


def _gap_rows(first: torch.Tensor, second: torch.Tensor) -> int | None:
    """The rows between weight `first` [out, in] and `second` [..., in] where `second` follows it in one storage,
    fewer than WIDTH_ROWS rows after it (both contiguous): one view reads both; None where it does not."""
    same = first.untyped_storage()._cdata == second.untyped_storage()._cdata  # _cdata: the storage itself
    if not (same and first.is_contiguous() and second.is_contiguous()):
        return None
    gap, width = second.storage_offset() - first.storage_offset() - first.numel(), first.shape[-1]
    return gap // width if 0 <= gap < WIDTH_ROWS * width and gap % width == 0 else None


def _layout(rows: list[int]) -> tuple[list[int], int]:
    """Where share_projection_storage puts the weights of a group ([rows_i, in] each), in rows from its buffer's
    start, and the buffer's rows: each at a multiple of ALIGN_ROWS, the last one whose rows are a multiple too placed
    last, so every part has an aligned start, and that one moved on to end at a multiple of WIDTH_ROWS: the product
    over the group reads the zero rows between."""
    order = list(range(len(rows)))
    aligned = [i for i in order if rows[i] % ALIGN_ROWS == 0]
    if aligned:
        order.append(order.pop(aligned[-1]))
    starts, end = [0] * len(rows), 0
    for i in order:
        starts[i] = end
        end += -(-rows[i] // ALIGN_ROWS) * ALIGN_ROWS
    if aligned:
        last = order[-1]
        end = -(-end // WIDTH_ROWS) * WIDTH_ROWS
        starts[last] = end - rows[last]
    return starts, end


def _stored(weight) -> fx.Node | None:
    """The parameter a linear's weight reads: the weight's node itself (a placeholder or attribute, defined before
    every product), or the one it is a view of (a 3-D weight flattened to [rows, in]); None for a computed weight."""
    if not isinstance(weight, fx.Node):
        return None
    if weight.op in ("placeholder", "get_attr"):
        return weight
    inputs = weight.all_input_nodes
    if weight.op not in ("call_method", "call_function") or len(inputs) != 1:
        return None
    base, value, view = inputs[0], weight.meta.get("example_value"), inputs[0].meta.get("example_value")
    shared = isinstance(value, torch.Tensor) and isinstance(view, torch.Tensor)
    if base.op in ("placeholder", "get_attr") and shared:
        return base if value.untyped_storage()._cdata == view.untyped_storage()._cdata else None
    return None


def _adjacent_runs(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The linear nodes of `nodes` whose weights lie one after another in one storage (`_gap_rows`), as runs of two
    or more in storage order: each run is read as one view."""
    by_storage: dict[int, list[fx.Node]] = {}
    for node in nodes:
        weight = _argument(node, 1, "weight")
        value = weight.meta.get("example_value")
        if _stored(weight) is not None and value is not None and value.dim() == 2 and value.is_contiguous():
            by_storage.setdefault(value.untyped_storage()._cdata, []).append(node)
    runs = []
    for members in by_storage.values():
        members.sort(key=lambda node: _argument(node, 1, "weight").meta["example_value"].storage_offset())
        run = members[:1]
        for node in members[1:]:
            if _gap_rows(*(_argument(n, 1, "weight").meta["example_value"] for n in (run[-1], node))) is not None:
                run.append(node)
                continue
            runs.append(run)
            run = [node]
        runs.append(run)
    return [run for run in runs if len(run) > 1]


def _fuse(graph: fx.Graph, source: fx.Node, nodes: list[fx.Node], order: dict, in_place: bool) -> None:
    """Replace the linear nodes `nodes` of input `source` by one product over their weights, read in place (one
    view of the storage they share, the rows between them included) or concatenated, and split after."""
    weights = [_argument(node, 1, "weight") for node in nodes]
    values = [w.meta["example_value"] for w in weights]
    gaps = [0] + [_gap_rows(a, b) if in_place else 0 for a, b in zip(values, values[1:])]
    sizes, index = [], []  # the product's parts, and each node's
    for gap, value in zip(gaps, values):
        if gap:
            sizes.append(gap)  # outputs of the rows between two weights (share_projection_storage's alignment)
        index.append(len(sizes))
        sizes.append(value.shape[0])
    shape, offset = (sum(sizes), values[0].shape[1]), values[0].storage_offset()
    with graph.inserting_before(min(nodes, key=order.__getitem__)):
        if in_place:  # [sum(out), in]: the weights themselves, a view of the parameter the first reads
            joined = graph.call_function(torch.as_strided, (_stored(weights[0]), shape, (shape[1], 1), offset))
            joined.meta["example_value"] = torch.as_strided(values[0], shape, (shape[1], 1), offset)
        else:
            joined = graph.call_function(torch.cat, (weights,), {"dim": 0})  # [sum(out), in]
            joined.meta["example_value"] = torch.cat(values, dim=0)
        fused = graph.call_function(torch._C._nn.linear, (source, joined))
        if "example_value" in source.meta:
            fused.meta["example_value"] = F.linear(source.meta["example_value"], joined.meta["example_value"])
        parts = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
        for i, node in zip(index, nodes):
            part = graph.call_function(operator.getitem, (parts, i))
            bias = _argument(node, 2, "bias")
            if bias is not None:  # added after the split: a pointwise add, which Inductor fuses into its reader
                part = graph.call_function(operator.add, (part, bias))
            part.meta.update(node.meta)
            node.replace_all_uses_with(part)
    for node in nodes:
        graph.erase_node(node)


def fuse_shared_input_linears(graph: fx.Graph, copy: bool = True) -> int:
    """Fuse the linear nodes that read the same input node (their biases added after the fused product); returns how
    many linear nodes were replaced.
    Weights stored one after another in one buffer (share_projection_storage) are read as one view of it, a run of
    them at a time; where there is no such run and `copy` allows, a group's weights are concatenated (a copy per step
    unless Inductor's freezing folds it). A group is not concatenated where a weight is computed after the group's
    first linear (it could not be concatenated before it) or the weights differ in dtype or input width."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node, source, weight, bias in _linears(graph):
        stored = isinstance(weight, fx.Node) and (bias is None or isinstance(bias, fx.Node))
        if isinstance(source, fx.Node) and stored:
            groups.setdefault(source, []).append(node)
    replaced = 0
    for source, nodes in groups.items():
        runs = _adjacent_runs(nodes) if len(nodes) > 1 else []
        for run in runs:
            _fuse(graph, source, run, order, in_place=True)
            replaced += len(run)
        if runs or not copy or len(nodes) < 2:
            continue
        weights = [_argument(node, 1, "weight") for node in nodes]
        values = [w.meta.get("example_value") for w in weights]
        if any(order[w] > order[nodes[0]] for w in weights):
            continue
        if any(v is None or v.dim() != 2 for v in values) or len({(v.dtype, v.shape[1]) for v in values}) > 1:
            continue
        _fuse(graph, source, nodes, order, in_place=False)
        replaced += len(nodes)
    return replaced


def _traced(graph: fx.Graph, op: str, target, args: tuple) -> fx.Node:
    """A new node of `graph` with the example value (fake tensor) its arguments' give, as dynamo's nodes carry."""
    node = graph.create_node(op, target, args)
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in args]
    if all(v is not None for v in values):
        node.meta["example_value"] = getattr(values[0], target)(*values[1:]) if op == "call_method" else target(*values)
    return node


def _replace_linear(graph: fx.Graph, node: fx.Node, out: fx.Node, bias, dead: tuple = ()) -> None:
    """Put `out` (made before `node`), plus `bias` where there is one, in place of the linear `node`, and erase it
    and the nodes `dead` that only it read, each read by the one before it alone."""
    if bias is not None:
        with graph.inserting_before(node):
            out = _traced(graph, "call_function", operator.add, (out, bias))
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    for erased in (node, *dead):
        graph.erase_node(erased)


def linears_as_reductions(graph: fx.Graph, max_rows: int) -> int:
    """Replace each linear node whose input has at most `max_rows` rows (a decode step's batch) by its float32 sum
    of products, (x [rows, 1, in] * weight [out, in]).sum(-1) (bias added after): Inductor writes it as one of its
    own reduction kernels, where a GEMV of cuBLAS is a kernel it cannot fuse with the norm before it or the
    pointwise work after it. Returns how many it replaced."""
    replaced = 0
    for node, x, weight, bias in _linears(graph):
        value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
        if value is None or value.dim() < 2 or value.numel() // value.shape[-1] > max_rows:
            continue
        with graph.inserting_before(node):
            x32 = _traced(graph, "call_method", "float", (_traced(graph, "call_method", "unsqueeze", (x, -2)),))
            w32 = _traced(graph, "call_method", "float", (weight,))
            products = _traced(graph, "call_function", operator.mul, (x32, w32))  # [..., out, in]
            total = _traced(graph, "call_method", "sum", (products, -1))
            out = _traced(graph, "call_method", "to", (total, value.dtype))
        _replace_linear(graph, node, out, bias)
        replaced += 1
    return replaced


KERNEL_OPS = "raven_hybrid"  # the namespace of the toolkit's custom ops (the decode steps of the mixers, attention)


def _kernel_op(node: fx.Node) -> bool:
    """Whether `node` calls one of the toolkit's custom ops."""
    target = node.target
    return node.op == "call_function" and getattr(target, "namespace", None) == KERNEL_OPS


def _unpadded(value: torch.Tensor) -> bool:
    """Whether Inductor lays out a buffer of `value`'s shape with `value`'s strides on any device: every stride of a
    dimension of more than one element but the last is a multiple of the alignment its comprehensive padding
    rounds strides up to (one row: nothing to round)."""
    align = max(1, inductor_config.padding_alignment_bytes // value.element_size())
    return all(stride % align == 0 for size, stride in zip(value.shape[:-1], value.stride()[:-1]) if size > 1)


def parts_as_views(graph: fx.Graph) -> int:
    """Hand the toolkit's ops each part of a split product (dim -1) as a strided view of the whole, not as the split's
    part: Inductor makes each part of a value it has not stored a buffer of its own (a small batch's products are
    reductions whose bf16 cast it stores nowhere), a kernel a layer that copies the product into the op's inputs.
    A view of the whole makes it store the product once, the cast inside the reduction. Only where Inductor keeps
    the whole's strides (_unpadded): on a GPU it may round a buffer's row stride up (comprehensive padding, SILA's
    product of 1,568 columns to 1,600), which the example value's stride does not show, and a view of several
    rows would then read the wrong rows. Returns the parts it replaced."""
    replaced = 0
    for op in [node for node in graph.nodes if _kernel_op(node)]:
        for part in list(op.all_input_nodes):
            split = part.args[0] if part.target is operator.getitem else None
            if not isinstance(split, fx.Node) or split.target is not torch.split or split.kwargs.get("dim") != -1:
                continue
            whole = split.args[0]
            value, sizes = whole.meta.get("example_value"), split.args[1]
            if value is None or not isinstance(sizes, (list, tuple)) or not _unpadded(value):
                continue
            start = sum(sizes[: part.args[1]])
            with graph.inserting_before(op):
                view = _traced(graph, "call_function", torch.as_strided, (
                    whole, (*value.shape[:-1], sizes[part.args[1]]), value.stride(),
                    value.storage_offset() + start * value.stride(-1),
                ))  # fmt: skip
            view.meta.update(part.meta)
            op.replace_input_with(part, view)
            replaced += 1
    return replaced


PROLOGUE_KERNELS = "raven_kernels.linear"  # norm_linear, add_norm_linear and silu_mul_linear (see backend.py)


def _call(node: fx.Node, op: str, target) -> bool:
    return node.op == op and node.target == target


def _rms_norm(normed: fx.Node) -> tuple[fx.Node, fx.Node, float, list[fx.Node]] | None:
    """(h, norm weight, eps, the norm's nodes from `normed` back to h32) where `normed` is transformers' RMSNorm
    of h as dynamo traces it (Llama's, Qwen3's, Mistral's): weight * (h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True)
    + eps)).to(h.dtype), h32 = h.to(float32), every step read by the next alone; else None."""
    if not _call(normed, "call_function", operator.mul) or len(normed.args) != 2:
        return None
    weight, cast = normed.args
    if not (isinstance(cast, fx.Node) and cast.op == "call_method"):
        weight, cast = cast, weight
    if not (isinstance(weight, fx.Node) and _stored(weight) is weight and _call(cast, "call_method", "to")):
        return None
    scaled = cast.args[0]
    if len(cast.users) != 1 or not _call(scaled, "call_function", operator.mul) or len(scaled.users) != 1:
        return None
    h32, rsqrt = scaled.args if _call(scaled.args[1], "call_function", torch.rsqrt) else scaled.args[::-1]
    if not (isinstance(rsqrt, fx.Node) and _call(rsqrt, "call_function", torch.rsqrt) and len(rsqrt.users) == 1):
        return None
    shifted = rsqrt.args[0]
    if not (_call(shifted, "call_function", operator.add) and isinstance(shifted.args[1], float)):
        return None
    mean, eps = shifted.args
    if not (_call(mean, "call_method", "mean") and mean.args[1:] == (-1,) and mean.kwargs == {"keepdim": True}):
        return None
    square = mean.args[0]
    if not (_call(square, "call_method", "pow") and square.args[1:] == (2,) and square.args[0] is h32):
        return None
    if not (_call(h32, "call_method", "to") and set(h32.users) == {square, scaled}):
        return None
    h = h32.args[0]
    values = [n.meta.get("example_value") for n in (h, h32, cast, weight)]
    if any(v is None for v in values) or values[1].dtype != torch.float32 or values[2].dtype != values[0].dtype:
        return None
    if values[3].shape != values[0].shape[-1:] or any(len(n.users) != 1 for n in (shifted, mean, square)):
        return None
    return h, weight, eps, [normed, cast, scaled, rsqrt, shifted, mean, square, h32]


def fuse_norms_into_linears(graph: fx.Graph) -> int:
    """Replace each linear whose input is transformers' RMSNorm of h (read by that linear alone) by one
    `norm_linear` of h, or, where h is a sum x + residual, by `add_norm_linear`, whose second output stands for the
    sum wherever else it is read (the next residual add): the norm, and the add, are then no kernels of their own
    (raven_kernels.linear). Run after fuse_shared_input_linears, so that the norm's one reader is the fused product.
    Returns how many linears it replaced; none where the kernels are not at hand for the graph's device."""
    order = {node: i for i, node in enumerate(graph.nodes)}  # erasing keeps the order; a node made since counts first
    replaced = 0
    for node, normed, weight, bias in _linears(graph):
        found = _rms_norm(normed) if isinstance(normed, fx.Node) and len(normed.users) == 1 else None
        product = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
        if found is None or product is None or product.dim() != 2 or product.stride(-1) != 1:
            continue
        h, norm_weight, eps, chain = found
        value = h.meta["example_value"]
        if kernel_module(PROLOGUE_KERNELS, value) is None or product.dtype != value.dtype:
            continue
        summed = _call(h, "call_function", operator.add) and all(isinstance(a, fx.Node) for a in h.args)
        others = [user for user in h.users if user is not chain[-1]]
        if summed:
            x, residual = h.args
            summed = all(order.get(user, -1) > order[node] for user in others) and all(
                getattr(a.meta.get("example_value"), "shape", None) == value.shape for a in (x, residual)
            )
        with graph.inserting_before(node):
            if summed:
                fused = _traced(graph, "call_function", torch.ops.raven_hybrid.add_norm_linear.default,
                                (x, residual, norm_weight, weight, eps))  # fmt: skip
                out = _traced(graph, "call_function", operator.getitem, (fused, 0))
                total = _traced(graph, "call_function", operator.getitem, (fused, 1))
            else:
                out = _traced(graph, "call_function", torch.ops.raven_hybrid.norm_linear.default,
                              (h, norm_weight, weight, eps))  # fmt: skip
        _replace_linear(graph, node, out, bias, tuple(chain))  # and the norm's nodes (_rms_norm)
        if summed:
            h.replace_all_uses_with(total)
            graph.erase_node(h)
        replaced += 1
    return replaced


def fuse_activations_into_linears(graph: fx.Graph) -> int:
    """Replace each linear whose input is silu(gate) * up (an MLP's gated activation, read by that linear alone) by
    one `silu_mul_linear` of gate and up (raven_kernels.linear): the activation is then no kernel of its own.
    Returns how many it replaced; none where the kernels are not at hand for the graph's device."""
    replaced = 0
    for node, gated, weight, bias in _linears(graph):
        if not (isinstance(gated, fx.Node) and _call(gated, "call_function", operator.mul) and len(gated.users) == 1):
            continue
        silu, up = gated.args if _call(gated.args[0], "call_function", F.silu) else gated.args[::-1]
        if not (isinstance(silu, fx.Node) and _call(silu, "call_function", F.silu) and len(silu.users) == 1):
            continue
        if silu.kwargs.get("inplace") or len(silu.args) > 1 or not isinstance(up, fx.Node):
            continue
        gate = silu.args[0]
        values = [n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in (gate, up, weight)]
        if any(v is None for v in values) or values[0].shape != values[1].shape or values[2].dim() != 2:
            continue
        if len({v.dtype for v in values}) > 1 or values[2].stride(-1) != 1:
            continue
        if kernel_module(PROLOGUE_KERNELS, values[0]) is None:
            continue
        with graph.inserting_before(node):
            out = _traced(graph, "call_function", torch.ops.raven_hybrid.silu_mul_linear.default, (gate, up, weight))
        _replace_linear(graph, node, out, bias, (gated, silu))
        replaced += 1
    return replaced


class SharedInputLinears(CustomGraphPass):
    """`fuse_shared_input_linears` as Inductor takes a pre-grad pass (`copy`: its argument), then, with `prologues`,
    `fuse_norms_into_linears` and `fuse_activations_into_linears`, and with `reduce_rows`, `linears_as_reductions`
    for inputs of up to that many rows, then `parts_as_views`. Its uuid keys Inductor's caches of compiled graphs,
    which are looked up before the pass runs: it hashes this package's files, where the pass and the groups whose
    layout it reads (share_projection_storage, `Mixer.shared_input_weights`) are defined, so a cached step never
    reads weights laid out as another version of the code laid them out."""

    def __init__(self, copy: bool = True, reduce_rows: int = 0, prologues: bool = False):
        self.copy, self.reduce_rows, self.prologues = copy, reduce_rows, prologues

    def __call__(self, graph: fx.Graph) -> None:
        fuse_shared_input_linears(graph, self.copy)
        if self.prologues:
            fuse_norms_into_linears(graph)
            fuse_activations_into_linears(graph)
        if self.reduce_rows:
            linears_as_reductions(graph, self.reduce_rows)
            parts_as_views(graph)

    def uuid(self) -> bytes:
        files = tuple(sorted(str(path) for path in Path(__file__).parent.glob("*.py")))
        flags = (b"copy" if self.copy else b"in place") + b"%d" % self.reduce_rows
        flags += b"prologues" if self.prologues else b""
        return get_hash_for_files(files) + flags


# Weights of one module whose products read one input, by name: a module's own `shared_input_weights` (a mixer's
# gates beside its q/k/v), else these where it has them (attention's q/k/v, an MLP's gate/up).
PROJECTION_GROUPS = (("q_proj.weight", "k_proj.weight", "v_proj.weight"), ("gate_proj.weight", "up_proj.weight"))


def _weight_groups(module: nn.Module) -> list[list[torch.Tensor]]:
    """The parameters of each of `module`'s groups that it has whole (its own parameters, not its children's
    groups): [out, in], or [..., in] read flattened to rows of `in` (SSE's LoRA factors of every partition)."""
    groups = []
    for names in getattr(module, "shared_input_weights", PROJECTION_GROUPS):
        try:
            weights = [module.get_parameter(name) for name in names]
        except AttributeError:  # a group it does not have
            continue
        if all(w.dim() >= 2 for w in weights) and len({(w.dtype, w.device, w.shape[-1]) for w in weights}) == 1:
            groups.append(weights)
    return groups


def share_projection_storage(model: nn.Module) -> int:
    """Store the weights of each group (PROJECTION_GROUPS, or a module's `shared_input_weights`) one after another in
    one buffer (`_layout`: aligned, zeros between), the parameters views of it: their values, names and objects are
    unchanged (training and saving see no difference), and a fused product can read them in place. Returns the
    groups laid out anew (those already so are skipped)."""
    laid = 0
    for module in model.modules():
        for weights in _weight_groups(module):
            width = weights[0].shape[-1]
            rows = [w.numel() // width for w in weights]
            starts, end = _layout(rows)
            first = weights[starts.index(0)].detach()
            if all(
                w.untyped_storage()._cdata == first.untyped_storage()._cdata
                and w.is_contiguous()
                and w.storage_offset() == first.storage_offset() + start * width
                for w, start in zip(weights, starts)
            ):
                continue
            joint = weights[0].new_zeros(end, width)  # [rows, in]
            for w, start, n in zip(weights, starts, rows):
                joint[start : start + n] = w.detach().reshape(n, width)
                w.data = joint[start : start + n].view(w.shape)
            laid += 1
    return laid


LAUNCH_SETTINGS = "raven_kernels.launch"  # DEPENDENT_LAUNCH: the decode kernels' programmatic dependent launch


def kernel_launches(options: dict, like: torch.Tensor):
    """The context each call of a step compiled with `options` runs in (its warm-up and its capture launch the
    kernels): where the options turn on Inductor's programmatic dependent launch (`triton.enable_pdl`), the
    toolkit's decode kernels launch that way too (raven_kernels.launch), so no kernel of the step waits for the
    whole kernel ahead to end before it is scheduled."""
    module = kernel_module(LAUNCH_SETTINGS, like) if options.get("triton.enable_pdl") else None
    return module.DEPENDENT_LAUNCH.use(True) if module is not None else contextlib.nullcontext()


def prepare_weights(model: nn.Module, options: dict) -> None:
    """Lay out the weights as `options`' pass reads them: in place (SHARED_PROJECTIONS) needs shared storage; and
    import the prologues' kernels where it fuses them, whose ops a step taken from Inductor's cache calls without
    the pass having run."""
    compiled_pass = options.get("pre_grad_custom_pass")
    if isinstance(compiled_pass, SharedInputLinears) and not compiled_pass.copy:
        share_projection_storage(model)
    if isinstance(compiled_pass, SharedInputLinears) and compiled_pass.prologues:
        preload([PROLOGUE_KERNELS])


AUTOTUNED_GEMMS = ("max_autotune", "max_autotune_gemm")


def check_decode_options(options: dict) -> None:
    """Refuse options Inductor cannot compile: products read in place (a view of the first weight's storage that
    reaches past it, over the group's other weights) with autotuned GEMMs, whose benchmarks allocate each input at
    its own extent only (on the H200: `setStorage: ... out of bounds`)."""
    compiled_pass = options.get("pre_grad_custom_pass")
    autotuned = [name for name in AUTOTUNED_GEMMS if options.get(name)]
    if isinstance(compiled_pass, SharedInputLinears) and not compiled_pass.copy and autotuned:
        name = autotuned[0]
        raise ValueError(
            f"decode options: {name}={options[name]!r} cannot autotune products that read their weights in place "
            "(SHARED_PROJECTIONS, REDUCED_PRODUCTS, the default); use FUSED_PROJECTIONS with it "
            f"({{**FUSED_PROJECTIONS, {name!r}: True}}) or leave it out"
        )


# The decode step's Inductor options with the fusion. SHARED_PROJECTIONS reads each group's weights in place, laid
# out one after another (share_projection_storage, when the step compiles): no copy, and the step sees any later
# change of the weights. FUSED_PROJECTIONS concatenates them and folds the concatenation into a constant under
# freezing: a second copy of those weights, baked in (set the options again after changing them, which recompiles).
SHARED_PROJECTIONS = {"pre_grad_custom_pass": SharedInputLinears(copy=False)}
# SHARED_PROJECTIONS with the products of a batch of up to 4 rows as Inductor's reductions (linears_as_reductions)
REDUCED_PRODUCTS = {"pre_grad_custom_pass": SharedInputLinears(copy=False, reduce_rows=4)}
FUSED_PROJECTIONS = {"freezing": True, "pre_grad_custom_pass": SharedInputLinears()}
# SHARED_PROJECTIONS with each RMSNorm (and the residual add before it) and each MLP's gated activation inside the
# product that reads it (fuse_norms_into_linears, fuse_activations_into_linears; raven_kernels.linear): three
# kernels fewer a decoder layer
FUSED_PROLOGUES = {"pre_grad_custom_pass": SharedInputLinears(copy=False, prologues=True)}


def default_decode_options() -> dict:
    """A model's decode step options unless set: the products fused in place, a batch of up to 4 rows' products as
    Inductor's reductions (fused with the work around them: the teacher's batch-1 step 19% shorter on an H200), and
    Inductor's `combo_kernels`, which launches the step's small independent pointwise kernels as one (all cut
    kernels per step, the cost of a step at small batch; the logits are the unfused step's: docs/GENERATION.md)."""
    return {**REDUCED_PRODUCTS, "combo_kernels": True}
