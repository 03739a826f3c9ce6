"""How long a hybrid's mixer memories hold a passkey: the needle's trace in each mixer state, token by token.

    python scripts/tools/memory_reach.py RUN/extend/model --out RUN/memory-reach --length 16384 --attention-window 4096

A passkey prompt and its twin, whose passkey has other digits and the same tokens everywhere else, are read by the
model up to just past the needle and then up to every `every` tokens after it. At each point the difference of the
twins' mixer states (each layer's cache tensors) is what that layer's memory holds of the passkey, written by the
needle itself or carried in by the layers below:

- `kept`: its norm over its norm just past the needle (`PAST_NEEDLE` tokens on, so that no short convolution's
  tail still holds needle tokens): 1 while the memory holds the passkey as written, near 0 once it is gone;
- `share`: its norm over the state's own norm, how much of the memory the passkey is;
- `control`: `kept` of a third prompt, the first with one haystack token before the needle changed instead of the
  passkey. Any change spreads through a deep model (sliding windows stacked over layers reach further than one),
  so a difference that lasts is not yet a memory of the passkey: only `kept` above `control` is.

For SILA layers the decay alone is traced beside them (`decay`, of the first pair: the exact gates step token by
token): the product of the forget gates gamma_t since that point, memory-dependent terms included
(`analysis.sila_gate_traces`), for the kv head that forgets least (`decay_heads`: every head's). Where `kept` falls
far below `decay`, the delta rule's later writes erase the passkey, not the forget gate. At the prompt's end the
next-token distributions are compared (`answer_tv` between the twins, `control_tv` between the prompt and its
control; total variation distance): 0 when the model's answer does not depend on the passkey at all.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass, field

import torch

from raven_layers.cache import output_cache

from ..files import write_png
from . import analysis, analysis_plots
from .retrieval import build_samples

PAST_NEEDLE = 8  # tokens after the needle's last one where `kept` is 1 by definition
TWIN_TRIES = 50


@dataclass
class Twins:
    """A passkey prompt, its twin and the control, [3, T] token ids, with the needle's token span in all three."""

    ids: torch.Tensor
    needle_start: int
    needle_end: int  # one past the needle's last token
    passkeys: tuple[str, str]


@dataclass
class Reach:
    """The measurement over `prompts` twin pairs: per mixer layer, medians over the pairs at each distance."""

    distances: list[int]  # tokens after the needle's last one
    kept: dict[int, list[float]] = field(default_factory=dict)
    control: dict[int, list[float]] = field(default_factory=dict)
    share: dict[int, list[float]] = field(default_factory=dict)
    decay: dict[int, list[float]] = field(default_factory=dict)  # SILA layers only, the first pair's
    decay_heads: dict[int, list[list[float]]] = field(default_factory=dict)  # the same per kv head, [distance][head]
    answer_tv: list[float] = field(default_factory=list)  # one per pair
    control_tv: list[float] = field(default_factory=list)
    layer_kinds: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def make_twins(tokenizer, length: int, depth: float, seed: int, device) -> Twins:
    """A passkey prompt of `length` tokens with its needle at `depth`, its twin (the same prompt with another
    passkey whose tokens differ only inside the needle) and the control (the prompt with the token before the needle
    changed to the one before it). Raises ValueError when no such passkey is found."""
    sample = build_samples("passkey", tokenizer, [length], [depth], 1, seed=seed)[0]
    add_special = sample.meta["add_special_tokens"]
    start, end = sample.meta["needles"][0]["token_span"]
    passkey = sample.answers[0]
    ids = tokenizer(sample.prompt, add_special_tokens=add_special).input_ids
    rng = random.Random(f"twin:{seed}")
    for _ in range(TWIN_TRIES):
        other = "".join(rng.choice([c for c in "0123456789" if c != d]) for d in passkey)  # every digit differs
        twin = tokenizer(sample.prompt.replace(passkey, other), add_special_tokens=add_special).input_ids
        differ = [t for t, (a, b) in enumerate(zip(ids, twin)) if a != b]
        if len(twin) == len(ids) and differ and start <= differ[0] and differ[-1] < end:
            control = list(ids)
            changed = next((t for t in range(start - 2, -1, -1) if ids[t] != ids[start - 1]), None)
            if changed is None:
                raise ValueError("the needle has no haystack token before it to change for the control")
            control[start - 1] = ids[changed]
            triple = torch.tensor([ids, twin, control], dtype=torch.long, device=device)  # [3, T]
            return Twins(triple, start, end, (passkey, other))
    raise ValueError(f"no twin passkey for {passkey!r} changes only the needle's tokens in {TWIN_TRIES} tries")


