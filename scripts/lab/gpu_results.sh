#!/usr/bin/env bash
# The runs behind the lab notes docs/lab/ (issue 6): the teacher's evaluation and the SmolLM2 recipes of each mixer, as
# background jobs on one H100 (scripts/lab/gpu_jobs.sh), so several share the GPU and outlive a 10-minute device call.
#
#   MODEL=~/cache/smollm2.gguf CORPUS=~/cache/corpus ESSAYS=~/cache/essays bash scripts/lab/gpu_results.sh start teacher raven sila
#
# after copying the model, corpus and essays over in a few calls: `bash scripts/lab/carry.sh JOB` builds what they
# carry (one tar of the three in parts sized to fit beside the checkout, the wheels the image lacks) and prints them;
# keep results under docs/results with scripts/lab/archive_run.py, whose gzipped scores keep the checkout small
# (chain the calls: the machine goes back after 30 idle seconds, with the jobs it runs)
#   bash scripts/lab/gpu_jobs.sh wait 540        # in each later call, until the jobs end
#   bash scripts/lab/gpu_jobs.sh collect         # $OUT/runs.tar.gz: stage summaries, reports, pictures; logs.tar.gz
# (the wait call's output whole, not through `| tail`: a call past its limit brings back nothing it printed)
#
# RECIPE_ARGS adds overrides to every run (a smoke test: RECIPE_ARGS="--set align.steps=2 ...").
# WINDOWED=0 skips the sliding-window evaluation.
# DELTA=0 skips saving a trained model as its difference from the teacher.
# The jobs, and what each one runs and measures: scripts/lab/JOBS.md (a new job gets its entry there).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device_env.sh
export TEACHER=$HOME/cache/teacher-hf RUNS=${RUNS:-$HOME/runs}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # several jobs share the GPU's memory

source scripts/lab/run_settings.sh  # the overrides, layers and windows the runs below set

