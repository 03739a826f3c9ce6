#!/usr/bin/env bash
# One GPU measurement session: CUDA tests of the kernels, the kernel benchmark, and the per-stage rates of the
# SmolLM2 recipes; every log goes to $OUT (default ./gpu-out), the tables come last.
#
#   MODEL=~/cache/smollm2.gguf CORPUS=~/cache/corpus bash scripts/lab/gpu_measure.sh [tests,bench,stages]
#
# MODEL is the teacher (a GGUF file or a model directory), CORPUS the training text. Wheels the machine lacks
# (gguf, datasets, fla, pydantic, ...) are installed from .whl/ when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PARTS=${1:-tests,bench,stages}
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $PARTS == *tests* ]]; then
  # the kernels' and mixers' GPU tests and the training steps as CUDA graphs against eager (every mixer); the whole
  # log comes back, tracebacks included
  timeout 480 python3 -m pytest -o addopts="" -q -rfE -m gpu tests/kernels tests/raven_layers/test_gpu.py \
    tests/convert/train/test_graphs.py > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -40
fi
if [[ $PARTS == *bench* ]]; then
  timeout 200 python3 scripts/bench/bench_kernels.py --shapes B4_T4096 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench: exit $?"
  timeout 100 python3 scripts/bench/bench_losses.py >> "$OUT/bench.log" 2>&1  # stage 2's losses, kernels vs PyTorch
  echo "losses bench: exit $?"
fi
if [[ $PARTS == *stages* ]]; then
  TEACHER=$HOME/cache/teacher-hf
  dequantised_teacher "$MODEL" "$TEACHER" || exit 1
  timeout 420 python3 scripts/bench/measure_stages.py recipes/smollm2-raven.yaml recipes/smollm2-sse.yaml \
    recipes/smollm2-sila.yaml --align-steps 20 --train-steps 12 --max-documents 400 --run-root /tmp/measure \
    --set "source=$TEACHER" --set "data.source=${CORPUS}" --json "$OUT/stages.json" > "$OUT/stages.log" 2>&1
  echo "stages: exit $?"
fi
tail -3 "$OUT/gpu-tests.log" 2>/dev/null
sed -n '/^NVIDIA\|^| /p' "$OUT/bench.log" 2>/dev/null
grep "^| " "$OUT/stages.log" 2>/dev/null
