#!/usr/bin/env bash
# Load MODEL_DIR with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True) and generate, in a Python
# process that sees only site-packages (no toolkit, no editable install), as on a machine that only downloaded it.
#   bash scripts/tools/clean_load.sh runs/smollm2-sila/train/model runs/smollm2-sila/load_check.json
# PYTHON names the interpreter whose site-packages hold torch and transformers (default: python3).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash scripts/tools/clean_load.sh MODEL_DIR OUT_JSON" >&2; exit 2; }
model=$(realpath "$1") out=$(realpath -m "$2") script=$(realpath "$(dirname "$0")/clean_load.py")
python=${PYTHON:-python3}
# every site-packages directory the interpreter imports from, in order (a venv's own, then any it links to)
site=$(env -u PYTHONPATH "$python" -c 'import sys; print(":".join(p for p in sys.path if p.endswith("-packages")))')
modules=$(mktemp -d)
trap 'rm -rf "$modules"' EXIT
cd "$modules"
env -u PYTHONPATH -u PYTHONSTARTUP PYTHONPATH="$site" HF_HUB_OFFLINE=1 HF_MODULES_CACHE="$modules" \
  TRANSFORMERS_VERBOSITY=error "$python" -S "$script" "$model" "$out"
