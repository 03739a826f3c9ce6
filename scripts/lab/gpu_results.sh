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
# Jobs (each one run directory under ~/runs, with the recipe's own settings and these paths):
#   teacher        the teacher, evaluated with the recipes' evaluate settings
#   raven|sse|sila recipes/smollm2-<mixer>.yaml, every stage but export; after training, the final model is loaded
#                  and generates in a process without the toolkit (scripts/tools/clean_load.sh -> RUN/load_check.json)
#                  and is saved as its difference from the teacher (RUN/model.delta.safetensors, about 54 MB for
#                  SILA; `bash scripts/lab/gpu_jobs.sh deltas RUN` brings it back, `python -m raven_convert.delta
#                  apply` rebuilds it).
#                  Before its own evaluation, RUN-sw: the trained hybrid evaluated with its kept attention layers
#                  as 4K sliding windows (it trained with full attention), on retrieval at 4K-16K (WINDOWED_EVAL)
#   sila-uniform   SILA's ablation: its aligned model trained with uniform token weights (started by the sila job
#                  unless ABLATION=0)
#   sse-every2     ablations of the sse job (layers auto:15 scored by fitted mixers), for the ablation table of
#                  docs/lab/2026-11-28-summary.md: every other layer (0-29:2) instead;
#   sse-window-choice  auto:15 scored by cutting each layer's attention to a 64-token window
#                  (layer_choice.ablation: window) instead of by fitted mixers;
#   MIXER-seed1    (raven, sse or sila) the MIXER job with every training seed 1 (layer fit, data order,
#                  retrieval samples, align, train, extend): a second seed of that recipe;
#   MIXER-eval-seed1  the MIXER job's trained model (it waits for it; EVAL_OF=RUN names another run of that
#                  recipe, e.g. sila-seed1, into RUN-eval-seed1) evaluated again on other prompts (evaluate.seed 1):
#                  the evaluation's own spread, to read MIXER-seed1 against;
#   MIXER-trained-windows  the kept attention layers as 4K sliding windows from conversion on (sliding_window),
#                  so the mixers learn to carry what the windows drop (the 16K sliding-window target);
#   MIXER-far-windows  MIXER-trained-windows whose extend rows carry far facts (extend.retrieval: half the text
#                  retrieval samples of 0.7-0.95 of a row with every fact in its first quarter, over 4K tokens from
#                  its question), so the mixers learn to carry what the windows drop (recipes/README.md);
#   sila-nodecay-windows  sila-far-windows with one kv head per SILA layer held at gamma = 1 (no_decay_heads: 1),
#                  so that its memory can outlast the 4K window (docs/lab/2026-11-28-ablations-11-loss-kernels.md)
#   MIXER-answers-windows  MIXER-far-windows with four times its extend steps (600) and each answer token of the
#                  far facts counted ANSWER_WEIGHT (100) times in the cross-entropy (extend.answer_weight): the answers
#                  are about 0.1% of a row's tokens, so the readout gets little gradient from them otherwise (Raven's
#                  slots keep a passkey to 16K where its answer does not read it: docs/lab/2026-11-28-ablations-13-train-16-rows.md);
#                  evaluated on the tasks that reach 16K only (TARGET_EVAL), as the run's own evaluation. Far facts
#                  stay half of extend's text: at 90% the mix is ten times the corpus, about 160M tokens to pack,
#                  some 24 minutes at the 110K tokens/s measured (docs/lab/2026-11-28-ablations-14-answer-weights.md);
#   sila-nodecay-answers-windows  sila-answers-windows with sila-nodecay-windows' head that never forgets
#   MIXER-narrow-windows  MIXER-answers-windows trained with 1K windows (sliding_window 1024 from conversion on) and
#                  evaluated with 4K ones (evaluate.attention_window): in 2K and 8K rows most of the context then
#                  reaches the answer through the mixers alone, where with 4K windows almost none did (no windowed
#                  run answered a needle past its window: docs/lab/2026-11-28-ablations-15-answers-x100.md; Raven's did not either,
#                  and lost most answers 1K-4K back: docs/lab/2026-11-28-ablations-16-narrow-windows.md)
#   profile-MIXER  the MIXER recipe's train step under the profiler (scripts/bench/profile_train.py), as the recipe runs it;
#   bench-MIXER    MIXER's train stage eager and as CUDA graphs at 8 and 16 rows a step (scripts/bench/bench_graphs.py, no
#                  weights needed);
#   MIXER-try-NAME  the MIXER job with TRY_ARGS (overrides split at spaces, so lists without them: TRY_ARGS="--set
#                  extend.steps=300 --set evaluate.lengths=[1024,2048]") into the run MIXER-try-NAME: a one-off
#                  experiment, named by what it tries;
#   sse-noretrieval  no synthetic retrieval samples in the data (the recipe mixes in 20%, data.retrieval);
#   sse-noextend   no extend stage;
#   sse-norouter   SSE's router without the language-model gradient (router_gradient: false).
#   reach-RUN      how long each mixer memory of run RUN's trained model holds a passkey over 16K tokens, with its
#                  kept attention as 4K windows (scripts/tools/memory_reach.py; it waits for RUN's extend): RUN/memory-reach
#   sila-deep22|sila-deep26  recipes/smollm2-sila-deepN.yaml: N of 30 layers, chosen by restoring attention
#                  (layer_choice.direction restore; docs/DEPTH.md)
#   sila-auto22|sila-auto26  smollm2-sila.yaml at auto:22/auto:26 with its own layer choice (each layer cut in
#                  turn, three rounds): the deep recipes' layer choice against the half-depth one's
#   sila-restore22-fine|sila-restore26-fine  smollm2-sila-deep26.yaml's restore choice at auto:22/auto:26 with the
#                  first 8 kept layers chosen one a round (layer_choice.round_sizes; docs/LAYER_CHOICE.md)
#   sila-kd22      smollm2-sila-deep22.yaml with distillation from the teacher in train and extend (kd_weight 1)
#   sila-kd22-e2e|sila-kd26-e2e  sila-kd22, and at auto:26 (the same cut choice), with a third of align's steps
#                  moved to train (align 800, train 600): the same minutes, more of them end to end
#   sila-prog22    converting in steps (docs/DEPTH.md): smollm2-sila.yaml's 15-layer hybrid trained without its
#                  evaluation into RUNS/sila-prog15 (about 11 GPU-minutes), then
#                  recipes/smollm2-sila-deep22-progressive.yaml from it (--start-from) into RUNS/sila-prog22, evaluated;
#                  against sila-deep22 (one step) at the same evaluation
#   sila-deepN-half|sila-deepN-double  (N: 22 or 26) smollm2-sila-deepN.yaml at half and twice its align, train and
#                  extend steps: perplexity and retrieval against the tokens read (about 8 and 22 GPU-minutes without
#                  evaluation; `python -m raven_convert.depth budget` puts them beside the recipe's own run)
#   sila-deep22-ddp4|sila-deep26-ddp4  the deep recipe on all four GPUs of the host under data parallel (PROCESSES=4:
#                  each stage through `accelerate launch`, batch_size rows per process), 4x the tokens; the stages
#                  run without CUDA graphs under several processes, so each process at about half the graphed
#                  rate (docs/SCALE_OUT.md); start it alone, with every GPU visible
#   sila-deep22-ddp2|sila-deep26-ddp2  the deep recipe on two GPUs under data parallel at 1.25x its steps: 2.5x its
#                  tokens (perplexity at 22 of 30 reaches 1.05x at about 2.4x by the budget fit, docs/DEPTH.md) in
#                  about 16 minutes of training (align 1.95x and train 1.5-1.6x one graphed GPU's tokens/s on two,
#                  scale-out); start it alone, with both GPUs visible
#   deep22-ddp2-x2 sila-deep22-ddp2 evaluated at 1K-8K (QUICK_EVAL), with the 2-GPU tests of align's and train's
#                  graphs under ddp beside it (tiny models). Its layer choice (50 s on GPU 0) is round 9's, kept in
#                  docs/results/layer_choice (every recipe job seeds its run's cache from there)
#   sila-deep22-ddp2-long  sila-deep22-ddp2 at 1.8x its align and train steps (227M tokens; align reads the
#                  20M-token corpus about 9 times over), evaluated at 1K-8K: the 22-layer perplexity target, where the
#                  budget fits put it
#   sila-deep22-qheads-ddp2  smollm2-sila-deep22.yaml (a memory per query head since round 14) as sila-deep22-ddp2
#                  ran it with a memory per kv head (2.5x the tokens, two GPUs), evaluated at 1K-8K: passkey at 8K,
#                  which that run found 4-6K tokens back and the recipe's budget does not; start it alone
#   sila-deep22-all  smollm2-sila-deep22.yaml whose train stage trains every weight (trainable all), the teacher's
#                  own at a tenth of the mixers' rate (pretrained_lr_scale 0.1): the perplexity LoRA leaves at 22 of 30
#   sila-deep22-all-ddp2  sila-deep22-all at sila-deep22-ddp2's 2.5x tokens on two GPUs, train's and extend's steps
#                  as CUDA graphs under ddp (their 2-GPU test passed in round 10; eager, extend gained 1.03x from
#                  the second GPU); start it alone, with both GPUs visible
#   raven-silarecipe|sse-silarecipe  smollm2-sila.yaml with the mixer swapped (its layer choice by fitted mixers, as
#                  the mixer's own recipe scores them): SILA's data, token weights and 16-row steps for Raven and SSE
#                  at 15 of 30, against their own recipes' NIAH-Word
#   MIXER-silarecipe-seed1  that job with every training seed 1 (SEED1 below)
#   raven-deep22|sse-deep22  smollm2-sila-deep22.yaml with the mixer swapped (its settings and layer choice from its
#                  own recipe): the other mixers at 22 of 30
#   raven-m128|raven-m256  smollm2-raven.yaml with 128 or 256 slots (top-8): NIAH-Word's far words against the state
#                  (the Raven variants run on the recipe's 15 layers, written out in it since round 12: a change
#                  of mixer settings does not score the layers again)
#   raven-nogumbel smollm2-raven.yaml with random routers (round 11's) and without Gumbel noise on the router in
#                  training (at the start the noise's spread is 18x the scores' across tokens: training routes at
#                  random, evaluation by the scores)
#                  (run by quick_on, as the 2-GPU sessions below run theirs, a Raven job also prints its routers'
#                  occupancy: scripts/tools/raven_router_occupancy.py)
#   raven-centred|raven-centred-nogumbel  smollm2-raven.yaml, whose routers start centred since round 12 (fitted to
#                  the layers' inputs at align's start: no offset shared by every token, unit spread), with and
#                  without the noise
#   routers15-x2   one 2-GPU session of about 26 minutes: raven-centred then sse-silarecipe on GPU 0,
#                  raven-centred-nogumbel then raven-nogumbel on GPU 1
#   sse-centred    smollm2-sse.yaml (sse-silarecipe on its 15 layers since round 13) with router_init centred
#   raven-centred-seed1  smollm2-raven.yaml (centred since round 12) with every training seed 1
#   sse-seed1      smollm2-sse.yaml (SILA's recipe on its 15 layers since round 13) with every training seed 1
#   raven-deep22-centred  smollm2-sila-deep22.yaml with Raven (centred routers) on SILA's 22 layers (SILA22)
#   sila-deep22-qheads|sila-deep26-qheads|sila-qheads  the deep recipe on its layers (SILA22, SILA26), or
#                  smollm2-sila.yaml on its own (SILA15: no new layer scan), with a memory per query head
#                  (sila.state_heads query: 3x the memories, k/v widened from the teacher's): round 13 found the deep
#                  hybrids' excess loss past position 64, growing to 512 and beyond
#   qheads-speed   times (about 10 minutes): SILA at 22 and 26 of 30 at batch 1 and 128 at 16K with a memory per
#                  kv head, then per query head (bench_generate.py --mixer-settings recipe,sila.state_heads=query),
#                  each against both teachers in its process; then SILA's step kernel alone in each layout, every
#                  warp count (sweep_sila_decode.py [--state-heads query])
#   qheads-x2      one 2-GPU session of about 25 minutes: sila-deep22-qheads then sse-seed1 on GPU 0,
#                  sila-deep26-qheads then sila-qheads on GPU 1
#   sila-deep22-seed1  smollm2-sila-deep22.yaml (a memory per query head since round 14) with every training seed 1
#   sila-deep26-qheads-induction  sila-deep26-qheads keeping layers 17, 18, 20 and 23 (SILA26_INDUCTION): the
#                  layers with induction heads (scripts/tools/induction_scores.py, docs/LAYER_CHOICE.md), where the
#                  restore choice keeps 1 instead of 23, the layer word and code answers need (round 11)
#   sila-deep22-far-facts  smollm2-sila-deep22.yaml whose extend stage's retrieval samples are half its text, each
#                  0.7-0.95 of an 8K row with its facts in the first quarter (FAR_FACTS_RECIPE): passkey at 8K, which
#                  the recipe loses 4-6K tokens back (round 14)
#   sila-deep22-seed1-far-facts  sila-deep22-far-facts from sila-deep22-seed1's trained model: it waits for that
#                  run's train stage, copies the run without extend and evaluation, and extends it with far facts (the
#                  stages before are done already), so the two runs differ in their extend data alone
#   qheads-next-x2 one 2-GPU session of about 25 minutes: qheads-speed then sila-deep22-seed1 on GPU 0 (the speed
#                  ratios are each against the teachers timed in the same process), sila-deep26-qheads-induction then
#                  sila-deep22-seed1-far-facts on GPU 1
#   deep26-ddp2-profile  one 2-GPU session of about 27 minutes: sila-deep26-ddp2 (smollm2-sila-deep26.yaml, the
#                  copying layers with a memory per query head since round 15, at 2.5x its tokens on both GPUs),
#                  evaluated at 1K-8K: whether the word and code cells at 26 come with tokens; then the 22-layer
#                  recipe's batch-128 decode step profiled kernel by kernel on GPU 0 (decode_profile_22q)
#   sila-deep22-w4k  smollm2-sila-deep22.yaml with 4K sliding windows on the four kept layers without induction heads
#                  (1, 7, 8, 16: previous- and duplicate-token heads, docs/results/depth/induction_scores.json) from
#                  conversion on (W22_WINDOWS); the copying layers 17, 18, 20, 23 stay full attention
#   sila-deep22-w4k-seed1  the same with every training seed 1
#   windows22-speed|windows26-speed  times: SILA at 22 (26) of 30 with a memory per query head, with 4 (1 and 2) of its
#                  kept layers as 4K windows, against both teachers in the same process (decode_windows)
#   windows22-x2   one 2-GPU session of about 25 minutes: sila-deep22-w4k then windows26-speed on GPU 0,
#                  windows22-speed then sila-deep22-w4k-seed1 on GPU 1
#   sila-deep22-w4k-local|sila-deep22-w4k-local-seed1  as sila-deep22-w4k(-seed1) with only layers 1 and 16 windowed
#                  (W22_LOCAL): the two kept layers that look least far back (scripts/tools/attention_reach.py; 7 and 8
#                  look farthest of all 30)
#   windows22-local-speed  times: SILA at 22 of 30, a memory per query head, with 1 and 2 kept layers as 4K windows
#   windows22-local-x1  one GPU, about 22 minutes: windows22-local-speed, then sila-deep22-w4k-local
#   windows22-local-x2  two GPUs, about 20 minutes: sila-deep22-w4k-local then windows22-local-speed on GPU 0,
#                  sila-deep22-w4k-local-seed1 on GPU 1
#   sila-deep22-w4k-sinks|sila-deep22-w4k-sinks-seed1  as sila-deep22-w4k-local(-seed1) with 4 attention sinks on the
#                  two windows (W22_SINKS; scripts/lab/window_cost.py: layer 16's window costs nothing with them)
#   windows22-sinks-speed  times: windows22-local-speed's models with 4 attention sinks on each window
#   sinks-gpu-check  the graphed decode with attention sinks against the eager path (tests/raven_layers/test_gpu.py)
#   windows22-sinks-x1  one GPU, about 24 minutes: sinks-gpu-check, windows22-sinks-speed, sila-deep22-w4k-sinks
#   windows22-sinks-x2  two GPUs, about 22 minutes: sila-deep22-w4k-sinks then windows22-sinks-speed on GPU 0,
#                  sila-deep22-w4k-sinks-seed1 then sinks-gpu-check on GPU 1
#   sila-deep26-w4k-sinks|sila-deep26-w4k-sinks-seed1  smollm2-sila-deep26.yaml with two of its four copying layers
#                  (17 and 20) as 4K windows with 4 attention sinks (W26_SINKS: the pair whose windows cost the
#                  teacher least past 4K, scripts/lab/window_cost.py, round 17); 5.39x the teacher at batch 128, 16K
#   windows26-sinks-x2  two GPUs, about 20 minutes: sila-deep26-w4k-sinks on GPU 0, its seed 1 on GPU 1
#   windows26-sinks-x1  one GPU, about 20 minutes: sila-deep26-w4k-sinks
#   sila-deep26-w4k-sinks-ddp2  sila-deep26-w4k-sinks at 2.5x its tokens on two GPUs (DDP2_STEPS, as sila-deep26-ddp2):
#                  whether 26's word and code cells come with tokens while two of its copying layers are windows
#   windows26-sinks-ddp2  one 2-GPU session of about 25 minutes: sila-deep26-w4k-sinks-ddp2 evaluated at 1K-8K
#   sila-deep22-answers|sila-deep26-answers  the deep recipe with extend's retrieval answers counted 100 times in its
#                  cross-entropy and extend at 600 steps (ANSWERS: round 15 of the ablations lifted NIAH-Word at 1K-4K
#                  with it); sila-deep26-w4k-sinks-answers: the same with sila-deep26-w4k-sinks' windows
#   answers26-x2   two GPUs, about 22 minutes: sila-deep26-answers on GPU 0, sila-deep26-w4k-sinks-answers on GPU 1
#   sila-deep22-w4k-sinks-far  smollm2-sila-deep22-windows.yaml with half of extend's rows carrying facts 4.3-7.8K
#                  tokens back from their questions (FAR_FACTS_RECIPE): seed 0's passkey at 8K fails 4-6K back,
#                  where it answers with the filler (round 18)
#   targets-x2     two GPUs, about 22 minutes: the two windowed recipes' open targets, sila-deep22-w4k-sinks-far on
#                  GPU 0 (passkey at 8K) and sila-deep26-w4k-sinks-answers on GPU 1 (cells at 1K-4K)
#   windows22-x1   the same on one GPU, about 25 minutes: windows22-speed at batch 128 alone, sila-deep22-w4k, then
#                  windows26-speed as time allows
#   centred-x2     one 2-GPU session of about 26 minutes: raven-deep22-centred, then raven-centred-seed1 on GPU 0;
#                  sse-centred, then sse-silarecipe on GPU 1
#   mixers15-x2    one 2-GPU session of about 26 minutes: sse-raven-x2's two runs, then raven-m128 after SSE on GPU 0
#                  and raven-nogumbel after Raven's second seed on GPU 1; no deltas saved
#   sse-raven-x2   one 2-GPU session: sse-silarecipe on GPU 0, raven-silarecipe-seed1 on GPU 1, both at 1K-8K
#   all-raven-x2   one 2-GPU session: sila-deep22-all on GPU 0, raven-silarecipe on GPU 1, both evaluated at 1K-8K
#   decode-b128-twice  issue 52's batch-128 row at 16K (every mixer at 15 of 30, both teachers) in two runs, alone
#                  on the machine: the ratio's spread within a session
#   views-check    round 8's fixes on the GPU: the batch-16 wide-products test, the real-SmolLM2 exactness tests,
#                  the 26-layer batch-128 profile (logits within a bf16 rounding of Inductor's own) and SSE's sweep
#   scale-out      the SILA recipe's align and train on one GPU (CUDA graphs) and on all of the host's GPUs under
#                  ddp and fsdp (weak scaling: the recipe's rows per GPU), and under ddp with align's and train's
#                  steps as graphs holding their all-reduces, tokens/s and memory (scripts/bench/bench_scale_out.py):
#                  what data parallel gains over one graphed GPU; then the GPU tests of those graphs on two GPUs
#   scale-out-round-8-x2  scale-out, then decode-round-8-x2, on a 2-GPU host (about 25 minutes)
#   memory-plan    the 8B-shaped conversion's memory per GPU and per process, stage by stage, and align's and train's
#                  tokens/s on 1, 2, ... up to all of the host's GPUs, under ddp and fsdp (scripts/bench/memory_plan.py:
#                  docs/SCALE_OUT.md's table, measured again where a fix came after it, and at N = 4 on a 4-GPU host);
#                  fsdp before ddp at each N (ddp's 1- and 2-GPU rows were measured again in round 18);
#                  PLAN_STRATEGY and PLAN_PROCESSES narrow it
#   scale-x4       issue 53 on a 4-GPU host: scale-out's runs at N = 4 under strong and weak scaling, then
#                  memory-plan (both take every GPU; start it alone)
#   decode-lab     times, so alone on the machine: the split-K attention's tilings at 16K (sweep_decode_attention.py),
#                  a batch-1 step's kernels and time under the default options and Inductor's own (profile_decode.py),
#                  SILA 15/30 at batch 1, 32, 128 and 16K, every mixer at batch 1 at 4K and 16K (bench_generate.py),
#                  into RUNS/decode-lab
#   decode-tests   the fast path's GPU tests, again under the newest transformers where /tmp/site-newest holds it
#                  (scripts/lab/newest_transformers.sh), then every model's batch-1 kernels under the default
#                  options against Inductor's own logits (profile_decode.py; its times do not count beside another
#                  job), into RUNS/decode-tests
#   decode-round   one device session's worth (about 25 minutes): decode-tests beside sila-deep22-half (evaluated at
#                  1K-8K), then decode-lab alone
#   decode-bench   times, alone: every mixer at 15 of 30 against both teachers at batch 1 at 4K and 16K and at
#                  batch 32 and 128 at 16K, with floors (bench_generate.py); where the 26-layer hybrid's batch-128
#                  step goes, kernel by kernel, and with autotuned GEMMs (profile_decode.py); SILA at 22 and 26 of 30
#                  at batch 128 and 16K; the attention's tilings at batch 1 and Raven's step splits and top-K
#                  methods (sweep_decode_attention.py, sweep_raven_decode.py, in CUDA graphs); a batch-1 step with
#                  its products as Inductor's reductions (profile_decode.py, `reduced`); where a batch-32 step goes,
#                  into RUNS/decode-bench
#   decode-parts   decode-bench without its first two tables (the 26-layer profile onwards, the norms inside their
#                  products among the variants, after their GPU tests, bench_products.py and sweep_sila_decode.py),
#                  alone
#   decode-round-2 decode-tests (NEWEST=1: again under the newest transformers) beside sila-deep26-half (evaluated
#                  at 1K-8K), then decode-bench alone
#   decode-round-3 the fast path's GPU tests, then decode-bench, all alone (about 25 minutes; what runs past the
#                  session's device time is lost, so decode-bench runs its parts in the order above)
#   decode-round-7 the fast path's GPU tests under round 6's defaults, issue 52's tables, the step under programmatic
#                  dependent launch, Raven at M = 256 and its slot ranges, SILA at 22 and 26 (about 28 minutes alone)
#   decode-round-7-x2  the same on a 2-GPU host in about half the minutes: the timed tables on GPU 0, the tests and
#                  the sweeps on GPU 1 (NEWEST=1 with /tmp/site-newest: the exactness tests under the newest
#                  transformers too)
#   decode-round-8-x2  round 7's "Next" on a 2-GPU host (about 15 minutes): the fast path's tests, SSE's step under
#                  1-8 warps and the 26-layer batch-128 profile with its generated code on one GPU; every model's
#                  batch-1 step with and without dependent launch (code saved), both at batch 128, and the batch-1
#                  table on the other
#   depth-speed    decode speed at 15, 22, 26 and 30 of 30 layers converted against the teacher on transformers and
#                  on this engine (bench_generate.py --depths: batch 1, 32, 128 at 4K and 16K, with bandwidth
#                  floors), and the largest batch at 32K (bench_capacity.py --depths), into RUNS/depth-speed;
#                  DEPTHS, BATCHES and CONTEXTS narrow it, CAPACITY=0 skips the 32K part
#   speed          short runs of the SSE and SILA recipes, one table of each stage's tokens/s
#                  (scripts/bench/measure_stages.py); with BASE=DIR (an older checkout's files, copied outside this one)
#                  the same runs of BASE's code first, and the rates as ratios to them.
#                  Several at once on several GPUs: CUDA_VISIBLE_DEVICES=0 ... start sse; CUDA_VISIBLE_DEVICES=1 ...
#                  start sse-seed1
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device_env.sh
export TEACHER=$HOME/cache/teacher-hf RUNS=${RUNS:-$HOME/runs}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # several jobs share the GPU's memory

