"""The surgery: decide which layer becomes which mixer, then build the hybrid from the source weights.

The source is a Transformer or a hybrid this toolkit saved, converted further (progressive conversion): a plan for a
hybrid keeps every layer it converted, with the same mixer and its trained weights, and converts more of the
attention layers it kept.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from raven_layers import HybridConfig, HybridForCausalLM, get_architecture, mixer_names, resolve_mixer
from raven_layers.architectures import layer_windows

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


def is_hybrid_config(config) -> bool:
    """Whether a source's config is a hybrid's (one this toolkit saved), not a Transformer's."""
    return getattr(config, "model_type", None) == HybridConfig.model_type


def start_kinds(config) -> list[str]:
    """Per layer, what the source runs: a hybrid's layer kinds, or attention everywhere for a Transformer."""
    return list(config.layer_mixers) if is_hybrid_config(config) else ["attention"] * config.num_hidden_layers


def source_windows(config) -> list[int | None]:
    """Per layer, the attention window of the source (None: full attention; a hybrid's mixer layers: None)."""
    if is_hybrid_config(config):
        return layer_windows(config)
    return get_architecture(getattr(config, "model_type", None)).sliding_windows(config)


def check_kept(start: list[str], kinds: list[str], source: str) -> None:
    """A plan of a further conversion (`start`: the source hybrid's kinds) keeps every layer the source converted,
    as the same mixer, and converts at least one layer more; ValueError naming the layers otherwise. A Transformer's
    plan (start all attention) passes."""
    if all(kind == "attention" for kind in start):
        return
    changed = [
        f"layer {i} is {was} in the source and {'kept as attention' if now == 'attention' else now} in the plan"
        for i, (was, now) in enumerate(zip(start, kinds))
        if was != "attention" and now != was
    ]
    if changed:
        raise ValueError(
            f"the source {source!r} is a hybrid, and a further conversion keeps each layer it converted as the same "
            f"mixer: {'; '.join(changed)}. Name those layers with their mixer in the plan (--mixer/--layers, or a "
            "recipe's layers)"
        )
    if kinds == start:
        raise ValueError(
            f"the plan converts no layer that the source hybrid {source!r} kept as attention (it converted "
            f"layers {listed_layers(start)}): name more layers, or auto:N with N above "
            f"{sum(k != 'attention' for k in start)}"
        )


def listed_layers(kinds: list[str]) -> str:
    """'0, 2 (sila), 5 (raven)': the converted layers of `kinds`."""
    return ", ".join(f"{i} ({kind})" for i, kind in enumerate(kinds) if kind != "attention")


def conversion_chain(config, name: str) -> list[dict]:
    """The `converted_from` record of a hybrid converted further from the hybrid `name` (whose config is `config`):
    the hybrids it came from, oldest first, each {"model": as it was given, "layer_mixers": its layers' kinds}."""
    return [*getattr(config, "converted_from", []), {"model": name, "layer_mixers": list(config.layer_mixers)}]


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


def check_sinks(sinks: int | None, kinds: list[str], windows: list[int | None]) -> None:
    """`sinks` (--attention-sinks; None: the source's) must be a count, and a count > 0 needs a sliding window on some
    kept attention layer (`windows`: the planned per-layer windows, or the source's)."""
    if sinks is None:
        return
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"--attention-sinks {sinks!r} is not allowed; expected an integer >= 0 (tokens)")
    if sinks and not any(w is not None and k == "attention" for k, w in zip(kinds, windows)):
        raise ValueError(
            f"--attention-sinks {sinks} keeps the first tokens visible to sliding-window layers, and this plan keeps "
            "no windowed attention layer: add --sliding-window (and --window-layers)"
        )


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


