# Sourced by scripts/lab/gpu_results.sh: the decode rounds' measurements (issue 52's tables, profiles and sweeps) and
# the fast path's and data parallel's GPU tests, which its jobs call. They read its settings (RUNS, MODEL, TEACHER)
# and write under $RUNS/decode-bench, $RUNS/decode-tests or their job's run.

fast_path_tests() {  # the fast path's GPU tests, again under the newest transformers where /tmp/site-newest holds it
  timeout 300 python3 -m pytest -o addopts="" -q -rfE tests/kernels/test_sila.py tests/kernels/test_raven.py \
    tests/kernels/test_sse.py tests/kernels/test_rows.py -k "decode or top_indices" 2>&1 | tail -20  # compiled here
  RAVEN_SMOLLM2_GGUF=$MODEL timeout 840 python3 -m pytest -o addopts="" -q -rfE --durations=12 \
    tests/raven_layers/test_gpu.py tests/kernels/test_attention.py tests/kernels/test_linear.py \
    tests/scripts/test_sweep_decode_attention.py tests/scripts/test_sweep_raven_decode.py \
    tests/scripts/test_sweep_sila_decode.py tests/scripts/test_sweep_sse_decode.py tests/scripts/test_bench_products.py \
    2>&1 | tail -60
  [ -d /tmp/site-newest ] && [ "${NEWEST:-1}" = 1 ] || return 0
  PYTHONPATH=/tmp/site-newest:$PYTHONPATH python3 -c "import transformers; print('+ transformers', transformers.__version__)"
  PYTHONPATH=/tmp/site-newest:$PYTHONPATH RAVEN_SMOLLM2_GGUF=$MODEL timeout 600 python3 -m pytest -o addopts="" -q \
    -rfE tests/raven_layers/test_gpu.py -k "real_smollm2 or graphed or decode_loop" 2>&1 | tail -20  # the exactness tests
}

decode_b1_table() {  # every mixer at 15 of 30 against both teachers at batch 1, 4K and 16K
  timeout 420 python3 scripts/bench/bench_generate.py --out "$RUNS/decode-bench/b1" --mixers raven,sse,sila \
    --batches 1 --contexts 4k,16k --steps 32
}

pdl_profile() {  # pdl_profile NAME MODELS BATCH STEPS LIMIT [ARGS...]: profile_decode.py's default step beside it
  # under programmatic dependent launch (each launched before the kernel ahead ends), and each model's plain step
  timeout "$5" python3 scripts/bench/profile_decode.py --out "$RUNS/decode-bench/$1" --models "$2" --batches "$3" \
    --context 16k --variants default "default,triton.enable_pdl=True" --steps "$4" "${@:6}"
}

decode_b128_twice() {  # issue 52's batch-128 row twice, each run with its own teacher: where the ratio sits within
  # one session's spread (round 9 measured SILA at 0.551x and Raven at 0.552x, the target 0.55x)
  local out="$RUNS/decode-bench" run && mkdir -p "$out"
  for run in 1 2; do
    timeout 420 python3 scripts/bench/bench_generate.py --out "$out/b128-$run" --mixers raven,sse,sila --batches 128 \
      --contexts 16k --steps 16 --repeats 3
  done
}

decode_tables() {  # issue 52's table: every mixer at 15 of 30 against both teachers at batch 1, 32 and 128
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  decode_b1_table
  local batch  # one call a batch: round 7's single call ran past its limit before SILA's batch-32 row
  for batch in 128 32; do
    timeout 420 python3 scripts/bench/bench_generate.py --out "$out/b$batch" --mixers raven,sse,sila --batches $batch \
      --contexts 16k --steps 16
  done
}

decode_pdl() {  # the batch-1 step under dependent launch, with its code (SILA's products as reductions: where it goes)
  mkdir -p "$RUNS/decode-bench" && pdl_profile pdl teacher-engine,sila 1 16 300 --save-code
}

decode_raven_paper() {  # Raven as the paper sets it (M = 256, top-32), beside the recipe's M = 64, top-8 of the tables
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 300 python3 scripts/bench/bench_generate.py --out "$out/raven-paper" --mixers raven --mixer-settings defaults \
    --batches 1,128 --contexts 16k --steps 16
}

