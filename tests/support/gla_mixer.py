"""A mixer declared outside the toolkit: plain gated linear attention (GLA; Yang et al., 2024), in PyTorch.

    convert --src model.gguf --mixer tests.support.gla_mixer:MIXER --layers 0-29:2 --gla-gate-rank 16 --out out

Per key/value head a state S [d_k, d_v], decayed per key channel and written with every token:

    g_t = sigmoid(W_up W_down x_t + b) ** (1 / gate_temperature)     [d_k], low-rank gate, near 1 at first
    S_t = diag(g_t) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t                                           (every query head of the group reads it)

The module imports from the model package only `raven_layers.common`, so a converted model carries it alone (as
mixer_gla.py) and loads where only transformers is installed. docs/ADD_A_MIXER.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raven_layers.common import Mixer, MixerSettings, MixerSpec, init_fresh_parameters

GLAState = tuple[torch.Tensor]  # (S [B, H_kv, d_k, d_v] float32,)


@dataclass(frozen=True)
class GLASettings(MixerSettings):
    """Hyper-parameters of a GLA layer; heads, head dim and GQA layout come from the source attention."""

    NAME, LABEL = "gla", "GLA"

    gate_rank: int = 16  # rank of the gate projection hidden -> H_kv d_k
    gate_temperature: float = 16.0  # log g = logsigmoid(.) / temperature, as in the GLA paper
    output_gate: bool = False  # o * 2 sigmoid(W_g x), read by the Mixer base class

    def __post_init__(self):
        self.check_positive_ints("gate_rank")
        if not self.is_number(self.gate_temperature) or not self.gate_temperature >= 1:
            self.fail("gate_temperature", "a number >= 1")
        self.check_bools("output_gate")


def gla_recurrent(q, k, v, log_g, scale: float, initial_state: torch.Tensor | None = None):
    """q [B, T, H_kv, G, d_k], k [B, T, H_kv, d_k], v [B, T, H_kv, d_v], log_g [B, T, H_kv, d_k] (<= 0), initial
    state [B, H_kv, d_k, d_v] (zeros if None) -> (o [B, T, H_kv, G, d_v], final state), in float32 at least."""
    B, T, Hkv, dk = k.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, log_g.exp()))
    state = k.new_zeros(B, Hkv, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        state = state * g[:, t, :, :, None] + k[:, t, :, :, None] * v[:, t, :, None, :]  # [B, H_kv, d_k, d_v]
        outputs.append(torch.einsum("bhgk,bhkv->bhgv", q[:, t], state) * scale)  # [B, H_kv, G, d_v]
    return torch.stack(outputs, dim=1), state


class GLAMixer(Mixer):
    """Drop-in replacement for a decoder layer's self-attention: q/k/v/o start from the teacher's projections, the
    gate is new. Returns (output [B, T, hidden], None); the decode state is `GLAState`."""

    def __init__(self, config, layer_idx: int, settings: GLASettings, source_has_qk_norm: bool = False):
        super().__init__(config, layer_idx, settings)
        Hkv, d = self.num_kv_heads, self.head_dim
        self.scale = d**-0.5
        self.gate_down = nn.Parameter(torch.empty(settings.gate_rank, config.hidden_size))
        self.gate_up = nn.Parameter(torch.empty(Hkv * d, settings.gate_rank))
        self.gate_bias = nn.Parameter(torch.empty(Hkv * d))
        self.reset_mixer_parameters()

    @torch.no_grad()
    def reset_mixer_parameters(self):
        """W_up = 0 and b = 4: every gate starts at sigmoid(4) ** (1 / 16) = 0.9989 (a memory of ~900 tokens),
        the same for every token, while W_down gets gradients from the first step."""
        inits = {
            "gate_down": lambda p: p.normal_(std=0.02),
            "gate_up": lambda p: p.zero_(),
            "gate_bias": lambda p: p.fill_(4.0),
            "gate_weight": lambda p: p.zero_(),
        }
        init_fresh_parameters(self, inits)

    def state_numel(self) -> int:
        return self.num_kv_heads * self.head_dim**2

    def fresh_parameter_names(self) -> set[str]:
        return {"gate_down", "gate_up", "gate_bias"} | ({"gate_weight"} if self.settings.output_gate else set())

    def log_gates(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> log g [B, T, H_kv, d_k] (float32 at least)."""
        B, T, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        pre = F.linear(F.linear(x, self.gate_down.to(x.dtype)), self.gate_up.to(x.dtype)).to(dtype) + self.gate_bias
        return (F.logsigmoid(pre) / self.settings.gate_temperature).view(B, T, self.num_kv_heads, self.head_dim)

    def mix(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if cu_seqlens is not None:  # packed documents, each from an empty state
            return self.forward_packed(hidden_states, cu_seqlens)
        x = hidden_states  # [B, T, hidden]
        B, T, _ = x.shape
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, Hkv, H // Hkv, d)
        k = self.k_proj(x).view(B, T, Hkv, d)
        v = self.v_proj(x).view(B, T, Hkv, d)
        log_g = self.log_gates(x)
        if padding_mask is not None:  # a padded token neither writes nor decays the state
            keep = padding_mask[:, :, None, None].to(log_g.dtype)
            k, log_g = k * keep.to(k.dtype), log_g * keep
        state = self.load_state(cache)
        o, memory = gla_recurrent(q, k, v, log_g, self.scale, state[0] if state is not None else None)
        self.save_state(cache, (memory,), num_tokens=T)
        return self.project_out(o.to(x.dtype).reshape(B, T, H * d), x)


MIXER = MixerSpec(
    settings=GLASettings,
    layer=GLAMixer,
    state="[d, d]",
    references=(gla_recurrent,),
    pictures="tests.support.gla_pictures:gla_pictures",
)
