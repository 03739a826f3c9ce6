"""Hybrid models: source decoder layers with linear-time mixers in place of chosen attention layers.

Importing the package registers the hybrid with the `transformers` Auto classes, so an exported model loads with
or without `trust_remote_code` wherever this toolkit is installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .architectures import ARCHITECTURES, Architecture, get_architecture
from .cache import HybridCache, cache_argument, output_cache
from .configuration_hybrid import LAYER_KINDS, MIXER_SETTINGS, HybridConfig
from .modeling_hybrid import MIXER_CLASSES, HybridForCausalLM, HybridModel
from .raven import RavenMixer, RavenSettings, raven_chunked, raven_recurrent
from .sila import SILAMixer, SILASettings, sila_chunked, sila_phi, sila_recurrent
from .sse import SSEMixer, SSESettings, sse_masking, sse_recurrent, sse_varlen
from .static_cache import StaticHybridCache

# The files an exported model carries so that it loads where only transformers is installed.
BUNDLED_FILES = (
    "architectures.py",
    "backend.py",
    "cache.py",
    "common.py",
    "configuration_hybrid.py",
    "decode_attention.py",
    "decode_graph.py",
    "modeling_hybrid.py",
    "raven.py",
    "sila.py",
    "sse.py",
    "static_cache.py",
)

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "BUNDLED_FILES",
    "HybridCache",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridModel",
    "LAYER_KINDS",
    "MIXER_CLASSES",
    "MIXER_SETTINGS",
    "RavenMixer",
    "RavenSettings",
    "SILAMixer",
    "SILASettings",
    "SSEMixer",
    "SSESettings",
    "StaticHybridCache",
    "cache_argument",
    "get_architecture",
    "output_cache",
    "raven_chunked",
    "raven_recurrent",
    "sila_chunked",
    "sila_phi",
    "sila_recurrent",
    "sse_masking",
    "sse_recurrent",
    "sse_varlen",
]