recipe() {  # recipe MIXER RUN [ARGS...]: the SmolLM2 recipe of MIXER into ~/runs/RUN
  read -ra extra <<< "${RECIPE_ARGS:-}"
  local_paths
  local launch=(python3)  # PROCESSES=N: every stage on N GPUs under data parallel (N x batch_size rows a step)
  [ "${PROCESSES:-1}" -gt 1 ] && launch=(accelerate launch --config_file recipes/accelerate/ddp.yaml
    --num_processes "$PROCESSES" --main_process_port "${PORT:-29500}")  # PORT: two launches on one host
  # layer choice's kept scans (docs/results/layer_choice, each named by its cache key): a run whose scan has one of
  # those keys reads it instead of scanning; the others lie unused
  mkdir -p "$RUNS/$2/cache/layer_choice" && cp docs/results/layer_choice/*.json "$RUNS/$2/cache/layer_choice/"
  "${launch[@]}" -m raven_convert.train "recipes/smollm2-$1.yaml" --run-dir "$RUNS/$2" "${LOCAL_PATHS[@]}" \
    "${extra[@]}" "${@:3}"
}

occupancy() {  # occupancy RUN: how many slots the trained Raven hybrid's routers write, into RUN/router_occupancy.json
  # (archive_run.py keeps it) and the job's log, the table printed whole under the run's name (two GPUs share a log)
  local table
  table=$(python3 scripts/tools/raven_router_occupancy.py --src "$RUNS/$1/extend/model" --text "$ESSAYS/addiction.txt" \
    --json "$RUNS/$1/router_occupancy.json") || return 1
  printf 'router occupancy of %s (scripts/tools/raven_router_occupancy.py):\n%s\n' "$1" "$table"
}

scale_bench() {  # scale_bench NAME FLAGS...: the SILA recipe's align and train on one GPU and on --gpus under ddp
  # and fsdp (bench_scale_out.py), and ddp with both stages graphed, 60 and 40 steps, into RUNS/NAME
  python3 scripts/bench/bench_scale_out.py recipes/smollm2-sila.yaml --src "$TEACHER" --data "$CORPUS" \
    --align-steps 60 --train-steps 40 --max-documents 400 --graphed align,train --out "$RUNS/$1" "${@:2}"
}

two_processes() {  # two_processes RECIPE RUN [ARGS...]: RUN trained on two processes, its evaluation again on one
  # should the 2-process one fail after training (the trained stages' DONE record their processes). A failure before
  # that is tried once more on two processes with every stage eager (their graphs under ddp are the default since
  # rounds 20 and 21; cuda_graphs is bookkeeping, so the stages done stay done): training on one process would
  # outlast a session (round 9)
  PROCESSES=2 trained "$@" && return 0
  if [ -f "$RUNS/$2/extend/DONE" ]; then
    PROCESSES=1 trained "$@"
  else
    PROCESSES=2 trained "$@" --set align.cuda_graphs=false --set train.cuda_graphs=false --set extend.cuda_graphs=false
  fi
}

quick() {  # quick RUN: RUN evaluated at 1K-8K without the windowed pass, no delta saved (on the GPUs the caller's
  # CUDA_VISIBLE_DEVICES names; PORT for a second launch on the host)
  WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" DELTA=0 run "$1"
}

quick_on() {  # quick_on GPU RUN...: the runs in turn on one GPU, evaluated at 1K-8K without the windowed pass; after
  # each Raven run, its routers' occupancy; fails if any run did (the rest still run)
  local job failed=0
  for job in "${@:2}"; do
    if ! CUDA_VISIBLE_DEVICES=$1 WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" run "$job"; then
      failed=1
    elif [[ $job == raven-* ]]; then
      CUDA_VISIBLE_DEVICES=$1 occupancy "$job" || failed=1
    fi
  done
  return "$failed"
}

as_mixer() {  # as_mixer RECIPE MIXER N RUN [ARGS...]: smollm2-RECIPE.yaml converting auto:N to MIXER, with the
  # mixer's settings and layer choice read from its own recipe (smollm2-MIXER.yaml)
  local mixer=$2
  own() {  # FIELD of the mixer's own recipe, as JSON (which --set reads as YAML)
    python3 -c "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))[sys.argv[2]]))" \
      "recipes/smollm2-$mixer.yaml" "$1"
  }
  trained "$1" "$4" --set "layers=[{mixer: $2, layers: \"auto:$3\"}]" \
    --set "mixer_settings=$(own mixer_settings)" --set "layer_choice=$(own layer_choice)" "${@:5}"
}

trained() {  # trained MIXER RUN [ARGS...]: train RUN, check that its model loads without the toolkit, evaluate it
  # windowed and as is; ARGS (--set overrides) go to every step of the run
  recipe "$1" "$2" --stages convert,align,weights,train,extend "${@:3}" || return 1
  local model="$RUNS/$2/extend/model"
  [ -d "$model" ] || model="$RUNS/$2/train/model"  # a recipe without extend
  bash scripts/tools/clean_load.sh "$model" "$RUNS/$2/load_check.json"
  if [ "${WINDOWED:-1}" = 1 ]; then
    rm -rf "$RUNS/$2-sw" && cp -a "$RUNS/$2" "$RUNS/$2-sw" &&
      recipe "$1" "$2-sw" --stages evaluate --redo evaluate "${@:3}" "${WINDOWED_EVAL[@]}"
  fi
  recipe "$1" "$2" "${@:3}" || return 1
  # then the trained hybrid as its difference from the teacher, small enough to bring back (gpu_jobs.sh deltas
  # RUN), on a few CPU threads: four jobs' saves on all of the host's cores held up their evaluations (docs/lab/2026-11-27-ablations-06-graphed-align.md)
  # (DELTA=0 skips it: a job that runs another recipe after this one on the same GPU)
  [ "${DELTA:-1}" = 1 ] || return 0
  OMP_NUM_THREADS=4 python3 -m raven_convert.delta save "$model" "$TEACHER" "$RUNS/$2/model.delta.safetensors" --bf16
}

source scripts/lab/decode_jobs.sh  # the decode rounds' measurements and the GPU tests
source scripts/lab/sessions.sh  # the device sessions: which runs go on which GPU

speed() {  # stage rates of the SSE and SILA recipes (short runs), against BASE's (an older checkout) where set
  local recipes=(recipes/smollm2-sse.yaml recipes/smollm2-sila.yaml)
  local flags=(--align-steps 40 --train-steps 30 --max-documents 300 --set "source=$TEACHER"
    --set "data.source=$CORPUS")
  if [ -n "${BASE:-}" ]; then
    (cd "$BASE" && source scripts/device_env.sh && python3 "$(ls scripts/{bench/,}measure_stages.py 2>/dev/null | head -1)" \
      "${recipes[@]}" "${flags[@]}" --run-root "$RUNS/speed-base" --json "$RUNS/speed-base.json") || return 1
    flags+=(--baseline "$RUNS/speed-base.json")
  fi
  python3 scripts/bench/measure_stages.py "${recipes[@]}" "${flags[@]}" --run-root "$RUNS/speed" --json "$RUNS/speed.json"
}

fork() {  # fork FROM RUN: RUN starts as the job FROM's run up to its train stage (waited for, up to 30 minutes),
  # so that RUN's extend can differ from FROM's; the stages after train are left out (FROM may be writing them)
  local from="$RUNS/$1" waited=0 parts=()
  until [ -f "$from/train/DONE" ]; do
    ((waited += 10)) && ((waited <= 1800)) || { echo "$2: no $from/train/DONE after 30 minutes"; return 1; }
    sleep 10
  done
  for part in "$from"/*; do
    case ${part##*/} in extend | evaluate | export) ;; *) parts+=("$part") ;; esac
  done
  rm -rf "${RUNS:?}/$2" && mkdir -p "$RUNS/$2" && cp -a "${parts[@]}" "$RUNS/$2/"  # one cp keeps the hard links
}