decode_sweeps() {  # what else round 6's defaults leave to check (docs/lab/2026-11-29-decode-round-6.md, "Next")
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  # slot_ranges' rule away from the points it was fitted on: 2 and 8 ranges at M = 256, and the recipe's M = 64
  timeout 120 python3 scripts/bench/sweep_raven_decode.py --out "$out/sweep-raven-256" --batches 1,32,128 \
    --blocks 8 --warps 1 --ranges 2,4,8,16,32 --top-k-by sort
  timeout 120 python3 scripts/bench/sweep_raven_decode.py --out "$out/sweep-raven-64" --slots 64 --top-k 8 \
    --batches 1,32,128 --blocks 4,8 --warps 1 --ranges 1,2,4 --top-k-by rounds,sort
}

decode_depth() {  # SILA at 22 and 26 of 30 against the teacher on both engines, batch 128 at 16K (issue 51's speed)
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 300 python3 scripts/bench/bench_generate.py --out "$out/depth" --mixers sila --depths 22,26 \
    --batches 128 --contexts 16k --steps 16
}

decode_qheads() {  # SILA at 22 and 26 of 30 with a memory per kv head and per query head (state_heads query, 3x
  # the memories; the 22-layer recipe's since round 14), at batch 1 and 128 at 16K, each run against both teachers
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 420 python3 scripts/bench/bench_generate.py --out "$out/depth-kv" --mixers sila --depths 22,26 \
    --batches 1,128 --contexts 16k --steps 16
  timeout 420 python3 scripts/bench/bench_generate.py --out "$out/depth-qheads" --mixers sila --depths 22,26 \
    --batches 1,128 --contexts 16k --steps 16 --mixer-settings recipe,sila.state_heads=query
  # the step kernel alone in each layout, every warp count (3x the programs at one warp each: about two waves of
  # 8 one-warp programs an SM at batch 128, by kernel_resources.py's 255 registers)
  timeout 90 python3 scripts/bench/sweep_sila_decode.py --out "$out/sweep-kv" --batches 1,32,128
  timeout 90 python3 scripts/bench/sweep_sila_decode.py --out "$out/sweep-qheads" --batches 1,32,128 \
    --state-heads query
}

decode_profile_26() {  # where the 26-layer SILA hybrid's batch-128 step goes under the current defaults, kernel by kernel
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 420 python3 scripts/bench/profile_decode.py --out "$out/b128-26" --models teacher-engine,sila --layers 26 \
    --batches 128 --context 16k --variants default --steps 8 --save-code
}

decode_profile_22q() {  # where the 22-layer recipe's batch-128 step goes (a memory per query head), kernel by kernel:
  # the 0.18 ms that 3x at 22 of 30 needs (round 15)
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 420 python3 scripts/bench/profile_decode.py --out "$out/b128-22q" --models teacher-engine,sila --layers 22 \
    --batches 128 --context 16k --variants default --steps 8 --save-code --mixer-settings recipe,sila.state_heads=query
}

decode_windows() {  # decode_windows DEPTH BATCHES COUNTS [SINKS]: SILA at DEPTH of 30 with a memory per query head,
  # as is and with COUNTS of its kept layers as 4K windows (with SINKS attention sinks), at 16K against both teachers
  # (issue 51's speed)
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 420 python3 scripts/bench/bench_generate.py --out "$out/windows$1${4:+-sinks$4}" --mixers sila \
    --depths "$1" --batches "$2" --contexts 16k --steps 16 --mixer-settings recipe,sila.state_heads=query \
    --windows 4096 --windowed-layers "$3" --attention-sinks "${4:-0}"
}

ddp_graph_tests() {  # align's and train's graphs under ddp on two GPUs end with the eager launch's model
  RAVEN_SMOLLM2_GGUF=$MODEL timeout 600 python3 -m pytest -o addopts="" -q -rfE tests/convert/train/test_distributed.py \
    -k two_gpus 2>&1 | tail -15
}

views_check() {  # round 8's fixes on the GPU: the views of a product only at one row (the batch-16 test and the
  # 26-layer step's logits against Inductor's own), SSE's warps by rule (the sweep's default rows)
  RAVEN_SMOLLM2_GGUF=$MODEL timeout 420 python3 -m pytest -o addopts="" -q -rfE tests/raven_layers/test_gpu.py \
    tests/scripts/test_sweep_sse_decode.py -k "wide_products or real_smollm2 or sweep" 2>&1 | tail -8
  decode_profile_26
  decode_sse_warps
}

