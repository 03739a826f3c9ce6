"""Which attention layers copy: each head's induction score, per layer, on random tokens repeated.

    rows = head_scores(attention_weights(model, repeated_tokens(vocab, 4, 200, seed=0)), length=200)
    scores = copying_scores(model)            # per layer: its strongest induction head, None for a mixer layer

A model reading a random sequence the second time can only predict it by copying: at a token seen before, an
induction head attends to the token that followed it then. Per head, over the second copy:
- `induction`: the weight on the token after the earlier occurrence (the copy);
- `duplicate`: the weight on the earlier occurrence itself;
- `previous`: over the first copy, the weight on the token just before (the other half of an induction circuit,
  local, which a mixer's short convolution can stand in for).
The exact answers a deep hybrid loses first (words, codes, several values: docs/DEPTH.md) are copies, so the layers
with induction heads are the ones a deep conversion keeps as attention (`layer_choice.keep_copying`,
docs/LAYER_CHOICE.md). The weights come from eager attention, read by hooks on the attention modules of the model as
a hybrid (surgery.build_hybrid), so a Transformer and a hybrid converted further are measured alike.
"""

from __future__ import annotations

import torch


def repeated_tokens(vocab_size: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, 2 length] random tokens, each row's second half a copy of its first; the vocabulary's first eighth
    (special and byte tokens in most tokenizers) left out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab_size // 8, vocab_size, (rows, length), generator=g)
    return torch.cat([x, x], dim=1)


def head_scores(attentions: dict[int, torch.Tensor], length: int) -> list[dict]:
    """Per attention layer (the keys of `attentions`, in order), each head's mean induction, duplicate-token and
    previous-token weights, from its attention weights [B, H, 2 L, 2 L] over sequences whose second half repeats
    the first."""
    later = torch.arange(length, 2 * length - 1)  # the second copy's tokens that have a next token in the first
    first = torch.arange(1, length)
    rows = []
    for layer in sorted(attentions):
        a = attentions[layer].float()
        rows.append({
            "layer": layer,
            "induction": a[:, :, later, later - length + 1].mean(dim=(0, 2)).tolist(),  # [H]
            "duplicate": a[:, :, later, later - length].mean(dim=(0, 2)).tolist(),
            "previous": a[:, :, first, first - 1].mean(dim=(0, 2)).tolist(),
        })  # fmt: skip
    return rows


@torch.no_grad()
def attention_weights(model, ids: torch.Tensor, device=None) -> dict[int, torch.Tensor]:
    """{layer: [B, H, T, T]} (on the CPU) for every attention layer of `model` (a transformers causal LM or a
    hybrid), read on `ids` [B, T] under eager attention, run on `device` (default: the model's); `model` is left as
    it was."""
    from raven_convert.surgery import build_hybrid, start_kinds

    device = model.device if device is None else device
    kinds = start_kinds(model.config)
    hybrid = build_hybrid(model, kinds, {}).to(device).eval()  # one class whatever the source
    hybrid.config._attn_implementation = "eager"  # the fused kernels return no weights
    weights, hooks = {}, []
    for i, kind in enumerate(kinds):
        if kind == "attention":

            def keep(module, args, out, i=i):
                weights[i] = out[1].detach().cpu()  # out: (attention output, weights [B, H, T, T])

            hooks.append(hybrid.model.layers[i].self_attn.register_forward_hook(keep))
    try:
        hybrid(ids.to(device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [i for i, kind in enumerate(kinds) if kind == "attention" and weights.get(i) is None]
    if missing:
        raise RuntimeError(f"attention layers {missing} returned no weights under eager attention")
    return weights


def copying_scores(model, length: int = 200, rows: int = 4, seed: int = 0, device=None) -> list[float | None]:
    """Per layer of `model`, its strongest head's induction score on `rows` random sequences of `length` tokens
    repeated (None for a layer a hybrid source converted: it has no attention to keep), run on `device`."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and 2 * length > limit:
        raise ValueError(
            f"copying scores: length {length} repeated needs {2 * length} positions; the model has {limit}"
        )
    ids = repeated_tokens(model.config.vocab_size, rows, length, seed)
    heads = head_scores(attention_weights(model, ids, device), length)
    by_layer = {row["layer"]: max(row["induction"]) for row in heads}
    return [by_layer.get(i) for i in range(model.config.num_hidden_layers)]


def most_copying(scores: list[float | None], k: int) -> list[int]:
    """The `k` layers of the highest scores (None left out; ties to the lower layer), sorted."""
    ranked = sorted((i for i, s in enumerate(scores) if s is not None), key=lambda i: (-scores[i], i))
    return sorted(ranked[:k])
