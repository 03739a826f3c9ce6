"""SILA: Selective Ignoring Linear Attention (SILA paper, Section 4, equations 2-7; Gated DeltaNet base, Appendix A).

Per key/value head the layer keeps a matrix memory M [d_v, d_k]. q, k, v come from the attention's projections,
a short causal depthwise convolution and SiLU (as in Gated DeltaNet); q and k are then L2-normalised per head
(after the source's own q/k RMSNorm where it has one, e.g. Qwen3). With M_{t-1} k_t the value the memory recalls
for the current key:

    beta_t  = sigmoid(W_b1 M_{t-1} k_t + W_b2 x_t)           input gate, one scalar per head          (eqs. 3, 5)
    gamma_t = phi(W_g1 M_{t-1} k_t + W_g2 x_t)               forget gate, one scalar per head         (eqs. 3, 5)
    phi(x)  = 2 / (e^x + e^-x) for x < 0, 1 for x >= 0      reaches 1: a head can keep its memory     (eq. 4)
    o_t     = M_{t-1} q_t + alpha_t (k_t . q_t) v_t,  alpha_t = sigmoid(W_a x_t)                    (eqs. 2, 6)
    M_t     = gamma_t M_{t-1} - beta_t (M_{t-1} k_t - v_t) k_t^T                                     (eq. 7)

Recall reads the memory before the current token is written, and the current token reaches the output through
the separate alpha term, so a token can be used without being stored (beta_t -> 0): the store/recall decoupling.
Because the gates depend on the memory, the recurrence is sequential in t. Under grouped-query attention the
memory and the gates beta, gamma live on the key/value heads; every query head of a group reads the memory and has
its own alpha. The memory starts at zero.

This file holds the phi gate (`sila_phi`, `sila_log_phi`), the two PyTorch forms of the recurrence
(`sila_recurrent`, the reference and the decode path; `sila_chunked`, the same recurrence reorganised for
training) and the `SILAMixer` module that replaces an attention layer. It must import nothing but torch and its
sibling common.py: it is copied next to every exported model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

SILAState = tuple[torch.Tensor, torch.Tensor]  # (M [B, H_kv, d_v, d_k] float32, conv tail [B, conv_size - 1, C])


@dataclass(frozen=True)
class SILASettings(MixerSettings):
    """Hyper-parameters of a SILA layer; heads, head dim and GQA layout come from the source attention."""

    NAME, LABEL = "sila", "SILA"

    conv_size: int = 4  # kernel of the short causal depthwise convolution on q, k, v; 1 is a per-channel scale only
    feature_map: str = "silu"  # after the convolution, on q, k and v: "silu" (Gated DeltaNet) or "identity"
    output_gate: bool = True  # o * 2 sigmoid(W_g x); W_g starts at zero so the gate starts as the identity
    chunk_size: int = 16  # chunk length of `sila_chunked`, the training path; results do not depend on it
    no_decay_heads: int = 0  # memories per layer whose forget gate is held at 1: only new writes overwrite them
    # one memory per kv head, shared by its query heads (the source's layout), or one per query head: k, v and the
    # write gates widened from the source's, each kv head's copied to its query heads, then trained apart
    state_heads: str = "kv"

    FEATURE_MAPS = ("silu", "identity")
    STATE_HEADS = ("kv", "query")

    def __post_init__(self):
        self.check_positive_ints("conv_size", "chunk_size")
        if not self.is_int(self.no_decay_heads) or self.no_decay_heads < 0:
            self.fail("no_decay_heads", "an integer >= 0 (at most the layer's memories: state_heads)")
        self.check_choice("feature_map", self.FEATURE_MAPS)
        self.check_bools("output_gate")
        self.check_choice("state_heads", self.STATE_HEADS)


def repeat_heads(w: torch.Tensor, heads: int, copies: int) -> torch.Tensor:
    """w [heads * n, ...] with each head's n rows repeated `copies` times in place: [heads * copies * n, ...]."""
    return w.unflatten(0, (heads, -1)).repeat_interleave(copies, dim=0).flatten(0, 1)


