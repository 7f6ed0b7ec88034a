#!/usr/bin/env bash
# How much of the gradient allreduce the GradientReducer hides behind the backward pass
# (issue 20, acceptance 3): examples/train_mlp_libtorch under gradsyncrun --standalone, 2 ranks
# on this machine's CPU, an MLP with tens of MiB of gradients, in two modes taking turns:
#   after-backward  every gradient in one allreduce once the backward pass is done (the baseline)
#   overlap         25 MiB buckets (1 MiB first) started from autograd hooks during the backward pass
# Each run prints rank 0's median step time and finish() time. The allreduce's own time is the
# baseline's finish() (nothing of it is hidden there); with the reducer, finish() is the part
# of the allreduce still exposed after the backward pass. Two hidden fractions:
#   by step time:  (step_after - step_overlap) / allreduce   (noisy where steps vary more than that)
#   by finish():   1 - finish_overlap / finish_after
#
#   scripts/bench-reducer-overlap.sh [ROUNDS] [-- extra train_mlp_libtorch args]
# Environment: GRADSYNC_BUILD_DIR (default build), MODEL (the model/batch arguments below).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${GRADSYNC_BUILD_DIR:-build}
rounds=${1:-3}
shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
model=${MODEL:---features 1024 --hidden 2048 --layers 4 --batch 64 --steps 12}
bin=$build/bin/train_mlp_libtorch
[ -x "$bin" ] || { echo "bench-reducer-overlap: $bin missing (needs libtorch-dev; cmake --build $build --target train_mlp_libtorch gradsyncrun)" >&2; exit 1; }

run() {  # mode -> "step backward finish" of rank 0 (ms)
  "$build/bin/gradsyncrun" --standalone -n 2 --timeout-s 900 "$bin" $model --no-check --mode "$1" "${extra[@]}" 2>&1 |
    tee -a "${LOG:-/dev/null}" |
    sed -n 's/.*rank 0: median step \([0-9.]*\) ms (forward+backward \([0-9.]*\) ms, finish \([0-9.]*\) ms).*/\1 \2 \3/p'
}

echo "model: $model; 2 ranks; $(nproc) cores; $(date -u +%FT%TZ)"
printf '| round | mode | step ms | forward+backward ms | finish ms |\n|---|---|---|---|---|\n'
results=()
for ((i = 1; i <= rounds; i++)); do
  for mode in after-backward overlap; do
    read -r step bw fin < <(run "$mode")
    printf '| %d | %s | %s | %s | %s |\n' "$i" "$mode" "$step" "$bw" "$fin"
    results+=("$mode $step $bw $fin")
  done
done
printf '%s\n' "${results[@]}" | /usr/bin/python3 -c '
import statistics, sys
rows = [l.split() for l in sys.stdin if l.strip()]
def med(mode, k):
    return statistics.median(float(r[k]) for r in rows if r[0] == mode)
after, over, comm, exposed = med("after-backward", 1), med("overlap", 1), med("after-backward", 3), med("overlap", 3)
print()
print(f"medians over rounds: after-backward step {after:.1f} ms (allreduce {comm:.1f} ms), overlap step {over:.1f} ms (finish {exposed:.1f} ms)")
print(f"hidden by step time: {after - over:.1f} ms of {comm:.1f} ms = {100 * (after - over) / comm:.0f} % of the allreduce")
print(f"hidden by finish(): {100 * (1 - exposed / comm):.0f} % (exposed {exposed:.1f} of {comm:.1f} ms)")
'
