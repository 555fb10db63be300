#!/usr/bin/env bash
# The full-protocol FBN cells (width 1, T = 3000; benchmarks/fbn.md, "Not yet run") that have no summary yet, one
# after another, in the order of the list below. Start one worker per free core: each claims a cell with flock (the
# claim goes when its process ends), so two workers never train the same cell, and a stopped worker's cell is taken
# again by the next one (fbn.sh resumes it from its last checkpoint where one is left, else from step 0).
#   OMP_NUM_THREADS=1 nohup nice -n 5 bash benchmarks/fbn_full_queue.sh > worker1.log 2>&1 &
#   LIST=1 bash benchmarks/fbn_full_queue.sh        # the cells and their state, nothing run
# Each cell is `SHORT=0 NAME=full-<setting>[-seed<k>]-<method> ONLY=<method> bash benchmarks/fbn.sh`, as the
# sections of fbn.md ran them by hand; the folder names are those `fbn_table.py --full` reads.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results/fbn
METHODS="fbn fixbn naive_bn centralized_bn"
# setting:seed, the most wanted first: seed 1 of every setting that has seed 0 only, then seed 2 of all
CELLS=${CELLS:-"gamma0.1:1 gamma0.01:1 dirichlet1:1 dirichlet0.1:1 gamma1:2 gamma0.1:2 gamma0.01:2 dirichlet1:2 dirichlet0.1:2"}

setting_overrides() {  # gamma0.1 -> --set data.gamma=0.1; dirichlet1 -> the Dirichlet partition with alpha 1
  case "$1" in
    gamma*) echo "--set data.gamma=${1#gamma}" ;;
    dirichlet*) echo "--set data.partition=dirichlet --set data.alpha=${1#dirichlet}" ;;
    *) echo "unknown setting $1 (gamma<g> or dirichlet<alpha>)" >&2; return 1 ;;
  esac
}

for cell in $CELLS; do
  setting=${cell%%:*} seed=${cell##*:}
  suffix=$([ "$seed" = 0 ] && echo "" || echo "-seed$seed")
  for m in $METHODS; do
    name="full-$setting$suffix-$m"
    out="$RESULTS/fbn_mnistm-$name"
    if [ -f "$out/$m/seed$seed/summary.json" ]; then
      [ -n "${LIST:-}" ] && echo "done     $name"
      continue
    fi
    mkdir -p "$RESULTS/.claims"
    exec {claim}>"$RESULTS/.claims/$name"
    if ! flock -n "$claim"; then
      [ -n "${LIST:-}" ] && echo "running  $name"
      exec {claim}>&-
      continue
    fi
    if [ -n "${LIST:-}" ]; then
      echo "to run   $name"
    else
      echo "$(date -u +%FT%TZ) start $name"
      overrides=$(setting_overrides "$setting") || exit 1
      SHORT=0 NAME="$name" ONLY="$m" \
        EXTRA="$overrides --set seeds=[$seed] --set training.precision=fp32" bash benchmarks/fbn.sh
      rc=$?  # (a refused resume, e.g. a folder another process runs: the next cell)
      [ "$rc" = 0 ] || echo "$(date -u +%FT%TZ) $name stopped with exit code $rc"
    fi
    exec {claim}>&-
  done
done
