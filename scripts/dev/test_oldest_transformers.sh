#!/usr/bin/env bash
# Rerun the tests marked `transformers_api` (cached decoding, generate(), export, loading without the toolkit) under
# the oldest transformers release pyproject.toml accepts; the README's test command runs the whole suite under the
# newest first. Everything else comes from the current environment (a venv or not): a throwaway venv that reads the
# current site-packages after its own gets only that transformers release and what it pins.
#   bash scripts/dev/test_oldest_transformers.sh [PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
oldest=$("$python" scripts/dev/transformers_bounds.py --oldest)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$python" -m venv "$venv"
"$python" scripts/dev/transformers_bounds.py --link-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==$oldest.*"
version=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
echo "+ transformers $version (the oldest accepted by pyproject.toml): python -m pytest -m transformers_api"
"$venv/bin/python" -m pytest -m transformers_api -p no:cacheprovider "$@" || {
  echo "transformers_api tests failed under transformers $version, the oldest release pyproject.toml accepts" >&2
  exit 1
}
