"""SSE: Sparse State Expansion (SSE paper, Sections 3.2, 4.1, 4.2 and Appendix B), with GLA gating.

Per key/value head the layer keeps P state partitions S^i, each [c, d]: N routed partitions and, with
`shared_partition`, one always-selected partition (index N, so P = N + 1). A linear scorer picks, for every token,
the top-k routed partitions it writes and the top-k' it reads (the paper's default is n4k1: N = 4, k = k' = 1):

    e_t = x_t W_e                                   [N] per kv head;   T_t = top-k(e_t),  T'_t = top-k'(e_t)
    q_t^i = x_t (W_q + A_q^i B_q^i)                 k~_t^i = x_t (W_k + A_k^i B_k^i)      rank-r LoRA per partition
    v_t = x_t W_v                                   shared by all partitions
    k_t^i = (1/k) softmax(k~_t^i + e_t^i)           i in T_t, softmax over the partition's c rows
    k_t^s = softmax(x_t W_k)                        shared partition: base projections, weight 1 (no 1/k)
    log a_t = logsigmoid(x_t W_a1 W_a2 + b) / tau   [c] GLA gate of the kv head, the same for all its partitions
    S_t^i = diag(a_t) S_{t-1}^i + k_t^i^T v_t       for i in T_t (+ shared); every other partition is untouched
    o_t = c^-1/2 sum_{i in T'_t (+ shared)} q_t^i S_t^i      read after the update, as in GLA
    out_t = W_o (RMSNorm(o_t) * 2 sigmoid(W_g x_t)) per-head RMSNorm as in GLA's block; W_g = 0 at init

c^-1/2 is the attention's own logit scale for c-dim queries and keys. The shared partition keeps a plain softmax:
it is written by every token, like a GLA head, and the 1/k split only concerns routed partitions sharing a token.
Adding e_t^i inside the softmax (eq. 11) changes no value: softmax is shift-invariant, so its gradient to e_t is
exactly zero, and in the paper W_e learns from the balance loss alone. With `router_gradient` (the default) every
routed entry's q and k are also multiplied by exp(log p - sg(log p)), p = softmax(e_t)^i: 1 in value, so outputs
are unchanged, while the language-model loss reaches W_e through d/de_t log p = onehot(i) - p (a straight-through
path: a partition's score rises when writing and reading it lowered the loss). The balance loss is the
partition-based one of Section 3.2 (footnote 6), in Switch / DeepSeek form, over real tokens, averaged over kv
heads (N plays the paper's c):
    f^i = (1/T) sum_t 1[i in T_t],  kbar^i = (1/T) sum_t softmax(e_t)^i,  L = alpha (N/k) sum_i f^i kbar^i
so L = alpha for uniform routing and up to alpha N when every token picks the same partition (k = 1).

Under grouped-query attention the state lives on the key/value heads and each query head of a group reads it.
The three computations below agree to float rounding: `sse_recurrent` (reference and decode path: it gathers and
scatters only the partitions a token touches), `sse_masking` (Algorithm 1: every partition is a head of one
chunked GLA; unselected tokens get q = k = 0 and a log-gate of 0, so they neither write, read nor decay it) and
`sse_varlen` (Algorithm 2: tokens regrouped by partition into variable-length segments of one chunked GLA).
It must import nothing but torch and its sibling common.py: it is copied next to every exported model.

The output norm matters for conversion: keys sum to one but the state sums over the memory's length, so without
it the read of a converted SmolLM2-135M layer comes out 10-47x larger than the attention it replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .backend import kernel_module
from .common import (
    Mixer,
    MixerSettings,
    MixerSpec,
    RMSNorm,
    document_positions,
    init_fresh_parameters,
    input_product,
    one_kernel_step,
)

SSEState = tuple[torch.Tensor]  # (S,), S: [B, H_kv, P, c, d] float32; partitions 0..N-1 routed, N the shared one

# implementation="auto": masking below this many tokens per sequence, varlen from it on. Masking runs the GLA
# over all P partitions of every token, varlen only over the k (+1) a token touches, but pays a sort and gathers;
# on these PyTorch forms both take the same time up to here, varlen wins beyond (docs/KERNELS.md, Settings: SSE
# masking or varlen).
VARLEN_MIN_TOKENS = 256


@dataclass(frozen=True)
class SSESettings(MixerSettings):
    """Hyper-parameters of an SSE layer; heads, head dim and GQA layout come from the source attention."""

    NAME, LABEL = "sse", "SSE"

    num_partitions: int = 4  # N routed partitions per head (paper default n4k1)
    top_k: int = 1  # k partitions written per token
    rows_per_partition: int | None = None  # c rows per partition; None: the source head_dim (keeps W_q, W_k)
    lora_rank: int = 64  # r of the per-partition LoRA on q and k (paper: 64)
    balance_coef: float = 0.01  # alpha of the balance loss (paper: 0.01); 0 turns it off
    router_gradient: bool = True  # the language-model loss trains W_e too, not only the balance loss (partition_inputs)
    shared_partition: bool = True  # one always-selected partition on the base projections (paper)
    read_top_k: int | None = None  # k' partitions read per token; None: top_k (paper default)
    gate_low_rank: int = 16  # rank of the GLA gate projection W_a1 W_a2 (GLA: 16)
    gate_normalizer: float = 16.0  # tau of log a = logsigmoid(.) / tau (GLA: 16)
    output_gate: bool = True  # o * 2 sigmoid(W_g x); W_g starts at zero so the gate starts as the identity
    output_norm: bool = True  # per-head RMSNorm of the read, as in GLA's block: the state sums, so its scale grows
    implementation: str = "auto"  # parallel form: "masking", "varlen", or "auto" (see VARLEN_MIN_TOKENS)
    chunk_size: int = 16  # chunk length of the parallel PyTorch form

    IMPLEMENTATIONS = ("auto", "masking", "varlen")

    def __post_init__(self):
        self.check_positive_ints("num_partitions", "top_k", "lora_rank", "gate_low_rank", "chunk_size")
        if self.top_k > self.num_partitions:
            self.fail("top_k", f"an integer in [1, num_partitions={self.num_partitions}]")
        if self.rows_per_partition is not None and (
            not self.is_int(self.rows_per_partition) or self.rows_per_partition < 1
        ):
            self.fail("rows_per_partition", "null (the source head_dim) or an integer >= 1")
        if self.read_top_k is not None and (
            not self.is_int(self.read_top_k) or not 1 <= self.read_top_k <= self.num_partitions
        ):
            self.fail("read_top_k", f"null (top_k) or an integer in [1, num_partitions={self.num_partitions}]")
        if not self.is_number(self.balance_coef) or not self.balance_coef >= 0:
            self.fail("balance_coef", "a number >= 0")
        if not self.is_number(self.gate_normalizer) or not self.gate_normalizer > 0:
            self.fail("gate_normalizer", "a number > 0")
        self.check_bools("shared_partition", "output_gate", "output_norm", "router_gradient")
        if self.implementation not in self.IMPLEMENTATIONS:
            self.fail("implementation", f"one of {list(self.IMPLEMENTATIONS)}")


def _promote(*tensors):
    """Tensors in the recurrence dtype: float32, or float64 when given."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return tuple(None if x is None else x.to(dtype) for x in tensors)


