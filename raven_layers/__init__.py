"""Hybrid models: source decoder layers with linear-time mixers in place of chosen attention layers.

Importing the package registers the hybrid with the `transformers` Auto classes, so an exported model loads with
or without `trust_remote_code` wherever this toolkit is installed.
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
from .sse import SSEMixer, SSESettings, sse_masking, sse_recurrent, sse_varlen
from .static_cache import StaticHybridCache

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

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
    "registered_mixers",
    "resolve_mixer",
    "sila_chunked",
    "sila_phi",
    "sila_recurrent",
    "sse_masking",
    "sse_recurrent",
    "sse_varlen",
]
