#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root: two gradsync-bench binaries (say, main
# before and after a change) on the same one-node shape, alternated ROUNDS times in one
# session, so that a regression shows beside the run-to-run spread:
#
#   bash scripts/bench-gpu-ab.sh OLD_BENCH NEW_BENCH [extra gradsync-bench flags]
#
# NGPUS ranks (default 2) through `gradsyncrun --standalone`, each on GPU (rank mod the GPUs
# present): on a one-GPU machine every rank shares GPU 0 and the processes time-slice it.
# BENCH_RANGE (default "-b 1M -e 1G -f 2"), ROUNDS (default 2). Tables go to
# $OUT/ab-{old,new}-N.txt; the last lines print algbw of both per size and round.
# OLD_BIN: a folder with the old build's gradsyncrun and gradsyncd (and their daemon protocol),
# where the old and new runtimes cannot talk to each other; default the bundle's. OLD_LIB: a
# folder with the old build's libraries (its libgradsync.so), searched first by the old runs.
# OLD_ENV / NEW_ENV: "VAR=value ..." set for the old / new runs only (one binary under two
# settings: pass it as both OLD_BENCH and NEW_BENCH).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
old=$1 new=$2
shift 2
bin=$PWD/bundle/bin
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
range=${BENCH_RANGE:--b 1M -e 1G -f 2}
for round in $(seq "${ROUNDS:-2}"); do
  for which in old new; do
    exe=$old run=${OLD_BIN:-$bin} libs=${OLD_LIB:+$OLD_LIB:}$LD_LIBRARY_PATH vars=${OLD_ENV:-}
    [ "$which" = new ] && exe=$new run=$bin libs=$LD_LIBRARY_PATH vars=${NEW_ENV:-}
    # shellcheck disable=SC2086
    env $vars LD_LIBRARY_PATH=$libs timeout 280 "$run/gradsyncrun" --standalone --no-prefix --timeout-s 270 -n "${NGPUS:-2}" \
      "$exe" --device cuda $range -w 3 -n 10 "$@" > "$OUT/ab-$which-$round.txt" 2> "$OUT/ab-$which-$round.err"
    echo "ab: $which round $round exit $?"
  done
done
# The size and the gradsync out-of-place algbw columns of each table, side by side.
for round in $(seq "${ROUNDS:-2}"); do
  echo "== round $round: size, then old and new lines"
  grep -E '^ +[0-9]+ ' "$OUT/ab-old-$round.txt" | head -20
  grep -E '^ +[0-9]+ ' "$OUT/ab-new-$round.txt" | head -20
done