def gla_recurrent(q, k, v, log_g, scale: float, initial_state=None, cu_seqlens=None):
    """Step-by-step gated linear attention: S_t = diag(exp(log_g_t)) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t.

    Args:
        q: [B, T, H, G, K], G query heads per state head; k, log_g: [B, T, H, K] (log_g <= 0); v: [B, T, H, V].
        initial_state: [B, H, K, V] ([S, H, K, V] with cu_seqlens); zeros when None.
        cu_seqlens: [S + 1] offsets of S sequences packed along T (then B == 1); each starts from its own state.

    Returns:
        o: [B, T, H, G, V] and the final state [B, H, K, V] ([S, H, K, V]), float32 (float64 for float64 inputs).
    """
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            s0 = None if initial_state is None else initial_state[i : i + 1]
            o, s = gla_recurrent(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], log_g[:, lo:hi], scale, s0)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    q, k, v, log_g, state = _promote(q, k, v, log_g, initial_state)
    B, T, H, G, K = q.shape
    if state is None:
        state = q.new_zeros(B, H, K, v.shape[-1])  # [B, H, K, V]
    outputs = []
    for t in range(T):
        state = log_g[:, t].exp().unsqueeze(-1) * state + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outputs.append(torch.einsum("bhgk,bhkv->bhgv", q[:, t], state))
    o = torch.stack(outputs, dim=1) if T else q.new_zeros(B, 0, H, G, v.shape[-1])  # [B, T, H, G, V]
    return o * scale, state


