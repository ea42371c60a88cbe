#!/usr/bin/env bash
# The CPU-scale comparison: the paper's six attentions (or COMPARE) x 3 seeds at size=tiny on the embedded corpus
# (conf/experiment/cpu_comparison.yaml), the decode benchmark at the same width, then report.py
# writes the tables and figures here and logs them to the sweep's parent run in MLflow
# (experiment `cpu_comparison-sweep-<date>`).
# Usage, from anywhere:  experiments/cpu_comparison/run.sh  [PYTHON]   (default: .venv/bin/python)
# Two runs go at once, one core each (the recipe's joblib launcher: hydra.launcher.n_jobs).
#   SWEEP_DIR=logs/cpu_comparison/NAME  picks the sweep directory (default: a new dated one)
#   COMPARE=paper,gta,gla                the mechanisms (names, paper, all; default: paper)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-.venv/bin/python}"
OUT=experiments/cpu_comparison
SWEEP_DIR="${SWEEP_DIR:-logs/cpu_comparison/$(date +%Y-%m-%d_%H-%M-%S)}"
COMPARE="${COMPARE:-paper}"

"$PY" train.py -m experiment=cpu_comparison "compare=[$COMPARE]" hydra.sweep.dir="$SWEEP_DIR"
# Decode tokens/s and KV cache per token for the trade-off table: one attention layer of the tiny
# width with the same head counts, at the trained block size and at 4k cached tokens.
"$PY" -m t6.bench.decode --attentions "$COMPARE" --size tiny --contexts 256,4k --json "$OUT/decode.json"
"$PY" report.py --sweep "$SWEEP_DIR" --out "$OUT" --decode-json "$OUT/decode.json"
