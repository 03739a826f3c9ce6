"""`convert_model`: the whole conversion, validated up front, heavy work last."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from raven_layers import get_architecture, get_mixer

from .bundle import check_bundle
from .export import check_out_dir, check_shard_size, push_to_hub, save_hybrid
from .layer_choice import (
    ChoiceSettings,
    auto_assignment,
    check_choice_data,
    check_keep_copying,
    choose_kinds,
    first_kinds,
)
from .sources import DEFAULT_SRC, Source
from .surgery import (
    build_hybrid,
    check_kept,
    check_mixers_fit,
    check_sinks,
    conversion_chain,
    format_layer_map,
    is_hybrid_config,
    listed_layers,
    plan_layers,
    plan_windows,
    source_windows,
    start_kinds,
)


@dataclass
class ConvertRequest:
    """Everything `convert` needs. `assignments` pairs a mixer with a `--layers` spec, e.g. [("raven", "0-23:5")]; a
    mixer is a registered name or the import path of a declaration (see raven_layers.registry). `mixer_settings`
    is keyed by the mixers' names. A spec `auto:N` (the only assignment then) converts the N layers that matter
    least, measured on `choice_data` (see layer_choice.py), with the scores cached in `choice_cache`. `src` may be a
    hybrid this toolkit saved, converted further: the plan keeps the layers it converted (auto:N counts them)."""

    out: Path
    assignments: list[tuple[str, str]]
    src: str = DEFAULT_SRC
    mixer_settings: dict[str, dict] = field(default_factory=dict)
    sliding_window: int | None = None  # kept attention layers named by window_layers (all by default) use it
    window_layers: str | None = None
    attention_sinks: int | None = None  # windowed layers also see each sequence's first S tokens; None: the source's
    dtype: str = "auto"
    seed: int = 0
    max_shard_size: str = "2GB"
    overwrite: bool = False
    push_to_hub: str | None = None
    private: bool = False
    choice_data: str | None = None  # corpus of auto:N's probes: file, folder or Hub dataset (see train/data.py)
    choice_text_field: str = "text"
    choice_settings: ChoiceSettings = field(default_factory=ChoiceSettings)
    choice_cache: Path | None = None  # None: layer_choice.default_cache_dir()

    @classmethod
    def of(cls, values: Mapping, **given) -> ConvertRequest:
        """The request of `given`, its other fields taken from `values` where a key there bears the field's name (the
        CLI's parsed flags, the recipe's fields), so that a field added here reaches every caller that names it so."""
        named = {f.name: values[f.name] for f in fields(cls) if f.name in values}
        return cls(**(named | given))


def convert_model(request: ConvertRequest, log=print) -> Path:
    """Convert `request.src` and write the hybrid to `request.out`; returns the output directory. The source may be
    a hybrid this toolkit saved: it is converted further (surgery.check_kept says what its plan must keep)."""
    out = Path(request.out)
    check_out_dir(out, request.overwrite)  # the output flags first: a typo there costs no download
    check_shard_size(request.max_shard_size)
    source = Source.resolve(request.src)
    if request.push_to_hub:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(request.push_to_hub)
    config = source.load_config()
    further = is_hybrid_config(config)  # a hybrid this toolkit saved, converted further
    arch = get_architecture(config.base_model_type if further else getattr(config, "model_type", None))
    before = start_kinds(config)
    L = config.num_hidden_layers
    auto = auto_assignment(request.assignments, L, request.window_layers)
    if auto:  # until the layers are measured, the mixer is checked on the first N
        from raven_convert.train.choice_parts import training_parts  # handed in: layer_choice imports nothing of train

        parts = training_parts()
        check_choice_data(request.choice_data, request.choice_text_field, parts)
    kinds = first_kinds(before, auto) if auto else plan_layers(request.assignments, L)  # registers import paths
    if auto:
        check_keep_copying(before, auto, request.choice_settings.keep_copying)
    check_kept(before, kinds, source.name)
    for mixer, values in request.mixer_settings.items():
        try:
            spec = get_mixer(mixer)
        except ValueError as err:
            raise ValueError(f"settings given for {err}") from None
        spec.settings.from_dict(values)
    windows = plan_windows(kinds, source_windows(config), request.sliding_window, request.window_layers)
    check_sinks(request.attention_sinks, kinds, windows or source_windows(config))  # auto:N windows all it keeps
    used = {k: request.mixer_settings.get(k, {}) for k in set(kinds) - {"attention"}}
    check_bundle(check_mixers_fit(config, kinds, used, windows, request.attention_sinks))
    converted = f"; a hybrid that converted layers {listed_layers(before)}" if further else ""
    log(f"source: {source.name} ({arch.model_type}, {L} layers{converted})")
    if not auto:
        log(format_layer_map(kinds, windows or source_windows(config)))

    start = time.perf_counter()
    model = source.load_model(request.dtype)
    tokenizer = source.load_tokenizer()
    log(f"loaded the source in {time.perf_counter() - start:.1f} s ({model.dtype})")
    record = None
    if auto:
        kinds, record = choose_kinds(model, tokenizer, auto, request, parts, log)
        windows = plan_windows(kinds, source_windows(config), request.sliding_window, request.window_layers)
        log(format_layer_map(kinds, windows or source_windows(config)))

    # the hybrid takes the source's tensors, not copies: the source is dropped here
    hybrid = build_hybrid(model, kinds, used, request.seed, windows, request.attention_sinks, share=True)
    del model
    if record is not None:
        hybrid.config.layer_choice = record  # saved in config.json, drawn and described by save_hybrid
    if further:
        hybrid.config.converted_from = conversion_chain(config, source.name)  # in config.json and the model card
    save_hybrid(
        hybrid,
        tokenizer,
        out,
        base_model=source.name,
        max_shard_size=request.max_shard_size,
        overwrite=request.overwrite,
    )
    log(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    if request.push_to_hub:
        push_to_hub(out, request.push_to_hub, private=request.private)
        log(f"pushed to https://huggingface.co/{request.push_to_hub}")
    return out