def check_mixers_fit(
    source_config, layer_kinds, mixer_settings, attention_windows=None, attention_sinks=None
) -> HybridConfig:
    """Raise the error a mixer would raise for this model (e.g. a LoRA rank above a projection's size) before any
    weight is loaded: one mixer of each kind is built on the meta device, which allocates nothing. Returns the
    hybrid's config."""
    config = HybridConfig.from_source(
        source_config, layer_kinds, mixer_settings, attention_windows, attention_sinks=attention_sinks
    )
    arch = get_architecture(config.base_model_type)
    for kind in set(layer_kinds) - {"attention"}:
        with torch.device("meta"):
            config.mixer_spec(kind).layer(config, layer_kinds.index(kind), config.settings_for(kind), arch.qk_norm)
    return config


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default floating dtype set to `dtype` inside the block (what new parameters are made in)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_hybrid(
    source,
    layer_kinds: list[str],
    mixer_settings: dict[str, dict],
    seed: int = 0,
    attention_windows: list[int | None] | None = None,
    attention_sinks: int | None = None,
    share: bool = False,
) -> HybridForCausalLM:
    """A hybrid of `source` (a transformers causal LM, or a hybrid converted further) with `layer_kinds[i]` in layer i.

    Every weight keeps its source name: embeddings, norms, MLPs and kept attention layers load unchanged, and a
    mixer's q/k/v/o (and q/k norms, where both sides have them) start from the attention it replaces. Only the
    mixer-specific parameters are new; they get the mixer's own initialisation (seeded by `seed`). The mixers a
    hybrid source has already load whole, trained weights included (check_kept: they stay where they are, the same
    mixer, with its settings: HybridConfig.from_source). `attention_windows` (see `plan_windows`) turns kept
    attention layers into sliding-window attention; their weights and RoPE are unchanged, and `attention_sinks` S
    keeps the first S tokens of a sequence visible to them (None: the source's, 0 for a Transformer).

    `share`: the hybrid takes the source's tensors themselves, not copies (for a caller that drops the source:
    convert). A source read from safetensors maps its files, so its weights then reach memory only as the hybrid is
    saved: the host holds about one model, not two. Either way the hybrid is built on the meta device and only its
    fresh parameters (and RoPE's tables) are made, so the build itself holds no second model.
    """
    config = HybridConfig.from_source(
        source.config, layer_kinds, mixer_settings, attention_windows, attention_sinks=attention_sinks
    )
    with default_dtype(source.dtype), torch.device("meta"):  # built in the source's dtype, nothing allocated
        hybrid = HybridForCausalLM(config)
    start = start_kinds(source.config)
    new = [i for i, kind in enumerate(layer_kinds) if kind != "attention" and start[i] == "attention"]
    fresh = {
        f"model.layers.{i}.self_attn.{name}"
        for i in new
        for name in hybrid.model.layers[i].self_attn.fresh_parameter_names()
    }
    here = torch.get_default_device()
    for name in fresh:
        owner, _, attr = name.rpartition(".")
        meta = hybrid.get_parameter(name)
        setattr(
            hybrid.get_submodule(owner),
            attr,
            torch.nn.Parameter(torch.empty_like(meta, device=here), meta.requires_grad),
        )
    arch = get_architecture(config.base_model_type)
    with default_dtype(source.dtype), torch.device(here):  # buffers are what __init__ computes: made again
        hybrid.model.rotary_emb = type(hybrid.model.rotary_emb)(config=config)
        for i, kind in enumerate(layer_kinds):
            mixer = hybrid.model.layers[i].self_attn
            if kind != "attention" and any(b.is_meta for b in mixer.buffers()):  # a mixer's own tables, if any
                made = config.mixer_spec(kind).layer(config, i, config.settings_for(kind), arch.qk_norm)
                for name, buffer in made.named_buffers():
                    owner, _, attr = name.rpartition(".")
                    mixer.get_submodule(owner)._buffers[attr] = buffer
    torch.manual_seed(seed)
    hybrid.init_weights()  # transformers' pass, a mixer's own last (reset_mixer_parameters): only made tensors change
    # a fresh parameter may share a source name with another shape (e.g. SSE's q/k with c != head_dim)
    weights = {k: v for k, v in source.state_dict().items() if k not in fresh}
    if not share:  # copies, in the hybrid's dtype where it has the tensor
        own = hybrid.state_dict(keep_vars=True)
        weights = {k: v.to(here, own[k].dtype if k in own else v.dtype, copy=True) for k, v in weights.items()}
    missing, unexpected = hybrid.load_state_dict(weights, strict=False, assign=True)
    hybrid.tie_weights()  # each assigned tensor became a parameter of its own: tied ones are tied again
    replaced = tuple(f"model.layers.{i}.self_attn." for i in new)
    dropped = {k for k in unexpected if k.startswith(replaced)}  # e.g. q/k norms of a mixer without them
    unmade = [k for k, t in itertools.chain(hybrid.named_parameters(), hybrid.named_buffers()) if t.is_meta]
    problems = {
        "missing": sorted(set(missing) ^ fresh),
        "unexpected": sorted(set(unexpected) - dropped),
        "left on the meta device": sorted(unmade),
    }
    if any(problems.values()):
        found = "; ".join(f"{kind} {names}" for kind, names in problems.items() if names)
        raise RuntimeError(f"source and hybrid weights do not line up: {found}")
    hybrid.generation_config = source.generation_config
    return hybrid.eval()
