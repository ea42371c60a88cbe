#!/usr/bin/env bash
# The matched comparison (conf/experiment/matched.yaml): the paper's six + GTA + GLA + DIFF (COMPARE), then gated MHA
# and gated TPA (GATED, attention.options.output_gate=elementwise), each under match=params, heads and kv_bytes
# (CRITERIA) x 3 seeds (SEEDS) at size=tiny, two runs at once; then report.py writes report.md and the figures here
# and logs them to the sweep's parent run in MLflow (experiment `matched-sweep-<dir>`).
# Usage, from anywhere:  experiments/matched/run.sh [PYTHON] [OVERRIDE ...]   (default PYTHON: .venv/bin/python)
#   SWEEP_DIR=logs/matched/NAME   the sweep directory (default: a new dated one); a rerun into it resumes the sweep
#   COMPARE=paper,gta,gla,diff    GATED=mha,tpa (empty: none)    CRITERIA=params,heads,kv_bytes    SEEDS=1,2,3
#   OUT=experiments/matched       where the report goes
#   OVERRIDE ...                  more train.py overrides for every run, e.g. trainer.max_steps=4 for a smoke
# Full study: 99 runs, ~2.3 h on an idle 2-core machine (~2.75 min per run, two at once).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-.venv/bin/python}"
shift || true
SWEEP_DIR="${SWEEP_DIR:-logs/matched/$(date +%Y-%m-%d_%H-%M-%S)}"
COMPARE="${COMPARE:-paper,gta,gla,diff}"
GATED="${GATED-mha,tpa}"
CRITERIA="${CRITERIA:-params,heads,kv_bytes}"
SEEDS="${SEEDS:-1,2,3}"
OUT="${OUT:-experiments/matched}"
# quoted: the sweep's choices as one value, not a sweep of the setting itself
SWEEP=(-m experiment=matched "hydra.sweeper.params.match='$CRITERIA'" "hydra.sweeper.params.seed='$SEEDS'")
SWEEP+=("hydra.sweep.dir=$SWEEP_DIR")

"$PY" train.py "${SWEEP[@]}" "compare=[$COMPARE]" "$@"
if [ -n "$GATED" ]; then  # the same sweep (its parent run), in subfolders of their own
  "$PY" train.py "${SWEEP[@]}" "compare=[$GATED]" attention.options.output_gate=elementwise \
    'hydra.sweep.subdir=gated_${hydra.job.num}' "$@"
fi
"$PY" report.py --sweep "$SWEEP_DIR" --out "$OUT" --group-by match.name,attention.name
