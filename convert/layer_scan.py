"""The scan of `--layers auto:N` (layer_choice.py): forward passes over the probes that score each attention layer
by what ablating it costs (direction "cut") or what restoring it recovers (direction "restore").

    ranking = score_layers(hybrid, probes, settings, eos, fitted=fitted)   # [{layer, round, retrieval, kl, score}]

`settings` is a layer_choice.ChoiceSettings (not imported here: layer_choice imports this module).

The model scanned is a hybrid (an attention-only one for a Transformer teacher). Its attention layers are scored;
the mixers of a hybrid converted further stay as they are in every pass, neither ablated nor ranked. A layer's
ablation reuses the hidden states before it and runs only the layers from it on.
"""

from __future__ import annotations

import time

import torch

from raven_convert.console import eta

KINDS = {"window": ("window",), "mixer": ("mixer",), "both": ("window", "mixer")}  # the ablations each scan runs


class _Stack:
    """The decoder stack of a hybrid (attention-only for a Transformer teacher), run layer by layer with chosen
    attention layers ablated: windowed ("window"), or with `replacements` (the decoder layers of a hybrid of the
    same source whose every attention layer is a mixer) run in their place ("mixer"). Layers already ranked are
    ablated as `ranked` says: by their mixers when there are replacements, else windowed."""

    def __init__(self, hybrid, window: int, replacements=None):
        self.inner, self.head, self.window = hybrid.model, hybrid.lm_head, window
        self.replacements = replacements
        self.ranked = "window" if replacements is None else "mixer"

    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """[B, T] token ids -> the embeddings [B, T, H] and what every layer needs (positions, masks)."""
        inner = self.inner
        h = inner.embed_tokens(ids)  # [B, T, H]
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, -1)
        windows = {*inner.windows, self.window}
        masks = {w: inner._attention_mask(None, T, 0, w, h, None, positions) for w in windows}
        return h, {"positions": positions, "rotary": inner.rotary_emb(h, positions), "masks": masks}

    def layer(self, i: int, h: torch.Tensor, context: dict, ablation: str | None) -> torch.Tensor:
        """Layer i on h, as it is (ablation None), windowed ("window") or replaced by its mixer ("mixer")."""
        layers, window = self.inner.layers, self.inner.windows[i]
        if ablation == "mixer":  # the mixer in place of the attention; it reads no mask
            layers = self.replacements
        elif ablation == "window":
            window = self.window if window is None else min(self.window, window)
        return layers[i](
            h,
            attention_mask=context["masks"][window],
            position_ids=context["positions"],
            position_embeddings=context["rotary"],
            use_cache=False,
            **{self.inner.cache_argument: None},
        )

    def finish(self, h: torch.Tensor, first: int, context: dict, ablated: dict[int, str]) -> torch.Tensor:
        """Layers first.. on h (those in `ablated` ablated as it says), then the final norm: [B, T, H] -> [B, T, H]."""
        for i in range(first, len(self.inner.layers)):
            h = self.layer(i, h, context, ablated.get(i))
        return self.inner.norm(h)


def _answer_nll(stack: _Stack, final: torch.Tensor, ids: torch.Tensor, starts: list[int], ends: list[int]) -> float:
    """Summed NLL of the answer tokens ids[b, starts[b]:ends[b]], from final hidden states [B, T, H]."""
    total = 0.0
    for b, (s, e) in enumerate(zip(starts, ends)):
        logits = stack.head(final[b, s - 1 : e - 1]).float()  # [A, V], each predicting the next answer token
        total += torch.nn.functional.cross_entropy(logits, ids[b, s:e], reduction="sum").item()
    return total


def _kl(stack: _Stack, final: torch.Tensor, teacher: torch.Tensor, chunk: int = 256) -> float:
    """Summed KL(teacher || model) over [B, T', H] final hidden states, in chunks of positions."""
    total = 0.0
    for c in range(0, final.shape[1], chunk):
        p = stack.head(teacher[:, c : c + chunk]).float().log_softmax(-1)  # [B, C, V]
        q = stack.head(final[:, c : c + chunk]).float().log_softmax(-1)
        total += (p.exp() * (p - q)).sum().item()
    return total


def _batches(probes: dict, settings, eos: int, device) -> list[dict]:
    """Probe batches on `device`: retrieval ones right-padded with `eos` (causal: a pad never reaches an answer)."""
    out = []
    items = probes["retrieval"]
    for b in range(0, len(items), settings.batch_size):
        group = items[b : b + settings.batch_size]
        width = max(len(ids) for ids, _ in group)
        ids = torch.tensor([ids + [eos] * (width - len(ids)) for ids, _ in group], device=device)  # [B, T]
        out.append({"ids": ids, "starts": [s for _, s in group], "ends": [len(i) for i, _ in group]})
    rows = probes["text"]
    for b in range(0, len(rows), settings.batch_size):
        out.append({"ids": torch.tensor(rows[b : b + settings.batch_size], device=device)})
    return out


