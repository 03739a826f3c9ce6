"""Raven: routing slot memory (Raven paper, Section 4 and Appendix A.4-A.6).

Per key/value head the layer keeps two slot memories, S^k and S^v, each [M, d]. A sigmoid router picks the
top-K slots for every token and the selected slots decay and are overwritten in proportion to the routing weight:

    m_t = sigmoid(W x_t + n_t)                     n_t ~ Gumbel(0, 1) in training only
    g_t = KeepTop_K(m_t),  r_t = g_t / (alpha * sum(g_t))
    a_t = -softplus(w . x_t + b) * exp(Delta)      one scalar per head (Mamba-2 style)
    S^k_t = exp(a_t r_t) * S^k_{t-1} + (1 - exp(a_t r_t)) k_t^T        (the same for S^v with v_t)
    o_t = (S^v_t)^T softmax(scale * S^k_t q_t)

Unselected slots (r_t[i] = 0) are left exactly untouched. States start at zero with no empty-slot mask, as in the
paper. Under grouped-query attention the state lives on the key/value heads and every query head of a group reads
it, exactly as the group would share a KV cache.

This file holds the two PyTorch forms of the recurrence (`raven_recurrent`, the reference and the decode path;
`raven_chunked`, the training path) and the `RavenMixer` module that replaces an attention layer. It must import
nothing but torch and its sibling common.py: it is copied next to every exported model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .backend import kernel_module
from .common import (
    ROUTER_INITS,
    Mixer,
    MixerSettings,
    MixerSpec,
    RMSNorm,
    init_fresh_parameters,
    input_product,
    one_kernel_step,
)

RavenState = tuple[torch.Tensor, torch.Tensor]  # (S^k, S^v), each [B, H_kv, M, d], float32


@dataclass(frozen=True)
class RavenSettings(MixerSettings):
    """Hyper-parameters of a Raven layer; heads, head dim and GQA layout come from the source attention."""

    NAME, LABEL = "raven", "Raven"

    num_slots: int = 256  # M, paper default
    top_k: int = 32  # K slots written per token, paper default
    alpha: float = 1.0  # router normaliser: r_t sums to 1 / alpha (paper: 1 at 400M, 4 at 800M)
    gumbel: bool = True  # Gumbel noise on router logits during training (paper Section 6.2.2)
    router_init: str = "random"  # or "centred": rows fitted to the layer's inputs before align (Mixer.calibrate)
    qk_norm: bool | None = None  # RMSNorm on q and k; None follows the source attention (kept where it has them)
    feature_map: str = "identity"  # "identity" keeps the teacher's q/k geometry; "silu" is the paper's block
    output_gate: bool = True  # o * 2 sigmoid(W_g x); W_g starts at zero so the gate starts as the identity
    chunk_size: int = 16  # chunk length of the parallel PyTorch form
    checkpoint_level: int = 2  # Triton backward: 2 recomputes gates and chunk states, 1 keeps the states, 0 both

    FEATURE_MAPS = ("identity", "silu")

    def __post_init__(self):
        self.check_positive_ints("num_slots", "top_k", "chunk_size")
        if self.top_k > self.num_slots:
            self.fail("top_k", f"an integer in [1, num_slots={self.num_slots}]")
        if not self.is_number(self.alpha) or not self.alpha > 0:
            self.fail("alpha", "a number > 0")
        self.check_bools("gumbel", "output_gate")
        if self.qk_norm is not None and not isinstance(self.qk_norm, bool):
            self.fail("qk_norm", "true, false or null (follow the source attention)")
        self.check_choice("feature_map", self.FEATURE_MAPS)
        self.check_choice("router_init", ROUTER_INITS, {"centered": "centred"})
        if not self.is_int(self.checkpoint_level) or self.checkpoint_level not in (0, 1, 2):
            self.fail("checkpoint_level", "0 (fastest backward, most memory), 1 or 2 (least memory)")


def _promote(q, k, v, log_f, initial_state, num_slots):
    """Inputs in the recurrence dtype (float32, or float64 when given), and the initial state (zeros if None)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, log_f = (x.to(dtype) for x in (q, k, v, log_f))
    if initial_state is None:
        B, _, H, d = k.shape
        initial_state = (q.new_zeros(B, H, num_slots, d), q.new_zeros(B, H, num_slots, d))
    return q, k, v, log_f, tuple(s.to(dtype) for s in initial_state)