def _state_difference(cache, layer: int) -> tuple[float, float, float]:
    """(|S_a - S_b|, |S_a - S_c|, |S_a|) of one mixer layer's state tensors in the cache of the [3, ...] batch of
    `Twins`, float64 norms."""
    squares = [0.0, 0.0, 0.0]
    for tensor in cache.get_mixer_state(layer):
        if tensor is None:
            continue
        a, b, c = tensor[0].double(), tensor[1].double(), tensor[2].double()
        for i, x in enumerate((a - b, a - c, a)):
            squares[i] += x.pow(2).sum().item()
    return tuple(math.sqrt(x) for x in squares)


def trace_twins(model, twins: Twins, every: int, gates: bool = True) -> dict:
    """For one pair: {"distances", "diff", "control", "norm", "decay", "decay_heads": {layer: [...]}, "answer_tv",
    "control_tv"}: the twins' state difference, the control's, and the state norm of every mixer layer after each
    prefix, the SILA layers' gate products since the first point (with `gates`; each head's and the largest), and
    the last token's total variation between the twins and between the prompt and its control."""
    kinds = model.config.layer_mixers
    mixers = [i for i, kind in enumerate(kinds) if kind != "attention"]
    T = twins.ids.shape[1]
    first = twins.needle_end + PAST_NEEDLE
    if first > T:
        raise ValueError(f"the needle ends {T - twins.needle_end} tokens before the prompt's end; move it earlier")
    ends = list(range(first, T + 1, every))
    out = {"distances": [e - twins.needle_end for e in ends], "diff": {}, "control": {}, "norm": {}}
    out |= {"decay": {}, "decay_heads": {}}
    with analysis._eval_mode(model):
        for end in ends:
            cache = output_cache(model(input_ids=twins.ids[:, :end], use_cache=True, logits_to_keep=1))
            for layer in mixers:
                for key, value in zip(("diff", "control", "norm"), _state_difference(cache, layer)):
                    out[key].setdefault(layer, []).append(value)
        logits = model(input_ids=twins.ids, logits_to_keep=1).logits[:, -1].float()  # [3, V]
    p = logits.softmax(-1)
    out["answer_tv"] = 0.5 * (p[0] - p[1]).abs().sum().item()
    out["control_tv"] = 0.5 * (p[0] - p[2]).abs().sum().item()
    sila = [layer for layer in mixers if kinds[layer] == "sila"]
    if sila and gates:
        inputs, _ = analysis.capture_mixer_inputs(model, twins.ids[:1], sila)
        for layer in sila:
            _, gamma = analysis.sila_gate_traces(model.model.layers[layer].self_attn, inputs[layer])  # [T, H_kv]
            log_kept = (
                gamma.clamp_min(1e-30).log().double().cumsum(0)
            )  # [T, H_kv]; a gate underflowing to 0 stays finite
            since = log_kept[[e - 1 for e in ends]] - log_kept[first - 1]  # gates of tokens first .. e - 1
            out["decay_heads"][layer] = since.exp().tolist()
            out["decay"][layer] = since.exp().amax(-1).tolist()
    return out


