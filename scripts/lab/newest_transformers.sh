#!/usr/bin/env bash
# The newest transformers release pyproject.toml accepts, with every wheel it needs that the device image may lack,
# for the device's Python 3.12, into .carry/newest/ (git-ignored; about 30 MB: one device call carries it). The GPU
# tests then run a second time under it, beside the image's own release:
#   here:             bash scripts/lab/newest_transformers.sh
#   a device call, carry [".carry/newest"]:
#                     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-newest .carry/newest/*.whl
#   then any job:     bash scripts/lab/gpu_results.sh start decode-tests    # finds /tmp/site-newest
set -euo pipefail
cd "$(dirname "$0")/../.."
requirement=$(python3 scripts/dev/transformers_bounds.py --requirement)
rm -rf .carry/newest && mkdir -p .carry/newest
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .carry/newest "$requirement" 2>&1 | grep -v "is ignored" || true
rm -f .carry/newest/numpy-*.whl  # the image's numpy serves (16 MB: it would not fit beside the checkout)
ls .carry/newest | sed -n 's/^\(transformers-[^-]*\)-.*/\1/p'
du -sh .carry/newest
