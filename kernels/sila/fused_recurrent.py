"""`fused_recurrent_sila`: SILA's recurrence (raven_layers/sila.py, eqs. 5-7) in Triton, forward and backward;
`fused_recurrent_sila_decode`: one decode step that updates a cache's memory in place."""

from __future__ import annotations

import torch

from .fused_recurrent_bwd import fused_recurrent_sila_bwd
from .fused_recurrent_fwd import fused_recurrent_sila_fwd

CHUNK_SIZE = 64  # steps between saved memories; the chunk-parallel kernels work on [CHUNK, d] tiles


class FusedRecurrentSILAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, output_final_state,
                cu_seqlens, chunk_size):  # fmt: skip
        o, ht, saved = fused_recurrent_sila_fwd(
            q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, output_final_state, cu_seqlens,
            chunk_size, save=True,
        )  # fmt: skip
        states, r, s, offsets, indices, n_chunks = saved
        ctx.save_for_backward(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, cu_seqlens,
                              states, r, s, offsets, indices)  # fmt: skip
        ctx.n_chunks, ctx.chunk_size = n_chunks, chunk_size
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, h0, mask, cu_seqlens, states, r, s, offsets, indices = (
            ctx.saved_tensors
        )
        saved = (states, r, s, offsets, indices, ctx.n_chunks)
        grads = fused_recurrent_sila_bwd(
            q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, h0, mask, cu_seqlens, ctx.chunk_size, saved,
            do.contiguous(), None if dht is None else dht.contiguous(),
        )  # fmt: skip
        return (*grads, None, None, None, None)


def _check(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, cu_seqlens, chunk_size):
    if q.dim() != 5:
        raise ValueError(f"q must be [B, T, H, G, d_k], got shape {tuple(q.shape)}")
    B, T, H, G, K = q.shape
    V = v.shape[-1]
    expected = {
        "k": (k, (B, T, H, K)),
        "v": (v, (B, T, H, V)),
        "alpha": (alpha, (B, T, H, G)),
        "beta_x": (beta_x, (B, T, H)),
        "gamma_x": (gamma_x, (B, T, H)),
        "w_beta": (w_beta, (H, V)),
        "w_gamma": (w_gamma, (H, V)),
    }
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from q {tuple(q.shape)}), got {tuple(x.shape)}")
    for name, dim in (("d_k", K), ("d_v", V)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (the memory is one register tile), got {dim}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along T: B must be 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-d int32/int64 tensor [N + 1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")  # fmt: skip
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, V, K):
        raise ValueError(f"initial_state must be [N, H, d_v, d_k] = {(N, H, V, K)}, got {tuple(initial_state.shape)}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, T)):
        raise ValueError(f"mask must be a bool tensor [B, T] = {(B, T)}, got {mask.dtype} {tuple(mask.shape)}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")


def fused_recurrent_sila(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SILA's recurrence as `raven_layers.sila.sila_recurrent`, differentiable in every input but the mask.

    Args:
        q: [B, T, H, G, d_k] queries, G query heads per key/value head; k: [B, T, H, d_k]; v: [B, T, H, d_v].
        alpha: [B, T, H, G] weight of the current token's recall.
        beta_x, gamma_x: [B, T, H] input parts of the gate pre-activations.
        w_beta, w_gamma: [H, d_v] map the recalled value M_{t-1} k_t to the gate pre-activations.
        initial_state: [N, H, d_v, d_k] memory before the first token (zeros when None), N = B or len(cu_seqlens) - 1.
        mask: [B, T] bool, False at padding (beta = 0, gamma = 1 there).
        output_final_state: also return the memory after the last token, [N, H, d_v, d_k] float32.
        cu_seqlens: [N + 1] offsets of N sequences packed along T (B == 1), each with its own state.
        chunk_size: steps between the memories saved for the backward pass and the chunk-parallel kernels.

    Returns:
        o: [B, T, H, G, d_v] in q's dtype (float32 accumulation), and the final memory or None.
    """
    _check(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, cu_seqlens, chunk_size)
    args = [x.contiguous() for x in (q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma)]
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if mask is not None:
        mask = mask.contiguous().view(torch.uint8)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    differentiable = [*args, initial_state]
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in differentiable):
        return FusedRecurrentSILAFunction.apply(*args, initial_state, mask, output_final_state, cu_seqlens, chunk_size)
    o, ht = sila_forward(*args, initial_state, mask, cu_seqlens, chunk_size)
    return o, (ht if output_final_state else None)


@torch.library.custom_op("raven_hybrid::sila_forward", mutates_args=())
def sila_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    initial_state: torch.Tensor | None,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference forward of `fused_recurrent_sila` (checked, contiguous inputs) as a custom op: torch.compile
    keeps it whole, and Inductor fuses the work around it. Returns o and the final memory."""
    o, ht, _ = fused_recurrent_sila_fwd(
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, True, cu_seqlens, chunk_size, save=False
    )
    return o, ht


@sila_forward.register_fake
def _(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state, mask, cu_seqlens, chunk_size):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ht = q.new_empty(N, k.shape[2], v.shape[-1], k.shape[-1], dtype=torch.float32)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), ht


def fused_recurrent_sila_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    state: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of `fused_recurrent_sila` (T == 1, no gradients) that updates `state`, the memory a cache
    holds, in place: the step reads and writes the memory where it lies, with no copy of it (for a cache, a copy of
    every SILA layer's memory per step).

    Args: as `fused_recurrent_sila`'s, with T == 1 and `state` [B, H, d_v, d_k] float32, contiguous (required:
    the memory after the step is written into it).

    Returns:
        o: [B, 1, H, G, d_v] in q's dtype.
    """
    _check(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state, mask, None, CHUNK_SIZE)
    if q.shape[1] != 1:
        raise ValueError(f"fused_recurrent_sila_decode takes one step: T must be 1, got T = {q.shape[1]}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 tensor (it is updated in place), got {state.dtype}"
                         f"{'' if state.is_contiguous() else ', not contiguous'}")  # fmt: skip
    inputs = (q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, state)):
        raise ValueError("fused_recurrent_sila_decode computes no gradients; use fused_recurrent_sila to train")
    args = [x.contiguous() for x in inputs]
    return sila_decode(*args, state, None if mask is None else mask.contiguous().view(torch.uint8))


@torch.library.custom_op("raven_hybrid::sila_decode", mutates_args=("state",))
def sila_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    state: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The launch of `fused_recurrent_sila_decode` (checked, contiguous inputs) as a custom op that updates `state`
    in place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    o, _, _ = fused_recurrent_sila_fwd(
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state, mask, True, None, CHUNK_SIZE, save=False,
        final_state=state,
    )  # fmt: skip
    return o


@sila_decode.register_fake
def _(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, state, mask):
    return q.new_empty(*q.shape[:-1], v.shape[-1])