def sse_recurrent(q, k, v, log_g, idx, num_partitions: int, scale: float, initial_state=None):
    """Step-by-step SSE: the reference, and the decode path. Only the partitions in `idx` are read or written.

    A token touches M distinct partitions idx[..., j] (its top-k written, top-k' read, and the shared one). Entry j
    writes with key k[..., j, :] and log-gate log_g[..., j, :] and reads with query q[..., j, :]; an entry that only
    reads has k = 0 and log_g = 0, one that only writes has q = 0, and a padded token has k = 0 and log_g = 0.

    Args:
        q: [B, T, H, G, M, c]; k, log_g: [B, T, H, M, c]; v: [B, T, H, d]; idx: [B, T, H, M] in [0, P).
        num_partitions: P, partitions of the state (routed + shared).
        initial_state: [B, H, P, c, d]; zeros when None.

    Returns:
        o: [B, T, H, G, d] and the final state [B, H, P, c, d], float32 (float64 for float64 inputs).
    """
    q, k, v, log_g, state = _promote(q, k, v, log_g, initial_state)
    B, T, H, G, M, c = q.shape
    d = v.shape[-1]
    if state is None:
        state = q.new_zeros(B, H, num_partitions, c, d)  # [B, H, P, c, d]
    outputs = []
    for t in range(T):
        at = idx[:, t, :, :, None, None].expand(B, H, M, c, d)
        touched = state.gather(2, at)  # [B, H, M, c, d]
        touched = log_g[:, t].exp().unsqueeze(-1) * touched + k[:, t].unsqueeze(-1) * v[:, t, :, None, None, :]
        state = state.scatter(2, at, touched)
        outputs.append(torch.einsum("bhgmc,bhmcd->bhgd", q[:, t], touched))
    return torch.stack(outputs, dim=1) * scale, state


def chunk_gla_reference(q, k, v, log_g, scale: float, initial_state=None, cu_seqlens=None, chunk_size: int = 16):
    """Chunked parallel form of `gla_recurrent` (same arguments and results), with varlen support.

    Sequences (the batch rows, or the segments of `cu_seqlens`) are cut into chunks of C tokens that never cross a
    sequence boundary; the last chunk of a sequence is filled with all-zero steps (log_g = 0, k = 0), which change
    nothing. Within a chunk, with g_t the cumulative log-gate since its start, token t reads token s <= t through
    exp(g_t - g_s) and the state entering the chunk through exp(g_t); only these non-positive exponents are ever
    exponentiated, so no term overflows however strong the decay. A scan over chunk positions carries each
    sequence's state from its initial state; empty sequences keep theirs.
    """
    q, k, v, log_g, state = _promote(q, k, v, log_g, initial_state)
    B, T, H, G, K = q.shape
    V, C, L, dev = v.shape[-1], chunk_size, B * T, q.device
    if cu_seqlens is None:  # each batch row is one sequence of the packed [B * T] stream
        cu = torch.arange(0, L + 1, T, device=dev)
    elif B != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got batch {B}")
    else:
        cu = cu_seqlens.to(dev, torch.long)
    S = cu.numel() - 1
    if state is None:
        state = q.new_zeros(S, H, K, V)  # [S, H, K, V]

    lengths = cu.diff()
    n_chunks = (lengths + C - 1) // C  # [S]
    first = n_chunks.cumsum(0) - n_chunks  # index of each sequence's first chunk
    seq = torch.repeat_interleave(torch.arange(S, device=dev), n_chunks)  # [Nc] sequence of each chunk
    if seq.numel() == 0:
        return q.new_zeros(B, T, H, G, V), state.view(B, H, K, V) if cu_seqlens is None else state
    pos = torch.arange(seq.numel(), device=dev) - first[seq]  # chunk index within its sequence
    tok = (cu[seq] + pos * C)[:, None] + torch.arange(C, device=dev)  # [Nc, C]
    valid = tok < cu[seq + 1][:, None]
    tok = tok.masked_fill(~valid, L)  # L: an appended all-zero step

    def chunked(x):  # [L, ...] -> [Nc, C, ...]
        return torch.cat([x.flatten(0, 1), x.new_zeros(1, *x.shape[2:])])[tok]

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(log_g)  # [Nc, C, H, (G,) K|V]
    g_cum = gc.cumsum(dim=1)  # [Nc, C, H, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    diff = g_cum.unsqueeze(2) - g_cum.unsqueeze(1)  # [Nc, Ct, Cs, H, K]
    decay = diff.masked_fill(~causal[:, :, None, None], float("-inf")).exp()
    scores = torch.einsum("nthgk,ntshk->nthgs", qc, decay * kc.unsqueeze(1))  # [Nc, Ct, H, G, Cs]
    o = torch.einsum("nthgs,nshv->nthgv", scores, vc)  # [Nc, C, H, G, V]

    # Chunk-local contribution to the end-of-chunk state, then a scan for the state entering each chunk.
    to_end = (g_cum[:, -1:] - g_cum).exp() * kc  # [Nc, C, H, K]
    u = torch.einsum("nshk,nshv->nhkv", to_end, vc)  # [Nc, H, K, V]
    chunk_decay = g_cum[:, -1].exp().unsqueeze(-1)  # [Nc, H, K, 1]
    entered, order = [], []
    for step in range(int(n_chunks.max())):
        seqs = (n_chunks > step).nonzero().squeeze(1)
        ids = first[seqs] + step
        entered.append(state[seqs])
        order.append(ids)
        state = state.index_copy(0, seqs, chunk_decay[ids] * state[seqs] + u[ids])
    enter = torch.cat(entered)[torch.cat(order).argsort()]  # [Nc, H, K, V]
    o = o + torch.einsum("nthgk,nhkv->nthgv", qc * g_cum.exp().unsqueeze(3), enter)
    o = o.flatten(0, 1)[valid.flatten()].view(B, T, H, G, V) * scale  # chunks are in token order
    return o, (state.view(B, H, K, V) if cu_seqlens is None else state)


