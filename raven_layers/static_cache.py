"""A preallocated generation cache: every buffer is made once, and a decode step only writes into them in place.

`StaticHybridCache` holds, for a batch of B sequences of at most `max_length` tokens:
- per full-attention layer, keys and values [B, H_kv, max_length, d], token t in slot t;
- per sliding-window layer, a ring of `window` slots [B, H_kv, window, d], token t in slot t % window (attention
  does not depend on the order of its keys, so the ring is never rolled); with attention sinks (sinks.py), S slots
  before the ring, slot s holding the row's token at position s, and the ring's slots shifted by S;
- per mixer layer, the recurrent state, updated in place by the decode kernels (or copied into its buffer);
- the decode bookkeeping as device tensors: how many tokens were written (`step`), the next position id of every
  row (`positions`, left padding counted out), and which slots of each layer window's buffers hold real tokens
  (`valid`; with sinks, a ring slot whose token is also in a sink slot is not, so that no key counts twice).

A decode step (one token per row) reads and writes only these tensors, with no host synchronisation and no
allocation that outlives it, so `DecodeGraph` can capture it once as a CUDA graph and replay it for every token.
Prefill (several tokens) runs eagerly and writes the same buffers. The host-side token count (`get_seq_length`)
moves in `advance`, outside any captured region.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .architectures import layer_windows
from .cache import HybridCache, _LayerCache, refuse_rollback
from .decode_attention import DecodeSlots
from .sinks import write_sinks


class StaticAttentionLayerCache(_LayerCache):
    """Keys and values of one attention layer in a buffer of max_length slots, or for a windowed layer its `sinks`
    slots and a ring of `ring` (the window, at most max_length)."""

    def __init__(
        self, owner: "StaticHybridCache", window: int | None, sinks: int, keys: torch.Tensor, values: torch.Tensor
    ):
        self.owner, self.window, self.sinks = owner, window, sinks
        self.keys, self.values = keys, values  # [B, H_kv, sinks + ring, d]
        self.ring = keys.shape[2] - sinks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens [B, H_kv, T, d]; return every key and value the new queries may attend to."""
        owner, S = self.owner, self.sinks
        if owner.decoding:  # one token, at slot step % ring after the sinks: device indices only
            slot, own = owner.step_slots(self.ring, S)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            if S:  # and a row's token at a position < S in its sink slot too
                self.keys[owner.row_index, :, own] = key_states[:, :, 0]
                self.values[owner.row_index, :, own] = value_states[:, :, 0]
            return self.keys, self.values
        past, T = owner.num_tokens, key_states.shape[2]
        if self.window is None:
            self.keys[:, :, past : past + T] = key_states
            self.values[:, :, past : past + T] = value_states
            return self.keys[:, :, : past + T], self.values[:, :, : past + T]
        # a ring: the cached part the new queries see, oldest first (as AttentionLayerCache returns it)
        kept = torch.arange(max(0, past - (self.window - 1)), past, device=self.keys.device) % self.ring + S
        keys = torch.cat([self.keys[:, :, : S if past else 0], self.keys.index_select(2, kept), key_states], dim=2)
        values = torch.cat(
            [self.values[:, :, : S if past else 0], self.values.index_select(2, kept), value_states], dim=2
        )
        last = torch.arange(past + max(0, T - self.ring), past + T, device=self.keys.device)  # the newest that fit
        self.keys.index_copy_(2, last % self.ring + S, key_states[:, :, last - past])
        self.values.index_copy_(2, last % self.ring + S, value_states[:, :, last - past])
        if S:
            write_sinks(self.keys[:, :, :S], key_states, owner.sink_writes)
            write_sinks(self.values[:, :, :S], value_states, owner.sink_writes)
        return keys, values

    def get_seq_length(self) -> int:
        return self.owner.num_tokens

    def tensors(self):
        return (self.keys, self.values)

    def _apply(self, fn):
        self.keys.copy_(fn(self.keys))
        self.values.copy_(fn(self.values))

    def reset(self):
        pass  # the owner's `valid` masks say which slots hold tokens; stale ones are never read


