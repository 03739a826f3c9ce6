"""How far back each attention layer looks on real text: what a sliding window on it would cut.

    ids = text_rows(tokenizer, load_texts("../shared/data/pg_essays"), rows=2, length=2048)
    rows = head_reach(attention_weights(model, ids), far=512, near=64, skip=1024)

Per head, averaged over the queries with at least `skip` tokens before them (and over rows):
- `sink`: the weight on the row's first token, where heads park attention they do not need; a sliding window
  drops it once the row is longer than the window;
- `far`: the weight on keys at least `far` tokens back, the first token left out: what a `far`-token window cuts;
- `near`: the weight on the last `near` tokens, the query's own included.
A kept attention layer whose heads put little weight far back can take a sliding window at little cost. One with
weight spread far back, or with induction or duplicate-token heads (copying.py, whose exact answers are sparse and
far), cannot: SmolLM2's layers 7 and 8 spread about half their weight 512 or more tokens back (docs/DEPTH.md).
"""

from __future__ import annotations

import torch


def text_rows(tokenizer, texts: list[str], rows: int, length: int) -> torch.Tensor:
    """[rows, length] token ids: `texts` joined by blank lines and tokenized, cut into consecutive rows."""
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0]
    if ids.numel() < rows * length:
        raise ValueError(f"the texts hold {ids.numel():,} tokens; {rows} rows of {length} need {rows * length:,}")
    return ids[: rows * length].view(rows, length)


def head_reach(attentions: dict[int, torch.Tensor], far: int, near: int, skip: int) -> list[dict]:
    """Per attention layer (the keys of `attentions`, in order), each head's mean `sink`, `far` and `near` weights
    (module docstring) from its attention weights [B, H, T, T], over the queries at positions `skip` to T - 1."""
    rows = []
    for layer in sorted(attentions):
        a = attentions[layer].float()  # [B, H, T, T]
        T = a.shape[-1]
        if not 0 <= skip < T:
            raise ValueError(f"skip {skip}: expected 0 to {T - 1}, the queries of rows of {T} tokens")
        positions = torch.arange(T)
        back = positions[skip:, None] - positions[None, :]  # [Tq, T]: how far back each key lies
        later = (positions > 0)[None, :]  # the first token is the sink, counted apart
        a = a[:, :, skip:]  # [B, H, Tq, T]
        rows.append({
            "layer": layer,
            "sink": a[..., 0].mean(dim=(0, 2)).tolist(),  # [H]
            "far": (a * ((back >= far) & later)).sum(-1).mean(dim=(0, 2)).tolist(),
            "near": (a * ((back < near) & (back >= 0))).sum(-1).mean(dim=(0, 2)).tolist(),
        })  # fmt: skip
    return rows


def by_far_weight(rows: list[dict], leave_out: set[int] = frozenset()) -> list[int]:
    """The layers of `rows`, least far weight first (their heads' mean; ties to the lower layer), those in
    `leave_out` (e.g. the copying layers) left out: the order in which to window kept layers."""
    kept = [r for r in rows if r["layer"] not in leave_out]
    return [r["layer"] for r in sorted(kept, key=lambda r: (sum(r["far"]) / len(r["far"]), r["layer"]))]