def raven_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    scale: float,
    initial_state: RavenState | None = None,
) -> tuple[torch.Tensor, RavenState]:
    """Step-by-step Raven recurrence: the reference, and the decode path.

    Args:
        q: [B, T, H, G, d] queries, G query heads per key/value head.
        k, v: [B, T, H, d] keys and values.
        log_f: [B, T, H, M] log of the per-slot retention a_t * r_t (<= 0; 0 where a slot is not written).
        scale: logit scale of the slot softmax.
        initial_state: (S^k, S^v), each [B, H, M, d]; zeros when None.

    Returns:
        o: [B, T, H, G, d] and the final state, in float32 (float64 for float64 inputs).
    """
    B, T, H, G, d = q.shape
    M = log_f.shape[-1]
    q, k, v, log_f, (s_k, s_v) = _promote(q, k, v, log_f, initial_state, M)
    outputs = []
    for t in range(T):
        f = log_f[:, t].exp().unsqueeze(-1)  # [B, H, M, 1]
        w = -torch.expm1(log_f[:, t]).unsqueeze(-1)  # 1 - f, exact for tiny writes
        s_k = f * s_k + w * k[:, t, :, None, :]
        s_v = f * s_v + w * v[:, t, :, None, :]
        p = torch.einsum("bhgd,bhmd->bhgm", q[:, t], s_k).mul(scale).softmax(-1)  # [B, H, G, M]
        outputs.append(torch.einsum("bhgm,bhmd->bhgd", p, s_v))
    o = torch.stack(outputs, dim=1) if outputs else q.new_zeros(B, 0, H, G, d)  # an empty sequence: no output
    return o, (s_k, s_v)


