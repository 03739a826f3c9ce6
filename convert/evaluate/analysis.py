"""The papers' pictures of what a hybrid's mixer memories hold, computed exactly from the model's own routing.

One prompt (batch size 1) is run through a `HybridForCausalLM`; forward pre-hooks capture each mixer's input
hidden states, from which the routing and gates are recomputed with the mixers' own methods and functions:

- Raven (Raven paper, Section 7 and Appendix A.8): which of the M slots every token writes
  (`raven_slot_writes`), the effective sequence length per slot (`effective_sequence_length`, Figures 5 and 8:
  tokens written to a slot over T, slots sorted), and the slot allocation after a prompt with a passkey
  (`slot_allocation`, `plot_slot_allocation`, Figures 6 and 7: red slots hold only passkey tokens, green only
  other tokens, blue both).
- SILA (SILA paper, Appendix D, Figure 11): the input gate beta_t per token and kv head, memory-dependent term
  included (`sila_input_gate_trace`), compared across prompt variants such as "no_inst" and "strong_inst"
  (`plot_gate_trace`, with the difference of two variants over their common token suffix).
- SSE (SSE paper, Figure 5 and footnote 8): the fraction of tokens writing each routed partition
  (`sse_partition_usage`) and the singular value entropy of every partition of the final state
  (`state_singular_value_entropy`).

Results come back as float32/bool CPU tensors; analysis_plots.py draws them (`plot_slot_allocation`,
`plot_gate_trace`, ...).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from raven_layers.cache import output_cache
from raven_layers.sila import sila_phi, sila_recurrent

# Slot categories of `slot_allocation` (analysis_plots.CATEGORY_COLORS colours them)
NEVER, SPECIAL_ONLY, OTHER_ONLY, BOTH = 0, 1, 2, 3
CATEGORY_NAMES = {NEVER: "never written", SPECIAL_ONLY: "special only", OTHER_ONLY: "other only", BOTH: "both"}


def _as_batch(model, input_ids) -> torch.Tensor:
    """Token ids (a list, [T] or [1, T]) as a [1, T] long tensor on the model's device."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one non-empty sequence ([T] or [1, T]), got shape {tuple(ids.shape)}")
    return ids.to(model.device)


def _mixer(model, layer: int, kind: str):
    """The mixer module of `layer`, after checking that it is of `kind` ("raven", "sila", "sse")."""
    kinds = getattr(model.config, "layer_mixers", None)
    if kinds is None:
        raise ValueError(f"{type(model).__name__} is not a hybrid model (its config has no layer_mixers)")
    if not isinstance(layer, int) or not -len(kinds) <= layer < len(kinds):
        raise ValueError(f"layer {layer!r} does not exist; the model has {len(kinds)} layers")
    layer = layer % len(kinds)
    if kinds[layer] != kind:
        same = [i for i, k in enumerate(kinds) if k == kind]
        raise ValueError(
            f"layer {layer} is of kind {kinds[layer]!r}, not {kind!r}; the {kind} layers of this model are "
            f"{same if same else 'none'}"
        )
    return model.model.layers[layer].self_attn


