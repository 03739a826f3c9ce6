#!/usr/bin/env bash
# What a lab session carries to the GPU machine, built in git-ignored folders of the checkout from ../shared (run
# it from the repository root, once per fresh checkout), then the calls that copy it over and start a job:
#
#   bash scripts/lab/carry.sh [JOB...]          # JOB: gpu_results.sh's jobs to start (default qheads-x2)
#
#   .carry/m4/smollm2.gguf.part-00..03   SmolLM2-135M-Instruct's GGUF in quarters (23.5 MiB each): a call carries
#                                        at most 64 MiB with the checkout, itself about 28 MiB
#   .carry/corpus-a, -b, -c              the offline corpus: linux's docs (8.1 MiB); perl's and postgresql's (4.7);
#                                        python's (3.0)
#   .carry/pg_essays                     the essay haystack (0.7 MiB)
#   .whl                                 the wheels the GPU image lacks (../shared/tools/gpu-prep.sh's, and
#                                        pydantic's, 3.7 MiB), installed into /tmp/site by scripts/device_env.sh
#
# Each call's checkout plus what it carries stays under 64 MiB: the first quarter goes with corpus-a, the second with
# the rest of the corpus and the essays, the third with the wheels, the fourth starts the job.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
shared=${SHARED:-$root/../shared}
jobs=${*:-qheads-x2}

bash "$shared/tools/gpu-prep.sh" >/dev/null  # .whl, and .carry/ in .git/info/exclude
rm -f .carry/smollm2.gguf.part-a?             # its halves: a session carries quarters
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection 2>&1 | grep -v "is ignored" || true
mkdir -p .carry/m4 .carry/corpus-a .carry/corpus-b .carry/corpus-c
[ -f .carry/m4/smollm2.gguf.part-03 ] ||
  split -n 4 -d "$shared/models/SmolLM2-135M-Instruct.Q4_1.gguf" .carry/m4/smollm2.gguf.part-
cp "$shared"/data/corpus/linux-* .carry/corpus-a/
cp "$shared"/data/corpus/perl-* "$shared"/data/corpus/postgresql-* .carry/corpus-b/
cp "$shared"/data/corpus/python-* .carry/corpus-c/
rm -rf .carry/pg_essays && cp -r "$shared/data/pg_essays" .carry/pg_essays
chmod -R u+w .carry .whl
du -sh .carry/m4/smollm2.gguf.part-00 .carry/corpus-? .carry/pg_essays .whl

cat <<EOF

Four device calls in a row (the machine goes back after 30 idle seconds):
  1. carry [".carry/m4/smollm2.gguf.part-00", ".carry/corpus-a"]:
     mkdir -p ~/cache/corpus && cp .carry/m4/smollm2.gguf.part-00 ~/cache/ && cp .carry/corpus-a/* ~/cache/corpus/
  2. carry [".carry/m4/smollm2.gguf.part-01", ".carry/corpus-b", ".carry/corpus-c", ".carry/pg_essays"]:
     cp .carry/m4/smollm2.gguf.part-01 ~/cache/ && cp .carry/corpus-b/* .carry/corpus-c/* ~/cache/corpus/ && cp -r .carry/pg_essays ~/cache/essays
  3. carry [".carry/m4/smollm2.gguf.part-02", ".whl"]:
     cp .carry/m4/smollm2.gguf.part-02 ~/cache/ && source scripts/device_env.sh
  4. carry [".carry/m4/smollm2.gguf.part-03"]:
     cat ~/cache/smollm2.gguf.part-0? .carry/m4/smollm2.gguf.part-03 > ~/cache/smollm2.gguf && source scripts/device_env.sh && export MODEL=~/cache/smollm2.gguf CORPUS=~/cache/corpus ESSAYS=~/cache/essays && bash scripts/lab/gpu_results.sh start $jobs && COLLECT=0 bash scripts/lab/gpu_jobs.sh wait 420
then, in each later call: source scripts/device_env.sh; bash scripts/lab/gpu_jobs.sh wait 540
EOF