def sse_masking(
    q,
    k,
    v,
    log_g,
    idx,
    num_partitions: int,
    scale: float,
    initial_state=None,
    chunk_size: int = 16,
    gla=None,
    cu_seqlens=None,
):
    """Masking form of `sse_recurrent` (paper Algorithm 1; same arguments and results).

    Every token is replicated over the P partitions; a partition the token does not touch gets q = k = 0 and a
    log-gate of 0, so the token neither reads, writes nor decays it. Partitions are merged into the head dimension
    (head h * P + i) and one chunked GLA runs over all of them; the shared partition is just one more head.
    `gla(q, k, v, log_g, scale, initial_state=, cu_seqlens=)` -> (o, final state) runs it: `chunk_gla_reference`
    with `chunk_size` when None (the mixer passes the kernels' `chunk_gla`). cu_seqlens [S + 1] packs S documents
    along T (B == 1): each starts from its own state (initial_state [S, H, P, c, d]), and the final state is
    [S, H, P, c, d].
    """
    B, T, H, G, M, c = q.shape
    d, P = v.shape[-1], num_partitions
    at = idx[..., None].expand(B, T, H, M, c)
    k_all = k.new_zeros(B, T, H, P, c).scatter(3, at, k)  # [B, T, H, P, c]
    g_all = log_g.new_zeros(B, T, H, P, c).scatter(3, at, log_g)  # [B, T, H, P, c]
    q_all = q.new_zeros(B, T, H, G, P, c).scatter(4, at.unsqueeze(3).expand(B, T, H, G, M, c), q)
    q_all = q_all.transpose(3, 4).reshape(B, T, H * P, G, c)  # [B, T, H*P, G, c]
    v_all = v.unsqueeze(3).expand(B, T, H, P, d).reshape(B, T, H * P, d)  # [B, T, H*P, d]
    S = B if cu_seqlens is None else cu_seqlens.numel() - 1
    s0 = None if initial_state is None else initial_state.reshape(S, H * P, c, d)
    gla = gla or partial(chunk_gla_reference, chunk_size=chunk_size)
    o, state = gla(
        q_all,
        k_all.view(B, T, H * P, c),
        v_all,
        g_all.view(B, T, H * P, c),
        scale,
        initial_state=s0,
        cu_seqlens=cu_seqlens,
    )
    return o.view(B, T, H, P, G, d).sum(3), state.view(S, H, P, c, d)


