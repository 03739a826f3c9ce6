"""The mixers a hybrid can run, by name: the one place that lists them.

Each mixer is one module declaring `MIXER = MixerSpec(...)` (see common.MixerSpec). The registry holds
- the built-in mixers (raven.py, sse.py, sila.py);
- the mixers a model directory carries from outside this package (extra_mixers.py, written by the exporter);
- on demand, a mixer another distribution installs under the entry point group ENTRY_POINT_GROUP, found by its name
  (in that distribution's pyproject.toml: [project.entry-points."raven_hybrid.mixers"] gla = "mypkg.gla:MIXER");
- on demand, a declaration named by its import path, "mypkg.gla:MIXER" (or "mypkg.gla", whose MIXER is taken),
  which `convert --mixer` and a recipe's layers[].mixer accept (`resolve_mixer`).

Copied next to every exported model, whose mixers are then all registered on import; it must import nothing but
torch and its siblings.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib.metadata import entry_points
from pathlib import Path

from .common import MixerSpec, did_you_mean
from .extra_mixers import MIXERS as EXTRA_MIXERS  # "from .name import": transformers copies what this form names
from .raven import MIXER as RAVEN
from .sila import MIXER as SILA
from .sse import MIXER as SSE

ENTRY_POINT_GROUP = "raven_hybrid.mixers"
BUILTIN_MIXERS = (RAVEN, SSE, SILA)
DEFAULT_MIXER = RAVEN.name

# The model's own files, which every model directory carries (with the mixers' modules) so that it loads where only
# transformers is installed.
MODEL_FILES = (
    "architectures.py",
    "backend.py",
    "cache.py",
    "common.py",
    "configuration_hybrid.py",
    "decode_attention.py",
    "decode_fusion.py",
    "decode_graph.py",
    "decode_loop.py",
    "extra_mixers.py",
    "masks.py",
    "modeling_hybrid.py",
    "registry.py",
    "sinks.py",
    "sse_forms.py",
    "static_cache.py",
)

_mixers: dict[str, MixerSpec] = {}


def module_file(spec: MixerSpec) -> Path:
    """The source file of the module that defines the mixer's layer class (and declares the mixer)."""
    return Path(inspect.getfile(spec.layer))


BUNDLED_FILES = (*MODEL_FILES, *(module_file(spec).name for spec in BUILTIN_MIXERS))


def register_mixer(spec: MixerSpec) -> MixerSpec:
    """Add `spec` under its name (again is a no-op); returns it. Two different mixers may not share a name."""
    if not isinstance(spec, MixerSpec):
        raise TypeError(f"{spec!r} is not a mixer declaration; expected a MixerSpec (raven_layers.common)")
    known = _mixers.setdefault(spec.name, spec)
    if known is not spec:
        raise ValueError(
            f"two mixers are named {spec.name!r}: one in {known.layer.__module__}, one in {spec.layer.__module__}; "
            "rename one (the NAME of its settings class)"
        )
    return spec


def is_builtin(name: str) -> bool:
    return any(spec.name == name for spec in BUILTIN_MIXERS)


def _load_entry_points() -> None:
    """Register the mixers installed under ENTRY_POINT_GROUP whose names are not registered yet."""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if is_builtin(point.name):
            raise ValueError(
                f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}) takes the name of a "
                "built-in mixer; rename it"
            )
        if point.name in _mixers:
            continue  # a model's own copy of the mixer, or one already loaded
        try:
            spec = point.load()
        except Exception as err:
            raise ValueError(
                f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}) cannot be loaded: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not isinstance(spec, MixerSpec) or spec.name != point.name:
            raise ValueError(
                f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}) must name a MixerSpec whose "
                f"settings' NAME is {point.name!r}; got {spec!r}"
            )
        register_mixer(spec)


def mixer_names() -> tuple[str, ...]:
    """Every mixer known here: built-in, carried by the model, registered, or installed as an entry point."""
    _load_entry_points()
    return tuple(_mixers)


def registered_mixers() -> tuple[MixerSpec, ...]:
    """The declarations of `mixer_names()`, in that order."""
    return tuple(_mixers[name] for name in mixer_names())


def is_mixer(name: str) -> bool:
    """Whether `name` is a registered mixer (entry points are looked up when it is not)."""
    if name not in _mixers:
        _load_entry_points()
    return name in _mixers


def get_mixer(name: str) -> MixerSpec:
    """The mixer registered as `name` (entry points are looked up when it is not); ValueError naming the known
    ones, with the closest as a suggestion, otherwise."""
    if not is_mixer(name):
        names = list(_mixers)
        raise ValueError(
            f"unknown mixer {name!r}; {did_you_mean(name, names)}allowed: {', '.join(names)}, or a mixer declared "
            f"outside the package, by import path (mypkg.module:NAME) or entry point ({ENTRY_POINT_GROUP})"
        )
    return _mixers[name]


def import_object(path: str, what: str):
    """The object an import path "module:attribute" names (`what` says what it should be, for errors)."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({err})") from None
    if not hasattr(module, attribute):
        names = [n for n in vars(module) if not n.startswith("_")]
        raise ValueError(
            f"{what} {path!r}: module {module_name!r} has no {attribute!r}; {did_you_mean(attribute, names)}"
            f"it defines: {', '.join(names)}"
        )
    return getattr(module, attribute)


def import_path(spec: MixerSpec) -> str:
    """ "module:NAME" of the mixer's declaration, which the module of its layer class must hold."""
    module = sys.modules[spec.layer.__module__]
    for name, value in vars(module).items():
        if value is spec:
            return f"{module.__name__}:{name}"
    raise ValueError(
        f"mixer {spec.name!r}: its declaration is not a module-level name of {module.__name__}, the module of its "
        f"layer class {spec.layer.__name__} (the file a model carries); declare MIXER = MixerSpec(...) there"
    )


def resolve_mixer(value: str) -> MixerSpec:
    """The mixer `value` names: a registered name, an entry point's name, or the import path of a declaration,
    "mypkg.module:NAME" ("mypkg.module" alone takes its MIXER), which is then registered under its name."""
    if ":" not in value and "." not in value:
        return get_mixer(value)
    path = value if ":" in value else f"{value}:MIXER"
    spec = import_object(path, "mixer")
    if not isinstance(spec, MixerSpec):
        raise ValueError(
            f"mixer {value!r} is {spec!r}, not a mixer declaration; declare one in its module, "
            "MIXER = MixerSpec(settings=..., layer=..., state=...) (raven_layers.common), and name it"
        )
    return register_mixer(spec)


for _spec in (*BUILTIN_MIXERS, *EXTRA_MIXERS):
    register_mixer(_spec)