def raven_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    scale: float,
    initial_state: RavenState | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, RavenState]:
    """Chunked parallel form of `raven_recurrent` (same arguments and results): the training path on CPU.

    Within a chunk of C tokens, with G_t the cumulative log-retention since the chunk start, the weight of token s
    in slot i as seen from token t >= s is D[t, s, i] = exp(G_t[i] - G_s[i]) (1 - f_s[i]). Both passes of the
    paper's two-pass GLA form (Appendix A.5) share D: the key pass gives the slot logits, the value pass reads the
    value slots with the softmax of those logits. Only differences G_t - G_s with s <= t are exponentiated, so no
    term can overflow however strong the decay. The states entering each chunk come from a scan over chunks.
    """
    B, T, H, G, d = q.shape
    M = log_f.shape[-1]
    C = chunk_size
    q, k, v, log_f, (s_k, s_v) = _promote(q, k, v, log_f, initial_state, M)
    pad = (-T) % C
    if pad:  # padded steps write nothing (log_f = 0), so the final state is unaffected
        q, k, v, log_f = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, log_f))
    N = (T + pad) // C
    q = q.view(B, N, C, H, G, d)
    k = k.view(B, N, C, H, d)
    v = v.view(B, N, C, H, d)
    log_f = log_f.view(B, N, C, H, M)

    g_cum = log_f.cumsum(dim=2)  # [B, N, C, H, M]
    w = -torch.expm1(log_f)  # [B, N, C, H, M]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = g_cum.unsqueeze(3) - g_cum.unsqueeze(2)  # [B, N, Ct, Cs, H, M]
    decay = diff.masked_fill(~causal[:, :, None, None], float("-inf")).exp() * w.unsqueeze(2)

    # Chunk-local contribution to the end-of-chunk state, then a scan for the state entering each chunk.
    to_end = (g_cum[:, :, -1:] - g_cum).exp() * w  # [B, N, C, H, M]
    u_k = torch.einsum("bnshm,bnshd->bnhmd", to_end, k)
    u_v = torch.einsum("bnshm,bnshd->bnhmd", to_end, v)
    chunk_decay = g_cum[:, :, -1].exp().unsqueeze(-1)  # [B, N, H, M, 1]
    enter_k, enter_v = [], []
    for n in range(N):
        enter_k.append(s_k)
        enter_v.append(s_v)
        s_k = chunk_decay[:, n] * s_k + u_k[:, n]
        s_v = chunk_decay[:, n] * s_v + u_v[:, n]
    enter_k = torch.stack(enter_k, dim=1)  # [B, N, H, M, d]
    enter_v = torch.stack(enter_v, dim=1)

    # Key pass: slot logits = carried-in state + this chunk's writes.
    from_start = g_cum.exp().unsqueeze(4)  # [B, N, C, H, 1, M]
    qk = torch.einsum("bnthgd,bnshd->bnthgs", q, k)  # [B, N, Ct, H, G, Cs]
    logits = torch.einsum("bnthgs,bntshm->bnthgm", qk, decay)
    logits = logits + from_start * torch.einsum("bnthgd,bnhmd->bnthgm", q, enter_k)
    p = (logits * scale).softmax(-1)  # [B, N, C, H, G, M]

    # Value pass: read the value slots with the same weights.
    o = torch.einsum("bnthgm,bnhmd->bnthgd", p * from_start, enter_v)
    o = o + torch.einsum("bnthgs,bnshd->bnthgd", torch.einsum("bnthgm,bntshm->bnthgs", p, decay), v)
    o = o.reshape(B, N * C, H, G, d)[:, :T]
    return o, (s_k, s_v)