# The windowed evaluation: its target is passkey at 16K (the teacher scores 0 there), so the retrieval tasks that
# reach past the 4K window, without the speed part; the whole suite would take as long again as the run's own.
WINDOWED_EVAL=(--set evaluate.attention_window=4096 --set "evaluate.tasks=[passkey, niah_single_2]"
  --set "evaluate.lengths=[4096, 8192, 16384]" --set "evaluate.task_lengths={}" --set "evaluate.speed_lengths=[]")

# The evaluation at the targets' lengths only (1K-8K), without 16K and the speed part: 3.5 minutes instead of 6
QUICK_EVAL=(--set "evaluate.lengths=[1024,2048,4096,8192]" --set "evaluate.speed_lengths=[]")

# MIXER-answers-windows' own evaluation: the tasks that reach 16K, where the target is, without the speed part
TARGET_EVAL=(--set "evaluate.tasks=[passkey, niah_single_2, niah_word]" --set "evaluate.task_lengths={}"
  --set "evaluate.speed_lengths=[]")
ANSWERS=(--set "extend.answer_weight=${ANSWER_WEIGHT:-100}" --set extend.steps=600)

# sila-kd*: distillation from the teacher in the train and extend stages
KD=(--set train.kd_weight=1.0 --set extend.kd_weight=1.0)

