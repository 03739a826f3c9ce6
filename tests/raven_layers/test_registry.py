"""The mixer registry: one declaration per mixer, found by name, import path or entry point, with clear errors."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

import raven_layers
from raven_layers import HybridConfig, MixerSettings, MixerSpec, get_mixer, mixer_names, resolve_mixer
from raven_layers.configuration_hybrid import HybridConfigError
from raven_layers.registry import BUILTIN_MIXERS, BUNDLED_FILES, ENTRY_POINT_GROUP, import_object, import_path
from tests.conftest import tiny_config
from tests.support import gla_mixer

PACKAGE = Path(raven_layers.__file__).parent


def test_the_built_in_mixers_are_declared_once_each():
    assert [spec.name for spec in BUILTIN_MIXERS] == ["raven", "sse", "sila"] == list(mixer_names())[:3]
    for spec in BUILTIN_MIXERS:
        assert get_mixer(spec.name) is spec and import_path(spec) == f"raven_layers.{spec.name}:MIXER"
        assert spec.settings.__module__ == spec.layer.__module__ == f"raven_layers.{spec.name}"
        assert spec.state and spec.references and all(callable(f) for f in spec.references)
        assert importlib.util.find_spec(spec.kernels) is not None, spec.kernels
        assert callable(import_object(spec.pictures, "pictures"))


def test_every_file_of_the_model_package_is_bundled():
    files = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py"}
    assert set(BUNDLED_FILES) == files


def test_an_unknown_name_gets_a_suggestion_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown mixer 'sila2'; did you mean 'sila'\? allowed: raven, sse, sila, or"):
        get_mixer("sila2")
    with pytest.raises(HybridConfigError, match=r"layer_mixers\[1\] = 'rvn'; did you mean 'raven'\? allowed: \["):
        HybridConfig.from_source(tiny_config("llama"), ["attention", "rvn", "attention", "attention"], {})


def test_a_declaration_is_found_by_import_path_and_registered(mixer_registry):
    assert "gla" not in mixer_names()
    assert resolve_mixer("tests.support.gla_mixer:MIXER") is gla_mixer.MIXER
    assert resolve_mixer("tests.support.gla_mixer") is gla_mixer.MIXER  # the module's MIXER
    assert get_mixer("gla") is gla_mixer.MIXER and "gla" in mixer_names()


@pytest.mark.parametrize(
    "path, message",
    [
        ("tests.support.no_such_module:MIXER", "cannot import 'tests.support.no_such_module'"),
        ("tests.support.gla_mixer:MIXR", "has no 'MIXR'; did you mean 'MIXER'?"),
        ("tests.support.gla_mixer:GLAMixer", "is <class 'tests.support.gla_mixer.GLAMixer'>, not a mixer declaration"),
    ],
)
def test_a_bad_import_path_says_what_is_wrong(mixer_registry, path, message):
    with pytest.raises(ValueError) as info:
        resolve_mixer(path)
    assert message in str(info.value)


def test_two_mixers_cannot_share_a_name(mixer_registry):
    copy = dataclasses.replace(gla_mixer.MIXER)
    mixer_registry.register_mixer(gla_mixer.MIXER)
    mixer_registry.register_mixer(gla_mixer.MIXER)  # the same one again: nothing to do
    with pytest.raises(ValueError, match="two mixers are named 'gla': one in tests.support.gla_mixer, one in"):
        mixer_registry.register_mixer(copy)


def test_a_declaration_is_checked():
    @dataclasses.dataclass(frozen=True)
    class Nameless(MixerSettings):
        output_gate: bool = False

    with pytest.raises(ValueError, match=r"Nameless.NAME = 'mixer' cannot name a mixer; expected lowercase letters"):
        MixerSpec(settings=Nameless, layer=gla_mixer.GLAMixer, state="[d, d]")
    with pytest.raises(TypeError, match=r"MixerSpec.layer = .*; expected a subclass of Mixer"):
        MixerSpec(settings=gla_mixer.GLASettings, layer=dict, state="[d, d]")
    with pytest.raises(TypeError, match=r"MixerSpec.pictures = .*; expected an import path"):
        MixerSpec(settings=gla_mixer.GLASettings, layer=gla_mixer.GLAMixer, state="[d, d]", pictures=print)


def fake_distribution(folder: Path, entry: str) -> Path:
    """An installed distribution declaring `entry` in the mixers' entry point group, as pip would leave it."""
    info = folder / "fake_mixers-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-mixers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry}\n")
    return folder


def test_an_installed_entry_point_is_found_by_name(mixer_registry, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(fake_distribution(tmp_path, "gla = tests.support.gla_mixer:MIXER")))
    assert get_mixer("gla") is gla_mixer.MIXER
    config = HybridConfig.from_source(tiny_config("llama"), ["gla", "attention", "attention", "attention"], {})
    assert config.mixer_sources == {"gla": "tests.support.gla_mixer:MIXER"}


@pytest.mark.parametrize(
    "entry, message",
    [
        ("raven = tests.support.gla_mixer:MIXER", "takes the name of a built-in mixer"),
        ("glb = tests.support.gla_mixer:MIXER", "must name a MixerSpec whose settings' NAME is 'glb'"),
        ("gone = tests.support.nothing:MIXER", "cannot be loaded: ModuleNotFoundError"),
    ],
)
def test_a_bad_entry_point_is_named(mixer_registry, monkeypatch, tmp_path, entry, message):
    monkeypatch.syspath_prepend(str(fake_distribution(tmp_path, entry)))
    with pytest.raises(ValueError, match=f"entry point {entry.split()[0]} = .*{message}"):
        mixer_names()


def test_a_config_imports_its_mixers_from_their_recorded_sources(mixer_registry):
    sources = {"gla": "tests.support.gla_mixer:MIXER"}
    kinds = ["gla", "attention", "raven", "attention"]
    config = HybridConfig.from_source(tiny_config("llama"), kinds, {}, mixer_sources=sources)
    assert get_mixer("gla") is gla_mixer.MIXER and config.mixer_sources == sources
    assert config.mixer_settings["gla"] == {"gate_rank": 16, "gate_temperature": 16.0, "output_gate": False}
    with pytest.raises(HybridConfigError, match=r"layer_mixers\[0\] = 'glb': .*cannot import .*trust_remote_code"):
        HybridConfig.from_source(tiny_config("llama"), ["glb", *kinds[1:]], {}, mixer_sources={"glb": "nowhere:X"})
