"""The generation cache of a hybrid model: key/value tensors for attention layers, constant-size states for mixers.

`HybridCache` is a `transformers` `Cache`, so `generate()` (greedy, sampling, beam search) drives it like any
other: attention layers call `update`, mixers call `get_mixer_state` / `set_mixer_state`, and the per-layer
objects answer the batch operations (`reorder_cache`, `batch_select_indices`, ...) that generation strategies use.

transformers 5.24 renamed the cache argument of models and decoder layers from `past_key_values` to `cache` (the
old name is deprecated, and loses when both are given) and the output field likewise. This file is also the
exported models' remote code, run under whatever release a user has, so the names are read from the installed
release's public signatures (`cache_argument`, `OUTPUT_CACHE_FIELD`) rather than from a version number.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

from .architectures import layer_windows
from .sinks import SinkWrites, write_sinks


def cache_argument(forward) -> str:
    """The keyword under which `forward` (a transformers decoder layer's) takes the generation cache."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


# The field of transformers' model outputs that holds the cache: `cache` from 5.24, `past_key_values` before.
OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else ("past_key_values")
)


def output_cache(outputs):
    """The generation cache a model's forward returned, under the installed release's field name."""
    return getattr(outputs, OUTPUT_CACHE_FIELD)


def refuse_rollback(num_tokens: int, max_length: int):
    """Recurrent states cannot be cropped: only cropping to the current length (a no-op) is allowed."""
    if max_length < 0:
        max_length = num_tokens + max_length
    if max_length != num_tokens:
        raise ValueError(
            f"a recurrent state cannot be rolled back from {num_tokens} to {max_length} tokens; "
            "assisted and speculative decoding are not supported by hybrid models"
        )


class _LayerCache(ABC):
    """Batch operations shared by both layer kinds; subclasses say which tensors `_apply` maps over."""

    is_compileable = False
    is_sliding = False
    kind = "attention"  # or "mixer": how `state_bytes` counts the layer

    @abstractmethod
    def _apply(self, fn): ...

    @abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]: ...

    def reorder_cache(self, beam_idx: torch.Tensor):
        self._apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        self._apply(lambda x: x[indices, ...])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class AttentionLayerCache(_LayerCache):
    """Keys and values of one attention layer, [B, H_kv, T, d] each; a windowed layer keeps only its last W - 1,
    and with `sinks` S also each row's first S tokens in S slots of their own (see sinks.py)."""

    def __init__(self, window: int | None = None, sinks: int = 0):
        self.window = window
        self.sinks = sinks if window is not None else 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None  # [B, H_kv, S, d], slot s: the row's token at position s
        self.sink_values: torch.Tensor | None = None
        self.num_tokens = 0  # seen, not stored: a windowed layer drops the oldest

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, sinks: SinkWrites | None = None, **kwargs
    ):
        """Append the new tokens; return every key and value the new queries may attend to: the sink slots first
        once earlier tokens are cached (`sinks` says which new tokens are sinks)."""
        new_keys, new_values = key_states, value_states
        if self.keys is not None:
            key_states = torch.cat([self.keys, key_states], dim=-2)
            value_states = torch.cat([self.values, value_states], dim=-2)
        past = self.num_tokens
        self.num_tokens += key_states.shape[-2] - self.stored_length()
        keep = key_states.shape[-2] if self.window is None else min(key_states.shape[-2], self.window - 1)
        self.keys = key_states[..., key_states.shape[-2] - keep :, :]
        self.values = value_states[..., value_states.shape[-2] - keep :, :]
        if not self.sinks:
            return key_states, value_states
        if sinks is None:
            raise ValueError("a windowed layer with attention sinks needs the sinks of its new tokens")
        if self.sink_keys is None:
            B, H, _, d = new_keys.shape
            self.sink_keys = new_keys.new_zeros(B, H, self.sinks, d)
            self.sink_values = new_values.new_zeros(B, H, self.sinks, d)
        if past > 0:  # the slots as they were, before this forward's sinks are written
            key_states = torch.cat([self.sink_keys, key_states], dim=-2)
            value_states = torch.cat([self.sink_values, value_states], dim=-2)
        write_sinks(self.sink_keys, new_keys, sinks)
        write_sinks(self.sink_values, new_values, sinks)
        return key_states, value_states

    def stored_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.num_tokens

    def tensors(self):
        return tuple(t for t in (self.keys, self.values, self.sink_keys, self.sink_values) if t is not None)

    def _apply(self, fn):
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        if self.sink_keys is not None:
            self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)

    def crop(self, max_length: int):
        if max_length < 0:
            max_length = self.num_tokens + max_length
        if max_length != self.num_tokens and (self.stored_length() < self.num_tokens or self.sink_keys is not None):
            raise ValueError(
                "a sliding-window cache has dropped the tokens it would need to be cropped (or holds sinks)"
            )
        self._apply(lambda x: x[..., :max_length, :])
        self.num_tokens = min(self.num_tokens, max_length)

    def reset(self):
        self.keys = self.values = self.sink_keys = self.sink_values = None
        self.num_tokens = 0


class MixerLayerCache(_LayerCache):
    """The recurrent state of one mixer layer: a tuple of tensors of fixed size, whatever the context length."""

    kind = "mixer"

    def __init__(self):
        self.state: tuple[torch.Tensor, ...] | None = None
        self.num_tokens = 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def tensors(self):
        return self.state or ()

    def _apply(self, fn):
        if self.state is not None:
            self.state = tuple(fn(s) for s in self.state)

    def crop(self, max_length: int):
        refuse_rollback(self.num_tokens, max_length)

    def reset(self):
        self.state, self.num_tokens = None, 0


class HybridCache(Cache):
    """One `AttentionLayerCache` or `MixerLayerCache` per decoder layer, following `config.layer_mixers`."""

    def __init__(self, config):
        sinks = getattr(config, "attention_sinks", 0)
        layers = [
            AttentionLayerCache(window, sinks) if kind == "attention" else MixerLayerCache()
            for kind, window in zip(config.layer_mixers, layer_windows(config))
        ]
        super().__init__(layers=layers)
        self.sink_writes: SinkWrites | None = None  # the current forward's, set by the model (see sinks.py)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, sinks=self.sink_writes)

    def get_mixer_state(self, layer_idx: int):
        return self.layers[layer_idx].state

    def set_mixer_state(self, layer_idx: int, state, num_tokens: int):
        layer = self.layers[layer_idx]
        layer.state = state
        layer.num_tokens += num_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    @property
    def is_compileable(self) -> bool:
        return False

    def state_bytes(self) -> dict[str, int]:
        """Bytes held per layer kind: mixer states stay constant, attention caches grow with the context."""
        sizes = {"attention": 0, "mixer": 0}
        for layer in self.layers:
            sizes[layer.kind] += layer.nbytes()
        return sizes
