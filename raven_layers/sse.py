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

Under grouped-query attention the state lives on the key/value heads and each query head of a group reads it. The
three computations of sse_forms.py agree to float rounding: `sse_recurrent` (reference and decode path: it gathers
and scatters only the partitions a token touches), `sse_masking` (Algorithm 1: every partition is a head of one
chunked GLA; unselected tokens get q = k = 0 and a log-gate of 0, so they neither write, read nor decay it) and
`sse_varlen` (Algorithm 2: tokens regrouped by partition into variable-length segments of one chunked GLA).
It imports nothing but torch and its siblings (common.py, sse_forms.py, backend.py): it is copied next to every
exported model.

The output norm matters for conversion: keys sum to one but the state sums over the memory's length, so without
it the read of a converted SmolLM2-135M layer comes out 10-47x larger than the attention it replaces.
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
from .sse_forms import (
    PARALLEL_FORMS,
    chunk_gla_entries_reference,
    chunk_gla_reference,
    gla_recurrent,
    sse_masking,
    sse_parallel,
    sse_recurrent,
    sse_varlen,
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
    router_init: str = "random"  # or "centred": W_e fitted to the layer's inputs before align (Mixer.calibrate)
    shared_partition: bool = True  # one always-selected partition on the base projections (paper)
    read_top_k: int | None = None  # k' partitions read per token; None: top_k (paper default)
    gate_low_rank: int = 16  # rank of the GLA gate projection W_a1 W_a2 (GLA: 16)
    gate_normalizer: float = 16.0  # tau of log a = logsigmoid(.) / tau (GLA: 16)
    output_gate: bool = True  # o * 2 sigmoid(W_g x); W_g starts at zero so the gate starts as the identity
    output_norm: bool = True  # per-head RMSNorm of the read, as in GLA's block: the state sums, so its scale grows
    implementation: str = "auto"  # parallel form: "masking", "varlen", or "auto" (see VARLEN_MIN_TOKENS)
    chunk_size: int = 16  # chunk length of the parallel PyTorch form

    IMPLEMENTATIONS = ("auto", *PARALLEL_FORMS)

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
        self.check_choice("router_init", ROUTER_INITS, {"centered": "centred"})
        self.check_choice("implementation", self.IMPLEMENTATIONS)


def step_state_share(top_k: int, read_top_k: int, partitions: int, shared: bool) -> float:
    """The share of a state of `partitions` one decode step moves, (bytes read + written) / (2 x the state's): the
    `top_k` partitions it writes (and the shared one) read and written, the `read_top_k` - `top_k` more it reads
    read, the others untouched."""
    written, read_only = top_k + int(shared), max(0, read_top_k - top_k)
    return (2 * written + read_only) / (2 * partitions)


class SSEMixer(Mixer):
    """Drop-in replacement for a decoder layer's self-attention, with a sparsely expanded GLA state.

    q/k/v/o keep the attention's names and shapes (q/k get H * c and H_kv * c outputs), so the converted layer
    starts from the teacher's projections. Called like the attention it replaces; returns (output, None) and
    leaves the balance loss of this call in `self.aux_loss` (None when balance_coef = 0).
    """

    # the partition scores, the decay's first product and every partition's first LoRA factors (read as [N r, hidden])
    input_weights = ("partition_weight", "decay_down", "q_lora_a", "k_lora_a")
    router_weight_name = "partition_weight"

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
          content-dependent, roughly balanced top-k from the first step, without early collapse. Scores of real
          inputs share an offset (their common direction): router_init "centred" refits W_e at align's start.
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

    def step_state_share(self) -> float:
        """A step moves the partitions it writes and reads, not the others (`step_state_share`)."""
        s = self.settings
        return step_state_share(s.top_k, self.read_top_k, self.num_partitions, s.shared_partition)

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