@contextlib.contextmanager
def _eval_mode(model):
    """Eval mode (no Gumbel noise, no dropout) and no gradients, restoring the model's training flags after."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags.items():
            module.training = flag


def capture_mixer_inputs(model, input_ids, layers: Sequence[int] | None = None, use_cache: bool = False):
    """Run `model` on one sequence and capture the hidden states each chosen mixer layer receives.

    A forward pre-hook (with_kwargs) on `model.model.layers[i].self_attn` records `hidden_states` exactly as the
    mixer sees it (after the decoder layer's input norm), so routing and gates can be recomputed from it.

    Args:
        input_ids: one sequence of token ids, [T] or [1, T].
        layers: layer indices to capture; None: every non-attention layer.
        use_cache: return the generation cache (`raven_layers.output_cache(outputs)`) holding the final mixer states.

    Returns:
        (inputs, outputs): inputs maps layer -> [1, T, hidden] (detached, model dtype and device); outputs is the
        model's forward output (logits, and the cache when use_cache).
    """
    ids = _as_batch(model, input_ids)
    kinds = model.config.layer_mixers
    if layers is None:
        layers = [i for i, k in enumerate(kinds) if k != "attention"]
    layers = [i % len(kinds) for i in layers]
    inputs: dict[int, torch.Tensor] = {}

    def hook_for(i):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            inputs[i] = x.detach()

        return hook

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i in layers]
    try:
        with _eval_mode(model):
            outputs = model(input_ids=ids, use_cache=use_cache)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs


def _layer_input(model, input_ids, layer: int, kind: str):
    """(mixer, x [1, T, hidden]) for one layer of the expected kind."""
    mixer = _mixer(model, layer, kind)
    inputs, _ = capture_mixer_inputs(model, input_ids, [layer])
    return mixer, inputs[layer % len(model.config.layer_mixers)]


def token_span_mask(input_ids, span_ids) -> torch.Tensor:
    """[T] bool, True on every occurrence of the sub-sequence `span_ids` (e.g. a passkey's tokens) in input_ids."""
    ids = torch.as_tensor(input_ids).flatten().tolist()
    span = torch.as_tensor(span_ids).flatten().tolist()
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for start in range(len(ids) - len(span) + 1):
        if span and ids[start : start + len(span)] == span:
            mask[start : start + len(span)] = True
    return mask


def raven_slot_writes(model, input_ids, layer: int) -> torch.Tensor:
    """[T, H_kv, M] bool: True where token t writes slot m of kv head h in Raven layer `layer`.

    Recomputed with the mixer's own `write_gates` (eval mode: no Gumbel noise): a slot is written where
    log f = a_t r_t < 0, i.e. exactly the top-K slots of the router, whose content the token changes.
    """
    mixer, x = _layer_input(model, input_ids, layer, "raven")
    with _eval_mode(model):
        log_f = mixer.write_gates(x, None)  # [1, T, H_kv, M]
    return (log_f[0] < 0).cpu()


def effective_sequence_length(writes: torch.Tensor) -> torch.Tensor:
    """[H_kv, M] float: tokens written to each slot over T (Raven's Definition 4, normalised by T).

    1 for a slot every token writes (an SSM's slots), 1 / M on average for a sliding window, K / M on average for
    Raven; per head the values sum to K.
    """
    return writes.float().sum(0) / writes.shape[0]


def slot_allocation(writes: torch.Tensor, special_token_mask) -> torch.Tensor:
    """[H_kv, M] long, the category of each slot: SPECIAL_ONLY (red: only special tokens, e.g. a passkey, wrote
    it), OTHER_ONLY (green), BOTH (blue) or NEVER (gray).

    Args:
        writes: [T, H_kv, M] bool from `raven_slot_writes`.
        special_token_mask: [T] bool, True at the special tokens (see `token_span_mask`).
    """
    special = torch.as_tensor(special_token_mask, dtype=torch.bool).flatten()
    if special.numel() != writes.shape[0]:
        raise ValueError(f"special_token_mask has {special.numel()} entries for {writes.shape[0]} tokens")
    by_special = writes[special].any(0)  # [H_kv, M]
    by_other = writes[~special].any(0)  # [H_kv, M]
    category = torch.full(by_special.shape, NEVER, dtype=torch.long)
    category[by_special & ~by_other] = SPECIAL_ONLY
    category[~by_special & by_other] = OTHER_ONLY
    category[by_special & by_other] = BOTH
    return category


def sila_input_gate_trace(model, input_ids, layer: int) -> torch.Tensor:
    """[T, H_kv] float: SILA's input gate beta_t = sigmoid(W_b1 M_{t-1} k_t + W_b2 x_t + b) per token and kv head.

    Exact, memory-dependent term included: the memory M_{t-1} each token sees comes from stepping the public
    `sila_recurrent` one token at a time (M_{-1} = 0), as the mixer's decode path does, on the inputs the mixer's
    own `recurrence_inputs` gives it.
    """
    mixer, x = _layer_input(model, input_ids, layer, "sila")
    return sila_gate_traces(mixer, x)[0]


def sila_gate_traces(mixer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, gamma), each [T, H_kv] float32 on the CPU: SILA's input and forget gates per token and kv head, with
    their memory-dependent terms, for the mixer input x [1, T, hidden] (see `sila_input_gate_trace`)."""
    w_beta, w_gamma = mixer.beta_state_weight, mixer.gamma_state_weight
    with _eval_mode(mixer):
        (q, k, v, alpha, beta_x, gamma_x), _ = mixer.recurrence_inputs(x)
        dtype = torch.promote_types(q.dtype, torch.float32)  # the recurrence's dtype
        memory = k.new_zeros(1, mixer.num_kv_heads, v.shape[-1], k.shape[-1], dtype=dtype)  # M_{-1} = 0
        w_gates = torch.stack([w_beta, w_gamma], dim=1).to(dtype)  # [H_kv, 2, d_v]
        gate_x = torch.stack([beta_x, gamma_x], dim=-1).to(dtype)  # [1, T, H_kv, 2]
        pres = []
        for t in range(x.shape[1]):
            step = slice(t, t + 1)
            recalled = torch.einsum("bhvk,bhk->bhv", memory, k[:, t].to(dtype))  # M_{t-1} k_t, [1, H_kv, d_v]
            pres.append(torch.einsum("bhv,hcv->bhc", recalled, w_gates)[0] + gate_x[0, t])  # [H_kv, 2]
            _, memory = sila_recurrent(
                q[:, step], k[:, step], v[:, step], alpha[:, step], beta_x[:, step], gamma_x[:, step],
                w_beta, w_gamma, memory,
            )  # fmt: skip
        pre = torch.stack(pres).float().cpu()  # [T, H_kv, 2]
    return torch.sigmoid(pre[..., 0]), sila_phi(pre[..., 1])


def sse_partition_usage(model, input_ids, layer: int) -> torch.Tensor:
    """[H_kv, N] float: the fraction of tokens writing each routed partition (its top-k); per head it sums to k.

    The shared partition, written by every token, is left out. Recomputed with the mixer's `partition_scores` and
    `partition_inputs`.
    """
    mixer, x = _layer_input(model, input_ids, layer, "sse")
    with _eval_mode(model):
        scores = mixer.partition_scores(x)  # e_t, [1, T, H_kv, N]
        top = mixer.partition_inputs(x, scores, None)[-1]  # [1, T, H_kv, k]
    chosen = torch.zeros_like(scores).scatter(-1, top, 1.0)  # [1, T, H_kv, N]
    return (chosen.sum((0, 1)) / x.shape[1]).float().cpu()


def singular_value_entropy(matrices: torch.Tensor) -> torch.Tensor:
    """Normalised singular value entropy of each matrix [..., m, n] (SSE paper, footnote 8) -> [...].

    H = -(1 / log r) sum_i p_i log p_i with p_i = s_i^2 / sum_j s_j^2 over the r = min(m, n) singular values:
    0 for a rank-1 matrix, 1 when all singular values are equal; nan for an all-zero matrix (never written).
    """
    s2 = torch.linalg.svdvals(matrices.double()).pow(2)  # [..., r]
    total = s2.sum(-1, keepdim=True)
    p = s2 / total
    r = s2.shape[-1]
    h = -torch.xlogy(p, p).sum(-1) / math.log(r) if r > 1 else torch.zeros_like(total[..., 0])
    return h.clamp(0.0, 1.0).masked_fill(total[..., 0] == 0, float("nan")).float()


def state_singular_value_entropy(model, input_ids, layer: int) -> torch.Tensor:
    """[H_kv, P] float: singular value entropy of every partition's final state S^i [c, d] after the prompt
    (partitions 0..N-1 routed, then the shared one); nan for a partition no token wrote. The SSE paper averages it
    over heads per layer (`.nanmean(0)`, or `.nanmean()` over partitions too)."""
    _mixer(model, layer, "sse")
    _, outputs = capture_mixer_inputs(model, input_ids, [], use_cache=True)
    (state,) = output_cache(outputs).get_mixer_state(layer % len(model.config.layer_mixers))  # [1, H_kv, P, c, d]
    return singular_value_entropy(state[0]).cpu()
