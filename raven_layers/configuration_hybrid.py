"""Configuration of a hybrid model: the source architecture's own fields, plus which mixer each layer runs."""

from __future__ import annotations

from transformers import PretrainedConfig

from .common import MixerSpec, did_you_mean
from .registry import get_mixer, import_path, is_builtin, is_mixer, mixer_names, resolve_mixer

# Fields of the source config that describe the source file, not the architecture a hybrid inherits.
_SOURCE_ONLY_FIELDS = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "_name_or_path",
    "quantization_config",
)
# Fields of a hybrid's config beyond its architecture's: the plan of its conversion and the toolkit's records of how
# it was made. A hybrid converted further states its own (from_source carries the settings, sources and windows).
_HYBRID_FIELDS = (
    "base_model_type",
    "layer_mixers",
    "mixer_settings",
    "mixer_sources",
    "attention_windows",
    "attention_sinks",
    "layer_choice",
    "converted_from",
)


class HybridConfigError(ValueError):
    """A hybrid config whose fields do not describe a valid hybrid (a ValueError)."""


class HybridConfig(PretrainedConfig):
    """`base_model_type` names the source architecture (see architectures.py); every other source field is kept.

    Args:
        base_model_type: `model_type` of the source model ("llama", "qwen3", ...).
        layer_mixers: one entry per layer: "attention" (the source layer is kept) or a mixer's registered name.
        mixer_settings: hyper-parameters per mixer in use, e.g. {"raven": {"num_slots": 256, ...}}.
        mixer_sources: the import path of each mixer in use from outside the package, e.g. {"gla":
            "mypkg.gla:MIXER"} (recorded when missing): the toolkit imports it from there, while the model's own
            code (trust_remote_code=True) runs the copy it carries (see registry.py).
        attention_windows: one entry per layer, the sliding window of a kept attention layer (None: full causal
            attention); None altogether keeps the source architecture's own windows.
        attention_sinks: S >= 0: every sliding-window layer also attends to the first S tokens of each sequence
            (StreamingLLM's attention sinks: heads park weight on the first tokens, which a bare window drops).
    """

    model_type = "raven_hybrid"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        base_model_type: str = "llama",
        layer_mixers=None,
        mixer_settings=None,
        attention_windows=None,
        mixer_sources=None,
        attention_sinks: int = 0,
        **kwargs,
    ):
        self.base_model_type = base_model_type
        self.layer_mixers = list(layer_mixers) if layer_mixers is not None else None
        self.mixer_settings = dict(mixer_settings or {})
        self.mixer_sources = dict(mixer_sources or {})
        self.attention_windows = list(attention_windows) if attention_windows is not None else None
        self.attention_sinks = attention_sinks
        super().__init__(**kwargs)
        if isinstance(attention_sinks, bool) or not isinstance(attention_sinks, int) or attention_sinks < 0:
            raise HybridConfigError(f"attention_sinks = {attention_sinks!r}; expected an integer >= 0 (tokens)")
        num_layers = getattr(self, "num_hidden_layers", None)
        if num_layers is None:  # transformers builds a bare instance to diff defaults against
            return
        if self.layer_mixers is None:
            self.layer_mixers = ["attention"] * num_layers
        if len(self.layer_mixers) != num_layers:
            raise HybridConfigError(f"layer_mixers has {len(self.layer_mixers)} entries for {num_layers} layers")
        for i, kind in enumerate(self.layer_mixers):
            if kind != "attention" and not is_mixer(kind):
                self._import_mixer(i, kind)
        if self.attention_windows is not None:
            if len(self.attention_windows) != num_layers:
                raise HybridConfigError(
                    f"attention_windows has {len(self.attention_windows)} entries for {num_layers} layers"
                )
            for i, window in enumerate(self.attention_windows):
                if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                    raise HybridConfigError(f"attention_windows[{i}] = {window!r}; expected an integer >= 1 or null")
        # validates, records every default so the saved config is complete, and drops mixers not in use
        in_use = sorted(set(self.layer_mixers) - {"attention"})
        try:
            self.mixer_settings = {name: self.settings_for(name).to_dict() for name in in_use}
        except ValueError as err:
            raise HybridConfigError(str(err)) from None
        outside = [name for name in in_use if not is_builtin(name)]
        self.mixer_sources = {name: self.mixer_sources.get(name) or import_path(get_mixer(name)) for name in outside}

    def _import_mixer(self, i: int, kind: str) -> None:
        """Register the mixer `kind` of layer i from its recorded import path; HybridConfigError if it has none or
        it cannot be imported."""
        source = self.mixer_sources.get(kind)
        if source is None:
            kinds = ["attention", *mixer_names()]
            raise HybridConfigError(f"layer_mixers[{i}] = {kind!r}; {did_you_mean(kind, kinds)}allowed: {kinds}")
        try:
            name = resolve_mixer(source).name
        except (TypeError, ValueError) as err:
            raise HybridConfigError(
                f"layer_mixers[{i}] = {kind!r}: {err}; load the model with trust_remote_code=True to run the copy of "
                "the mixer it carries"
            ) from None
        if name != kind:
            raise HybridConfigError(f"mixer_sources[{kind!r}] = {source!r} declares a mixer named {name!r}")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except HybridConfigError as err:  # a hand-edited or damaged config: name the file
            raise HybridConfigError(f"{pretrained_model_name_or_path}/config.json: {err}") from None

    @staticmethod
    def mixer_spec(kind: str) -> MixerSpec:
        """The declaration of the mixer `kind` names, from the registry beside this file (the model's own copy)."""
        return get_mixer(kind)

    def settings_for(self, mixer: str):
        return get_mixer(mixer).settings.from_dict(self.mixer_settings.get(mixer, {}))

    @classmethod
    def from_source(
        cls,
        source_config,
        layer_mixers,
        mixer_settings,
        attention_windows=None,
        mixer_sources=None,
        attention_sinks: int | None = None,
    ) -> "HybridConfig":
        """The config of a hybrid of `source_config` with `layer_mixers`. The source may be a hybrid itself, converted
        further: its architecture, its mixers' settings and import paths, and its attention windows and sinks (unless
        `attention_windows`, `attention_sinks` are given) carry over, and settings given for one of its mixers must be
        the ones it has (every layer of a mixer shares them, its trained layers included); HybridConfigError
        otherwise."""
        fields = {k: v for k, v in source_config.to_dict().items() if k not in _SOURCE_ONLY_FIELDS + _HYBRID_FIELDS}
        base_model_type = source_config.model_type
        if attention_sinks is None:
            attention_sinks = getattr(source_config, "attention_sinks", 0) or 0
        if base_model_type == cls.model_type:
            base_model_type = source_config.base_model_type
            mixer_settings = _carried_settings(source_config.mixer_settings, mixer_settings)
            mixer_sources = {**source_config.mixer_sources, **(mixer_sources or {})}
            if attention_windows is None and source_config.attention_windows is not None:  # none on a new mixer
                attention_windows = [
                    w if kind == "attention" else None for w, kind in zip(source_config.attention_windows, layer_mixers)
                ]
        return cls(
            base_model_type=base_model_type,
            layer_mixers=layer_mixers,
            mixer_settings=mixer_settings,
            attention_windows=attention_windows,
            mixer_sources=mixer_sources,
            attention_sinks=attention_sinks,
            **fields,
        )


def _carried_settings(source: dict[str, dict], given: dict[str, dict]) -> dict[str, dict]:
    """The settings of a further conversion: the source hybrid's for its mixers, `given` for the others; a given
    value that differs from the source's raises HybridConfigError naming it."""
    for mixer, values in given.items():
        changed = {k: v for k, v in values.items() if k in source.get(mixer, {}) and source[mixer][k] != v}
        if changed:
            name, value = next(iter(changed.items()))
            raise HybridConfigError(
                f"{mixer}.{name} = {value!r}, but the source hybrid's {mixer} layers were made with "
                f"{source[mixer][name]!r}: the layers of one mixer share its settings; leave it out (the source's "
                "value is kept) or give that value"
            )
    return {**given, **{mixer: {**values, **given.get(mixer, {})} for mixer, values in source.items()}}
