#!/bin/sh
# data_parallel_check.sh COMM_RUN PROGRAM BACKEND RANKS WORKDIR
# Runs examples/data_parallel_training on 1 rank, then on RANKS ranks, over BACKEND (cdb name;
# "hierarchical" gets two fake nodes through COMM_NODE_ID = rank % 2), and checks that every loss
# the N-rank run prints matches the 1-rank run's within float tolerance (relative 1e-4), and that
# the checkpoint was written and loaded.
set -u
comm_run=$1 program=$2 backend=$3 ranks=$4 work=$5
rm -rf "$work" && mkdir -p "$work" || exit 1

run() {  # run N: the rank-0 output of a job of N ranks
  if [ "$backend" = hierarchical ]; then
    "$comm_run" -n "$1" sh -c 'COMM_NODE_ID=node$((RANK % 2)) exec "$0" "$@"' "$program" \
      --backend "$backend" --checkpoint "$work/ckpt.np$1"
  else
    "$comm_run" -n "$1" "$program" --backend "$backend" --checkpoint "$work/ckpt.np$1"
  fi
}

run 1 > "$work/np1.txt" 2>&1 || { cat "$work/np1.txt"; echo "FAILED: the 1-rank run"; exit 1; }
run "$ranks" > "$work/npN.txt" 2>&1 || { cat "$work/npN.txt"; echo "FAILED: the $ranks-rank run"; exit 1; }
cat "$work/np1.txt" "$work/npN.txt"

losses() { sed -n 's/^\[0\] \(step [0-9]* loss\|final loss\) \([^ ]*\)$/\1 \2/p' "$1"; }
losses "$work/np1.txt" > "$work/np1.loss"
losses "$work/npN.txt" > "$work/npN.loss"
[ -s "$work/np1.loss" ] || { echo "FAILED: no losses printed"; exit 1; }
for f in np1 npN; do
  grep -q 'checkpoint of step [0-9]* written by rank 0 .* loaded by all' "$work/$f.txt" ||
    { echo "FAILED: no checkpoint in the $f run"; exit 1; }
done
paste -d ' ' "$work/np1.loss" "$work/npN.loss" | awk -v n="$ranks" '
  { a = $(NF/2); b = $NF; d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a; if (m < 1e-3) m = 1e-3
    if (d > 1e-4 * m) { printf "FAILED: %s %s: 1 rank %s, %d ranks %s\n", $1, $2, a, n, b; bad = 1 }
    rows++ }
  END { if (rows < 3) { print "FAILED: too few losses"; exit 1 }
        if (!bad) printf "ok: %d losses of %d ranks match the 1-rank run (relative 1e-4)\n", rows, n
        exit bad }'
