#!/usr/bin/env bash
# FedWon experiments (presets fedwon_digits, fedwon_cross_device, fedwon_pacs, fedwon_small_batch,
# fedwon_ablation, fedwon_local_epochs) on the data available offline. One run folder per
# (preset, method, seed) under results/fedwon/, so partial results are usable and `fednorm report`
# merges them; re-running resumes unfinished cells.
#   PRESET=fedwon_digits CELLS="fedavg:0 fedwon:0" ROUNDS=30 bash benchmarks/fedwon.sh
# ROUNDS shortens a run (the presets hold the paper's rounds); EXTRA adds --set overrides.
# A cell that fails is reported at the end (exit 1) and the remaining cells still run.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-fedwon_digits}
OUT=${OUT:-benchmarks/results/fedwon/$PRESET${ROUNDS:+-r$ROUNDS}}
DATA=${DATA:-../shared/data}
CELLS=${CELLS:?set CELLS, e.g. CELLS=\"fedavg:0 fedwon:0\" (method labels of the preset : seed)}
EXTRA=${EXTRA:-}
eval "extra=($EXTRA)"  # EXTRA may quote values with spaces: --set 'methods=[{name: fedwon, agc_clip: 0}]'
mkdir -p "$OUT"
failed=()
for cell in $CELLS; do
  label=${cell%%:*}; seed=${cell##*:}
  dir="$OUT/$label-seed$seed"
  start=$(date +%s)
  if [ -f "$dir/config.yaml" ]; then
    .venv/bin/fednorm resume "$dir" --data-dir "$DATA" --quiet || { failed+=("$cell"); continue; }
  else
    # keep only this method of the preset (by label), with its own overrides (lr, agc_clip...)
    method=$(.venv/bin/python -c "
import json, sys
from fednorm.runs.config import load_config
m = [m for m in load_config('$PRESET').methods if m.display == '$label']
sys.exit('no method labelled $label in $PRESET') if not m else print(json.dumps(m[0].model_dump(exclude_none=True)))")
    .venv/bin/fednorm run "$PRESET" --data-dir "$DATA" --set "methods=[$method]" --set "seeds=[$seed]" \
      ${ROUNDS:+--set federation.rounds=$ROUNDS} "${extra[@]}" --out "$dir" --quiet || { failed+=("$cell"); continue; }
  fi
  # the precision and thread count decide the wall time, so the line names them
  precision=$(sed -n 's/^  precision: //p' "$dir/config.yaml")
  echo "$PRESET $label seed $seed${ROUNDS:+ ($ROUNDS rounds)}: $(( $(date +%s) - start )) s wall" \
    "($precision, OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset})" | tee -a "$OUT/wall_times.txt"
done
if compgen -G "$OUT/*/config.yaml" > /dev/null; then
  .venv/bin/fednorm report "$OUT"/*/ --markdown | tee "$OUT/table.md"
fi
# a failed cell (error, or divergence with on_divergence: stop) does not stop the cells after it; it is
# named here and the script exits non-zero. Re-running resumes it.
if [ ${#failed[@]} -gt 0 ]; then echo "failed cells: ${failed[*]} (see the errors above; re-run to resume)" >&2; exit 1; fi
