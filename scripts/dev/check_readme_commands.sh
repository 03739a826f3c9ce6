#!/usr/bin/env bash
# Run the README's two fresh-machine commands (main job, tests) in a new virtual environment on a fresh clone
# of HEAD, as a new machine would.  Usage: scripts/dev/check_readme_commands.sh [workdir]
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
if [ -n "${1:-}" ]; then
  work=$1
else  # a folder of its own, removed at the end (a clone and a virtual environment: about 3.4 GB)
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
git clone -q "$repo" "$work/clone"
python3 -m venv "$work/venv"
source "$work/venv/bin/activate"
cd "$work/clone"
for marker in "raven-demo" "<!-- test-command -->"; do
  if [ "$marker" = "raven-demo" ]; then
    cmd=$(grep -m1 -E '^pip install .*raven-demo$' README.md)
  else
    cmd=$(awk '/<!-- test-command -->/ {found=1; next} found && /^```bash/ {getline; print; exit}' README.md)
  fi
  echo "+ $cmd"
  start=$SECONDS
  eval "$cmd"
  echo "ok in $((SECONDS - start)) s: $cmd"
done
