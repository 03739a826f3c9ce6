"""The code a model directory carries, so that it loads with `trust_remote_code=True` where only transformers is
installed.

The model package's files (`raven_layers.BUNDLED_FILES`, the built-in mixers included) are copied as they are. A
mixer declared outside the package is carried as mixer_NAME.py: its module, with its imports of the model package
made relative; extra_mixers.py, written here, imports its declaration so that the model's own registry holds it.

A mixer's module is carried alone, so it may import torch, transformers, the standard library, other installed
libraries, and from the model package only `raven_layers.<block>` for the blocks in BUILDING_BLOCKS (`common`,
`backend`, the built-in mixers). An import of anything else of the toolkit, or of the module's own package, would be
missing where the model is loaded: it is refused here, naming the import, before any weight is written.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import raven_layers
from raven_layers import BUNDLED_FILES, MixerSpec
from raven_layers.registry import BUILTIN_MIXERS, import_path, is_builtin, module_file

MODEL_PACKAGE = raven_layers.__name__
BUILDING_BLOCKS = ("backend", "common", *(module_file(spec).stem for spec in BUILTIN_MIXERS))
TOOLKIT_PACKAGES = (MODEL_PACKAGE, "raven_convert", "raven_kernels")


def bundled_name(spec: MixerSpec) -> str:
    """The file a mixer from outside the package becomes in a model directory."""
    return f"mixer_{spec.name}.py"


def declaration_name(spec: MixerSpec) -> str:
    """The module-level name under which the module of the mixer's layer class holds its declaration."""
    return import_path(spec).partition(":")[2]


def _refusal(spec: MixerSpec, line: int, statement: str, why: str) -> ValueError:
    blocks = ", ".join(f"{MODEL_PACKAGE}.{b}" for b in BUILDING_BLOCKS)
    return ValueError(
        f"mixer {spec.name!r}: {module_file(spec)}, line {line}: {statement!r} {why}; a model carries the mixer's "
        f"module alone, which may import torch, transformers, other installed libraries and {blocks}"
    )


def bundled_source(spec: MixerSpec) -> str:
    """The source of the mixer's module as a model directory carries it: imports of `raven_layers.<block>` made
    relative (`from .common import ...`); ValueError naming any import that would be missing there."""
    path = module_file(spec)
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    own_package = spec.layer.__module__.split(".")[0]
    for node in ast.walk(ast.parse(source, str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        statement = ast.get_source_segment(source, node) or ""
        if isinstance(node, ast.Import):
            tops = {alias.name.split(".")[0] for alias in node.names}
            if tops & {*TOOLKIT_PACKAGES, own_package}:
                raise _refusal(spec, node.lineno, statement, "imports a package the model does not carry")
            continue
        parts = (node.module or "").split(".")
        if node.level == 1 and len(parts) == 1 and parts[0] in BUILDING_BLOCKS:
            continue  # already relative: a module a model directory carries, saved again
        if node.level > 0:
            raise _refusal(spec, node.lineno, statement, "imports a module beside it, which is not carried")
        if parts[0] == MODEL_PACKAGE and len(parts) == 2 and parts[1] in BUILDING_BLOCKS:
            first = node.lineno - 1
            lines[first] = re.sub(rf"\bfrom\s+{MODEL_PACKAGE}\.", "from .", lines[first], count=1)
            continue
        if parts[0] in (*TOOLKIT_PACKAGES, own_package):
            raise _refusal(spec, node.lineno, statement, "imports what the model does not carry")
    return "".join(lines)


def extra_mixers_source(specs: list[MixerSpec]) -> str:
    """extra_mixers.py of a model carrying `specs`, mixers from outside the package."""
    imports = "".join(
        f"from .{Path(bundled_name(s)).stem} import {declaration_name(s)} as MIXER_{s.name.upper()}\n" for s in specs
    )
    names = "".join(f"MIXER_{s.name.upper()}, " for s in specs)
    return (
        '"""The mixers this model carries from outside the raven_layers package, registered when registry.py is '
        'imported.\nWritten by the exporter (convert/bundle.py)."""\n\n'
        f"{imports}\nMIXERS = ({names.strip()})\n"
    )


def extra_mixers(config) -> list[MixerSpec]:
    """The mixers of `config` (a HybridConfig) declared outside the model package, in layer order."""
    kinds = dict.fromkeys(k for k in config.layer_mixers if k != "attention")
    return [config.mixer_spec(kind) for kind in kinds if not is_builtin(kind)]


def check_bundle(config) -> None:
    """Raise the error `write_code` would raise for `config`'s mixers, before any heavy work."""
    for spec in extra_mixers(config):
        declaration_name(spec)
        bundled_source(spec)


def write_code(config, directory: Path) -> None:
    """Write the model code of `config` (a HybridConfig) into `directory`."""
    code_dir = Path(raven_layers.__file__).parent
    for name in BUNDLED_FILES:
        shutil.copy2(code_dir / name, directory / name)
    specs = extra_mixers(config)
    if specs:
        for spec in specs:
            (directory / bundled_name(spec)).write_text(bundled_source(spec))
        (directory / "extra_mixers.py").write_text(extra_mixers_source(specs))
