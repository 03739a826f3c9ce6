# Sourced by scripts/lab/gpu_results.sh: the settings its runs add to the recipes (--set overrides, as arrays), the
# layers earlier runs chose, and the windows of the windowed runs; the jobs that use them are described in
# scripts/lab/JOBS.md.

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
answers() {  # answers WEIGHT: ANSWERS with extend's answers weighted xWEIGHT (a windowed run's -answersWEIGHT)
  printf '%s\n' --set "extend.answer_weight=$1" --set extend.steps=600
}

# sila-kd*: distillation from the teacher in the train and extend stages
KD=(--set train.kd_weight=1.0 --set extend.kd_weight=1.0)

# the deep recipes' steps under two processes: 2.5x their tokens (twice the rows a step, 1.25x the steps)
DDP2_STEPS=(--set align.steps=1500 --set train.steps=375 --set extend.steps=188)
# extend at 4 rows a step over half the steps (the recipe's tokens): a global batch four processes can split (-ext4);
# STRONG4: the -ext4 run's global batches split over four processes (-strong4: strong scaling, issue 53)
EXT4=(--set extend.batch_size=4 --set extend.steps=75)
STRONG4=(--set align.batch_size=4 --set token_weights.batch_size=4 --set train.batch_size=4
  --set extend.batch_size=1 --set extend.steps=75)
# 1.8x align's and train's steps, extend's as DDP2_STEPS' (227M tokens): where round 10's fits put 1.05x at 22 of 30
# (208-275M); extend reads 3% of them and took 249 s of round 10's 14.7 minutes, so it stays, for the run to fit a session
DDP2_LONG_STEPS=(--set align.steps=2700 --set train.steps=675 --set extend.steps=188)

# stage 2 trains the teacher's own weights too, at a tenth of the mixers' rate (train.pretrained_lr_scale)
ALL=(--set train.trainable=all --set train.pretrained_lr_scale=0.1)

# seeds N: every training seed N (layer fit, data order, retrieval samples, align, train, extend), one word a line;
# SEED1, MIXER-seed1's settings, is N = 1
seeds() {
  local field
  for field in data data.retrieval layer_choice align train extend; do printf -- '--set\n%s.seed=%s\n' "$field" "$1"; done
}
mapfile -t SEED1 < <(seeds 1)

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
# the 22-layer recipe with all four kept layers that 26 converts (1, 7, 8, 16) as 4K windows with 4 sinks: at 8K its
# full attention is then 26's four layers, which find the passkey 4-6K back in every 26-layer run (round 19)
W22_FOUR_SINKS=("${W22_WINDOWS[@]}" --set attention_sinks=4)
# the windowed runs: each NAME (and NAME-seed1) is its recipe (the name up to -w4k) with these windows
declare -A WINDOWS_OF=(
  [sila-deep22-w4k]="${W22_WINDOWS[*]}"
  [sila-deep22-w4k-local]="${W22_LOCAL[*]}"
  [sila-deep22-w4k-sinks]="${W22_SINKS[*]}"
  [sila-deep22-w4k-four-sinks]="${W22_FOUR_SINKS[*]}"
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