# the deep recipes' steps under two processes: 2.5x their tokens (twice the rows a step, 1.25x the steps)
DDP2_STEPS=(--set align.steps=1500 --set train.steps=375 --set extend.steps=188)
# 1.8x align's and train's steps, extend's as DDP2_STEPS' (227M tokens): where round 10's fits put 1.05x at 22 of 30
# (208-275M); extend reads 3% of them and took 249 s of round 10's 14.7 minutes, so it stays, for the run to fit a session
DDP2_LONG_STEPS=(--set align.steps=2700 --set train.steps=675 --set extend.steps=188)

# stage 2 trains the teacher's own weights too, at a tenth of the mixers' rate (train.pretrained_lr_scale)
ALL=(--set train.trainable=all --set train.pretrained_lr_scale=0.1)

# MIXER-seed1's settings: every training seed 1 (layer fit, data order, retrieval samples, align, train, extend)
SEED1=(--set data.seed=1 --set data.retrieval.seed=1 --set layer_choice.seed=1 --set align.seed=1 --set train.seed=1
  --set extend.seed=1)

# layers the recipes' layer choices picked, for runs that keep them while settings change (a change of mixer settings
# would score the layers again): smollm2-sila.yaml's 15 (the run sila-rows16), smollm2-sila-deep22.yaml's 22
# (sila-auto22, sila-deep22-all, sila-deep22-ddp2) and smollm2-sila-deep26.yaml's 26 (sila-restore26)
SILA15="0,2,6,10-13,15,21,22,25-29"
SILA22="0,2-6,9-15,19,21,22,24-29"
SILA26="0,2-16,19,21-29"
SILA26_INDUCTION="0-16,19,21,22,24-29"
# smollm2-sila-deep22.yaml's kept layers without induction heads as 4K windows (sila-deep22-w4k)
W22_WINDOWS=(--set sliding_window=4096 --set window_layers=1,7,8,16)
# ... and only the two of them that look least far back (round 16: 7 and 8 spread half their weight 512+ tokens back)
W22_LOCAL=(--set sliding_window=4096 --set window_layers=1,16)
# ... with the first 4 tokens of a row visible to both windows (attention sinks: layer 16 parks 27% of its weight on
# the first token)
W22_SINKS=("${W22_LOCAL[@]}" --set attention_sinks=4)
# smollm2-sila-deep26.yaml's copying layers 17 and 20 as 4K windows with 4 sinks (round 17's window_cost.py)
W26_SINKS=(--set sliding_window=4096 --set window_layers=17,20 --set attention_sinks=4)
# the windowed runs: each NAME (and NAME-seed1) is its recipe (the name up to -w4k) with these windows
declare -A WINDOWS_OF=(
  [sila-deep22-w4k]="${W22_WINDOWS[*]}"
  [sila-deep22-w4k-local]="${W22_LOCAL[*]}"
  [sila-deep22-w4k-sinks]="${W22_SINKS[*]}"
  [sila-deep26-w4k-sinks]="${W26_SINKS[*]}"
)

