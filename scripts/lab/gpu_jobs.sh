#!/usr/bin/env bash
# Background jobs on the device machine. A device call lasts at most 10 minutes and ends what it started, except
# processes in a session of their own (setsid), which run on until the machine goes back. So runs longer than a
# call start here as jobs; later calls wait on them and collect what they wrote.
#
#   bash scripts/lab/gpu_jobs.sh start NAME 'COMMAND'   # COMMAND runs under bash in a snapshot of the checkout
#   bash scripts/lab/gpu_jobs.sh wait SECONDS           # until every job has ended or SECONDS have passed, then
#                                                   # collect (COLLECT=0: not), so a machine taken back between
#                                                   # calls loses no stage summary the last call could bring back
#   bash scripts/lab/gpu_jobs.sh status                 # each job's state, last progress line, and GPU memory
#   bash scripts/lab/gpu_jobs.sh collect                # summaries, reports, pictures and logs -> $OUT/runs.tar.gz
#   bash scripts/lab/gpu_jobs.sh deltas RUN...          # the runs' trained hybrids as deltas (raven_convert.delta) -> $OUT
#
# Jobs live in $JOBS (~/jobs): NAME.log (output), NAME.rc (exit status, once ended), NAME.src (the snapshot, so a
# job keeps the code it started with while later calls replace the checkout). Runs write under $RUNS (~/runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
JOBS=${JOBS:-$HOME/jobs}
RUNS=${RUNS:-$HOME/runs}
mkdir -p "$JOBS" "$RUNS" "${OUT:=gpu-out}"
OUT=$(cd "$OUT" && pwd)

status() {
  for log in "$JOBS"/*.log; do
    [ -e "$log" ] || continue
    name=$(basename "$log" .log)
    state="running"
    [ -f "$JOBS/$name.rc" ] && state="exit $(cat "$JOBS/$name.rc")"
    last=$(tr '\r' '\n' < "$log" | grep -v '^\s*$' | tail -1 | cut -c1-160)
    printf '%-14s %-8s %s\n' "$name" "$state" "$last"
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
}

running() {
  for log in "$JOBS"/*.log; do
    [ -e "$log" ] && [ ! -f "$JOBS/$(basename "$log" .log).rc" ] && return 0
  done
  return 1
}

collect() {  # stage summaries, reports, pictures -> $OUT/runs.tar.gz; the jobs' logs -> $OUT/logs.tar.gz
  (cd "$RUNS" && find . \( -name DONE -o -name '*.json' -o -name '*.png' \) -not -path '*/checkpoint*' \
    -not -path '*/model/*' -print0 | tar --null -czf "$OUT/runs.tar.gz" -T -) || return 1
  for log in "$JOBS"/*.log; do  # progress bars redrawn in place would fill the logs: keep their last state
    [ -e "$log" ] && tr '\r' '\n' < "$log" | grep -v 'it/s\]$' > "$OUT/$(basename "$log")"
  done
  (cd "$OUT" && ls *.log > /dev/null 2>&1 && tar -czf logs.tar.gz *.log && rm -f *.log)
  ls -la "$OUT"
}

case ${1:-} in
start)
  name=$2
  snap=$JOBS/$name.src
  rm -rf "$snap" "$JOBS/$name.rc" && mkdir -p "$snap"
  tar --exclude=./.carry --exclude=./.whl --exclude=./.git --exclude=./gpu-out -cf - . | tar -xf - -C "$snap"
  # -f: the job's own session, not waited for; no inherited descriptor keeps this call's output open
  (cd "$snap" && setsid -f bash -c "$3; echo \$? > '$JOBS/$name.rc'" > "$JOBS/$name.log" 2>&1 < /dev/null \
    3>&- 4>&- 5>&- 6>&- 7>&- 8>&- 9>&-)
  echo "started $name"
  ;;
wait)
  deadline=$((SECONDS + $2))
  next=$SECONDS
  while running && [ $SECONDS -lt $deadline ]; do
    if [ $SECONDS -ge $next ]; then
      echo "--- $(date +%T)"
      status
      next=$((SECONDS + 120))
    fi
    sleep 10
  done
  echo "--- $(date +%T)"
  status
  [ "${COLLECT:-1}" = 0 ] || collect > /dev/null
  ;;
status)
  status
  ;;
collect)
  collect
  ;;
deltas)  # one call brings back what fits its 64 MiB: about one SmolLM2 hybrid (raven_convert/delta.py)
  for run in "${@:2}"; do
    cp "$RUNS/$run/model.delta.safetensors" "$OUT/$run.delta.safetensors" || exit 1
  done
  ls -la "$OUT"
  ;;
*)
  echo "usage: bash scripts/lab/gpu_jobs.sh start NAME 'COMMAND' | wait SECONDS | status | collect | deltas RUN..." >&2
  exit 2
  ;;
esac
