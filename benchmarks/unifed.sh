#!/usr/bin/env bash
# UniFed experiments on offline data (presets unifed_corrupt_internal, unifed_corrupt_external, unifed_digits).
#   PRESET=unifed_digits bash benchmarks/unifed.sh                   # one run folder
#   PRESET=unifed_corrupt_external FOLDS="noise blur weather digital" bash benchmarks/unifed.sh
#   DATA=<folder with cifar10c/> PRESET=unifed_cifar10c_external BASE=cifar10c FOLDS="noise blur weather digital" bash benchmarks/unifed.sh
#                                  # the same on the released CIFAR-10-C (fednorm data prepare cifar10c; a GPU machine)
#                                  # leave-one-corruption-type-out: one run folder per held-out type, each
#                                  # ending with its summary beside UniFed Table III (paper_summary.md)
#   ABLATION=1 RUN=benchmarks/results/unifed/<run> bash benchmarks/unifed.sh
#                                  # UniFed Fig. 6 (= fednorm external-ablation <run>): external accuracy against
#                                  # (a) test batch size, (b) momentum and (c) the order of the test samples,
#                                  # re-evaluating a finished run's checkpoints (no training), saved per cell
#                                  # (re-running continues); SELECTED=1: each cell's validation-selected model
#                                  # (selected.pt, runs since session 31) instead of its last one
#   PAIRS="fedavg fedprox" PART=a PRESET=unifed_corrupt_internal bash benchmarks/unifed.sh
#                                  # only these algorithms, each with and without client-specific BN (+ours), in
#                                  # run folder <preset>-<PART>: split a preset across parallel one-thread runs;
#                                  # unifed_table.py merges the folders
#   HOLD_OUT="mnist mnistm usps rendered/synth" PAIRS=fedavg PRESET=unifed_digits bash benchmarks/unifed.sh
#                                  # leave-one-domain-out: one run folder <preset>-lodo-<domain> per held-out domain,
#                                  # that domain an external client beside the preset's (external.held_out_domains)
# EXTRA adds --set overrides (e.g. "--set federation.rounds=50 --set model.width=0.5"); re-running resumes.
# SUFFIX is appended to every run folder's name, for another seed of the same protocol beside the first:
#   SUFFIX=-seed1 PRESET=unifed_corrupt_external FOLDS=noise EXTRA="--set seeds=[1]" bash benchmarks/unifed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-unifed_digits}
DATA=${DATA:-../shared/data}
EXTRA=${EXTRA:-}
eval "extra=($EXTRA)"  # EXTRA may quote values with spaces: --set 'seeds=[0, 1]'
BASE=${BASE:-mnistm}
SEVERITY=${SEVERITY:-3}
SUFFIX=${SUFFIX:-}
run() {  # run folder, extra args...
  local out=$1; shift
  start=$(date +%s)
  if [ -f "$out/config.yaml" ]; then
    .venv/bin/fednorm resume "$out" --data-dir "$DATA" --quiet
  else
    .venv/bin/fednorm run "$PRESET" --data-dir "$DATA" "$@" "${extra[@]}" --out "$out" --quiet
  fi
  echo "$out: $(( $(date +%s) - start )) s wall" | tee -a benchmarks/results/unifed/wall_times.txt
}
mkdir -p benchmarks/results/unifed
if [ "${ABLATION:-0}" = 1 ]; then
  which=(); [ "${SELECTED:-0}" = 1 ] && which=(--selected)
  .venv/bin/python -m fednorm.runs.unifed_ablation "${RUN:?set RUN to a finished run folder}" --data-dir "$DATA" "${which[@]}"
  exit 0
fi
pairs=()
if [ -n "${PAIRS:-}" ]; then
  items=""
  for m in $PAIRS; do items="$items$m, {name: $m, policy: local_bn, label: $m+ours}, "; done
  pairs=(--set "methods=[${items%, }]")
fi
if [ -n "${HOLD_OUT:-}" ]; then
  # leave-one-domain-out: one run folder per held-out domain (external.held_out_domains), the preset's methods or PAIRS
  for held in $HOLD_OUT; do
    run "benchmarks/results/unifed/$PRESET-lodo-${held//\//_}$SUFFIX" --set "external.held_out_domains=[$held]" \
      "${pairs[@]}"
  done
  exit 0
fi
if [ -n "${PAIRS:-}" ]; then
  run "benchmarks/results/unifed/$PRESET-${PART:?set PART to name the run folder of these PAIRS}$SUFFIX" "${pairs[@]}"
  exit 0
fi
if [ -z "${FOLDS:-}" ]; then
  run "benchmarks/results/unifed/$PRESET$SUFFIX"
  exit 0
fi
for held in $FOLDS; do
  # external.held_out_type builds the fold's two domain lists from one corrupted domain naming the set and severity
  # (BASE=cifar10c: the released CIFAR-10-C files, preset unifed_cifar10c_external; else a generated corruption of BASE)
  if [ "$BASE" = cifar10c ]; then any="cifar10c/fog/$SEVERITY"; else any="corrupt/fog/$SEVERITY/$BASE"; fi
  run "benchmarks/results/unifed/$PRESET-$held$SUFFIX" --set "data.domains=[$any]" --set "external.domains=[]" \
    --set "external.held_out_type=$held"
  # the fold's external means beside UniFed Table III's means over the same type's columns
  .venv/bin/python benchmarks/unifed_table.py "benchmarks/results/unifed/$PRESET-$held$SUFFIX" --paper \
    | tee "benchmarks/results/unifed/$PRESET-$held$SUFFIX/paper_summary.md"
done