def sila_phi(x: torch.Tensor) -> torch.Tensor:
    """The forget-gate nonlinearity phi of eq. 4: 2 / (e^x + e^-x) = sech(x) for x < 0, exactly 1 for x >= 0.

    Computed as 2 e^x / (1 + e^{2x}) on min(x, 0): both exponentials are at most 1, so neither the value nor the
    gradient can overflow (the textbook form has e^-x = inf for x < -89 in float32, and inf / inf = nan in the
    backward pass). At x >= 0 the value is exactly 1 and the gradient exactly 0 (the clamp blocks it for x > 0 and
    sech'(0) = 0), so a head whose pre-activation stays >= 0 keeps its memory with no decay at all.
    """
    x = x.clamp(max=0.0)
    e = x.exp()
    return 2 * e / (1 + e * e)


def sila_log_phi(x: torch.Tensor) -> torch.Tensor:
    """log phi(x) = log 2 + x - softplus(2x) on min(x, 0); exactly 0 for x >= 0 and finite wherever x is."""
    x = x.clamp(max=0.0)
    return torch.where(x < 0, math.log(2.0) + x - F.softplus(2 * x), torch.zeros_like(x))


def _promote(q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state):
    """Inputs in the recurrence dtype (float32, or float64 when given), and the initial memory (zeros if None)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    tensors = tuple(x.to(dtype) for x in (q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma))
    if initial_state is None:
        B, _, H, d_k = k.shape
        initial_state = q.new_zeros(B, H, v.shape[-1], d_k, dtype=dtype)
    return (*tensors, initial_state.to(dtype))


def _current_token_term(q, k, v, alpha):
    """alpha_t (k_t . q_t) v_t: [B, T, H, G, d_v], the recall of the current token, which never enters M_{t-1}."""
    return (alpha * torch.einsum("bthgk,bthk->bthg", q, k)).unsqueeze(-1) * v.unsqueeze(3)


def sila_recurrent(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step SILA recurrence (eqs. 5-7): the reference, and the decode path.

    Args:
        q: [B, T, H, G, d_k] queries (L2-normalised), G query heads per key/value head.
        k: [B, T, H, d_k] keys (L2-normalised); v: [B, T, H, d_v] values.
        alpha: [B, T, H, G] weight of the current token's recall, sigmoid(W_a x_t), per query head.
        beta_x, gamma_x: [B, T, H] the input parts of the gate pre-activations, W_b2 x_t and W_g2 x_t (with biases).
        w_beta, w_gamma: [H, d_v] W_b1 and W_g1, which map the recalled value M_{t-1} k_t to a scalar per head.
        initial_state: M_0, [B, H, d_v, d_k]; zeros when None.
        mask: [B, T] bool, False at padding: there beta = 0 and gamma = 1, so M is left exactly as it was.

    Returns:
        o: [B, T, H, G, d_v] and the final memory [B, H, d_v, d_k], in float32 (float64 for float64 inputs).
    """
    T = q.shape[1]
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, memory = _promote(
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state
    )
    outputs = []
    for t in range(T):
        k_t, v_t = k[:, t], v[:, t]  # [B, H, d]
        recalled = torch.einsum("bhvk,bhk->bhv", memory, k_t)  # M_{t-1} k_t, [B, H, d_v]
        beta = torch.sigmoid((recalled * w_beta).sum(-1) + beta_x[:, t])  # [B, H]
        gamma = sila_phi((recalled * w_gamma).sum(-1) + gamma_x[:, t])  # [B, H]
        if mask is not None:
            m = mask[:, t, None]  # [B, 1]
            beta = beta * m
            gamma = torch.where(m, gamma, torch.ones_like(gamma))
        read = torch.einsum("bhvk,bhgk->bhgv", memory, q[:, t])  # M_{t-1} q_t, [B, H, G, d_v]
        current = (alpha[:, t] * torch.einsum("bhgk,bhk->bhg", q[:, t], k_t)).unsqueeze(-1) * v_t.unsqueeze(2)
        outputs.append(read + current)
        write = (beta.unsqueeze(-1) * (recalled - v_t)).unsqueeze(-1) * k_t.unsqueeze(-2)  # [B, H, d_v, d_k]
        memory = gamma[..., None, None] * memory - write
    return torch.stack(outputs, dim=1), memory


