#!/usr/bin/env bash
# FedBN digits benchmark (FedBN Table 11) on MNIST, MNIST-M, USPS (real, from ../shared/data) and two
# rendered stand-ins for SVHN / SynthDigits. One run folder per (method, seed), so partial results are
# usable and `fednorm report` merges them; re-running the script resumes unfinished cells.
# precision auto: bf16 autocast where the CPU has AMX / AVX512-BF16, else fp32; PRECISION=fp32 for the paper's numerics.
# EXTRA adds --set overrides, e.g. the fast-path accuracy check of performance.md:
#   OUT=benchmarks/results/fastpath_accuracy/eager PRECISION=fp32 CELLS="fedbn:0 fedbn:1 fedbn:2" \
#     EXTRA="--set federation.rounds=50 --set federation.channels_last=false" bash benchmarks/fedbn_digits.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/fedbn_digits}
DATA=${DATA:-../shared/data}
PRECISION=${PRECISION:-auto}
# the recorded cells ran the authors' code's 100 rounds; the preset holds the paper's 300 (ROUNDS=300)
ROUNDS=${ROUNDS:-100}
CELLS=${CELLS:-"fedbn:0 fedavg:0 singleset:0 fedprox:0 fedbn:1 fedavg:1 fedbn:2 fedavg:2"}
EXTRA=${EXTRA:-}
eval "extra=($EXTRA)"  # EXTRA may quote values with spaces: --set 'methods=[{name: fedbn}]'
mkdir -p "$OUT"
failed=()
for cell in $CELLS; do
  method=${cell%%:*}; seed=${cell##*:}
  dir="$OUT/$method-seed$seed"
  start=$(date +%s)
  if [ -f "$dir/config.yaml" ]; then
    .venv/bin/fednorm resume "$dir" --data-dir "$DATA" --quiet || { failed+=("$cell"); continue; }
  else
    .venv/bin/fednorm run fedbn_digits --data-dir "$DATA" --set "methods=[$method]" --set "seeds=[$seed]" \
      --set "training.precision=$PRECISION" --set "federation.rounds=$ROUNDS" "${extra[@]}" --out "$dir" --quiet || { failed+=("$cell"); continue; }
  fi
  echo "$method seed $seed: $(( $(date +%s) - start )) s wall" | tee -a "$OUT/wall_times.txt"
done
if compgen -G "$OUT/*/config.yaml" > /dev/null; then
  .venv/bin/fednorm report "$OUT"/*/ --markdown | tee "$OUT/table.md"
fi
# a failed cell does not stop the cells after it; it is named here (exit 1). Re-running resumes it.
if [ ${#failed[@]} -gt 0 ]; then echo "failed cells: ${failed[*]} (see the errors above; re-run to resume)" >&2; exit 1; fi