wait_trained() {  # wait_trained RUN: until the job RUN has its trained model (extend's); fails if it ended without
  until [ -f "$RUNS/$1/extend/DONE" ]; do
    [ -f "${JOBS:-$HOME/jobs}/$1.rc" ] && return 1
    sleep 30
  done
}

run() {
  case $1 in
  teacher)
    python3 - <<'PY'
import os
import shlex
from pathlib import Path

from raven_convert.evaluate.report import EvalRequest, evaluate_model
from raven_convert.train.recipe import load_recipe

essays = os.environ["ESSAYS"]
extra = shlex.split(os.environ.get("RECIPE_ARGS", ""))
overrides = [f"evaluate.haystack_dir={essays}", f"evaluate.ppl_data={essays}"]
overrides += [value for flag, value in zip(extra, extra[1:]) if flag == "--set"]
recipe = load_recipe("recipes/smollm2-raven.yaml", overrides)
out = Path(os.environ["RUNS"]) / "teacher" / "evaluate"
evaluate_model(EvalRequest(model=os.environ["TEACHER"], out=out, **recipe.evaluate.model_dump()))
PY
    ;;
  raven | sse)
    trained "$1" "$1"
    ;;
  sila)
    recipe sila sila --stages convert,align || return 1
    if [ "${ABLATION:-1}" = 1 ]; then
      rm -rf "$RUNS/sila-uniform" && cp -a "$RUNS/sila" "$RUNS/sila-uniform" &&
        bash scripts/lab/gpu_jobs.sh start sila-uniform "bash scripts/lab/gpu_results.sh run sila-uniform"
    fi
    trained sila sila
    ;;
  sila-uniform)
    recipe sila sila-uniform --set token_weights.enabled=false
    ;;
  sse-every2)
    trained sse sse-every2 --set 'layers=[{mixer: sse, layers: "0-29:2"}]'
    ;;
  sse-window-choice)
    trained sse sse-window-choice --set layer_choice.ablation=window
    ;;
  raven-eval-seed1 | sse-eval-seed1 | sila-eval-seed1)
    local mixer=${1%%-*}
    local of=${EVAL_OF:-$mixer} seeds=()
    [ "$of" = "$mixer-seed1" ] && seeds=("${SEED1[@]}")  # the run's own settings, which its stages' DONE check
    wait_trained "$of" || return 1
    rm -rf "$RUNS/$of-eval-seed1" && cp -a "$RUNS/$of" "$RUNS/$of-eval-seed1" &&
      recipe "$mixer" "$of-eval-seed1" --stages evaluate --redo evaluate "${seeds[@]}" --set evaluate.seed=1
    ;;
  raven-seed1 | sse-seed1 | sila-seed1)
    trained "${1%%-*}" "$1" "${SEED1[@]}"
    ;;
  raven-trained-windows | sse-trained-windows | sila-trained-windows)
    trained "${1%%-*}" "$1" --set sliding_window=4096
    ;;
  raven-far-windows | sse-far-windows | sila-far-windows)
    trained "${1%%-*}" "$1" --set sliding_window=4096 "${FAR_FACTS[@]}"
    ;;
  sila-nodecay-windows)
    trained sila "$1" --set sliding_window=4096 "${FAR_FACTS[@]}" --set mixer_settings.sila.no_decay_heads=1
    ;;
  raven-answers-windows | sse-answers-windows | sila-answers-windows)
    trained "${1%%-*}" "$1" --set sliding_window=4096 "${FAR_FACTS[@]}" "${ANSWERS[@]}" "${TARGET_EVAL[@]}"
    ;;
  sila-nodecay-answers-windows)
    trained sila "$1" --set sliding_window=4096 "${FAR_FACTS[@]}" "${ANSWERS[@]}" "${TARGET_EVAL[@]}" \
      --set mixer_settings.sila.no_decay_heads=1
    ;;
  raven-narrow-windows | sse-narrow-windows | sila-narrow-windows)
    trained "${1%%-*}" "$1" --set sliding_window=1024 "${FAR_FACTS[@]}" "${ANSWERS[@]}" "${TARGET_EVAL[@]}" \
      --set evaluate.attention_window=4096
    ;;
  sila-deep22 | sila-deep26)
    trained "$1" "$1"
    ;;
  sila-auto22 | sila-auto26)
    trained sila "$1" --set "layers=[{mixer: sila, layers: \"auto:${1#sila-auto}\"}]"
    ;;
  sila-restore22-fine | sila-restore26-fine)
    local n=${1#sila-restore} && n=${n%-fine}
    trained sila-deep26 "$1" --set "layers=[{mixer: sila, layers: \"auto:$n\"}]" \
      --set "layer_choice.round_sizes=[1, 1, 1, 1, 1, 1, 1, 1]"
    ;;
  sila-kd22)
    trained sila-deep22 "$1" "${KD[@]}"
    ;;
  sila-prog22)
    recipe sila sila-prog15 --stages convert,align,weights,train,extend || return 1
    trained sila-deep22-progressive "$1" --start-from "$RUNS/sila-prog15/extend/model"
    ;;
  sila-deep22-half | sila-deep22-double | sila-deep26-half | sila-deep26-double)
    local a=600 t=150 e=75
    [ "${1##*-}" = double ] && a=2400 t=600 e=300
    trained "${1%-*}" "$1" --set align.steps=$a --set train.steps=$t --set extend.steps=$e
    ;;
  sila-deep22-qheads | sila-deep26-qheads | sila-qheads)  # a memory per query head, on the recipe's layers
    local layers=$SILA22
    [ "$1" = sila-deep26-qheads ] && layers=$SILA26
    [ "$1" = sila-qheads ] && layers=$SILA15
    trained "${1%-qheads}" "$1" --set "$(on_layers sila "$layers")" --set mixer_settings.sila.state_heads=query
    ;;
  sila-deep26-qheads-induction)
    trained sila-deep26 "$1" --set "$(on_layers sila "$SILA26_INDUCTION")" --set mixer_settings.sila.state_heads=query
    ;;
  sila-deep30)  # every layer converted, trained as smollm2-sila-deep26-windows.yaml (its extend's answers x30 over
    # 600 steps) but with no attention left to window: the depth table's last row
    local weighted
    mapfile -t weighted < <(answers 30)
    trained sila-deep26 "$1" --set "$(on_layers sila 0-29)" "${weighted[@]}"
    ;;
  sila-deep22-seed1)
    trained sila-deep22 "$1" "${SEED1[@]}"
    ;;
  sila-deep22-answers | sila-deep26-answers)  # the deep recipe with its extend's answers weighted (ANSWERS)
    trained "${1%-answers}" "$1" "${ANSWERS[@]}"
    ;;
  sila-deep22-w4k* | sila-deep26-w4k*)  # a run of WINDOWS_OF; after its name, in this order, -far:
    # FAR_FACTS_RECIPE, -answers: ANSWERS (-answersN: weighted xN), -seedN: every training seed N, -extendN: N extend
    # steps, -rowsN: N rows an extend step, and one of -ddp2: 2.5x the recipe's tokens on two GPUs (as
    # sila-deepN-ddp2), -ddp4: 4x on four (the recipe's rows on each, its steps), -ext4: EXT4 on one GPU, -strong4:
    # EXT4's global batches on four GPUs (STRONG4)
    local name=${1%-ddp2} extra=() steps=() rows=()
    name=${name%-ddp4}
    name=${name%-strong4} && [[ $name == *-ext4 ]] && extra+=("${EXT4[@]}") && name=${name%-ext4}
    if [[ $name =~ ^(.*)-rows([0-9]+)$ ]]; then
      name=${BASH_REMATCH[1]} && rows=(--set "extend.batch_size=${BASH_REMATCH[2]}")
    fi
    if [[ $name =~ ^(.*)-extend([0-9]+)$ ]]; then
      name=${BASH_REMATCH[1]} && steps=(--set "extend.steps=${BASH_REMATCH[2]}")
    fi
    if [[ $name =~ ^(.*)-seed([0-9]+)$ ]]; then
      name=${BASH_REMATCH[1]} && mapfile -t -O "${#extra[@]}" extra < <(seeds "${BASH_REMATCH[2]}")
    fi
    [[ $name == *-answers ]] && extra+=("${ANSWERS[@]}") && name=${name%-answers}
    if [[ $name =~ ^(.*)-answers([0-9]+)$ ]]; then
      name=${BASH_REMATCH[1]} && mapfile -t -O "${#extra[@]}" extra < <(answers "${BASH_REMATCH[2]}")
    fi
    [[ $name == *-far ]] && extra+=("${FAR_FACTS_RECIPE[@]}") && name=${name%-far}
    local windows="WINDOWS_OF[$name]"
    [ -n "${!windows:-}" ] || { echo "no windowed run named $1" >&2; return 1; }
    read -ra windows <<<"${!windows}"
    extra+=("${steps[@]}" "${rows[@]}")  # after the answers' steps: the last --set of a field is the one that counts
    if [[ $1 == *-ddp2 ]]; then
      # weighted answers keep their extend tokens (300 steps of twice the rows, unless -extendN): 2.5x would add
      # 8 minutes
      [[ -z ${steps[*]} && " ${extra[*]} " == *extend.answer_weight=* ]] && extra+=(--set extend.steps=300)
      two_processes "${1%%-w4k*}" "$1" "${windows[@]}" "${DDP2_STEPS[@]}" "${extra[@]}"
    elif [[ $1 == *-ddp4 ]]; then
      PROCESSES=4 trained "${1%%-w4k*}" "$1" "${windows[@]}" "${extra[@]}"
    elif [[ $1 == *-strong4 ]]; then
      PROCESSES=4 trained "${1%%-w4k*}" "$1" "${windows[@]}" "${extra[@]}" "${STRONG4[@]}" "${steps[@]}"
    else
      trained "${1%%-w4k*}" "$1" "${windows[@]}" "${extra[@]}"
    fi
    ;;
  sila-deep22-far-facts)
    trained sila-deep22 "$1" "${FAR_FACTS_RECIPE[@]}"
    ;;
  sila-deep22-seed1-far-facts)  # sila-deep22-seed1's trained model extended with FAR_FACTS_RECIPE: the same hybrid
    # both ways, 5 minutes
    fork sila-deep22-seed1 "$1" && trained sila-deep22 "$1" "${SEED1[@]}" "${FAR_FACTS_RECIPE[@]}"
    ;;
  sila-deep22-ddp4 | sila-deep26-ddp4)
    local recipe=${1%-ddp4}
    PROCESSES=4 trained "$recipe" "$1"
    ;;
  sila-deep22-ddp2 | sila-deep26-ddp2)  # 2.5x the recipe's tokens: twice the rows a step, 1.25x the steps
    two_processes "${1%-ddp2}" "$1" "${DDP2_STEPS[@]}"
    ;;
  sila-deep22-ddp2-long)  # about 24 minutes with the evaluation at 1K-8K: start it alone, first in a session.
    # Train and extend as CUDA graphs under ddp (eager, extend gained 1.03x from the second GPU); should they fail,
    # the same run as two_processes runs it, eagerly (cuda_graphs is bookkeeping: the stages already done stand)
    export WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" DELTA=0  # no delta: the session's minutes go to the run
    PROCESSES=2 trained sila-deep22 "$1" "${DDP2_LONG_STEPS[@]}" --set train.cuda_graphs=true \
      --set extend.cuda_graphs=true || two_processes sila-deep22 "$1" "${DDP2_LONG_STEPS[@]}"
    ;;
  sila-deep22-qheads-ddp2)  # about 20 minutes with the evaluation: start it alone, first in a session
    export WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" DELTA=0
    two_processes sila-deep22 "$1" "${DDP2_STEPS[@]}"
    ;;
  deep22-ddp2-x2)  # one 2-GPU session: sila-deep22-ddp2 evaluated at 1K-8K, the 2-GPU graph tests beside it
    ddp_graph_tests &
    WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" run sila-deep22-ddp2
    wait
    ;;
  sila-deep22-all)
    trained sila-deep22 "$1" "${ALL[@]}"
    ;;
  sila-deep22-all-ddp2)
    PROCESSES=2 trained sila-deep22 "$1" "${ALL[@]}" "${DDP2_STEPS[@]}" --set train.cuda_graphs=true \
      --set extend.cuda_graphs=true
    ;;
  raven-silarecipe | sse-silarecipe | raven-silarecipe-seed1 | sse-silarecipe-seed1)
    local seeds=()
    [ "${1%-seed1}" != "$1" ] && seeds=("${SEED1[@]}")
    as_mixer sila "${1%%-silarecipe*}" 15 "$1" "${seeds[@]}"
    ;;
  raven-deep22 | sse-deep22)  # smollm2-sila-deep22.yaml with the mixer swapped: the other mixers at 22 of 30
    as_mixer sila-deep22 "${1%-deep22}" 22 "$1"
    ;;
  raven-m128 | raven-m256)  # Raven's recipe with 128 or 256 slots (top-8 still): each slot written half or a quarter
    # as often
    trained raven "$1" --set "mixer_settings.raven.num_slots=${1#raven-m}"
    ;;
  raven-nogumbel)  # Raven's recipe with round 11's random routers and without the router's Gumbel noise in
    # training: training routes as evaluation does
    trained raven "$1" --set mixer_settings.raven.router_init=random --set mixer_settings.raven.gumbel=false
    ;;
  raven-centred | raven-centred-nogumbel)  # Raven's recipe (routers fitted to the layers' inputs at align's start,
    # router_init centred, since round 12), with and without the noise
    local noise=()
    [ "$1" = raven-centred-nogumbel ] && noise=(--set mixer_settings.raven.gumbel=false)
    trained raven "$1" "${noise[@]}"
    ;;
  sse-centred)  # smollm2-sse.yaml with its scorer fitted to the layers' inputs (router_init centred)
    trained sse "$1" --set mixer_settings.sse.router_init=centred
    ;;
  raven-centred-seed1 | sse-seed1)  # smollm2-raven.yaml (centred routers since round 12) or smollm2-sse.yaml
    # (SILA's recipe since round 13) with every training seed 1
    trained "${1%%-*}" "$1" "${SEED1[@]}"
    ;;
  raven-deep22-centred)  # smollm2-sila-deep22.yaml with Raven (its recipe's settings: centred routers) on the 22
    # layers SILA's deep recipe converts (SILA22): the two mixers at 22 of 30 on the same layers
    as_mixer sila-deep22 raven 22 "$1" --set "$(on_layers raven "$SILA22")"
    ;;
  decode-b128-twice)  # times, alone: about 9 minutes
    decode_b128_twice
    ;;
  views-check)  # round 8's fixes on the GPU (round 9 ran it beside the deep run, on GPU 1)
    views_check
    ;;
  memory-plan)
    local n gpus=1
    for ((n = 2; n <= $(nvidia-smi -L | wc -l); n *= 2)); do gpus+=",$n"; done
    python3 scripts/bench/memory_plan.py --processes "${PLAN_PROCESSES:-$gpus}" \
      --strategy "${PLAN_STRATEGY:-fsdp,ddp}" --out "$RUNS/memory-plan"
    ;;
  scale-x4)  # both scalings at N = 4 (the 2-GPU rows are docs/SCALE_OUT.md's), then the 8B plan at 1, 2 and 4
    scale_bench scale-out-x4 --gpus 4 --scaling strong,weak
    run memory-plan
    ;;
  scale-pair)  # both scalings on two GPUs (CUDA_VISIBLE_DEVICES names them), ddp and fsdp, and ddp graphed
    scale_bench scale-pair --gpus 2 --scaling strong,weak
    ;;
  scale-strong)  # strong scaling to every GPU of the host, ddp and fsdp, and ddp graphed
    scale_bench scale-strong --gpus "$(nvidia-smi -L | wc -l)" --scaling strong
    ;;
  scale-weak)  # weak scaling to every GPU of the host under ddp, as cuda_graphs auto has it and with align's and
    # train's steps as graphs
    scale_bench scale-weak --gpus "$(nvidia-smi -L | wc -l)" --scaling weak --strategy ddp
    ;;
  scale-out)
    scale_bench scale-out --gpus "$(nvidia-smi -L | wc -l)" --scaling weak
    ddp_graph_tests
    ;;
  sila-kd22-e2e | sila-kd26-e2e)
    local n=${1#sila-kd} && n=${n%-e2e}
    trained sila-deep22 "$1" "${KD[@]}" --set align.steps=800 --set train.steps=600 \
      --set "layers=[{mixer: sila, layers: \"auto:$n\"}]"
    ;;
  decode-lab)  # times: alone on the machine
    local out="$RUNS/decode-lab" && mkdir -p "$out"
    timeout 540 python3 scripts/bench/sweep_decode_attention.py --out "$out" --batches 128,32,1 --contexts 16k
    timeout 420 python3 scripts/bench/profile_decode.py --out "$out" --models teacher-engine,sila --batches 1 \
      --context 16k --variants plain default
    timeout 540 python3 scripts/bench/bench_generate.py --out "$out/sila" --mixers sila --depths 15 \
      --batches 1,32,128 --contexts 16k --steps 16
    timeout 540 python3 scripts/bench/bench_generate.py --out "$out/b1" --mixers raven,sse,sila --batches 1 \
      --contexts 4k,16k --steps 16
    ;;
  decode-tests)  # correctness and kernel counts only: may run beside another job
    fast_path_tests
    timeout 600 python3 scripts/bench/profile_decode.py --out "$RUNS/decode-tests" --batches 1 --context 16k \
      --models teacher-engine,raven,sse,sila --variants default --steps 8
    ;;
  decode-round)  # one device session: what needs no quiet machine side by side, then what times
    (run decode-tests & WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" run sila-deep22-half; wait)
    run decode-lab
    ;;
  qheads-speed)  # times: what a memory per query head costs SILA's decode step at 22 and 26 of 30
    decode_qheads
    ;;
  windows22-speed)  # times: the 22-layer recipe's step with 4 of its 8 kept layers as 4K windows, batch 1 and 128
    decode_windows 22 "${WINDOW_BATCHES:-1,128}" 4
    ;;
  windows22-local-speed)  # times: the 22-layer recipe's step with 1 and 2 of its kept layers as 4K windows
    decode_windows 22 128 1,2
    ;;
  windows22-sinks-speed)  # times: windows22-local-speed with 4 attention sinks on each window
    decode_windows 22 128 1,2 4
    ;;
  windows22-four-sinks-speed)  # times: the 22-layer recipe with 2 and 4 of its kept layers as 4K windows with 4 sinks
    decode_windows 22 128 2,4 4
    ;;
  sinks-gpu-check)  # the graphed, compiled decode with attention sinks equals the eager path (float32 and bf16)
    timeout 420 python3 -m pytest -o addopts="" -q -rfE tests/raven_layers/test_gpu.py -k "graphed_static and sila" \
      2>&1 | tail -8
    ;;
  windows26-speed)  # times: 26 of 30 with 1 or 2 of its 4 kept layers as 4K windows, batch 128
    decode_windows 26 128 1,2
    ;;
  decode-bench)  # times, so alone on the machine: issue 52's table, the floor targets first
    decode_tables
    decode_parts
    ;;
  decode-round-7)  # one device session, alone: the fast path's tests under round 6's defaults, the tables, the checks
    NEWEST=${NEWEST:-0} fast_path_tests
    decode_tables
    decode_pdl
    decode_raven_paper
    decode_sweeps
    decode_depth
    decode_profile_26
    ;;
  decode-round-7-x2)  # decode-round-7 on two GPUs in about half the minutes: the times of issue 52's tables on one,
    # the tests, then the sweeps and the 26-layer profile (timed alone on their GPU), on the other
    (export CUDA_VISIBLE_DEVICES=0; decode_tables; decode_pdl; decode_depth; decode_raven_paper) &
    (export CUDA_VISIBLE_DEVICES=1; fast_path_tests; decode_sweeps; decode_profile_26) &
    wait
    ;;
  decode-round-8-x2)  # round 7's "Next" on a 2-GPU host (about 15 minutes): the tests, SSE's warps and the 26-layer
    # batch-128 profile with its code on one GPU, the batch-1 and dependent-launch profiles and the batch-1 table on
    # the other
    (export CUDA_VISIBLE_DEVICES=0; decode_round_8_steps) &
    (export CUDA_VISIBLE_DEVICES=1; NEWEST=${NEWEST:-0} fast_path_tests; decode_sse_warps; decode_profile_26) &
    wait
    ;;
  scale-out-round-8-x2)  # one 2-GPU session: scale-out (both GPUs, so first and alone), then decode-round-8-x2
    run scale-out
    run decode-round-8-x2
    ;;
  decode-parts)  # decode-bench without its tables: where the steps go, and the sweeps
    decode_parts
    ;;
  decode-round-2)  # one device session: the fast path's tests beside the 26-layer recipe at half its steps, then times
    (NEWEST=${NEWEST:-0} run decode-tests & WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" run sila-deep26-half; wait)
    run decode-bench
    ;;
  decode-round-3)  # one device session, alone: the fast path's tests, then decode-bench
    NEWEST=${NEWEST:-0} fast_path_tests
    run decode-bench
    ;;
  depth-speed)
    local out="$RUNS/depth-speed" depths=(--mixers sila --depths "${DEPTHS:-15,22,26,30}")
    python3 scripts/bench/bench_generate.py --out "$out" "${depths[@]}" --batches "${BATCHES:-1,32,128}" \
      --contexts "${CONTEXTS:-4k,16k}" --steps 16 || return 1
    [ "${CAPACITY:-1}" = 0 ] || python3 scripts/bench/bench_capacity.py --out "$out" "${depths[@]}" --context 32k --time all
    ;;
  profile-raven | profile-sse | profile-sila)
    python3 scripts/bench/profile_train.py "recipes/smollm2-${1#profile-}.yaml" --src "$TEACHER" --data "$CORPUS" \
      --stage train --out "$RUNS/$1"
    ;;
  profile-deep26-extend | profile-deep26-extend-in-place)  # the windowed 26's extend step (40% of the recipe's
    # time in round 22); -in-place: its next inputs made after the step, not beside it (what StepInputs buys)
    local where=()
    [ "$1" = profile-deep26-extend ] || where=(--inputs-in-place)
    python3 scripts/bench/profile_train.py recipes/smollm2-sila-deep26-windows.yaml --src "$TEACHER" --data "$CORPUS" \
      --stage extend --out "$RUNS/$1" "${where[@]}"
    ;;
  bench-raven | bench-sse | bench-sila)
    (cd scripts/bench && python3 bench_graphs.py --stage train --mixer "${1#bench-}" --steps 60 --rows 8 16 --whole-rows 2)
    ;;
  raven-try-* | sse-try-* | sila-try-*)
    local tries
    read -ra tries <<< "${TRY_ARGS:?set TRY_ARGS to the overrides this experiment tries}"
    trained "${1%%-*}" "$1" "${tries[@]}"
    ;;
  sse-noretrieval)
    trained sse sse-noretrieval --set data.retrieval=null
    ;;
  sse-noextend)
    trained sse sse-noextend --set extend=null
    ;;
  sse-norouter)
    trained sse sse-norouter --set mixer_settings.sse.router_gradient=false
    ;;
  reach-*)
    # how long each mixer memory of run RUN's model holds a passkey, with its kept attention as 4K windows
    local of=${1#reach-}
    wait_trained "$of" || return 1
    python3 scripts/tools/memory_reach.py "$RUNS/$of/extend/model" --out "$RUNS/$of/memory-reach" --length 16384 \
      --attention-window 4096
    ;;
  speed)
    speed
    ;;
  *)
    session "$1"
    local status=$?
    [ "$status" -ne 127 ] && return "$status"
    echo "unknown job $1; jobs: teacher raven sse sila sila-uniform MIXER-seed1 MIXER-eval-seed1" \
      "MIXER-trained-windows MIXER-far-windows MIXER-answers-windows MIXER-narrow-windows MIXER-try-NAME" \
      "(MIXER: raven, sse or sila) sila-deep22 sila-deep26 sila-auto22 sila-auto26 sila-restore22-fine sila-restore26-fine sila-kd22 sila-kd22-e2e sila-kd26-e2e sila-prog22 sila-deepN-half sila-deepN-double (N: 22 or 26) sila-deep22-ddp4 sila-deep26-ddp4 sila-deep22-ddp2 sila-deep26-ddp2 sila-deep22-ddp2-long sila-deep22-qheads-ddp2 deep22-ddp2-x2 sila-deep22-all sila-deep22-all-ddp2 raven-silarecipe sse-silarecipe MIXER-silarecipe-seed1 raven-deep22 sse-deep22 raven-m128 raven-m256 raven-nogumbel raven-centred raven-centred-nogumbel raven-centred-seed1 sse-centred raven-deep22-centred centred-x2 sila-deep22-qheads sila-deep26-qheads sila-qheads qheads-speed qheads-x2 sila-deep22-seed1 sila-deep30 sila-deep26-qheads-induction sila-deep22-far-facts sila-deep22-seed1-far-facts qheads-next-x2 deep26-ddp2-profile mixers15-x2 routers15-x2 sse-raven-x2 all-raven-x2 views-check decode-b128-twice scale-out scale-pair scale-strong scale-weak memory-plan scale-x4 decode-lab decode-tests decode-round decode-bench decode-round-2 decode-round-3 decode-parts decode-round-7 decode-round-7-x2 decode-round-8-x2 scale-out-round-8-x2 depth-speed sila-nodecay-windows sila-nodecay-answers-windows profile-MIXER profile-deep26-extend profile-deep26-extend-in-place bench-MIXER" \
      "sse-every2 sse-window-choice sse-noretrieval sse-noextend sse-norouter reach-RUN speed;" \
      "sessions (scripts/lab/sessions.sh): $(sessions)" >&2
    return 2
    ;;
  esac
}

case ${1:-} in
start)
  dequantised_teacher "$MODEL" "$TEACHER" || exit 1
  for job in "${@:2}"; do
    bash scripts/lab/gpu_jobs.sh start "$job" "bash scripts/lab/gpu_results.sh run $job"
  done
  ;;
run)
  run "$2"
  ;;
*)
  echo "usage: bash scripts/lab/gpu_results.sh start JOB... | run JOB" >&2
  exit 2
  ;;
esac