decode_sse_warps() {  # SSE's step kernel under 1-8 warps (8, the default, came from head dim 128's registers):
  # SSE is 0.58x the teacher at batch 128, the mixer furthest from 0.55x, and SILA's step ran fastest at one warp
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  timeout 180 python3 scripts/bench/sweep_sse_decode.py --out "$out/sweep-sse" --batches 1,32,128
}

decode_round_8_steps() {  # round 8's times (docs/lab/2026-11-29-decode-round-7.md, "Next"): every model's batch-1 step
  # with its mixer's product read as views (parts_as_views) and under dependent launch, then both at batch 128
  mkdir -p "$RUNS/decode-bench"
  # what decides dependent launch first (both models at batch 1 and 128), in calls short enough not to be cut
  pdl_profile pdl-b1 teacher-engine,sila 1 16 540 --save-code
  pdl_profile pdl-b128 teacher-engine,sila 128 8 420
  decode_b1_table
  pdl_profile pdl-b1-raven-sse raven,sse 1 16 540 --save-code
}

decode_parts() {  # where the steps go, kernel by kernel, and the sweeps of the tilings and splits; the runs that
  # decide a default first (docs/lab/2026-11-29-decode-round-5.md, "What each result decides")
  local out="$RUNS/decode-bench" && mkdir -p "$out"
  # the norms inside their products (raven_kernels.linear) on the GPU first: the kernel in bf16, the greedy tokens
  timeout 240 python3 -m pytest -o addopts="" -q -rfE tests/kernels/test_linear.py tests/raven_layers/test_gpu.py \
    tests/scripts/test_bench_products.py tests/scripts/test_sweep_sila_decode.py \
    -k "linear or norms_inside or products or sweep_sila" 2>&1 | tail -15
  # each product with its norm or activation as the default step runs them against one fused kernel, by tiling
  timeout 240 python3 scripts/bench/bench_products.py --out "$out/products" --batches 1,32,128
  # SILA's step kernel (its m at depth) under each number of warps
  timeout 120 python3 scripts/bench/sweep_sila_decode.py --out "$out/sweep-sila" --batches 1,32,128
  # a batch-1 step with its products as Inductor's reductions (fusable with the work around them), as GEMVs, or
  # with the norms inside them
  timeout 360 python3 scripts/bench/profile_decode.py --out "$out/reduced" --models teacher-engine,sila \
    --batches 1 --context 16k --variants default "reduced,combo_kernels=True" "prologues,combo_kernels=True" --steps 16
  # where the 26-layer hybrid's step goes at batch 128, and what the norms inside their products change
  timeout 420 python3 scripts/bench/profile_decode.py --out "$out/b128-26" --models teacher-engine,sila --layers 26 \
    --batches 128 --context 16k --variants default "prologues,combo_kernels=True" --steps 8
  timeout 240 python3 scripts/bench/sweep_raven_decode.py --out "$out/sweep-raven" --batches 1,32,128 \
    --blocks 4,8 --warps 1,2 --ranges 1,4,16
  # the attention at batch 1 (128 ranges a row at 16K, merged by a second kernel), against fewer, longer ranges
  # whose merge fits the last program, timed inside CUDA graphs
  timeout 180 python3 scripts/bench/sweep_decode_attention.py --out "$out/sweep-b1" --batches 1 --contexts 4k,16k \
    --blocks 64,128 --warps 4 --stages 3 --per-sm 2 --native 1 --merge 0,1 --max-ranges 0,8,16,32
  # Inductor's autotuned GEMMs (epilogues fused) at batch 128
  timeout 420 python3 scripts/bench/profile_decode.py --out "$out/b128-26-autotune" --models teacher-engine,sila \
    --layers 26 --batches 128 --context 16k --variants "fused,combo_kernels=True,max_autotune_gemm=True" --steps 8
  timeout 300 python3 scripts/bench/bench_generate.py --out "$out/depth" --mixers sila --depths 22,26 \
    --batches 128 --contexts 16k --steps 16
  timeout 420 python3 scripts/bench/profile_decode.py --out "$out" --models teacher-engine,raven,sse,sila \
    --batches 32 --context 16k --variants default --steps 8
}