class StaticMixerLayerCache(_LayerCache):
    """The recurrent state of one mixer layer, in buffers made at the first prefill and reused after."""

    kind = "mixer"

    def __init__(self, owner: "StaticHybridCache"):
        self.owner = owner
        self.state: tuple[torch.Tensor, ...] | None = None

    def write(self, state: tuple[torch.Tensor, ...]):
        if self.state is None:
            self.state = tuple(s.contiguous() for s in state)
            return
        for buffer, new in zip(self.state, state):
            if new is not buffer:  # the kernels update their state in place; the PyTorch forms return a new one
                buffer.copy_(new)

    def get_seq_length(self) -> int:
        return self.owner.num_tokens

    def tensors(self):
        return self.state or ()

    def _apply(self, fn):
        for s in self.state or ():
            s.copy_(fn(s))

    def reset(self):
        pass  # a prefill from zero overwrites the buffers


class StaticHybridCache(HybridCache):
    """A `HybridCache` whose buffers are allocated once for `batch_size` sequences of at most `max_length` tokens.

    Made by `HybridForCausalLM.generate` (see there), or by hand and passed as the cache:
    `cache = StaticHybridCache(model.config, batch_size=4, max_length=4096, device="cuda", dtype=torch.bfloat16)`.
    """

    def __init__(self, config, batch_size: int, max_length: int, device=None, dtype=None):
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r} is not allowed; expected an integer >= 1")
        device = torch.device(device if device is not None else "cpu")
        dtype = dtype or torch.float32
        Hkv = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rows, self.max_length, self.device, self.dtype = batch_size, max_length, device, dtype
        self.num_tokens, self.decoding = 0, False
        self.drop_graphs()
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # tokens written, the same for every row
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)  # next position id per row
        self.row_index = torch.arange(batch_size, device=device)  # [B]: a row's own slot in per-row writes
        self.sinks = getattr(config, "attention_sinks", 0)
        self.sink_writes = None  # a prefill's SinkWrites (sinks.py), set by the model
        self.valid: dict[int | None, torch.Tensor] = {}  # layer window -> [B, slots] bool: holds a real token
        layers = []
        for kind, window in zip(config.layer_mixers, layer_windows(config)):
            if kind != "attention":
                layers.append(StaticMixerLayerCache(self))
                continue
            sinks = self.sinks if window is not None else 0
            size = max_length if window is None else sinks + min(window, max_length)
            self.valid.setdefault(window, torch.zeros(batch_size, size, dtype=torch.bool, device=device))
            keys = torch.zeros(batch_size, Hkv, size, d, dtype=dtype, device=device)
            layers.append(StaticAttentionLayerCache(self, window, sinks, keys, torch.zeros_like(keys)))
        super(HybridCache, self).__init__(layers=layers)

    @property
    def batch_size(self) -> int:
        return self.rows

    def fits(self, batch_size: int, max_length: int, device, dtype) -> bool:
        """Whether this cache can serve a generation of `batch_size` rows up to `max_length` tokens."""
        return (batch_size, torch.device(device), dtype) == (self.rows, self.device, self.dtype) and (
            max_length <= self.max_length
        )

    def check_room(self, batch_size: int, new_tokens: int):
        if batch_size != self.rows:
            raise ValueError(f"a static cache made for batch size {self.rows} was given {batch_size} rows")
        if self.num_tokens + new_tokens > self.max_length:
            raise ValueError(
                f"the static cache holds {self.max_length} tokens per sequence; {self.num_tokens} are cached and "
                f"{new_tokens} more were given: make it with a larger max_length"
            )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_mixer_state(self, layer_idx: int):
        # a decode step reads no host counter: a compiled step would be specialised to its value
        return self.layers[layer_idx].state if self.decoding or self.num_tokens > 0 else None

    def set_mixer_state(self, layer_idx: int, state, num_tokens: int):
        self.layers[layer_idx].write(state)  # the token count moves once per forward, in `advance`

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_tokens

    def record_prefill(self, padding: torch.Tensor | None, new_tokens: int, positions: torch.Tensor):
        """Before a prefill of `new_tokens` per row: mark their slots (padding [B, past + T] bool, or all real;
        positions [B, T] their position ids, which say the sinks)."""
        past = self.num_tokens
        new = torch.arange(past, past + new_tokens, device=self.device)
        real = (
            padding[:, -new_tokens:].to(torch.bool)
            if padding is not None
            else torch.ones(self.rows, new_tokens, dtype=torch.bool, device=self.device)
        )
        if past == 0:
            for valid in self.valid.values():
                valid.zero_()
            self.positions.zero_()
        for window, valid in self.valid.items():
            S = self.sinks if window is not None else 0
            ring = valid.shape[1] - S
            keep = slice(max(0, new_tokens - ring), None)  # a ring keeps only the newest
            marks = real[:, keep] & (positions[:, keep] >= S) if S else real[:, keep]  # a sink's slot, not the ring's
            valid.index_copy_(1, new[keep] % ring + S, marks)
            if S:
                valid[:, :S] |= self.sink_writes.present
        self.positions.add_(real.sum(-1))
        self.step.fill_(past + new_tokens)

    @contextmanager
    def decoding_step(self):
        """Within the block, attention layers write one token per row at slot `step` (device indices only)."""
        self.decoding = True
        try:
            yield
        finally:
            self.decoding = False

    def begin_step(self) -> torch.Tensor:
        """Start a decode step of one real token per row; returns its position ids [B, 1]. Device ops only."""
        for window, valid in self.valid.items():
            S = self.sinks if window is not None else 0
            slot, own = self.step_slots(valid.shape[1] - S, S)
            if not S:
                valid.index_fill_(1, slot, True)
                continue
            valid.index_copy_(1, slot, (self.positions >= S)[:, None])  # a sink's token counts in its own slot
            valid[self.row_index, own] = True
        return self.positions.unsqueeze(1)

    def step_slots(self, ring: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where a decode step writes in a buffer of `sinks` slots and a ring of `ring`: the ring's slot [1], and
        with sinks each row's own [B] (its sink slot while its position is < sinks, else the ring's again)."""
        slot = self.step % ring + sinks
        own = torch.where(self.positions < sinks, self.positions, slot) if sinks else None
        return slot, own

    def end_step(self):
        self.step.add_(1)
        self.positions.add_(1)

    def advance(self, new_tokens: int):
        """Count tokens on the host, after each forward (a captured step does not run Python)."""
        self.num_tokens += new_tokens

    def decode_slots(self, window: int | None) -> DecodeSlots:
        """The attention mask of a decode step over the buffers of this window (see decode_attention.py)."""
        S = self.sinks if window is not None else 0
        return DecodeSlots(self.valid[window], self.step + S if S else self.step)  # the ring's slots start at S

    def reset(self):
        self.num_tokens = 0  # buffers, and a graph captured over them, serve the next generation as they are

    def reorder_cache(self, beam_idx: torch.Tensor):
        super().reorder_cache(beam_idx)
        for tensor in (self.positions, *self.valid.values()):
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def _resize_batch(self, fn):
        """Rows change (contrastive search, batch selection): new buffers of the new batch size, and no graph."""
        for layer in self.layers:
            if isinstance(layer, StaticAttentionLayerCache):
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)
            elif layer.state is not None:
                layer.state = tuple(fn(s).contiguous() for s in layer.state)
        self.positions = fn(self.positions)
        self.valid = {window: fn(valid) for window, valid in self.valid.items()}
        self.rows = self.positions.shape[0]
        self.row_index = torch.arange(self.rows, device=self.device)
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget the captured decode steps (new buffers, moved weights): the next step captures anew."""
        self.graph, self.graph_step = None, None  # a DecodeGraph over these buffers, and the step it captures
        self.token_graph, self.token_graph_step = None, None  # the same, ending in `greedy`'s choice of tokens
        self.greedy = None  # decode_loop.GreedyTokens: buffers the token graph captures

    def batch_repeat_interleave(self, repeats: int):
        self._resize_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        self._resize_batch(lambda x: x[indices.to(x.device), ...])

    def crop(self, max_length: int):
        refuse_rollback(self.num_tokens, max_length)
