#!/usr/bin/env bash
# The full-protocol FBN cells (width 1, T = 3000; benchmarks/fbn.md, "Not yet run") that have no summary yet, one
# after another, in the order of the lists below. Start one worker per free core: each claims a cell with flock (the
# claim goes when its process ends), so two workers never train the same cell, and a stopped worker's cell is taken
# again by the next one (fbn.sh resumes it from its last checkpoint where one is left, else from step 0).
#   OMP_NUM_THREADS=1 nohup nice -n 5 bash benchmarks/fbn_full_queue.sh > worker1.log 2>&1 &
#   LIST=1 bash benchmarks/fbn_full_queue.sh        # the cells and their state, nothing run
# First the robust cells (FBN Section 5, Fig. 4; preset fbn_robust_mnistm), seed 0 at gamma ROBUST_GAMMA: each
# `SHORT=0 PRESET=fbn_robust_mnistm NAME=full-<attack>-gamma<g>-<label> ONLY=<label> bash benchmarks/fbn.sh`, in bf16
# autocast (2.1x faster than fp32 on an AMX CPU, benchmarks/performance.md), with their no-attack references
# (attack "noattack") in bf16 too, so that a robust row differs from its reference by the attack only. Then the
# heterogeneity cells (preset fbn_mnistm) in fp32, as every seed-0 cell of that table ran:
# `SHORT=0 NAME=full-<setting>[-seed<k>]-<method> ONLY=<method> bash benchmarks/fbn.sh`, as the sections of fbn.md
# ran them by hand. The folder names are those `fbn_table.py --full` and `--robust-full` read.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results/fbn
METHODS="fbn fixbn naive_bn centralized_bn"
# setting:seed, the most wanted first: seed 1 of every setting that has seed 0 only, then seed 2 of all
CELLS=${CELLS:-"gamma0.1:1 gamma0.01:1 dirichlet1:1 dirichlet0.1:1 gamma1:2 gamma0.1:2 gamma0.01:2 dirichlet1:2 dirichlet0.1:2"}
ROBUST_GAMMA=${ROBUST_GAMMA:-0.01}
# attack:label, the most wanted first: the paper's Fig. 4 (SF; no attack, no defense, median) and then its appendix
# figures (FOE, ALIE; the trimmed mean)
ROBUST=${ROBUST:-"sf:fbn-median-stats sf:naive-median-stats noattack:fbn-mean noattack:naive-mean sf:fbn-mean sf:naive-mean
  foe:fbn-median-stats foe:naive-median-stats foe:fbn-mean foe:naive-mean
  alie:fbn-median-stats alie:naive-median-stats alie:fbn-mean alie:naive-mean
  sf:fbn-trimmed-stats sf:naive-trimmed-stats foe:fbn-trimmed-stats foe:naive-trimmed-stats
  alie:fbn-trimmed-stats alie:naive-trimmed-stats"}

setting_overrides() {  # gamma0.1 -> --set data.gamma=0.1; dirichlet1 -> the Dirichlet partition with alpha 1
  case "$1" in
    gamma*) echo "--set data.gamma=${1#gamma}" ;;
    dirichlet*) echo "--set data.partition=dirichlet --set data.alpha=${1#dirichlet}" ;;
    *) echo "unknown setting $1 (gamma<g> or dirichlet<alpha>)" >&2; return 1 ;;
  esac
}

attack_overrides() {  # the robust preset attacks with SF; the others by name, noattack without Byzantine clients
  case "$1" in
    sf) echo "" ;;
    foe) echo "--set federation.byzantine.attack=fall_of_empires" ;;
    alie) echo "--set federation.byzantine.attack=a_little_is_enough" ;;
    noattack) echo "--set federation.byzantine.count=0 --set federation.byzantine.attack=null" ;;
    *) echo "unknown attack $1 (sf, foe, alie or noattack)" >&2; return 1 ;;
  esac
}

# run_cell PRESET NAME LABEL SEED EXTRA: train one cell unless it has a summary or another worker holds it
run_cell() {
  local preset=$1 name=$2 label=$3 seed=$4 extra=$5 claim rc
  if [ -f "$RESULTS/$preset-$name/$label/seed$seed/summary.json" ]; then
    [ -n "${LIST:-}" ] && echo "done     $preset-$name"
    return 0
  fi
  mkdir -p "$RESULTS/.claims"
  exec {claim}>"$RESULTS/.claims/$preset-$name"
  if ! flock -n "$claim"; then
    [ -n "${LIST:-}" ] && echo "running  $preset-$name"
    exec {claim}>&-
    return 0
  fi
  if [ -n "${LIST:-}" ]; then
    echo "to run   $preset-$name"
  else
    echo "$(date -u +%FT%TZ) start $preset-$name"
    SHORT=0 PRESET="$preset" NAME="$name" ONLY="$label" EXTRA="$extra --set seeds=[$seed]" bash benchmarks/fbn.sh
    rc=$?  # (a refused resume, e.g. a folder another process runs: the next cell)
    [ "$rc" = 0 ] || echo "$(date -u +%FT%TZ) $preset-$name stopped with exit code $rc"
  fi
  exec {claim}>&-
}

for cell in $ROBUST; do
  attack=${cell%%:*} label=${cell##*:}
  overrides=$(attack_overrides "$attack") || exit 1
  run_cell fbn_robust_mnistm "full-$attack-gamma$ROBUST_GAMMA-$label" "$label" 0 \
    "--set data.gamma=$ROBUST_GAMMA --set training.precision=bf16 $overrides"
done

for cell in $CELLS; do
  setting=${cell%%:*} seed=${cell##*:}
  suffix=$([ "$seed" = 0 ] && echo "" || echo "-seed$seed")
  overrides=$(setting_overrides "$setting") || exit 1
  for m in $METHODS; do
    run_cell fbn_mnistm "full-$setting$suffix-$m" "$m" "$seed" "$overrides --set training.precision=fp32"
  done
done
