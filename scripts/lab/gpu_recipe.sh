#!/usr/bin/env bash
# Run stages of a recipe on the device machine, one device call per stage (each stage of the SmolLM2 recipes
# takes about 10 minutes), and bring back what the results need: the stage summaries, the evaluation report and
# its pictures (at most 8 files under $OUT).
#
#   MODEL=~/cache/smollm2.gguf CORPUS=~/cache/corpus ESSAYS=.carry/pg_essays \
#     bash scripts/lab/gpu_recipe.sh recipes/smollm2-raven.yaml convert,align [--set sliding_window=4096 ...]
#
# The run directory is ~/runs/<recipe name> (RUN_DIR overrides it): later calls on the same warm machine continue
# it, and the recipe's fingerprints refuse to mix runs of different settings. MODEL is dequantised once into
# ~/cache/teacher-hf, which every stage then loads quickly. Extra arguments go to `python -m raven_convert.train`.
set -uo pipefail
cd "$(dirname "$0")/../.."
recipe=$1
stages=$2
shift 2
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
RUN_DIR=${RUN_DIR:-$HOME/runs/$(basename "$recipe" .yaml)}
source scripts/device_env.sh
TEACHER=$HOME/cache/teacher-hf
dequantised_teacher "$MODEL" "$TEACHER" || exit 1
local_paths
python3 -m raven_convert.train "$recipe" --run-dir "$RUN_DIR" --stages "$stages" "${LOCAL_PATHS[@]}" "$@" \
  > "$OUT/stages.log" 2>&1
status=$?
python3 - "$RUN_DIR" "$OUT" <<'EOF'
import json, shutil, sys
from pathlib import Path

run, out = Path(sys.argv[1]), Path(sys.argv[2])
done = {p.parent.name: json.loads(p.read_text()) for p in sorted(run.glob("*/DONE"))}
(out / "summary.json").write_text(json.dumps(done, indent=1))
keep = [run / "evaluate" / "report.json", *sorted((run / "evaluate").glob("niah_*.png"))[:3], run / "weights" / "weights.png",
        run / "convert" / "model" / "layer_choice.png"]  # the last: the scores of layers: auto:N
for path in keep:
    if path.is_file():
        shutil.copy(path, out / f"{path.parent.name}-{path.name}")
for stage, summary in done.items():
    rate = summary.get("tokens_per_second")
    print(f"{stage}: {summary.get('seconds', 0):.0f} s" + (f", {rate:,.0f} tokens/s" if rate else ""))
EOF
grep -v "it/s\]" "$OUT/stages.log" | grep -E "^\[|^\|" | tail -25
exit $status