def chunk_gla_entries_reference(q, k, v, log_g, order, cu_seqlens, scale: float, initial_state=None, chunk_size=16):
    """GLA over the (token, partition) entries of SSE's varlen form (the reference of the kernels'
    `chunk_gla_entries`): q [B, T, H, G, M, c], k and log_g [B, T, H, M, c], v [B, T, H, d]; the E = B T H M
    entries, gathered in `order` [E] into one packed sequence (one head), run `chunk_gla_reference` over its
    segments cu_seqlens [S' + 1] (initial_state [S', 1, c, d]). Returns o [B, T, H, G, d], each token's M entries
    summed, and the final state [S', 1, c, d]."""
    B, T, H, G, M, c = q.shape
    d = v.shape[-1]
    q_e = q.transpose(3, 4).reshape(-1, G, c)[order]  # [E, G, c]
    k_e, g_e = k.reshape(-1, c)[order], log_g.reshape(-1, c)[order]  # [E, c]
    v_e = v.unsqueeze(3).expand(B, T, H, M, d).reshape(-1, d)[order]  # [E, d]
    packed = (x[None, :, None] for x in (q_e, k_e, v_e, g_e))  # one sequence of E entries, one head
    o_e, state = chunk_gla_reference(
        *packed, scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    o = o_e.new_zeros(order.numel(), G, d).index_copy(0, order, o_e[0, :, 0])  # [E, G, d] back in entry order
    return o.view(B, T, H, M, G, d).sum(3), state


def varlen_entries(idx: torch.Tensor, num_partitions: int, cu_seqlens=None):
    """The entry order of the varlen form: order [E] (E = B T H M) lists the flat (b, t, h, m) entries of idx
    [B, T, H, M] by segment (document, kv head, partition), then time; cu [S H P + 1] bounds the segments (empty
    ones included) and S counts the documents (the batch rows without cu_seqlens)."""
    B, T, H, M = idx.shape
    P, dev = num_partitions, idx.device
    if cu_seqlens is None:  # a document per batch row
        S, document = B, torch.arange(B, device=dev)[:, None]  # [B, 1]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got batch {B}")
        S = cu_seqlens.numel() - 1
        document = document_positions(cu_seqlens.to(dev), T)[0][None]  # [1, T]
    sample = document[:, :, None, None] * H + torch.arange(H, device=dev)[:, None]  # [B, T|1, H, 1]
    segment = (sample * P + idx).flatten()  # [E] segment of each entry: (document, h, partition)
    order = segment.argsort(stable=True)  # entries are flat in time order within a segment: stable keeps it
    ids = torch.arange(S * H * P + 1, device=dev)
    return order, torch.searchsorted(segment.gather(0, order), ids), S  # cu: empty segments included, no host sync


def sse_varlen(
    q,
    k,
    v,
    log_g,
    idx,
    num_partitions: int,
    scale: float,
    initial_state=None,
    chunk_size: int = 16,
    gla_entries=None,
    cu_seqlens=None,
):
    """Varlen form of `sse_recurrent` (paper Algorithm 2; same arguments and results; `cu_seqlens` as in
    `sse_masking`).

    Each (batch row or packed document, kv head) is a sample with its own routing. Its (token, partition) entries
    are reordered by partition, then time (`varlen_entries`), so every (sample, partition) becomes one segment of a
    single packed sequence with its own initial state, and one chunked GLA processes only the tokens each partition
    received. The shared partition, last of each sample, is the sample's tokens in their own order concatenated
    after the routed segments along the sequence dimension, so it costs no second call. Outputs come back summed.
    `gla_entries(q, k, v, log_g, order, cu_seqlens, scale, initial_state)` -> (o, final state) runs the GLA over the
    entries: `chunk_gla_entries_reference` with `chunk_size` when None (the kernels' `chunk_gla_entries` reads them in
    place).
    """
    B, T, H, G, M, c = q.shape
    d, P = v.shape[-1], num_partitions
    order, cu, S = varlen_entries(idx, P, cu_seqlens)
    s0 = None if initial_state is None else initial_state.reshape(S * H * P, 1, c, d)
    gla_entries = gla_entries or partial(chunk_gla_entries_reference, chunk_size=chunk_size)
    o, state = gla_entries(q, k, v, log_g, order, cu, scale, s0)
    return o, state.view(S, H, P, c, d)


def sse_parallel(implementation: str, kernels=None, chunk_size: int = 16):
    """SSE's parallel form `implementation`, "varlen" (`sse_varlen`) or "masking" (`sse_masking`), called with their
    arguments: on the GLA kernels of `kernels` (the module named by MIXER.kernels) when given, else on the PyTorch
    chunked GLA with chunks of `chunk_size`."""
    allowed = [name for name in SSESettings.IMPLEMENTATIONS if name != "auto"]
    if implementation not in allowed:
        raise ValueError(f"implementation = {implementation!r} is not allowed; allowed: {allowed}")
    varlen = implementation == "varlen"
    if kernels is None:
        return partial(sse_varlen if varlen else sse_masking, chunk_size=chunk_size)
    if varlen:  # the kernels read the entries in place
        return partial(sse_varlen, gla_entries=kernels.chunk_gla_entries)
    return partial(sse_masking, gla=partial(kernels.chunk_gla, output_final_state=True))


class SSEMixer(Mixer):
    """Drop-in replacement for a decoder layer's self-attention, with a sparsely expanded GLA state.

    q/k/v/o keep the attention's names and shapes (q/k get H * c and H_kv * c outputs), so the converted layer
    starts from the teacher's projections. Called like the attention it replaces; returns (output, None) and
    leaves the balance loss of this call in `self.aux_loss` (None when balance_coef = 0).
    """

    # the partition scores, the decay's first product and every partition's first LoRA factors (read as [N r, hidden])
    input_weights = ("partition_weight", "decay_down", "q_lora_a", "k_lora_a")

    def __init__(self, config, layer_idx: int, settings: SSESettings, source_has_qk_norm: bool = False):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rows = settings.rows_per_partition or head_dim  # c
        super().__init__(config, layer_idx, settings, qk_head_dim=self.rows)
        hidden = config.hidden_size
        self.source_has_qk_norm = source_has_qk_norm  # the source's q/k norms are dropped: keys go through softmax
        self.read_top_k = settings.read_top_k or settings.top_k  # k'
        self.num_partitions = settings.num_partitions + int(settings.shared_partition)  # P
        self.scale = self.rows**-0.5
        H, Hkv, d, c = self.num_heads, self.num_kv_heads, self.head_dim, self.rows
        N, r = settings.num_partitions, settings.lora_rank
        limit = min(hidden, Hkv * c)
        if r > limit:
            raise ValueError(
                f"sse.lora_rank = {r!r} is not allowed; expected an integer in [1, {limit}] (the q/k projections "
                f"map hidden_size={hidden} to {H * c} and {Hkv * c} features)"
            )
        self.partition_weight = nn.Parameter(torch.empty(Hkv * N, hidden))  # W_e
        self.q_lora_a = nn.Parameter(torch.empty(N, r, hidden))  # A_q^i
        self.q_lora_b = nn.Parameter(torch.empty(N, H * c, r))  # B_q^i
        self.k_lora_a = nn.Parameter(torch.empty(N, r, hidden))  # A_k^i
        self.k_lora_b = nn.Parameter(torch.empty(N, Hkv * c, r))  # B_k^i
        self.decay_down = nn.Parameter(torch.empty(settings.gate_low_rank, hidden))  # W_a1
        self.decay_up = nn.Parameter(torch.empty(Hkv * c, settings.gate_low_rank))  # W_a2
        self.decay_bias = nn.Parameter(torch.empty(Hkv * c))  # b
        if settings.output_norm:
            self.o_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.aux_loss: torch.Tensor | None = None
        self.reset_mixer_parameters()

    @torch.no_grad()
    def reset_mixer_parameters(self):
        """Initialise the parameters attention does not have, so the converted layer trains stably from step 0.

        - LoRA: A ~ N(0, 1/hidden), B = 0, so every partition starts with the attention's own W_q / W_k: routing
          only decides where a token is stored, not how it is projected, and no partition starts worse than the
          others. A being random, B gets a gradient at once and the partitions specialise gradually.
        - Scorer W_e ~ N(0, 0.02^2): near-equal scores, near-uniform softmax(e_t) (balance loss ~ alpha) and a
          content-dependent, roughly balanced top-k from the first step, without early collapse.
        - GLA gate: W_a2 = 0 and W_a1 ~ N(0, 1/hidden) (LoRA-like), so the gate starts input-independent and still
          learns; b is set so the retention per write a = exp(logsigmoid(b) / tau) is spread log-uniformly in
          1 - a over the c rows from 0.97 to 0.999 (half-lives of 23 to 693 writes, N/k times more tokens), the
          same for every head: the state starts with a long memory, closer to the attention it replaces, and
          stays bounded (keys sum to at most 1, so |S| <= |v| / (1 - a)).
        - Output gate: W_g = 0, and the gate is 2 sigmoid(W_g x), so it starts as the identity.
        """
        hidden, c, tau = self.q_proj.in_features, self.rows, self.settings.gate_normalizer
        forget = torch.logspace(math.log10(0.03), math.log10(0.001), c, dtype=torch.float64)  # 1 - a per row
        a_tau = (1.0 - forget) ** tau  # sigmoid(b) = a^tau
        bias = torch.log(a_tau / (1.0 - a_tau)).float().repeat(self.num_kv_heads)
        inits = {
            "partition_weight": lambda p: p.normal_(std=0.02),
            "q_lora_a": lambda p: p.normal_(std=hidden**-0.5),
            "q_lora_b": lambda p: p.zero_(),
            "k_lora_a": lambda p: p.normal_(std=hidden**-0.5),
            "k_lora_b": lambda p: p.zero_(),
            "decay_down": lambda p: p.normal_(std=hidden**-0.5),
            "decay_up": lambda p: p.zero_(),
            "decay_bias": lambda p: p.copy_(bias),
            "gate_weight": lambda p: p.zero_(),
        }
        init_fresh_parameters(self, inits)

    def state_numel(self) -> int:
        """Elements of the decoding state per sequence: P partitions of [c, d] per key/value head."""
        return self.num_kv_heads * self.num_partitions * self.rows * self.head_dim

    def fresh_parameter_names(self) -> set[str]:
        """Parameters a converted layer cannot take from the source attention."""
        names = {"partition_weight", "q_lora_a", "q_lora_b", "k_lora_a", "k_lora_b"}
        names |= {"decay_down", "decay_up", "decay_bias"}
        if self.settings.output_gate:
            names.add("gate_weight")
        if self.settings.output_norm:
            names.add("o_norm.weight")
        if self.rows != self.head_dim:  # q/k reshaped to c rows: the teacher's cannot be copied
            names |= {f"{proj}.{p}" for proj in ("q_proj", "k_proj") for p, _ in getattr(self, proj).named_parameters()}
        return names

    def balance_loss(self, scores, top, padding_mask):
        """alpha (N/k) sum_i f^i kbar^i per kv head, averaged over heads, over real tokens (see the module docstring).

        As in Switch / DeepSeek: f^i, the fraction of tokens writing partition i (sums to k), is a count and carries
        no gradient; kbar^i, the mean of softmax(e_t)^i (sums to 1), carries it to W_e.
        """
        s = self.settings
        if s.balance_coef == 0:
            return None
        probs = scores.softmax(-1)  # [B, T, H_kv, N]
        chosen = torch.zeros_like(probs).scatter(-1, top, 1.0)  # [B, T, H_kv, N]
        real = probs.new_ones(probs.shape[:2]) if padding_mask is None else padding_mask.to(probs.dtype)
        real = real[:, :, None, None]
        count = real.sum().clamp(min=1.0)
        f = (chosen * real).sum((0, 1)) / count  # [H_kv, N]
        kbar = (probs * real).sum((0, 1)) / count  # [H_kv, N]
        return s.balance_coef * s.num_partitions / s.top_k * (f * kbar).sum(-1).mean()

    def partition_scores(self, x: torch.Tensor) -> torch.Tensor:
        """The router's scores e_t [B, T, H_kv, N] of hidden states x [B, T, hidden], in float32 at least."""
        B, T, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)  # routing and the state in float32 at least
        return F.linear(x, self.partition_weight).view(B, T, self.num_kv_heads, self.settings.num_partitions).to(dtype)

    def partition_inputs(self, x, scores, padding_mask):
        """Queries, keys, log-gates and indices of the partitions each token touches (see `sse_recurrent`).

        Returns q [B, T, H_kv, G, M, c], k and log_g [B, T, H_kv, M, c], idx [B, T, H_kv, M] and the top-k
        indices; entries are the top-max(k, k') routed partitions, best first, then the shared one (index N).
        """
        s = self.settings
        B, T, _ = x.shape
        H, Hkv, c, N = self.num_heads, self.num_kv_heads, self.rows, s.num_partitions
        G, m, dtype = H // Hkv, max(s.top_k, self.read_top_k), scores.dtype
        top_e, top = scores.topk(m, dim=-1)  # [B, T, H_kv, m], best first
        slot = torch.arange(m, device=x.device)
        write, read = (slot < s.top_k).to(dtype), (slot < self.read_top_k).to(dtype)  # [m]

        q_base = self.q_proj(x)  # [B, T, H*c]
        k_base = self.k_proj(x)  # [B, T, H_kv*c]
        # LoRA of every partition (cheap: N r (H + H_kv) c per token), then the ones each token picked
        q_down, k_down = (F.linear(x, a.flatten(0, 1)).view(B, T, N, -1) for a in (self.q_lora_a, self.k_lora_a))
        dq = torch.einsum("btnr,nor->btno", q_down, self.q_lora_b)  # [B, T, N, H*c]
        dk = torch.einsum("btnr,nor->btno", k_down, self.k_lora_b)  # [B, T, N, H_kv*c]
        q_all = (q_base[:, :, None] + dq).view(B, T, N, Hkv, G, c).permute(0, 1, 3, 4, 2, 5)  # [B, T, H_kv, G, N, c]
        k_all = (k_base[:, :, None] + dk).view(B, T, N, Hkv, c).transpose(2, 3)  # [B, T, H_kv, N, c]
        q = q_all.gather(4, top[:, :, :, None, :, None].expand(B, T, Hkv, G, m, c)).to(dtype)  # [B, T, H_kv, G, m, c]
        q = q * read[:, None]
        k_logits = k_all.gather(3, top[..., None].expand(B, T, Hkv, m, c)).to(dtype)  # [B, T, H_kv, m, c]
        k = (k_logits + top_e[..., None]).softmax(-1) * (write[:, None] / s.top_k)  # e_t^i: a no-op shift (eq. 11)

        log_a = F.logsigmoid(F.linear(F.linear(x, self.decay_down), self.decay_up, self.decay_bias).to(dtype))
        log_a = (log_a / s.gate_normalizer).view(B, T, Hkv, 1, c)  # [B, T, H_kv, 1, c]
        log_g = log_a * write[:, None]  # [B, T, H_kv, m, c]: read-only entries do not decay
        if s.router_gradient and torch.is_grad_enabled() and scores.requires_grad:
            # x exp(log p - sg(log p)) is x in value, p = softmax(e_t) of the partition: the selection itself only
            # shifts logits under the keys' softmax (eq. 11), so without this W_e learns from the balance loss alone
            log_p = scores.log_softmax(-1).gather(-1, top)  # [B, T, H_kv, m]
            through = torch.exp(log_p - log_p.detach())  # [B, T, H_kv, m]
            q, k = q * through[:, :, :, None, :, None], k * through[..., None]
        idx = top
        if s.shared_partition:
            q = torch.cat([q, q_base.view(B, T, Hkv, G, 1, c).to(dtype)], dim=4)
            k = torch.cat([k, k_base.view(B, T, Hkv, 1, c).to(dtype).softmax(-1)], dim=3)
            log_g = torch.cat([log_g, log_a], dim=3)
            idx = torch.cat([idx, torch.full_like(top[..., :1], N)], dim=3)
        if padding_mask is not None:  # padding neither writes nor decays
            real = padding_mask[:, :, None, None, None].to(dtype)
            k, log_g = k * real, log_g * real
        return q, k, log_g, idx, top[..., : s.top_k]

    def kernel_inputs(self, x: torch.Tensor, padding_mask: torch.Tensor | None, balance: bool = True):
        """What the SSE forms take from hidden states x [B, T, hidden]: q, k, v [B, T, H_kv, d], log_g and idx (see
        `partition_inputs`), and the balance loss (None when balance_coef = 0 or not `balance`)."""
        B, T, _ = x.shape
        scores = self.partition_scores(x)  # e_t
        q, k, log_g, idx, top = self.partition_inputs(x, scores, padding_mask)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v, log_g, idx, self.balance_loss(scores, top, padding_mask) if balance else None

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """`Mixer.read_out` with the per-head RMSNorm of the read o [B, T, H_kv, G, d] (`output_norm`) first."""
        o = o.to(x.dtype)
        if self.settings.output_norm:
            o = self.o_norm(o)
        return self.project_out(o.reshape(*x.shape[:2], -1), x)

    def fused_decode_step(self, kernels, x: torch.Tensor, state: torch.Tensor, padding_mask) -> torch.Tensor:
        """A decode step of x [B, 1, hidden] on `fused_recurrent_sse_decode`: the products of x here (one, fused in a
        compiled step: q/k/v, the scores, the decay's first product, every partition's first LoRA products, the
        output gate), the routing, the LoRA's second products, gate, the partitions' update and read, the read's norm
        and output gate in one kernel that updates the state [B, H_kv, P, c, d] in place. Returns the layer's output
        ([B, 1, hidden], None), as `read_out`."""
        s = self.settings
        lora_x = tuple(input_product(x, a.flatten(0, 1)) for a in (self.q_lora_a, self.k_lora_a))  # [B, 1, N r]
        o = kernels.fused_recurrent_sse_decode(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), input_product(x, self.partition_weight),
            input_product(x, self.decay_down), lora_x, (self.q_lora_b, self.k_lora_b),
            self.decay_up, self.decay_bias, state, self.scale, s.top_k, self.read_top_k, s.gate_normalizer,
            out_norm=self.o_norm.weight if s.output_norm else None,
            norm_eps=self.o_norm.eps if s.output_norm else 1e-6,
            out_gate=input_product(x, self.gate_weight) if s.output_gate else None,
            mask=None if padding_mask is None else padding_mask.bool(),
        )  # fmt: skip
        return self.o_proj(o), None

    def mix(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        x = hidden_states  # [B, T, hidden]
        B, T, _ = x.shape
        s = self.settings
        state = self.load_state(cache)
        decoding = T == 1 and state is not None  # no balance loss for a generation step: nothing trains on it
        kernels = kernel_module(MIXER.kernels, x)
        if one_kernel_step(kernels, x, cu_seqlens, state):
            self.aux_loss = None
            out = self.fused_decode_step(kernels, x, state[0], padding_mask)  # one kernel from the products
            self.save_state(cache, state, num_tokens=T)
            return out
        q, k, v, log_g, idx, self.aux_loss = self.glue(self.kernel_inputs)(x, padding_mask, not decoding)
        initial = state[0] if state is not None else None
        args = (q, k, v, log_g, idx, self.num_partitions, self.scale, initial)
        varlen = s.implementation == "varlen" or (s.implementation == "auto" and T >= VARLEN_MIN_TOKENS)
        form = "varlen" if varlen else "masking"
        if cu_seqlens is not None:  # packed documents: one sequence of B * T tokens, each document from zero
            packed = [t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, log_g, idx)]
            o, _ = sse_parallel(form, kernels, s.chunk_size)(*packed, *args[5:], cu_seqlens=cu_seqlens)
            o = o.view(B, T, *o.shape[2:])
        elif decoding:
            o, new_state = kernels.fused_recurrent_sse(*args) if kernels else sse_recurrent(*args)
        else:
            o, new_state = sse_parallel(form, kernels, s.chunk_size)(*args)
        if cu_seqlens is None:
            self.save_state(cache, (new_state,), num_tokens=T)
        return self.glue(self.read_out)(o, x)


MIXER = MixerSpec(
    settings=SSESettings,
    layer=SSEMixer,
    state="(N + 1) x [c, d]: N routed partitions and the shared one",
    kernels="raven_kernels.sse",
    references=(
        sse_recurrent,
        sse_masking,
        sse_varlen,
        gla_recurrent,
        chunk_gla_reference,
        chunk_gla_entries_reference,
    ),
    pictures="raven_convert.evaluate.pictures:sse_pictures",
    graph_safe=True,  # both output kernels queued in a capture, each reads the range flag on the device
)
