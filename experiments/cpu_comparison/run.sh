#!/usr/bin/env bash
# The CPU-scale comparison: six attentions x 3 seeds at size=tiny on the embedded corpus
# (conf/experiment/cpu_comparison.yaml), then report.py writes the tables and figures here
# and logs them to the sweep's parent run in MLflow (experiment `cpu_comparison`).
# Usage, from anywhere:  experiments/cpu_comparison/run.sh  [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-.venv/bin/python}"

"$PY" train.py -m experiment=cpu_comparison
if [ -f src/t6/bench/decode.py ]; then  # decode tokens/s and KV cache per token for the trade-off table
  "$PY" -m t6.bench.decode --json experiments/cpu_comparison/decode.json
  DECODE=(--decode-json experiments/cpu_comparison/decode.json)
else
  DECODE=()
fi
"$PY" report.py --experiment cpu_comparison --parent latest --out experiments/cpu_comparison "${DECODE[@]}"
