"""SSE's computations in PyTorch (raven_layers/sse.py has the layer and the equations): the recurrent reference,
which is also the decode path, and the two parallel forms of the paper, `sse_masking` (Algorithm 1) and
`sse_varlen` (Algorithm 2), over a GLA given as a function (the chunked PyTorch references here, or the Triton
kernels of raven_kernels.sse). They agree to float rounding.
It must import nothing but torch and its sibling common.py: it is copied next to every exported model.
"""

from __future__ import annotations

from functools import partial

import torch

from .common import document_positions

PARALLEL_FORMS = ("masking", "varlen")  # sse_parallel's forms; SSESettings.implementation adds "auto"


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
    if implementation not in PARALLEL_FORMS:
        raise ValueError(f"implementation = {implementation!r} is not allowed; allowed: {list(PARALLEL_FORMS)}")
    varlen = implementation == "varlen"
    if kernels is None:
        return partial(sse_varlen if varlen else sse_masking, chunk_size=chunk_size)
    if varlen:  # the kernels read the entries in place
        return partial(sse_varlen, gla_entries=kernels.chunk_gla_entries)
    return partial(sse_masking, gla=partial(kernels.chunk_gla, output_final_state=True))