on_layers() {  # on_layers MIXER LAYERS: the --set value that converts LAYERS to MIXER
  printf 'layers=[{mixer: %s, layers: "%s"}]' "$1" "$2"
}

# MIXER-far-windows' extend data: every fact past a 4K window from its question (retrieval_data.py)
FAR_FACTS=(--set "extend.retrieval={ratio: 0.5, length: [0.7, 0.95], depth: [0.0, 0.25]}")
# the same far facts with the SmolLM2 recipes' own values and restated questions (data.retrieval's), for a recipe
# whose kept layers are whole: its extend stage then practises answers 4.3-7.8K tokens back in its 8K rows
far_mix="{ratio: 0.5, length: [0.7, 0.95], depth: [0.0, 0.25], values: [digits, word, code, code, code, phrase]"
FAR_FACTS_RECIPE=(--set "extend.retrieval=$far_mix, restated: 0.5}")

recipe() {  # recipe MIXER RUN [ARGS...]: the SmolLM2 recipe of MIXER into ~/runs/RUN
  read -ra extra <<< "${RECIPE_ARGS:-}"
  local_paths
  local launch=(python3)  # PROCESSES=N: every stage on N GPUs under data parallel (N x batch_size rows a step)
  [ "${PROCESSES:-1}" -gt 1 ] && launch=(accelerate launch --config_file recipes/accelerate/ddp.yaml
    --num_processes "$PROCESSES")
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

two_processes() {  # two_processes RECIPE RUN [ARGS...]: RUN trained on two processes, its evaluation again on one
  # should the 2-process one fail after training (the trained stages' DONE record their processes). A failure before
  # that ends it: training on one process would outlast a session (round 9)
  PROCESSES=2 trained "$@" || { [ -f "$RUNS/$2/extend/DONE" ] && PROCESSES=1 trained "$@"; }
}

quick_on() {  # quick_on GPU RUN...: the runs in turn on one GPU, evaluated at 1K-8K without the windowed pass; after
  # each Raven run, its routers' occupancy
  local job
  for job in "${@:2}"; do
    CUDA_VISIBLE_DEVICES=$1 WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" run "$job" && [[ $job == raven-* ]] &&
      CUDA_VISIBLE_DEVICES=$1 occupancy "$job"
  done
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
  sila-deep22-seed1)
    trained sila-deep22 "$1" "${SEED1[@]}"
    ;;
  sila-deep22-answers | sila-deep26-answers)  # the deep recipe with its extend's answers weighted (ANSWERS)
    trained "${1%-answers}" "$1" "${ANSWERS[@]}"
    ;;
  sila-deep22-w4k* | sila-deep26-w4k*)  # a run of WINDOWS_OF; after its name, in this order, -far:
    # FAR_FACTS_RECIPE, -answers: ANSWERS, -seed1: every training seed 1, -ddp2: 2.5x the recipe's tokens on two GPUs
    # (as sila-deepN-ddp2)
    local name=${1%-ddp2} extra=()
    [[ $name == *-seed1 ]] && extra+=("${SEED1[@]}") && name=${name%-seed1}
    [[ $name == *-answers ]] && extra+=("${ANSWERS[@]}") && name=${name%-answers}
    [[ $name == *-far ]] && extra+=("${FAR_FACTS_RECIPE[@]}") && name=${name%-far}
    local windows="WINDOWS_OF[$name]"
    [ -n "${!windows:-}" ] || { echo "no windowed run named $1" >&2; return 1; }
    read -ra windows <<<"${!windows}"
    if [[ $1 == *-ddp2 ]]; then
      two_processes "${1%%-w4k*}" "$1" "${windows[@]}" "${extra[@]}" "${DDP2_STEPS[@]}"
    else
      trained "${1%%-w4k*}" "$1" "${windows[@]}" "${extra[@]}"
    fi
    ;;
  sila-deep22-far-facts)
    trained sila-deep22 "$1" "${FAR_FACTS_RECIPE[@]}"
    ;;
  sila-deep22-seed1-far-facts)  # sila-deep22-seed1's trained model (waited for, up to 30 minutes, and copied
    # without its extend and evaluation) extended with FAR_FACTS_RECIPE: the same hybrid both ways, 5 minutes
    local from="$RUNS/sila-deep22-seed1" waited=0
    until [ -f "$from/train/DONE" ]; do
      ((waited += 10)) && ((waited <= 1800)) || { echo "$1: no $from/train/DONE after 30 minutes"; return 1; }
      sleep 10
    done
    rm -rf "${RUNS:?}/$1" && cp -a "$from" "$RUNS/$1" && rm -rf "$RUNS/$1/extend" "$RUNS/$1/evaluate"
    trained sila-deep22 "$1" "${SEED1[@]}" "${FAR_FACTS_RECIPE[@]}"
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
  qheads-x2)  # two recipes a GPU, about 25 minutes: the deep ones with a memory per query head first
    DELTA=0 quick_on 0 sila-deep22-qheads sse-seed1 & DELTA=0 quick_on 1 sila-deep26-qheads sila-qheads &
    wait
    ;;
  qheads-next-x2)  # about 26 minutes: the decode cost of a memory per query head, then the 22-layer recipe's second
    # seed on GPU 0; 26 layers keeping the 4 with induction heads, then that second seed's model extended with far
    # facts, on GPU 1
    DELTA=0 quick_on 0 qheads-speed sila-deep22-seed1 &
    DELTA=0 quick_on 1 sila-deep26-qheads-induction sila-deep22-seed1-far-facts &
    wait
    ;;
  windows22-x2)  # about 25 minutes: two seeds of the 22-layer recipe with 4K windows on its non-copying kept layers,
    # and the decode speed windows buy at 22 and 26 (each ratio against the teachers timed in the same process)
    DELTA=0 quick_on 0 sila-deep22-w4k windows26-speed &
    DELTA=0 quick_on 1 windows22-speed sila-deep22-w4k-seed1 &
    wait
    ;;
  windows22-local-x1)  # about 22 minutes on one GPU
    DELTA=0 quick_on 0 windows22-local-speed sila-deep22-w4k-local
    ;;
  windows22-local-x2)  # about 20 minutes: both seeds at once, the speed after the first
    DELTA=0 quick_on 0 sila-deep22-w4k-local windows22-local-speed &
    DELTA=0 quick_on 1 sila-deep22-w4k-local-seed1 &
    wait
    ;;
  windows22-sinks-x1)  # about 24 minutes on one GPU
    DELTA=0 quick_on 0 sinks-gpu-check windows22-sinks-speed sila-deep22-w4k-sinks
    ;;
  windows22-sinks-x2)  # about 22 minutes: both seeds at once, the speed and the GPU check after them
    DELTA=0 quick_on 0 sila-deep22-w4k-sinks windows22-sinks-speed &
    DELTA=0 quick_on 1 sila-deep22-w4k-sinks-seed1 sinks-gpu-check &
    wait
    ;;
  windows26-sinks-x1)  # about 20 minutes on one GPU
    DELTA=0 quick_on 0 sila-deep26-w4k-sinks
    ;;
  windows26-sinks-x2)  # about 20 minutes: both seeds at once
    DELTA=0 quick_on 0 sila-deep26-w4k-sinks &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-seed1 &
    wait
    ;;
  windows26-sinks-ddp2)  # about 25 minutes on two GPUs: start it alone, first in a session
    WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" DELTA=0 run sila-deep26-w4k-sinks-ddp2
    ;;
  targets-x2)  # about 22 minutes: both at once
    DELTA=0 quick_on 0 sila-deep22-w4k-sinks-far &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-answers &
    wait
    ;;
  answers26-x2)  # about 22 minutes: both at once
    DELTA=0 quick_on 0 sila-deep26-answers &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-answers &
    wait
    ;;
  windows22-x1)  # about 25 minutes on one GPU: windows22-x2's speed at batch 128, its first seed, then 26's speed
    DELTA=0 WINDOW_BATCHES=128 quick_on 0 windows22-speed sila-deep22-w4k windows26-speed
    ;;
  deep26-ddp2-profile)  # about 27 minutes: start it alone, first in a session
    WINDOWED=0 RECIPE_ARGS="${QUICK_EVAL[*]}" DELTA=0 run sila-deep26-ddp2
    CUDA_VISIBLE_DEVICES=0 decode_profile_22q
    ;;
  centred-x2)  # two recipes a GPU, about 26 minutes: Raven at 22 then its second seed at 15; SSE with its scorer
    # centred, then on SILA's recipe evaluated to the end (round 12 cut it during evaluation)
    DELTA=0 quick_on 0 raven-deep22-centred raven-centred-seed1 & DELTA=0 quick_on 1 sse-centred sse-silarecipe &
    wait
    ;;
  mixers15-x2)  # two recipes a GPU, about 26 minutes: the first pair is sse-raven-x2
    DELTA=0 quick_on 0 sse-silarecipe raven-m128 &
    DELTA=0 quick_on 1 raven-silarecipe-seed1 raven-nogumbel &
    wait
    ;;
  routers15-x2)  # two recipes a GPU, about 26 minutes: the centred routers first, then SSE and Raven without noise
    DELTA=0 quick_on 0 raven-centred sse-silarecipe &
    DELTA=0 quick_on 1 raven-centred-nogumbel raven-nogumbel &
    wait
    ;;
  sse-raven-x2)  # one GPU each, about 13 minutes with the evaluation
    quick_on 0 sse-silarecipe & quick_on 1 raven-silarecipe-seed1 &
    wait
    ;;
  all-raven-x2)  # one GPU each, about 18 minutes
    quick_on 0 sila-deep22-all & quick_on 1 raven-silarecipe &
    wait
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
    python3 scripts/bench/bench_scale_out.py recipes/smollm2-sila.yaml --src "$TEACHER" --data "$CORPUS" --gpus 4 \
      --align-steps 60 --train-steps 40 --max-documents 400 --scaling strong,weak --graphed align,train \
      --out "$RUNS/scale-out-x4"
    run memory-plan
    ;;
  scale-out)
    python3 scripts/bench/bench_scale_out.py recipes/smollm2-sila.yaml --src "$TEACHER" --data "$CORPUS" \
      --gpus "$(nvidia-smi -L | wc -l)" --align-steps 60 --train-steps 40 --max-documents 400 --scaling weak \
      --graphed align,train --out "$RUNS/scale-out"
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
    echo "unknown job $1; jobs: teacher raven sse sila sila-uniform MIXER-seed1 MIXER-eval-seed1" \
      "MIXER-trained-windows MIXER-far-windows MIXER-answers-windows MIXER-narrow-windows MIXER-try-NAME" \
      "(MIXER: raven, sse or sila) sila-deep22 sila-deep26 sila-auto22 sila-auto26 sila-restore22-fine sila-restore26-fine sila-kd22 sila-kd22-e2e sila-kd26-e2e sila-prog22 sila-deepN-half sila-deepN-double (N: 22 or 26) sila-deep22-ddp4 sila-deep26-ddp4 sila-deep22-ddp2 sila-deep26-ddp2 sila-deep22-ddp2-long sila-deep22-qheads-ddp2 deep22-ddp2-x2 sila-deep22-all sila-deep22-all-ddp2 raven-silarecipe sse-silarecipe MIXER-silarecipe-seed1 raven-deep22 sse-deep22 raven-m128 raven-m256 raven-nogumbel raven-centred raven-centred-nogumbel raven-centred-seed1 sse-centred raven-deep22-centred centred-x2 sila-deep22-qheads sila-deep26-qheads sila-qheads qheads-speed qheads-x2 sila-deep22-seed1 sila-deep26-qheads-induction sila-deep22-far-facts sila-deep22-seed1-far-facts qheads-next-x2 deep26-ddp2-profile mixers15-x2 routers15-x2 sse-raven-x2 all-raven-x2 views-check decode-b128-twice scale-out memory-plan scale-x4 decode-lab decode-tests decode-round decode-bench decode-round-2 decode-round-3 decode-parts decode-round-7 decode-round-7-x2 decode-round-8-x2 scale-out-round-8-x2 depth-speed sila-nodecay-windows sila-nodecay-answers-windows profile-MIXER bench-MIXER" \
      "sse-every2 sse-window-choice sse-noretrieval sse-noextend sse-norouter reach-RUN speed" >&2
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
