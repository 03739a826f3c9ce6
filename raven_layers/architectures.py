"""Source architectures a hybrid can be built from, as data.

A hybrid keeps the source model's own decoder layer, norm and rotary classes from `transformers`, so attention
layers that are kept compute exactly what they computed before. Supporting another Llama-like decoder is one entry
in `ARCHITECTURES`: the `transformers` module that defines it, the class-name prefix, whether its attention has
per-head q/k norms, and which layers use a sliding window. The toolkit reads a source attention's queries and keys
through it (`Architecture.queries_keys`, e.g. for the token weights), so that it never re-implements a forward.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str  # `config.model_type` of the source
    prefix: str  # class-name prefix in transformers: f"{prefix}DecoderLayer", f"{prefix}RMSNorm", ...
    qk_norm: bool = False  # the attention has per-head q_norm / k_norm
    window_rule: str = "none"  # "none", "all" (config.sliding_window on every layer), "layer_types"

    @property
    def module(self):
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def cls(self, suffix: str):
        return getattr(self.module, f"{self.prefix}{suffix}")

    def sliding_windows(self, config) -> list[int | None]:
        """Per layer, the attention window of the source model (None: full causal attention)."""
        window = getattr(config, "sliding_window", None)
        n = config.num_hidden_layers
        if self.window_rule == "all" and window:
            return [window] * n
        if self.window_rule == "layer_types" and window:
            types = getattr(config, "layer_types", None) or ["full_attention"] * n
            return [window if t == "sliding_attention" else None for t in types]
        return [None] * n

    def queries_keys(self, attn, hidden, position_embeddings):
        """The queries [B, H, T, d] and keys [B, Hkv, T, d] that attention module `attn` of this architecture
        computes from its input hidden [B, T, hidden_size] and (cos, sin): its projections, its per-head q/k norms
        where it has them (Qwen3), then its module's own `apply_rotary_pos_emb`."""
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        q, k = attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape)  # [B, T, H, d], [B, T, Hkv, d]
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = position_embeddings
        return self.module.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


ARCHITECTURES = {
    a.model_type: a
    for a in (
        Architecture("llama", "Llama"),
        Architecture("mistral", "Mistral", window_rule="all"),
        Architecture("qwen2", "Qwen2", window_rule="layer_types"),
        Architecture("qwen3", "Qwen3", qk_norm=True, window_rule="layer_types"),
    )
}


def get_architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported source architecture {model_type!r}; supported: {sorted(ARCHITECTURES)}. "
            "Another Llama-like decoder is one entry in raven_layers/architectures.py."
        )
    return ARCHITECTURES[model_type]


def layer_windows(config) -> list[int | None]:
    """Per layer of a hybrid, the attention window (None: full attention, and for mixer layers)."""
    windows = getattr(config, "attention_windows", None)
    if windows is None:
        windows = get_architecture(config.base_model_type).sliding_windows(config)
    return [w if kind == "attention" else None for w, kind in zip(windows, config.layer_mixers)]
