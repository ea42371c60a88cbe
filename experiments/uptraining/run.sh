#!/usr/bin/env bash
# Uptraining study (GQA paper, Ainslie et al. 2023, §2.1) at CPU scale on the embedded corpus:
#   MHA, GQA and MQA trained from scratch for STEPS steps, and GQA / MQA converted from the MHA
#   (mean-pooled K/V heads) and uptrained for 5% and 10% of the MHA's tokens.
# Then report.py reads the runs from MLflow, measures the converted checkpoints before any
# uptraining, and writes experiments/uptraining/REPORT.md.
#
#   bash experiments/uptraining/run.sh              # STEPS=200: 5% = 10 steps, 10% = 20 steps
#   STEPS=400 SIZE=tiny bash experiments/uptraining/run.sh
# The committed REPORT.md ran on 2 CPU cores (~22 min):
#   STEPS=100 SIZE=tiny EXTRA="data.batch_size=8" PY=.venv/bin/python bash experiments/uptraining/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
STEPS=${STEPS:-200}        # source length; 5% of it should be at least ~10 steps
SIZE=${SIZE:-tiny}
HEADS=${HEADS:-4}          # query heads of every model (the MHA's; conversion keeps them)
KV=${KV:-2}               # KV heads of the GQA models
OUT=${OUT:-logs/uptraining}
EXTRA=${EXTRA:-}           # more overrides for every training run, e.g. "data.batch_size=4"
mkdir -p "$OUT"

common=(experiment_name=uptraining size="$SIZE" size.n_head="$HEADS"
        callbacks.rich_model_summary=null logger.mlflow.log_model=false print_config=false)
read -r -a extra <<< "$EXTRA"
common+=("${extra[@]}")

train() {  # train NAME ARGS...: one run in $OUT/NAME, skipped when it already finished
  local name=$1; shift
  if [[ -f "$OUT/$name/checkpoints/last.ckpt" ]]; then echo "skip $name (done)"; return; fi
  echo "== $name"
  "$PY" train.py "${common[@]}" run_name="$name" hydra.run.dir="$OUT/$name" "$@"
}

# 1. From scratch.
train mha-scratch attention=mha trainer.max_steps="$STEPS" trainer.val_check_interval="$STEPS"
train gqa"$KV"-scratch attention=gqa attention.options.n_kv_head="$KV" trainer.max_steps="$STEPS" trainer.val_check_interval="$STEPS"
train mqa-scratch attention=mqa trainer.max_steps="$STEPS" trainer.val_check_interval="$STEPS"

# 2. Convert the MHA (mean-pooling, and the paper's "first head" comparison).
SRC="$OUT/mha-scratch/checkpoints/last.ckpt"
"$PY" convert.py ckpt_path="$SRC" target=gqa target_kv_heads="$KV" out="$OUT/converted/gqa$KV-mean.ckpt"
"$PY" convert.py ckpt_path="$SRC" target=mqa out="$OUT/converted/mqa-mean.ckpt"
"$PY" convert.py ckpt_path="$SRC" target=gqa target_kv_heads="$KV" method=first out="$OUT/converted/gqa$KV-first.ckpt"
"$PY" convert.py ckpt_path="$SRC" target=mqa method=first out="$OUT/converted/mqa-first.ckpt"

# 3. Uptrain the mean-pooled conversions at 5% and 10% of the MHA's tokens, re-warming to the
#    size's peak learning rate (the pretraining schedule again: tiny 3e-3 -> 3e-4).
PEAK=("lr_ablation.max_lr=\${lr_ablation.by_size.$SIZE.max_lr}" "lr_ablation.min_lr=\${lr_ablation.by_size.$SIZE.min_lr}")
for target in gqa"$KV" mqa; do
  for fraction in 0.05 0.10; do
    train "$target-uptrain-$fraction" experiment=uptrain init_from="$OUT/converted/$target-mean.ckpt" uptrain_fraction="$fraction" "${PEAK[@]}"
  done
done

# 3b. The same with the recipe's default: start at the source's final learning rate (its min_lr,
#     tiny 3e-4) and decay to a tenth of it.
LOW_TAG=${LOW_TAG:-lr3e-4}   # run-name suffix (the tiny source's final learning rate)
for target in gqa"$KV" mqa; do
  for fraction in 0.05 0.10; do
    train "$target-uptrain-$fraction-$LOW_TAG" experiment=uptrain init_from="$OUT/converted/$target-mean.ckpt" uptrain_fraction="$fraction"
  done
done

# 4. The report.
"$PY" experiments/uptraining/report.py --runs "$OUT" --out "${REPORT:-experiments/uptraining/REPORT.md}"
