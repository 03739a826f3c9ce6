"""Attention sinks of sliding-window layers: the first S tokens of every sequence stay visible beside the window.

Heads park attention weight on a sequence's first tokens (StreamingLLM's "attention sinks"), which a bare window
drops once it slides past them. With `config.attention_sinks = S`, a windowed kept layer's query at position q sees
the keys at positions q - W < p <= q and those at p < S. Positions count each row's real tokens (left padding
counted out; packed documents from each document's start), so a row's sinks are its own first S tokens however
the batch is padded.

The caches keep a windowed layer's sinks in S slots of their own, slot s holding the row's token at position s,
written as the tokens arrive (`sink_writes` says which new token goes where; `write_sinks` writes them). A forward
over a cache whose layer has seen earlier tokens gets its keys as [the S sink slots, the cached window, the new
tokens]; `HybridModel._attention_mask` builds the mask of that layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SinkWrites(NamedTuple):
    """Which of a forward's new tokens are sinks, per row and sink slot."""

    source: torch.Tensor  # [B, S] long: the index among the new tokens of the row's token at position s
    present: torch.Tensor  # [B, S] bool: that token is among the new ones


def sink_writes(positions: torch.Tensor, real: torch.Tensor | None, sinks: int) -> SinkWrites:
    """positions [B, T] of the new tokens, real [B, T] bool (None: every token is real) -> SinkWrites."""
    hit = positions[:, :, None] == torch.arange(sinks, device=positions.device)  # [B, T, S]
    if real is not None:
        hit &= real[:, :, None].bool()
    return SinkWrites(source=hit.int().argmax(1), present=hit.any(1))


def write_sinks(slots: torch.Tensor, new: torch.Tensor, writes: SinkWrites) -> None:
    """Copy the new keys (or values) new [B, H, T, d] that are sinks into slots [B, H, S, d], in place."""
    B, H, S, d = slots.shape
    picked = new.gather(2, writes.source[:, None, :, None].expand(B, H, S, d))  # [B, H, S, d]
    slots.copy_(torch.where(writes.present[:, None, :, None], picked, slots))


def visible_sinks(padding: torch.Tensor | None, kv_start: int, sinks: int, device) -> torch.Tensor:
    """[B or 1, S] bool: sink slot s holds a token that the cached window no longer does, i.e. the row has more than
    s real tokens before column `kv_start`, the first the window keeps (padding [B, past + T], None: all real)."""
    count = torch.tensor([kv_start], device=device) if padding is None else padding[:, :kv_start].sum(-1)  # [B]
    return torch.arange(sinks, device=device)[None, :] < count[:, None]
