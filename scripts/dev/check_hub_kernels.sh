#!/usr/bin/env bash
# Install this checkout (not editable) and Hugging Face's `kernels` into one new virtual environment, then check in a
# process outside the checkout that both import, each under its own name, and that transformers finds Hugging Face's
# `kernels` (its version, its module) and none of ours. Needs the package index for `kernels`.
#   bash scripts/dev/check_hub_kernels.sh           # the venv reads the current environment's packages after its own
#   bash scripts/dev/check_hub_kernels.sh --fresh   # everything installed anew (torch from the configured index)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
python=${PYTHON:-python}
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$python" -m venv "$venv"
if [ "${1:-}" = "--fresh" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$repo" kernels
else
  "$python" scripts/dev/transformers_bounds.py --link-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$repo" kernels
fi
cd "$venv"
"$venv/bin/python" - "$venv" <<'PY'
import importlib.metadata as metadata
import sys
from pathlib import Path

import torch
from packaging.version import Version

venv = Path(sys.argv[1]).resolve()
import kernels  # Hugging Face's
import raven_convert
import raven_kernels.raven
import raven_kernels.sse
import raven_layers
from raven_layers.backend import kernel_module, use_backend
from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION, _is_package_available
from transformers.utils.import_utils import is_kernels_available
import transformers.integrations.hub_kernels as hub_kernels

hub = metadata.version("kernels")
for module in (kernels, raven_convert, raven_kernels, raven_layers):
    assert Path(module.__file__).resolve().is_relative_to(venv), f"{module.__name__} from {module.__file__}"
assert hasattr(kernels, "get_kernel"), f"{kernels.__file__} is not Hugging Face's kernels"
assert metadata.packages_distributions()["kernels"] == ["kernels"]
assert _is_package_available("kernels", return_version=True) == (True, hub)
accepted = Version(KERNELS_MIN_VERSION) <= Version(hub) < Version(KERNELS_MAX_VERSION)
assert is_kernels_available() == accepted
if accepted:
    assert hub_kernels.get_kernel_hub is kernels.get_kernel
with use_backend("triton"):
    assert kernel_module("raven_kernels.raven", torch.zeros(1)) is raven_kernels.raven
print(f"ok: kernels {hub} ({kernels.__file__}) and raven-hybrid {metadata.version('raven-hybrid')} in one environment;")
print(f"transformers {metadata.version('transformers')} finds kernels {hub}, "
      f"{'within' if accepted else 'outside'} the range it uses, [{KERNELS_MIN_VERSION}, {KERNELS_MAX_VERSION})")
PY
