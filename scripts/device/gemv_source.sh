#!/usr/bin/env bash
# On the GPU machine: where inside a batch-route GEMV's loop the warps wait. For each "N K FMT TOKENS" shape, ncu
# profiles one launch of scripts/device/gemv_ncu.py with its full set (which samples each warp's stall reason at its
# program counter), prints the report's tables, and writes the per-SASS-instruction samples as CSV to
# $OUT/sass-N_K_FMT_TOKENS.csv (columns: the instruction, its executions, and the samples of each stall reason) and
# the report's tables to $OUT/details-N_K_FMT_TOKENS.txt.
# Usage: bash scripts/device/gemv_source.sh ["5120 17408 q5_g64_fp16 8" ...]   (default: 27B down and gate_up, T = 8)
set -uo pipefail
[ $# -gt 0 ] || set -- "5120 17408 q5_g64_fp16 8" "34816 5120 q4_g64_fp16 8"
for shape in "$@"; do
  name=${shape// /_}
  echo "=== N K FMT T = $shape"
  # shellcheck disable=SC2086
  ncu --clock-control none -k regex:_gemv_batch --launch-skip 10 --launch-count 1 --set full -f -o "/tmp/$name" \
    python3 scripts/device/gemv_ncu.py $shape >"/tmp/$name.log" 2>&1 || { tail -20 "/tmp/$name.log"; continue; }
  ncu -i "/tmp/$name.ncu-rep" --page details 2>&1 | grep -v -E "^\s*$|----" >"$OUT/details-$name.txt"
  grep -E "Duration|Throughput|Hit Rate|Registers|Eligible|Issued Warp|Achieved Active" "$OUT/details-$name.txt"
  ncu -i "/tmp/$name.ncu-rep" --page source --print-source sass --csv >"$OUT/sass-$name.csv" 2>&1
  wc -l "$OUT/sass-$name.csv"
done