def sila_chunked(
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
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sila_recurrent` (same arguments and results, exactly; no approximation) reorganised for training.

    Write the update as M_t = gamma_t M_{t-1} + u_t k_t^T with u_t = beta_t (v_t - M_{t-1} k_t). Inside a chunk
    of C tokens entering with memory S, the only thing the sequential part needs is the recalled value
    p_t = M_{t-1} k_t, and the memory's products with the chunk's own keys obey

        M_t k_j = gamma_t (M_{t-1} k_j) + u_t (k_t . k_j)          for the later keys j > t,

    starting from S k_j (one matmul per chunk). So the loop over t carries a [C - t, d_v] block instead of the
    [d_v, d_k] memory: a few small batched ops per token, and far less saved for backward than storing M at every
    step. Everything that does not depend on the memory (the current-token term, the key Gram matrix, q . k) is
    computed outside the loop. Once the chunk's u_t and gammas are known, its reads and its final memory are
    parallel, with G_t = sum_{r <= t} log gamma_r (only differences over s < t are exponentiated, so <= 0):

        M_{t-1} q_t = exp(G_{t-1}) S q_t + sum_{s < t} exp(G_{t-1} - G_s) (k_s . q_t) u_s
        M_C         = exp(G_C) S + sum_s exp(G_C - G_s) u_s k_s^T
    """
    B, T, H, G, d_k = q.shape
    d_v = v.shape[-1]
    C = chunk_size
    q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, memory = _promote(
        q, k, v, alpha, beta_x, gamma_x, w_beta, w_gamma, initial_state
    )
    current = _current_token_term(q, k, v, alpha)  # [B, T, H, G, d_v]
    live = q.new_ones(B, T) if mask is None else mask.to(q.dtype)
    pad = (-T) % C
    if pad:  # padded steps are masked: they neither write nor decay, so the final memory is unaffected
        padded = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, beta_x, gamma_x, live))
        q, k, v, beta_x, gamma_x, live = padded
    N = (T + pad) // C
    # chunk-major, head before time: [N, B, H, C, ...]
    q = q.view(B, N, C, H, G, d_k).permute(1, 0, 3, 2, 4, 5)
    k = k.view(B, N, C, H, d_k).permute(1, 0, 3, 2, 4)
    v = v.view(B, N, C, H, d_v).permute(1, 0, 3, 2, 4)
    gate_x = torch.stack([beta_x, gamma_x], dim=-1).view(B, N, C, H, 2).permute(1, 0, 3, 2, 4)  # [N, B, H, C, 2]
    live = live.view(B, N, 1, C).transpose(0, 1)  # [N, B, 1, C]
    w_gates = torch.stack([w_beta, w_gamma], dim=1)  # [H, 2, d_v]

    gram = k @ k.transpose(-1, -2)  # [N, B, H, C, C], k_s . k_j
    qk = torch.einsum("nbhtgk,nbhsk->nbhtgs", q, k)  # [N, B, H, C, G, C]
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # s < t
    reads = []
    for n in range(N):
        later = k[n] @ memory.transpose(-1, -2)  # [B, H, C, d_v]: M_{t-1} k_j for j >= t, here t = 0
        us, gamma_pre = [], []
        for t in range(C):
            recalled = later[:, :, 0]  # M_{t-1} k_t, [B, H, d_v]
            pre = torch.einsum("bhv,hcv->bhc", recalled, w_gates) + gate_x[n, :, :, t]  # [B, H, 2]
            m = live[n, :, :, t]  # [B, 1]
            beta = torch.sigmoid(pre[..., 0]) * m
            gamma = torch.where(m > 0, sila_phi(pre[..., 1]), torch.ones_like(m))
            u = beta.unsqueeze(-1) * (v[n, :, :, t] - recalled)  # [B, H, d_v]
            later = gamma[..., None, None] * later[:, :, 1:] + u.unsqueeze(2) * gram[n, :, :, t, t + 1 :, None]
            us.append(u)
            gamma_pre.append(pre[..., 1])
        u = torch.stack(us, dim=2)  # [B, H, C, d_v]
        log_gamma = torch.where(live[n] > 0, sila_log_phi(torch.stack(gamma_pre, dim=-1)), 0.0)  # [B, H, C]
        # G_t in float64: one scalar per head and step, and differences of large cumulative sums lose |G| * eps
        g_cum = log_gamma.double().cumsum(-1)  # G_t
        g_prev = F.pad(g_cum[..., :-1], (1, 0))  # G_{t-1}, 0 at the chunk start
        diff = (g_prev.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~strict, float("-inf"))
        decay = diff.exp().to(u.dtype)  # [B, H, Ct, Cs]
        read = torch.einsum("bhtgk,bhvk->bhtgv", q[n], memory) * g_prev.exp().to(u.dtype)[..., None, None]
        read = read + torch.einsum("bhtgs,bhsv->bhtgv", qk[n] * decay.unsqueeze(3), u)
        reads.append(read)  # [B, H, C, G, d_v]
        to_end = (g_cum[..., -1:] - g_cum).exp().to(u.dtype)  # [B, H, C]
        written = torch.einsum("bhsv,bhsk->bhvk", u * to_end.unsqueeze(-1), k[n])
        memory = g_cum[..., -1, None, None].exp().to(u.dtype) * memory + written
    o = torch.stack(reads, dim=0).permute(1, 0, 3, 2, 4, 5).reshape(B, N * C, H, G, d_v)[:, :T]
    return o + current, memory


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim in float32 (Gated DeltaNet's l2norm); 0 stays 0."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


class SILAMixer(Mixer):
    """Drop-in replacement for a decoder layer's self-attention, with SILA's selectively written memory.

    q/k/v/o (and q_norm/k_norm where the source has them) keep the attention's names and shapes, so the converted
    layer starts from the teacher's weights. Called like the attention it replaces; returns (output [B, T, hidden],
    None). The decode state is (M [B, H_kv, d_v, d_k] float32, conv tail [B, conv_size - 1, (H + 2 H_kv) d]), where
    H_kv counts the layer's memories: the source's kv heads, or its H query heads with `state_heads: query`.
    """

    input_weights = ("beta_weight", "gamma_weight", "alpha_weight")  # the gates' input parts (gate_inputs)

    INIT_BETA = 0.25  # beta at initialisation, for every token
    INIT_GAMMA = 0.999  # gamma at initialisation: just below 1, see reset_mixer_parameters
    INIT_ALPHA = 0.9  # alpha at initialisation
    NO_DECAY_BIAS = 1.0  # the forget-gate bias of a no-decay head: any value >= 0 holds phi at exactly 1

    def __init__(self, config, layer_idx: int, settings: SILASettings, source_has_qk_norm: bool = False):
        per_query_head = settings.state_heads == "query"  # k and v then as wide as q
        super().__init__(config, layer_idx, settings, kv_heads=config.num_attention_heads if per_query_head else None)
        hidden = config.hidden_size
        if per_query_head:
            self.register_load_state_dict_pre_hook(SILAMixer.widen_source_weights)
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.use_qk_norm = self.source_has_qk_norm = source_has_qk_norm
        if settings.no_decay_heads > Hkv:
            raise ValueError(
                f"sila.no_decay_heads = {settings.no_decay_heads!r} is not allowed; expected an integer in [0, {Hkv}] "
                f"(the layer's memories: num_key_value_heads={self.source_kv_heads} of the source, "
                f"state_heads={settings.state_heads!r})"
            )
        if self.use_qk_norm:  # the teacher's norms; before the L2 normalisation they act as per-dim key/query scales
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.conv_weight = nn.Parameter(torch.empty((H + 2 * Hkv) * d, settings.conv_size))  # channels q, k, v
        self.beta_state_weight = nn.Parameter(torch.empty(Hkv, d))  # W_b1
        self.beta_weight = nn.Parameter(torch.empty(Hkv, hidden))  # W_b2
        self.beta_bias = nn.Parameter(torch.empty(Hkv))
        self.gamma_state_weight = nn.Parameter(torch.empty(Hkv, d))  # W_g1
        self.gamma_weight = nn.Parameter(torch.empty(Hkv, hidden))  # W_g2
        self.gamma_bias = nn.Parameter(torch.empty(Hkv))
        self.alpha_weight = nn.Parameter(torch.empty(H, hidden))  # W_a
        self.alpha_bias = nn.Parameter(torch.empty(H))
        self.reset_mixer_parameters()

    @torch.no_grad()
    def reset_mixer_parameters(self):
        """Initialise the parameters attention does not have, so the converted layer trains stably from step 0.

        - Convolution: identity (last tap 1, earlier taps 0), so q, k, v start as the teacher's projections (then
          SiLU and L2 normalisation); the taps on earlier tokens grow from 0 as training finds them useful.
        - W_b1, W_g1 = 0 (the memory-dependent parts) and W_b2, W_g2, W_a = 0: every gate starts as a constant, the
          same for every token, so the untrained gates inject no noise; the memory-dependent parts still get
          gradients (proportional to M_{t-1} k_t) from the first steps.
        - beta: bias logit(0.25) = -log 3. A moderate write strength: each key direction of M holds a blend of its
          last few writes (a 1 - 0.75^n share after n), the memory read stays on the scale of one value, like the
          teacher's convex mix of values, and sigmoid is at 75% of its steepest slope, so beta learns quickly both
          ways (towards ignoring a token, and towards storing it).
        - gamma: bias -arccosh(1 / 0.999) = -0.0447, so gamma = phi(bias) = 0.999 (memory half-life ~700 tokens).
          Not exactly 1: phi is flat at 1 for x >= 0, so with W_g1 = W_g2 = 0 a bias >= 0 would make every gradient
          reaching W_g1, W_g2 and the bias exactly 0, and the forget gate could never learn. Just below 0 the
          slope is phi'(-0.0447) = 0.045 > 0 while decay is negligible next to the teacher's full context.
          The first `no_decay_heads` kv heads take that flat part on purpose: bias NO_DECAY_BIAS >= 0, so their
          gamma is exactly 1 and, with W_g1 = W_g2 = 0, no gradient ever moves it (nor those rows of W_g1, W_g2).
          They forget only by the delta rule's overwriting, so what they store can outlast a sliding window
          (the learned gates forget within ~3K tokens in most layers: docs/lab/2026-11-28-ablations-11-loss-kernels.md).
        - alpha: bias logit(0.9) = log 9. The current token enters the output at nearly full weight, as in the
          teacher's heads where each token attends to itself, while the slope 0.09 leaves alpha trainable.
        - Output gate: W_g = 0, and the gate is 2 sigmoid(W_g x), so it starts as the identity.
        """
        beta_bias = math.log(self.INIT_BETA / (1 - self.INIT_BETA))
        gamma_bias = -math.acosh(1 / self.INIT_GAMMA)
        alpha_bias = math.log(self.INIT_ALPHA / (1 - self.INIT_ALPHA))
        no_decay = torch.arange(self.settings.no_decay_heads, device=self.gamma_bias.device)

        def identity_conv(p):
            p.zero_()
            p[:, -1] = 1.0

        inits = {
            "conv_weight": identity_conv,
            "beta_state_weight": lambda p: p.zero_(),
            "beta_weight": lambda p: p.zero_(),
            "beta_bias": lambda p: p.fill_(beta_bias),
            "gamma_state_weight": lambda p: p.zero_(),
            "gamma_weight": lambda p: p.zero_(),
            "gamma_bias": lambda p: p.fill_(gamma_bias).index_fill_(0, no_decay, self.NO_DECAY_BIAS),
            "alpha_weight": lambda p: p.zero_(),
            "alpha_bias": lambda p: p.fill_(alpha_bias),
            "gate_weight": lambda p: p.zero_(),
        }
        init_fresh_parameters(self, inits)

    # the parameters with a row (or a block of head_dim rows) per memory, widened by `widen_source_weights`
    PER_MEMORY = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "beta_state_weight",
                  "beta_weight", "beta_bias", "gamma_state_weight", "gamma_weight", "gamma_bias")  # fmt: skip

    def widen_source_weights(self, state_dict, prefix, *args):
        """Before loading (state_heads "query"): the tensors of a layer with a memory per kv head (the source
        attention's k/v projections, or a SILA layer's with state_heads "kv") widened to a memory per query head,
        each kv head's rows copied to the query heads that read it (query head h reads kv head h // G, as GQA's
        repeat_kv). The widened layer then computes what the narrow one does until training sets the copies apart.
        Tensors already as wide as this layer's are left alone."""
        H, Hs, d = self.num_heads, self.source_kv_heads, self.head_dim
        G = H // Hs
        if G == 1:
            return
        for name in self.PER_MEMORY:
            module, _, attr = name.rpartition(".")
            own = getattr(self.get_submodule(module), attr)  # this layer's parameter (None: a bias it has not)
            if own is not None and prefix + name in state_dict and state_dict[prefix + name].shape[0] * G == len(own):
                state_dict[prefix + name] = repeat_heads(state_dict[prefix + name], Hs, G)
        key = prefix + "conv_weight"  # channels q [H d], k [H_kv d], v [H_kv d]
        if key in state_dict and state_dict[key].shape[0] == (H + 2 * Hs) * d != self.conv_weight.shape[0]:
            q, k, v = state_dict[key].split([H * d, Hs * d, Hs * d])
            state_dict[key] = torch.cat([q, repeat_heads(k, Hs, G), repeat_heads(v, Hs, G)])

    def state_numel(self) -> int:
        """Elements of the decoding state per sequence: the memory [H_kv, d, d] and the convolution tail."""
        channels = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return self.num_kv_heads * self.head_dim**2 + (self.settings.conv_size - 1) * channels

    def fresh_parameter_names(self) -> set[str]:
        """Parameters a converted layer cannot take from the source attention."""
        names = {
            "conv_weight",
            "beta_state_weight",
            "beta_weight",
            "beta_bias",
            "gamma_state_weight",
            "gamma_weight",
            "gamma_bias",
            "alpha_weight",
            "alpha_bias",
        }
        if self.settings.output_gate:
            names.add("gate_weight")
        return names

    def short_conv(self, x: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise convolution of x [B, T, C] after the cached tail [B, conv_size - 1, C] (zeros if None).

        Returns the convolved x and the new tail: the last conv_size - 1 inputs, prompt or earlier tail included.
        """
        B, T, Cn = x.shape
        K = self.settings.conv_size
        if tail is None:
            tail = x.new_zeros(B, K - 1, Cn)
        full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, K - 1 + T, C]
        if T == 1:  # a decode step: the K taps as one multiply-add, which a compiled step fuses (no convolution launch)
            out = (full.float() * self.conv_weight.t().float()).sum(1, keepdim=True).to(x.dtype)  # [B, 1, C]
            return out, full[:, 1:].clone()
        out = F.conv1d(full.transpose(1, 2), self.conv_weight.to(x.dtype).unsqueeze(1), groups=Cn)
        return out.transpose(1, 2), full[:, T:].clone()

    def short_conv_packed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`short_conv` of packed documents x [B, T, C], positions [B, T] each token's position in its document:
        every document starts from a zero tail, so no input reaches across a boundary."""
        T, K = x.shape[1], self.settings.conv_size
        offset = positions.unsqueeze(-1)  # [B, T, 1] tokens since the document start
        weight = self.conv_weight.to(x.dtype)  # [C, K]: tap K - 1 - j multiplies x_{t - j}
        out = x * weight[:, K - 1]
        for j in range(1, min(K, T)):
            shifted = F.pad(x, (0, 0, j, 0))[:, :T]  # x_{t - j}
            out = out + shifted * weight[:, K - 1 - j] * (offset >= j).to(x.dtype)
        return out

    def gate_products(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gates' products of x in x's dtype, before their biases: [B, T, H_kv] twice (beta, gamma), [B, T, H]."""
        # a product per gate, of the weight itself: a compiled decode step joins the three with q/k/v into one
        # (shared_input_weights, decode_fusion.py), where a concatenation here would be a copy every step
        return tuple(input_product(x, w) for w in (self.beta_weight, self.gamma_weight, self.alpha_weight))

    def gate_inputs(self, x: torch.Tensor):
        """The input parts of the gates, in float32 at least: beta_x, gamma_x [B, T, H_kv] and alpha [B, T, H]."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # gamma ~ 0.999 needs more than bf16's 8 bits
        products = self.gate_products(x)
        beta_x, gamma_x, alpha = (p.to(dtype) + b.to(dtype) for p, b in zip(products, self.gate_biases()))
        return beta_x, gamma_x, torch.sigmoid(alpha)

    def gate_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The biases of `gate_products`, in the same order: [H_kv], [H_kv], [H]."""
        return self.beta_bias, self.gamma_bias, self.alpha_bias

    def recurrence_inputs(
        self,
        x: torch.Tensor,
        tail: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ):
        """What the recurrence takes from hidden states x [B, T, hidden]: ((q [B, T, H_kv, G, d], k, v
        [B, T, H_kv, d], alpha [B, T, H_kv, G], beta_x, gamma_x [B, T, H_kv]), the new convolution tail) after the
        cached `tail` (None: a fresh sequence). Packed documents come with `positions` [B, T], each token's position
        in its document: each starts from zeros, and the tail returned is None. With the state weights W_b1, W_g1
        they are the arguments of `sila_recurrent` / `sila_chunked`."""
        B, T, _ = x.shape
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_qk_norm:  # the teacher's q/k norms act on its projections, so they come first
            q = self.q_norm(q.view(B, T, H, d)).reshape(B, T, H * d)
            k = self.k_norm(k.view(B, T, Hkv, d)).reshape(B, T, Hkv * d)
        qkv = torch.cat([q, k, v], dim=-1)  # [B, T, (H + 2 H_kv) d]
        if padding_mask is not None:  # padding must not reach the convolution windows of real tokens
            qkv = qkv * padding_mask.unsqueeze(-1).to(qkv.dtype)
        if positions is None:
            qkv, tail = self.short_conv(qkv, tail)
        else:
            qkv, tail = self.short_conv_packed(qkv, positions), None
        if self.settings.feature_map == "silu":
            qkv = F.silu(qkv)
        q, k, v = qkv.split([H * d, Hkv * d, Hkv * d], dim=-1)
        q = q.view(B, T, Hkv, H // Hkv, d)  # [B, T, H_kv, G, d]
        k = k.view(B, T, Hkv, d)  # [B, T, H_kv, d]
        v = v.view(B, T, Hkv, d)
        q, k = l2_normalize(q), l2_normalize(k)
        beta_x, gamma_x, alpha = self.gate_inputs(x)
        alpha = alpha.view(B, T, Hkv, H // Hkv)  # [B, T, H_kv, G]
        return (q, k, v, alpha, beta_x, gamma_x), tail

    def fused_decode_step(self, kernels, x: torch.Tensor, memory, tail, padding_mask) -> tuple[torch.Tensor, None]:
        """A decode step of x [B, 1, hidden] on `fused_recurrent_sila_decode`: the projections here, what
        `recurrence_inputs`, the recurrence and the output gate do after them in one kernel that updates memory and
        tail in place, then o_proj. Returns the layer's output ([B, 1, hidden], None), as `read_out`."""
        norms = (self.q_norm.weight, self.k_norm.weight) if self.use_qk_norm else None
        gate = self.gate_weight if self.settings.output_gate else None
        o = kernels.fused_recurrent_sila_decode(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), *self.gate_products(x), self.gate_biases(),
            self.conv_weight, tail, self.beta_state_weight, self.gamma_state_weight, memory, qk_norms=norms,
            norm_eps=self.q_norm.eps if self.use_qk_norm else 1e-6, feature_map=self.settings.feature_map,
            mask=None if padding_mask is None else padding_mask.bool(),
            out_gate=None if gate is None else input_product(x, gate),
        )  # fmt: skip
        return self.o_proj(o.to(x.dtype).reshape(*x.shape[:2], -1)), None

    def mix(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        kernels = kernel_module(MIXER.kernels, hidden_states)
        if cu_seqlens is not None and kernels is None:  # packed documents, each from an empty state
            return self.forward_packed(hidden_states, cu_seqlens)
        x = hidden_states  # [B, T, hidden]
        B, T, _ = x.shape
        state = self.load_state(cache)
        memory, tail = state if state is not None else (None, None)
        # packed documents: positions [B, T], not cu_seqlens, whose length changes with the batch, go to the glue
        positions = None if cu_seqlens is None else document_positions(cu_seqlens, B * T)[1].view(B, T)
        if one_kernel_step(kernels, x, cu_seqlens, (memory,), (tail,)):
            out = self.fused_decode_step(kernels, x, memory, tail, padding_mask)
            self.save_state(cache, (memory, tail), num_tokens=T)
            return out
        inputs, tail = self.glue(self.recurrence_inputs)(x, tail, padding_mask, positions)
        mask = padding_mask.bool() if padding_mask is not None else None
        args = (*inputs, self.beta_state_weight, self.gamma_state_weight, memory, mask)
        if cu_seqlens is not None:  # packed documents: one sequence of B * T tokens cut at cu_seqlens
            packed = [t.flatten(0, 1).unsqueeze(0) for t in args[:6]]
            o, _ = kernels.fused_recurrent_sila(*packed, *args[6:8], cu_seqlens=cu_seqlens)
            return self.glue(self.read_out)(o, x)
        if kernels is not None:  # Triton: one fused recurrent kernel for training, prefill and decode steps
            o, memory = kernels.fused_recurrent_sila(*args, output_final_state=True)
        elif T == 1 and memory is not None:
            o, memory = sila_recurrent(*args)
        else:
            o, memory = sila_chunked(*args, chunk_size=self.settings.chunk_size)
        self.save_state(cache, (memory, tail), num_tokens=T)
        return self.glue(self.read_out)(o, x)


MIXER = MixerSpec(
    settings=SILASettings,
    layer=SILAMixer,
    state="[d, d] memory, and the short convolution's last conv_size - 1 inputs",
    kernels="raven_kernels.sila",
    references=(sila_recurrent, sila_chunked),
    pictures="raven_convert.evaluate.pictures:sila_pictures",
    graph_safe=True,  # the kernels' packed layout is bounded by shapes (kernels/sila/utils.py varlen_layout)
)
