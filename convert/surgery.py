"""The surgery: decide which layer becomes which mixer, then build the hybrid from the source weights."""

from __future__ import annotations

import torch

from raven_layers import HybridConfig, HybridForCausalLM, get_architecture, mixer_names, resolve_mixer

from .layer_spec import parse_layer_spec


def plan_layers(assignments: list[tuple[str, str]], num_layers: int) -> list[str]:
    """Per-layer kind from (mixer, layer spec) pairs; layers no pair names keep attention. A mixer is a registered
    name or the import path of a declaration (see raven_layers.registry), which the kinds name by its name.

    >>> plan_layers([("raven", "0-3:2")], 4)
    ['raven', 'attention', 'raven', 'attention']
    """
    kinds = ["attention"] * num_layers
    owner: dict[int, tuple[str, str]] = {}
    for given, spec in assignments:
        try:
            mixer = resolve_mixer(given).name
        except (TypeError, ValueError) as err:
            raise ValueError(f"--mixer: {err}") from None
        for i in parse_layer_spec(spec, num_layers):
            if i in owner:
                raise ValueError(
                    f"layer {i} is assigned twice: to {owner[i][0]} by --layers {owner[i][1]!r} "
                    f"and to {mixer} by --layers {spec!r}"
                )
            owner[i] = (mixer, spec)
            kinds[i] = mixer
    return kinds


def plan_windows(
    kinds: list[str], source_windows: list[int | None], window: int | None, spec: str | None
) -> list[int | None] | None:
    """Per-layer attention windows: `window` on the kept attention layers `spec` names (all of them by default),
    the source's own window elsewhere. None when no window is asked for (the source's windows stand)."""
    if window is None:
        if spec is not None:
            raise ValueError(f"--window-layers {spec!r} needs --sliding-window")
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"--sliding-window {window!r} is not allowed; expected an integer >= 1 (tokens)")
    chosen = (
        parse_layer_spec(spec, len(kinds), "--window-layers")
        if spec is not None
        else [i for i, k in enumerate(kinds) if k == "attention"]
    )
    mixers = [i for i in chosen if kinds[i] != "attention"]
    if mixers:
        raise ValueError(
            f"--window-layers {spec!r} names layer(s) {mixers}, which become mixers; only kept attention layers "
            "take a sliding window"
        )
    return [window if i in chosen else w for i, w in enumerate(source_windows)]


def format_layer_map(kinds: list[str], windows: list[int | None] | None = None) -> str:
    """One line per layer kind with its layers, then one line per layer."""
    windows = windows or [None] * len(kinds)
    order = ["attention", *mixer_names()]
    width = max(len(k) for k in order)
    summary = [
        f"  {kind:<{width}}  {sum(k == kind for k in kinds):>3} layers: "
        + (",".join(str(i) for i, k in enumerate(kinds) if k == kind) or "-")
        for kind in order
        if kind in kinds
    ]
    rows = [
        f"  layer {i:>3}  "
        + ("becomes " + k if k != "attention" else "keeps attention" + (f" (sliding window {w})" if w else ""))
        for i, (k, w) in enumerate(zip(kinds, windows))
    ]
    return "\n".join(["layer map:", *summary, *rows])


def check_mixers_fit(source_config, layer_kinds, mixer_settings, attention_windows=None) -> HybridConfig:
    """Raise the error a mixer would raise for this model (e.g. a LoRA rank above a projection's size) before any
    weight is loaded: one mixer of each kind is built on the meta device, which allocates nothing. Returns the
    hybrid's config."""
    config = HybridConfig.from_source(source_config, layer_kinds, mixer_settings, attention_windows)
    arch = get_architecture(config.base_model_type)
    for kind in set(layer_kinds) - {"attention"}:
        with torch.device("meta"):
            config.mixer_spec(kind).layer(config, layer_kinds.index(kind), config.settings_for(kind), arch.qk_norm)
    return config


def build_hybrid(
    source,
    layer_kinds: list[str],
    mixer_settings: dict[str, dict],
    seed: int = 0,
    attention_windows: list[int | None] | None = None,
) -> HybridForCausalLM:
    """A hybrid of `source` (a transformers causal LM) with `layer_kinds[i]` in layer i.

    Every weight keeps its source name: embeddings, norms, MLPs and kept attention layers load unchanged, and a
    mixer's q/k/v/o (and q/k norms, where both sides have them) start from the attention it replaces. Only the
    mixer-specific parameters are new; they get the mixer's own initialisation (seeded by `seed`).
    `attention_windows` (see `plan_windows`) turns kept attention layers into sliding-window attention; their
    weights and RoPE are unchanged.
    """
    config = HybridConfig.from_source(source.config, layer_kinds, mixer_settings, attention_windows)
    torch.manual_seed(seed)
    hybrid = HybridForCausalLM(config).to(source.dtype)
    fresh = {
        f"model.layers.{i}.self_attn.{name}"
        for i, kind in enumerate(layer_kinds)
        if kind != "attention"
        for name in hybrid.model.layers[i].self_attn.fresh_parameter_names()
    }
    # a fresh parameter may share a source name with another shape (e.g. SSE's q/k with c != head_dim)
    weights = {k: v for k, v in source.state_dict().items() if k not in fresh}
    missing, unexpected = hybrid.load_state_dict(weights, strict=False)
    replaced = tuple(f"model.layers.{i}.self_attn." for i, kind in enumerate(layer_kinds) if kind != "attention")
    dropped = {k for k in unexpected if k.startswith(replaced)}  # e.g. q/k norms of a mixer without them
    if set(missing) != fresh or set(unexpected) != dropped:
        raise RuntimeError(
            "source and hybrid weights do not line up: "
            f"missing {sorted(set(missing) ^ fresh)}, unexpected {sorted(set(unexpected) - dropped)}"
        )
    hybrid.generation_config = source.generation_config
    return hybrid.eval()
