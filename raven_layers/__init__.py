"""Hybrid models: source decoder layers with linear-time mixers in place of chosen attention layers.

Importing the package, or any module of it (Python runs this file first), registers the hybrid with the
`transformers` Auto classes: here and nowhere else, so that an exported model loads as this package's classes, with
or without `trust_remote_code`, wherever this toolkit is imported, whatever was imported or loaded before. The copy
of the model's code a model directory carries registers nothing. Code that must have the toolkit's classes
whatever ran before (the training stages) loads through `HybridForCausalLM.from_pretrained`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .architectures import ARCHITECTURES, Architecture, get_architecture
from .cache import HybridCache, cache_argument, output_cache
from .common import Mixer, MixerSettings, MixerSpec
from .configuration_hybrid import HybridConfig
from .modeling_hybrid import HybridForCausalLM, HybridModel
from .raven import RavenMixer, RavenSettings, raven_chunked, raven_recurrent
from .registry import (
    BUNDLED_FILES,
    DEFAULT_MIXER,
    ENTRY_POINT_GROUP,
    get_mixer,
    mixer_names,
    register_mixer,
    registered_mixers,
    resolve_mixer,
)
from .sila import SILAMixer, SILASettings, sila_chunked, sila_phi, sila_recurrent
from .sse import SSEMixer, SSESettings
from .sse_forms import sse_masking, sse_recurrent, sse_varlen
from .static_cache import StaticHybridCache


def register_auto_classes() -> None:
    """Make AutoConfig (by model_type), AutoModel and AutoModelForCausalLM resolve a hybrid to this package's
    classes. Run on import; running it again changes nothing."""
    AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
    AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
    AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)


register_auto_classes()

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "BUNDLED_FILES",
    "DEFAULT_MIXER",
    "ENTRY_POINT_GROUP",
    "HybridCache",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridModel",
    "Mixer",
    "MixerSettings",
    "MixerSpec",
    "RavenMixer",
    "RavenSettings",
    "SILAMixer",
    "SILASettings",
    "SSEMixer",
    "SSESettings",
    "StaticHybridCache",
    "cache_argument",
    "get_architecture",
    "get_mixer",
    "mixer_names",
    "output_cache",
    "raven_chunked",
    "raven_recurrent",
    "register_mixer",
    "register_auto_classes",
    "registered_mixers",
    "resolve_mixer",
    "sila_chunked",
    "sila_phi",
    "sila_recurrent",
    "sse_masking",
    "sse_recurrent",
    "sse_varlen",
]