class RavenMixer(Mixer):
    """Drop-in replacement for a decoder layer's self-attention, with Raven's slot memory.

    q/k/v/o keep the attention's names and shapes, so the converted layer starts from the teacher's projections.
    Called like the attention it replaces; returns (output [B, T, hidden], None). No auxiliary loss: the paper
    omits load balancing on purpose (Section 4.1).
    """

    input_weights = ("router_weight", "decay_weight")  # the router's slot scores and the write decay
    router_weight_name = "router_weight"

    def __init__(self, config, layer_idx: int, settings: RavenSettings, source_has_qk_norm: bool = False):
        super().__init__(config, layer_idx, settings)
        hidden = config.hidden_size
        self.scale = self.head_dim**-0.5  # the attention's logit scale, so slot logits start on its scale
        Hkv, d, M = self.num_kv_heads, self.head_dim, settings.num_slots
        self.use_qk_norm = source_has_qk_norm if settings.qk_norm is None else settings.qk_norm
        self.source_has_qk_norm = source_has_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.router_weight = nn.Parameter(torch.empty(Hkv * M, hidden))  # W
        self.decay_weight = nn.Parameter(torch.empty(Hkv, hidden))  # w
        self.decay_bias = nn.Parameter(torch.empty(Hkv))  # b
        self.decay_log_scale = nn.Parameter(torch.empty(Hkv))  # Delta
        self.reset_mixer_parameters()

    @torch.no_grad()
    def reset_mixer_parameters(self):
        """Initialise the parameters attention does not have, so the converted layer trains stably from step 0.

        - Router: small random logits, so sigmoid scores start near 0.5 and no slot is favoured; which K slots a
          token picks is then decided by content and, in training, by the Gumbel noise (avoids early collapse).
          Scores of real inputs share an offset (their common direction): router_init "centred" refits the rows
          at align's start.
        - Decay: w = 0 and softplus(b) = 1, so a_t = -exp(Delta) per head. Delta spreads the heads over time
          scales: a slot written with an average weight r = 1 / (alpha K) keeps between 95% and 50% of its
          content per write, from the slowest head to the fastest (a Mamba-2-like range of memories).
        - Output gate: W_g = 0, and the gate is 2 sigmoid(W_g x), so it starts as the identity.
        """
        s = self.settings
        per_write = torch.logspace(  # in float32 whatever the model is built in: its cast is the value
            math.log10(-math.log(0.95)), math.log10(-math.log(0.5)), self.num_kv_heads, dtype=torch.float32
        )
        inits = {
            "router_weight": lambda p: p.normal_(std=0.02),
            "decay_weight": lambda p: p.zero_(),
            "decay_bias": lambda p: p.fill_(math.log(math.e - 1.0)),  # softplus^-1(1)
            "decay_log_scale": lambda p: p.copy_(torch.log(per_write * s.alpha * s.top_k)),
            "gate_weight": lambda p: p.zero_(),
        }
        init_fresh_parameters(self, inits)

    def state_numel(self) -> int:
        """Elements of the decoding state per sequence (float32): S^k and S^v, [H_kv, M, d] each."""
        return 2 * self.num_kv_heads * self.settings.num_slots * self.head_dim

    def step_state_share(self) -> float:
        """A step reads every slot and writes the K it routes to."""
        return (1 + self.settings.top_k / self.settings.num_slots) / 2

    def fresh_parameter_names(self) -> set[str]:
        """Parameters a converted layer cannot take from the source attention."""
        names = {"router_weight", "decay_weight", "decay_bias", "decay_log_scale"}
        if self.settings.output_gate:
            names.add("gate_weight")
        if self.use_qk_norm and not self.source_has_qk_norm:
            names |= {"q_norm.weight", "k_norm.weight"}
        return names

    def route(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None, kernels=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's choice: log-decay a [B, T, H_kv] (0 at padding), slots idx [B, T, H_kv, K], weights r.
        `kernels` (the Triton module mix() runs) picks the top-K of a prompt on chip; without it, torch.topk."""
        B, T, _ = x.shape
        s = self.settings
        dtype = torch.promote_types(x.dtype, torch.float32)  # routing in float32 at least, even for bf16 models
        logits = F.linear(x, self.router_weight).view(B, T, self.num_kv_heads, s.num_slots).to(dtype)
        if self.training and s.gumbel:
            u = torch.rand_like(logits).clamp_(1e-10, 1.0 - 1e-7)
            logits = logits - torch.log(-torch.log(u))  # Gumbel(0, 1) noise: exploration of all slots
        if kernels is not None and T > 1:  # prefill and training: a sort per row on chip, not a radix select each
            idx = kernels.topk_slots(logits, s.top_k)  # [B, T, H_kv, K]
            top = logits.gather(-1, idx)
        else:
            top, idx = logits.topk(s.top_k, dim=-1)
        top = top.sigmoid()  # sigmoid is monotone: the same slots as the top-K of the scores, fewer exponentials
        r = top / (s.alpha * top.sum(-1, keepdim=True))  # [B, T, H_kv, K]
        a = (
            -F.softplus(F.linear(x, self.decay_weight, self.decay_bias).to(dtype))
            * self.decay_log_scale.to(dtype).exp()
        )
        if padding_mask is not None:  # padding neither writes nor decays
            a = a * padding_mask[:, :, None].to(a.dtype)
        return a, idx, r

    def write_gates(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        """log of the per-slot retention, a_t * r_t: [B, T, H_kv, M], zero outside the top-K slots and at padding."""
        a, idx, r = self.route(x, padding_mask)
        log_f = r.new_zeros(*idx.shape[:-1], self.settings.num_slots)
        return log_f.scatter(-1, idx, a.unsqueeze(-1) * r)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H_kv, G, d], k and v [B, T, H_kv, d] of hidden states x [B, T, hidden], after the q/k norms
        and feature map."""
        B, T, _ = x.shape
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, Hkv, H // Hkv, d)
        k = self.k_proj(x).view(B, T, Hkv, d)
        v = self.v_proj(x).view(B, T, Hkv, d)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.settings.feature_map == "silu":
            q, k = F.silu(q), F.silu(k)
        return q, k, v

    def fused_decode_step(self, kernels, x: torch.Tensor, state, padding_mask) -> torch.Tensor:
        """A decode step of x [B, 1, hidden] on `fused_recurrent_raven_decode`: the products here (one, fused in a
        compiled step), the norms, feature map, routing and the slots' update in one kernel that rewrites the state
        in place. Returns o [B, 1, H_kv, G, d]."""
        s = self.settings
        norms = (self.q_norm.weight, self.k_norm.weight) if self.use_qk_norm else None

        return kernels.fused_recurrent_raven_decode(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), input_product(x, self.router_weight),
            input_product(x, self.decay_weight),
            self.decay_bias, self.decay_log_scale, state, self.scale, s.top_k, s.alpha, qk_norms=norms,
            norm_eps=self.q_norm.eps if self.use_qk_norm else 1e-6, feature_map=s.feature_map,
            mask=None if padding_mask is None else padding_mask.bool(),
        )  # fmt: skip

    def mix(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        kernels, s = kernel_module(MIXER.kernels, hidden_states), self.settings
        if cu_seqlens is not None and kernels is None:  # packed documents, each from an empty state
            return self.forward_packed(hidden_states, cu_seqlens)
        x = hidden_states  # [B, T, hidden]
        T = x.shape[1]
        state = self.load_state(cache)
        if not self.training and one_kernel_step(kernels, x, cu_seqlens, state):  # training routes with noise
            o = self.fused_decode_step(kernels, x, state, padding_mask)  # one kernel from the projections
            self.save_state(cache, state, num_tokens=T)
            return self.glue(self.read_out)(o, x)
        q, k, v = self.glue(self.projections)(x)
        if kernels is not None:  # Triton: the router's choice goes to the kernels, which build the gates on chip
            a, idx, r = self.route(x, padding_mask, kernels)
            if cu_seqlens is not None:  # packed documents: one sequence of B * T tokens cut at cu_seqlens
                packed = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, a, idx, r))
                o, _ = kernels.chunk_raven(
                    *packed, self.scale, s.num_slots, cu_seqlens=cu_seqlens, checkpoint_level=s.checkpoint_level
                )
                return self.glue(self.read_out)(o, x)
            if T == 1 and state is not None:
                o, new_state = kernels.fused_recurrent_raven(q, k, v, a, idx, r, self.scale, s.num_slots, state, True)
            else:
                o, new_state = kernels.chunk_raven(
                    q, k, v, a, idx, r, self.scale, s.num_slots, state, True, checkpoint_level=s.checkpoint_level
                )
            self.save_state(cache, new_state, num_tokens=T)
            return self.glue(self.read_out)(o, x)
        log_f = self.write_gates(x, padding_mask)
        if T == 1 and state is not None:
            o, new_state = raven_recurrent(q, k, v, log_f, self.scale, state)
        else:
            o, new_state = raven_chunked(q, k, v, log_f, self.scale, state, self.settings.chunk_size)
        self.save_state(cache, new_state, num_tokens=T)
        return self.glue(self.read_out)(o, x)


MIXER = MixerSpec(
    settings=RavenSettings,
    layer=RavenMixer,
    state="2 x [M, d]: slot keys and slot values",
    kernels="raven_kernels.raven",
    references=(raven_recurrent, raven_chunked),
    pictures="raven_convert.evaluate.pictures:raven_pictures",
    graph_safe=True,  # in a capture the in-chunk kernels take their exact forms, which pick per slot block
)
