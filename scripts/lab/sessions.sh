# Sourced by scripts/lab/gpu_results.sh: the device sessions, each a job that packs runs onto the GPUs of one host for
# one session's 30 device-minutes (quick_on GPU RUN...: the runs in turn on one GPU; `&` and `wait` put them side by
# side). The runs they name are gpu_results.sh's; what each session measured: scripts/lab/JOBS.md.

session() {  # session JOB: the session JOB, run; 127 when JOB names no session
  case $1 in
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
    quick sila-deep26-w4k-sinks-ddp2
    ;;
  targets-x2)  # about 24 minutes: both recipes at once; once GPU 0's ends, the 8B plan's 2-process fsdp row on both
    # GPUs beside GPU 1's recipe (memory is per process, so it holds; its tokens/s share a GPU and measure nothing)
    (DELTA=0 quick_on 0 sila-deep22-w4k-sinks-far; PLAN_PROCESSES=2 PLAN_STRATEGY=fsdp run memory-plan) &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-answers &
    wait
    ;;
  targets2-x2)  # about 24 minutes: GPU 0 the 22-layer recipe with four windows and sinks (passkey 8K), then the 8B
    # plan's 1-process and 2-process fsdp rows on both GPUs beside GPU 1's recipe (the host memory of the save a tensor
    # at a time); GPU 1 the windowed 26 with extend's answers x30 (cells at <= 1.10x the perplexity)
    (DELTA=0 quick_on 0 sila-deep22-w4k-four-sinks; PLAN_PROCESSES=1,2 PLAN_STRATEGY=fsdp run memory-plan) &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-answers30 &
    wait
    ;;
  x4-round)  # about 25 minutes on a 4-GPU host: the 22-layer recipe with four windows and sinks, both seeds, on GPUs 0
    # and 1 beside the 8B plan's 1- and 2-process fsdp rows on GPUs 2 and 3; then, every GPU free, the plan's 4-process
    # fsdp row, the SILA recipe's weak scaling to 4 GPUs under ddp (eager and graphed), and the plan's 4-process ddp row
    DELTA=0 quick_on 0 sila-deep22-w4k-four-sinks &
    DELTA=0 quick_on 1 sila-deep22-w4k-four-sinks-seed1 &
    (CUDA_VISIBLE_DEVICES=2,3 PLAN_PROCESSES=1,2 PLAN_STRATEGY=fsdp run memory-plan) &
    wait
    PLAN_PROCESSES=4 PLAN_STRATEGY=fsdp run memory-plan
    run scale-weak
    PLAN_PROCESSES=4 PLAN_STRATEGY=ddp run memory-plan
    ;;
  x4-pair)  # about 24 minutes on a 4-GPU host: the windowed 26 at 2.5x its tokens, two GPUs each, side by side, with
    # extend's answers x30 and x100 (x100 at the recipe's tokens: 30 of 32 cells at 1.12x; the 2.5x tokens alone:
    # 1.07x, 22 cells): which gives the cells at <= 1.10x
    (CUDA_VISIBLE_DEVICES=0,1 PORT=29500 quick sila-deep26-w4k-sinks-answers30-ddp2) &
    (CUDA_VISIBLE_DEVICES=2,3 PORT=29501 quick sila-deep26-w4k-sinks-answers-ddp2) &
    wait
    ;;
  x4-strong)  # about 30 minutes on a 4-GPU host (issue 53), what matters first: the 22-layer windowed recipe at
    # extend batch 4 on GPU 0, the 8B plan's convert and one process on GPU 1, both scalings on GPUs 2 and 3; then
    # that recipe on all four GPUs at the same global batches, evaluated on the four; the plan's 4-process fsdp row
    # (host memory with each process reading its own rows); strong scaling to four; the plan's 4-process ddp row
    DELTA=0 quick_on 0 sila-deep22-w4k-sinks-ext4 &
    (CUDA_VISIBLE_DEVICES=1 PLAN_PROCESSES=1 run memory-plan) &
    (CUDA_VISIBLE_DEVICES=2,3 run scale-pair) &
    wait
    quick sila-deep22-w4k-sinks-strong4
    PLAN_PROCESSES=4 PLAN_STRATEGY=fsdp run memory-plan
    run scale-strong
    PLAN_PROCESSES=4 PLAN_STRATEGY=ddp run memory-plan
    ;;
  x4-host)  # about 22 minutes on a 4-GPU host (issue 53), the one unmeasured target first: the 8B plan's 4-process
    # fsdp row with the host fixes (its convert included); then the 22-layer windowed recipe's EXT4 global batches
    # on all four GPUs, evaluated on the four (its one-GPU twin, sila-deep22-w4k-sinks-ext4, ran in round 26); strong
    # scaling to four; the plan's 4-process ddp row. x4-strong's runs without the one-GPU ones
    PLAN_PROCESSES=4 PLAN_STRATEGY=fsdp run memory-plan
    quick sila-deep22-w4k-sinks-strong4
    run scale-strong
    PLAN_PROCESSES=4 PLAN_STRATEGY=ddp run memory-plan
    ;;
  x8)  # about 26 minutes on an 8-GPU host (issue 54), in the order of its targets: the 8B plan's 8-process fsdp row
    # (at most 10 GiB a GPU; its convert first, about 5 minutes), weak scaling to eight under ddp, the plan's
    # 8-process ddp row, then its 1-, 2- and 4-process fsdp rows (the report keeps every row a cut job finished)
    PLAN_PROCESSES=8 PLAN_STRATEGY=fsdp run memory-plan
    run scale-weak
    PLAN_PROCESSES=8 PLAN_STRATEGY=ddp run memory-plan
    PLAN_PROCESSES=1,2,4 PLAN_STRATEGY=fsdp run memory-plan
    ;;
  ext4-x1)  # about 20 minutes on one GPU: the twin of x4-host's 4-GPU recipe run (the same global batches on one GPU)
    DELTA=0 quick_on 0 sila-deep22-w4k-sinks-ext4
    ;;
  ext4-plan1-x1)  # about 20 minutes on one GPU: ext4-x1 beside the 8B plan's 1-process row with the save leaving a
    # mapped file unread (align's host memory at one process: 17.1 GiB in round 20; the plan's tokens/s share the GPU)
    DELTA=0 quick_on 0 sila-deep22-w4k-sinks-ext4 &
    (PLAN_PROCESSES=1 PLAN_STRATEGY=fsdp run memory-plan) &
    wait
    ;;
  windows22-seed1-ddp2)  # about 17 minutes on both GPUs of a 2-GPU host: the windowed 22 at 2.5x align's and
    # train's tokens (round 21's run) on every training seed 1
    quick sila-deep22-w4k-sinks-seed1-ddp2
    ;;
  windows22-plan2-x2)  # about 18 minutes on a 2-GPU host (round 21): the windowed 22 at 2.5x beside the 8B plan's
    # 2-process fsdp row on the same two GPUs (host memory with convert sharing the teacher's tensors and each process
    # reading its own rows; the plan's tokens/s are not clean, its memory is)
    (PORT=29501 quick sila-deep22-w4k-sinks-ddp2) &
    (PLAN_PROCESSES=2 PLAN_STRATEGY=fsdp run memory-plan) &
    wait
    ;;
  answers26-ddp2)  # about 22 minutes on both GPUs: the windowed 26 at 2.5x align's and train's tokens (1.07x the
    # perplexity before weighting answers) with extend's answers x100 over 300 steps of twice the rows
    quick sila-deep26-w4k-sinks-answers-ddp2
    ;;
  answers30-plan2-x2)  # about 22 minutes on a 2-GPU host: the shipped 26-layer recipe at 2.5x align's and train's
    # tokens (its seeds score 1.086x and 1.118x against the 1.10x target, round 25), beside the 8B plan's 2-process
    # fsdp row with the file trace and the save leaving a mapped file unread (align's main process: 17.5 GiB in round
    # 25, predicted near the other process's 10.2)
    (PORT=29501 quick sila-deep26-w4k-sinks-answers30-ddp2) &
    (PLAN_PROCESSES=2 PLAN_STRATEGY=fsdp run memory-plan) &
    wait
    ;;
  answers26-x1)  # about 24 minutes on one GPU: the windowed 26 at the recipe's tokens with extend's answers x30 over
    # 600 steps; from its trained model, beside it, x100 over 300 steps (x100 over 600: 30 of 32 cells at 1.12x): which
    # of the answers' weight and extend's length costs the perplexity
    DELTA=0 quick_on 0 sila-deep26-w4k-sinks-answers30 &
    (fork sila-deep26-w4k-sinks-answers30 sila-deep26-w4k-sinks-answers-extend300 &&
      DELTA=0 quick_on 0 sila-deep26-w4k-sinks-answers-extend300) &
    wait
    ;;
  deep30-x1)  # about 24 minutes on one GPU: where the windowed 26's extend step goes (3 minutes, before anything
    # shares the GPU), then every layer converted (the depth table's last row, speed only so far)
    DELTA=0 quick_on 0 profile-deep26-extend sila-deep30
    ;;
  windows26-seed1-x1)  # about 22 minutes on one GPU: round 22's windowed 26 with answers x30 on every training seed 1
    DELTA=0 quick_on 0 sila-deep26-w4k-sinks-answers30-seed1
    ;;
  seed2-plan1-x1)  # about 24 minutes on one GPU: the shipped 26-layer recipe on every training seed 2 (seeds 0 and 1:
    # 1.086x and 1.118x the perplexity, round 25), beside the 8B plan's 1-process row with the trace of where its own
    # memory grows (align holds 7.6 GiB of its own at every process count, round 26)
    DELTA=0 quick_on 0 sila-deep26-w4k-sinks-answers30-seed2 &
    (PLAN_PROCESSES=1 PLAN_STRATEGY=fsdp run memory-plan) &
    wait
    ;;
  extend-ab-x1)  # about 25 minutes on one GPU: the windowed 26's extend step timed with its next inputs made beside
    # it and after it, in one session (round 24's profile waited between steps, which undid the overlap), then that
    # recipe's seed 1
    DELTA=0 quick_on 0 profile-deep26-extend profile-deep26-extend-in-place sila-deep26-w4k-sinks-answers30-seed1
    ;;
  extend-ab-plan-x2)  # about 22 minutes on a 2-GPU host (ran in round 25): GPU 0 times the windowed 26's extend
    # step with its next inputs made beside it and after it (extend-ab-x1's profiles), then the 8B plan's 2-process
    # fsdp row on both GPUs (align's main process since its save compares the teacher's file in pieces); GPU 1 that
    # recipe's seed 1
    (DELTA=0 quick_on 0 profile-deep26-extend profile-deep26-extend-in-place
      PLAN_PROCESSES=2 PLAN_STRATEGY=fsdp run memory-plan) &
    DELTA=0 quick_on 1 sila-deep26-w4k-sinks-answers30-seed1 &
    wait
    ;;
  extend-rows4-x1)  # about 21 minutes on one GPU (ran in round 24): the windowed 26's extend step profiled (as
    # extend-ab-x1), then the recipe with extend at 4 rows a step over half the steps (the same tokens): its SILA
    # sweeps take about as long at 4 rows as at 2 (round 23), so extend would take about half the time
    DELTA=0 quick_on 0 profile-deep26-extend sila-deep26-w4k-sinks-answers30-extend300-rows4
    ;;
  targets3-x2)  # about 25 minutes, after targets2-x2: the four windows' second seed and their decode speed
    DELTA=0 quick_on 0 sila-deep22-w4k-four-sinks-seed1 &
    DELTA=0 quick_on 1 windows22-four-sinks-speed &
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
    quick sila-deep26-ddp2
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
  *)
    return 127
    ;;
  esac
}

sessions() {  # the names of the sessions above
  sed -n 's/^  \([a-z0-9-]*\))  #.*/\1/p' scripts/lab/sessions.sh | tr '\n' ' '
}
