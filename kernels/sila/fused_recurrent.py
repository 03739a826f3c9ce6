"""`fused_recurrent_sila`: SILA's recurrence (raven_layers/sila.py, eqs. 5-7) in Triton, forward and backward;
`fused_recurrent_sila_decode`: a generation step from a layer's projections in one kernel, its cached state
updated in place."""

from __future__ import annotations

import torch

from ..decode_checks import check_row_views, check_shapes
from ..launch import LaunchSetting, dependent_launch
from . import utils
from .fused_recurrent_bwd import fused_recurrent_sila_bwd
from .fused_recurrent_fwd import fused_recurrent_sila_fwd, sila_fwd_kernel_decode

CHUNK_SIZE = 64  # steps between saved memories; the chunk-parallel kernels work on [CHUNK, d] tiles
DECODE_WARPS: LaunchSetting[int | None] = LaunchSetting(None)  # a decode step's warps where set (else step_warps)


def decode_warps(warps: int | None):
    """Every `fused_recurrent_sila_decode` launched within takes `warps` a program (scripts/bench/sweep_sila_decode.py
    times the choices; not thread-safe)."""
    return DECODE_WARPS.use(warps)


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
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    alpha_x: torch.Tensor,
    gate_biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_weight: torch.Tensor,
    tail: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    state: torch.Tensor,
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_eps: float = 1e-6,
    feature_map: str = "silu",
    mask: torch.Tensor | None = None,
    out_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of a SILA layer from its projections, in one kernel that updates the layer's cached state
    (the memory and the convolution tail) in place: what `raven_layers.sila.SILAMixer.recurrence_inputs` and then
    `fused_recurrent_sila` compute at T == 1, with no copy of the state and no launch for the convolution, the
    feature map, the norms or the gates. No gradients.

    Args:
        q: [B, 1, H * G * d], k and v: [B, 1, H * d]: the layer's projections of the new token (rows may be strided
            views of one product, the last dim contiguous); H key/value heads of G query heads, head dim d.
        beta_x, gamma_x: [B, 1, H], alpha_x: [B, 1, H * G]: the gates' input products, before their biases
            `gate_biases` ([H], [H], [H * G]).
        conv_weight: [C, conv_size] over the channels C = (G + 2) H d (q, k, v); tail: [B, conv_size - 1, C], the
            last inputs of the convolution (updated in place).
        w_beta, w_gamma: [H, d]; state: [B, H, d, d] float32, the memory M (updated in place).
        qk_norms: the RMSNorm weights [d] of q and k (the teacher's q/k norms), applied first, with `norm_eps`.
        feature_map: "silu" or "identity", after the convolution.
        mask: [B, 1] bool, False where the token is padding (it enters neither the state nor the tail).
        out_gate: [B, 1, H * G * d], the output gate's product: o is multiplied by 2 sigmoid(out_gate).

    Returns:
        o: [B, 1, H, G, d] in q's dtype.
    """
    B, H, d = state.shape[0], state.shape[1], state.shape[-1]
    G = q.shape[-1] // (H * d) if H * d else 0
    C, taps = (G + 2) * H * d, conv_weight.shape[-1]
    expected = {
        "q": (q, (B, 1, H * G * d)),
        "k": (k, (B, 1, H * d)),
        "v": (v, (B, 1, H * d)),
        "beta_x": (beta_x, (B, 1, H)),
        "gamma_x": (gamma_x, (B, 1, H)),
        "alpha_x": (alpha_x, (B, 1, H * G)),
        "conv_weight": (conv_weight, (C, taps)),
        "tail": (tail, (B, taps - 1, C)),
        "w_beta": (w_beta, (H, d)),
        "w_gamma": (w_gamma, (H, d)),
        "state": (state, (B, H, d, d)),
    }
    if out_gate is not None:
        expected["out_gate"] = (out_gate, (B, 1, H * G * d))
    check_shapes(expected, f"state {tuple(state.shape)} and q")
    products = {"q": q, "k": k, "v": v, "beta_x": beta_x, "gamma_x": gamma_x, "alpha_x": alpha_x, "out_gate": out_gate}
    check_row_views(products)
    for name, x in (("state", state), ("tail", tail)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is updated in place")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be float32 (it is updated in place), got {state.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"the head dim must be a power of two >= 16 (the memory is one register tile), got {d}")
    if feature_map not in ("silu", "identity"):
        raise ValueError(f"feature_map must be 'silu' or 'identity', got {feature_map!r}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, 1)):
        raise ValueError(f"mask must be a bool tensor [B, 1] = {(B, 1)}, got {mask.dtype} {tuple(mask.shape)}")
    tensors = (*(x for x in products.values() if x is not None), *gate_biases, conv_weight, w_beta, w_gamma,
               *(qk_norms or ()))  # fmt: skip
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*tensors, state, tail)):
        raise ValueError("fused_recurrent_sila_decode computes no gradients; use fused_recurrent_sila to train")
    q_norm, k_norm = qk_norms if qk_norms is not None else (None, None)
    return sila_decode(
        q, k, v, beta_x, gamma_x, alpha_x, out_gate, *(b.contiguous() for b in gate_biases), conv_weight.contiguous(),
        tail, w_beta.contiguous(), w_gamma.contiguous(), state, q_norm, k_norm, float(norm_eps),
        feature_map == "silu", None if mask is None else mask.contiguous().view(torch.uint8),
    )  # fmt: skip


@torch.library.custom_op("raven_hybrid::sila_decode", mutates_args=("tail", "state"))
def sila_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta_x: torch.Tensor,
    gamma_x: torch.Tensor,
    alpha_x: torch.Tensor,
    out_gate: torch.Tensor | None,
    beta_bias: torch.Tensor,
    gamma_bias: torch.Tensor,
    alpha_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    tail: torch.Tensor,
    w_beta: torch.Tensor,
    w_gamma: torch.Tensor,
    state: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    norm_eps: float,
    silu: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The launch of `fused_recurrent_sila_decode` (checked inputs) as a custom op that updates `tail` and `state` in
    place: torch.compile keeps it whole, and Inductor fuses the work around it."""
    B, H, d = state.shape[0], state.shape[1], state.shape[-1]
    G = q.shape[-1] // (H * d)
    o = utils.new_output((B, 1, H, G, d), q)
    if B * H:
        sila_fwd_kernel_decode[(B, H)](
            q, k, v, beta_x, gamma_x, alpha_x, out_gate, q.stride(0), k.stride(0), v.stride(0), beta_x.stride(0),
            gamma_x.stride(0), alpha_x.stride(0), 0 if out_gate is None else out_gate.stride(0), beta_bias,
            gamma_bias, alpha_bias, conv_weight, tail, q_norm, k_norm, norm_eps, w_beta, w_gamma, state, mask, o,
            H=H, G=G, K=d, KB=utils.sweep_block(d), TAPS=conv_weight.shape[-1], SILU=silu,
            HAS_QK_NORM=q_norm is not None, HAS_MASK=mask is not None, GATED=out_gate is not None,
            num_warps=DECODE_WARPS.value or utils.step_warps(d, d), **dependent_launch(q.device),
        )  # fmt: skip
    return o


@sila_decode.register_fake
def _(q, k, v, beta_x, gamma_x, alpha_x, out_gate, beta_bias, gamma_bias, alpha_bias, conv_weight, tail, w_beta,
      w_gamma, state, q_norm, k_norm, norm_eps, silu, mask):  # fmt: skip
    B, H, d = state.shape[0], state.shape[1], state.shape[-1]
    return q.new_empty(B, 1, H, q.shape[-1] // (H * d), d)