def measure_reach(model, tokenizer, length: int, depth: float, prompts: int, every: int, seed: int = 0, log=print):
    """`prompts` twin pairs (seeds seed, seed + 1, ...) traced with `trace_twins`; medians over the pairs at the
    distances all pairs reach (SILA's decay: the first pair's). Returns a `Reach`."""
    if prompts < 1 or every < 1:
        raise ValueError(f"prompts and every must be >= 1, got prompts={prompts}, every={every}")
    traces = []
    for i in range(prompts):
        twins = make_twins(tokenizer, length, depth, seed + i, model.device)
        traces.append(trace_twins(model, twins, every, gates=i == 0))
        tv = f"answer TV {traces[-1]['answer_tv']:.3f} (control {traces[-1]['control_tv']:.3f})"
        log(f"pair {i + 1}/{prompts}: passkeys {twins.passkeys}, {tv}")
    n = min(len(t["distances"]) for t in traces)
    reach = Reach(distances=[statistics.median(t["distances"][k] for t in traces) for k in range(n)])
    reach.layer_kinds = {layer: model.config.layer_mixers[layer] for layer in traces[0]["diff"]}
    for layer in traces[0]["diff"]:
        kept, control, share = [], [], []
        for k in range(n):
            kept.append(statistics.median(_ratio(t["diff"][layer][k], t["diff"][layer][0]) for t in traces))
            control.append(statistics.median(_ratio(t["control"][layer][k], t["control"][layer][0]) for t in traces))
            share.append(statistics.median(_ratio(t["diff"][layer][k], t["norm"][layer][k]) for t in traces))
        reach.kept[layer], reach.control[layer], reach.share[layer] = kept, control, share
        if layer in traces[0]["decay"]:
            reach.decay[layer] = traces[0]["decay"][layer][:n]
            reach.decay_heads[layer] = traces[0]["decay_heads"][layer][:n]
    reach.answer_tv = [t["answer_tv"] for t in traces]
    reach.control_tv = [t["control_tv"] for t in traces]
    return reach


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def format_reach(reach: Reach, columns: int = 6) -> str:
    """A markdown table: per mixer layer, `kept`, the control's and SILA's `decay` at up to `columns` distances
    spread over the measured ones, then the last token's total variation of the twins and of the control."""
    n = len(reach.distances)
    m = min(columns, n)
    picks = sorted({round(k * (n - 1) / max(m - 1, 1)) for k in range(m)})  # first and last included
    head = " / ".join(f"{int(reach.distances[k])}" for k in picks)
    lines = [
        f"tokens after the needle: {head}",
        "",
        "| layer | mixer | passkey kept | control kept | forget-gate product (SILA) |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(values):
        return " / ".join(f"{values[k]:.2g}" for k in picks)

    for layer, kept in reach.kept.items():
        decay = row(reach.decay[layer]) if layer in reach.decay else "-"
        lines.append(f"| {layer} | {reach.layer_kinds[layer]} | {row(kept)} | {row(reach.control[layer])} | {decay} |")
    tv = ", ".join(f"{x:.3f}" for x in reach.answer_tv)
    control = ", ".join(f"{x:.3f}" for x in reach.control_tv)
    lines.append(f"\nthe last token's total variation: twins {tv}; prompt and control {control}")
    return "\n".join(lines)


def plot_reach(reach: Reach, path, title: str | None = None):
    """Per mixer layer (one colour each) against tokens after the needle: the passkey kept (solid), the control's
    (dotted) and SILA's forget-gate product (dashed)."""
    from matplotlib import colormaps

    fig = analysis_plots.new_figure(7.5, 4.5)
    ax = fig.subplots()
    cmap = colormaps["viridis"]
    layers = list(reach.kept)
    for i, layer in enumerate(layers):
        colour = cmap(i / max(len(layers) - 1, 1))
        ax.plot(reach.distances, reach.kept[layer], color=colour, label=f"{layer}")
        ax.plot(reach.distances, reach.control[layer], color=colour, linestyle=":", linewidth=0.8)
        if layer in reach.decay:
            ax.plot(reach.distances, reach.decay[layer], color=colour, linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("tokens after the needle")
    ax.set_ylabel("passkey kept (solid), control (dotted), gates (dashed)")
    ax.legend(title="layer", fontsize=6, ncol=2, loc="lower left")
    ax.set_title(title or "the needle's trace in each mixer's memory")
    return write_png(fig, path, dpi=120)
