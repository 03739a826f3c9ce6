#!/usr/bin/env bash
# What a lab session carries to the GPU machine, built in git-ignored folders of the checkout from ../shared (run
# it from the repository root, once per fresh checkout), then the calls that copy it over and start a job:
#
#   bash scripts/lab/carry.sh [JOB...]          # JOB: gpu_results.sh's jobs to start (default x4-pair)
#
#   .carry/bundle/part-NN   one tar of SmolLM2-135M-Instruct's GGUF (smollm2.gguf), the offline corpus (corpus/) and
#                           the essay haystack (essays/), 110 MiB, cut into as many parts as the checkout leaves
#                           room for: a call carries at most 64 MiB together with the checkout (tracked files,
#                           30 MiB on 2026-12-01 with its pictures in 256 colours, growing with every archived run)
#   .whl                    the wheels the GPU image lacks (../shared/tools/gpu-prep.sh's, and pydantic's, 3.7 MiB),
#                           carried by the first call and installed into /tmp/site by scripts/device_env.sh
#
# The parts are sized afresh on each run of this script, so a larger checkout means more calls, never a refused one.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
shared=${SHARED:-$root/../shared}
jobs=${*:-x4-pair}
limit_kib=$((64 * 1024))
margin_kib=$((2 * 1024)) # the device tool's count of the checkout is not du's to the block

bash "$shared/tools/gpu-prep.sh" >/dev/null # .whl, and .carry/ in .git/info/exclude
rm -rf .carry/smollm2.gguf.part-a? .carry/m4 .carry/m5 .carry/corpus-? .carry/pg_essays # earlier layouts
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection 2>&1 | grep -v "is ignored" || true

checkout_kib=$(git ls-files -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl_kib=$(du -sk .whl | cut -f1)
part_kib=$((limit_kib - margin_kib - checkout_kib - whl_kib)) # every part leaves room for the wheels
if [ "$part_kib" -lt 4096 ]; then
  echo "the checkout takes ${checkout_kib} KiB of the ${limit_kib} a call carries: too little is left for the data" >&2
  exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/corpus"
ln -s "$shared/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$stage/smollm2.gguf"
ln -s "$shared"/data/corpus/* "$stage/corpus/"
ln -s "$shared/data/pg_essays" "$stage/essays"
rm -rf .carry/bundle && mkdir -p .carry/bundle
tar -chf - --mode=u+w -C "$stage" smollm2.gguf corpus essays | split -b "${part_kib}K" -d - .carry/bundle/part-
chmod -R u+w .carry .whl
parts=(.carry/bundle/part-*)
echo "checkout ${checkout_kib} KiB, wheels ${whl_kib} KiB: ${#parts[@]} parts of at most ${part_kib} KiB"

n=${#parts[@]}
echo
echo "$n device calls in a row (the machine goes back after 30 idle seconds):"
for i in "${!parts[@]}"; do
  p=${parts[$i]}
  if [ "$i" -eq 0 ]; then
    echo "  1. carry [\"$p\", \".whl\"]:"
    echo "     mkdir -p ~/cache && cp $p ~/cache/ && source scripts/device_env.sh"
  elif [ "$i" -lt $((n - 1)) ]; then
    echo "  $((i + 1)). carry [\"$p\"]:"
    echo "     cp $p ~/cache/"
  else
    echo "  $((i + 1)). carry [\"$p\"]:"
    echo "     cat ~/cache/part-* $p | tar -xf - -C ~/cache && rm ~/cache/part-* && source scripts/device_env.sh &&" \
      "export MODEL=~/cache/smollm2.gguf CORPUS=~/cache/corpus ESSAYS=~/cache/essays &&" \
      "bash scripts/lab/gpu_results.sh start $jobs && COLLECT=0 bash scripts/lab/gpu_jobs.sh wait 420"
  fi
done
echo "then, in each later call: source scripts/device_env.sh; bash scripts/lab/gpu_jobs.sh wait 540"
