"""The attention masks of a hybrid's kept layers, and the packed documents they (and the mixers) keep apart.

`attention_mask` builds the mask transformers' attention functions take for one forward: causal, a sliding window
with its attention sinks (sinks.py), left padding, packed documents, over the keys a cache returns.
`find_packed_documents` finds documents packed back to back in a row, as transformers does.
"""

from __future__ import annotations

import torch

from .sinks import visible_sinks


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: where a packed document starts in each row of position_ids [B, T] (any integer dtype): at the
    row's start and wherever the position ids do not step by one."""
    positions = position_ids.long()  # narrow stored dtypes would wrap at + 1
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def find_packed_documents(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Documents packed back to back in each row, marked as transformers marks them: the position ids restart.

    A new document starts wherever position_ids [B, T] does not step by one (the convention of transformers'
    masking utilities and of its padding-free data collators). Returns None when every row is one sequence, else
    (document index of every token within its row [B, T], cu_seqlens [S + 1]: the offsets of all S documents in
    the flattened B * T tokens, each row starting a new one) for the attention masks and the mixers.
    """
    B, T = position_ids.shape
    starts = document_starts(position_ids)  # [B, T], every row opens a document
    if not bool(starts[:, 1:].any()):  # one host sync per forward
        return None
    documents = starts.long().cumsum(-1) - 1
    flat = starts.flatten().nonzero().squeeze(1)
    cu_seqlens = torch.cat([flat, flat.new_tensor([B * T])]).to(torch.int32)
    return documents, cu_seqlens


def attention_mask(
    impl: str,
    padding: torch.Tensor | None,
    T: int,
    past: int,
    window: int | None,
    sinks: int,
    like: torch.Tensor,
    documents: torch.Tensor | None,
    positions: torch.Tensor | None,
):
    """The mask attention implementation `impl` expects for T new tokens after `past` cached ones, or None where
    transformers would take the causal fast path.

    Keys are the cached ones plus the new ones: all `past + T` of them, or for a sliding-window layer only the
    last `window - 1` cached ones (see AttentionLayerCache), after its `sinks` slots where it keeps attention sinks
    and has cached tokens (sinks.py): a sink slot is visible while the window no longer holds its token, and a key in
    the window at a position < sinks (positions [B, T] of the new tokens, or counted from the padding) always.
    padding [B, past + T]: the 2D padding mask (None: every token real). SDPA takes a boolean mask, eager attention
    an additive float one in `like`'s dtype; flash-attention kernels take the 2D padding mask and apply causality
    (and the window, passed by the layer) themselves, and find packed documents in the position ids as transformers
    does. documents [B, T] (packed input, no cache) restricts every query to the keys of its own document.
    """
    if sinks and impl not in ("sdpa", "eager"):
        raise ValueError(
            f"attention_sinks = {sinks} needs the 'sdpa' or 'eager' attention implementation (a window's sinks are "
            f"written into its mask); this model runs {impl!r}"
        )
    kv_start = 0 if window is None else max(0, past - (window - 1))
    full_padding = padding
    if padding is not None:
        padding = padding[:, kv_start:]
    if impl not in ("sdpa", "eager"):
        return padding
    simple = padding is None and documents is None
    if simple and (
        (T == 1 and not (sinks and past)) or (past == 0 and impl == "sdpa" and (window is None or T <= window))
    ):
        return None  # every stored key is visible (T == 1), or SDPA's own causal mask is the right one
    q_pos = torch.arange(past, past + T, device=like.device)[:, None]
    k_pos = torch.arange(kv_start, past + T, device=like.device)[None, :]
    allowed = k_pos <= q_pos  # [T, kv]
    if window is not None:
        allowed &= k_pos > q_pos - window
    allowed = allowed[None, None]  # [1, 1, T, kv]
    if sinks:  # keys at positions < S stay visible past the window
        if full_padding is not None:
            key_positions = (full_padding.long().cumsum(-1) - 1)[:, kv_start:]  # [B, kv]
        elif documents is not None:
            key_positions = positions  # [B, T]: no cache, each document counted from its start
        else:
            key_positions = k_pos  # [1, kv]
        allowed = allowed | ((key_positions < sinks)[:, None, None, :] & (k_pos <= q_pos))
    if documents is not None:  # no cache here, so keys and queries are the same T tokens
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])  # [B, 1, T, T]
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
        allowed = allowed | (k_pos == q_pos)  # a padded query sees itself, so no row is empty (no NaN)
    if sinks and past:  # the sink slots before the keys
        slots = visible_sinks(full_padding, kv_start, sinks, like.device)[:, None, None, :]  # [B or 1, 1, 1, S]
        rows = max(allowed.shape[0], slots.shape[0])
        allowed = torch.cat([slots.expand(rows, 1, T, sinks), allowed.expand(rows, 1, T, allowed.shape[-1])], dim=-1)
    if impl == "eager":
        return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~allowed, torch.finfo(like.dtype).min
        )
    return allowed