@torch.no_grad()
def _scan(
    stack: _Stack, batches: list[dict], plan, candidates: list[int], kinds: tuple[str, ...], window: int, progress
):
    """Summed answer NLL and plain-text KL of each kind's base, and of each candidate changed in each kind's way.
    `plan(kind)` gives (base, change): the base ablates the layers of {layer: ablation}; a candidate runs as
    `change` (an ablation, or None for its attention) over that base.
    -> ({("base", kind) or (layer, kind): [nll, kl]}, answer tokens, KL positions)."""
    sums = {key: [0.0, 0.0] for kind in kinds for key in [("base", kind), *((i, kind) for i in candidates)]}
    tokens = positions = 0
    L = len(stack.inner.layers)
    for batch in batches:
        ids = batch["ids"]
        if "starts" in batch:
            tokens += sum(e - s for s, e in zip(batch["starts"], batch["ends"]))

            def measure(final, batch=batch):
                return _answer_nll(stack, final, batch["ids"], batch["starts"], batch["ends"]), 0.0
        else:
            positions += ids.shape[0] * max(0, ids.shape[1] - window)

            def measure(final, teacher=batch["teacher"][:, window:]):
                return 0.0, _kl(stack, final[:, window:], teacher)

        groups: dict[str, list[str]] = {}  # kinds with the same base share its prefix (cut: every kind)
        for kind in kinds:
            groups.setdefault(repr(sorted(plan(kind)[0].items())), []).append(kind)
        for group in groups.values():
            base = plan(group[0])[0]
            h, context = stack.start(ids)
            for i in range(L):
                for kind in group if i in candidates else ():  # the layers before i ran once, for every candidate
                    changed = stack.finish(stack.layer(i, h, context, plan(kind)[1]), i + 1, context, base)
                    sums[i, kind] = [a + b for a, b in zip(sums[i, kind], measure(changed))]
                    progress(L - i)  # the layers it ran
                h = stack.layer(i, h, context, base.get(i))
            measured = measure(stack.inner.norm(h))
            for kind in group:
                sums["base", kind] = [a + b for a, b in zip(sums["base", kind], measured)]
            progress(L)
    return sums, tokens, positions


@torch.no_grad()
def score_layers(hybrid, probes: dict, settings, eos: int, log=print, fitted=None) -> list[dict]:
    """The ranking of the attention layers of `hybrid` (eval mode; its mixers, where it is a hybrid converted further,
    run as they are and are not ranked), one row per layer in ranking order: {layer, round, retrieval, kl, score},
    each a rise over its round's base (the layers ranked before ablated), or under direction "restore" a fall from
    it (every attention layer but those kept before ablated; the first kept rank last); under ablation "both",
    retrieval and kl summed over the two ablations, and "parts": {kind: its score}. `fitted`: the hybrid of aligned
    mixers whose layers replace the ablated ones (ablations "mixer" and "both", and the ranked layers); None:
    windows."""
    device = next(hybrid.parameters()).device
    stack = _Stack(hybrid, settings.window, None if fitted is None else fitted.model.layers)
    kinds = KINDS[settings.ablation]
    batches = _batches(probes, settings, eos, device)
    for batch in batches:
        if "starts" not in batch:  # the unablated teacher's final hidden states, the reference of the KL
            h, context = stack.start(batch["ids"])
            batch["teacher"] = stack.finish(h, 0, context, {})
    L = len(hybrid.model.layers)
    free = [i for i, kind in enumerate(hybrid.config.layer_mixers) if kind == "attention"]  # the layers ranked
    sizes = settings.schedule(len(free))
    # layer passes: a candidate of layer i runs L - i layers (on average (L + 1) / 2), the round's base L, per kind
    candidates = [len(free) - sum(sizes[:r]) for r in range(len(sizes))]
    total = round(sum((c * (L + 1) / 2 + L) * len(kinds) for c in candidates) * len(batches))
    clock, done, last = time.perf_counter(), [0], [0.0]

    def progress(units: int) -> None:
        done[0] += units
        spent = time.perf_counter() - clock
        if spent - last[0] >= 10:  # the total is an estimate: never shown as reached before the end
            last[0] = spent
            log(
                f"layer choice: {done[0]:,}/~{total:,} layer passes, {spent:.0f} s, "
                f"{eta(spent / done[0] * max(total - done[0], 1))}"
            )

    restore = settings.direction == "restore"
    left, ranked = list(free), []  # cut: the layers to convert, first first; restore: those kept, first first
    for r, size in enumerate(sizes):
        done_layers = {row["layer"] for row in ranked}
        if restore:  # every attention layer not yet kept ablated; a candidate's attention restored

            def plan(kind, kept=done_layers):
                return {i: kind for i in free if i not in kept}, None
        else:  # the layers already ranked ablated; a candidate ablated besides

            def plan(kind, cut=done_layers):
                return dict.fromkeys(cut, stack.ranked), kind

        sums, tokens, positions = _scan(stack, batches, plan, left, kinds, settings.window, progress)
        sign = -1.0 if restore else 1.0  # restore: what the candidate recovers, the base's loss over its own
        rows = []
        for i in left:
            row = {"layer": i, "round": r + 1, "retrieval": 0.0, "kl": 0.0, "score": 0.0}
            parts = {}
            for kind in kinds:
                base_nll = sums["base", kind][0] / max(tokens, 1)
                base_kl = sums["base", kind][1] / max(positions, 1)
                retrieval = sign * (sums[i, kind][0] / max(tokens, 1) - base_nll)
                kl = sign * (sums[i, kind][1] / max(positions, 1) - base_kl)
                parts[kind] = max(retrieval, 0.0) + settings.kl_weight * kl  # only harm to retrieval counts
                row["retrieval"] += retrieval
                row["kl"] += kl
                row["score"] += parts[kind]
            rows.append(row | ({"parts": parts} if len(kinds) > 1 else {}))
        rows.sort(key=lambda row: (-row["score"], row["layer"]) if restore else (row["score"], row["layer"]))
        ranked += rows[:size]
        left = [i for i in left if i not in {row["layer"] for row in ranked}]
    return ranked[::-1] if restore else ranked
