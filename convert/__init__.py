"""Surgery on pretrained decoders: `convert_model` (and the `convert` command) builds and exports a hybrid."""

from .layer_spec import LayerSpecError, parse_layer_spec
from .pipeline import ConvertRequest, convert_model
from .sources import DEFAULT_SRC, Source, SourceError, smollm2_gguf
from .surgery import build_hybrid, format_layer_map, plan_layers, plan_windows

__all__ = [
    "DEFAULT_SRC",
    "ConvertRequest",
    "LayerSpecError",
    "Source",
    "SourceError",
    "build_hybrid",
    "convert_model",
    "format_layer_map",
    "parse_layer_spec",
    "plan_layers",
    "plan_windows",
    "smollm2_gguf",
]
