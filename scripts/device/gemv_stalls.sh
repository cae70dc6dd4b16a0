#!/usr/bin/env bash
# On the GPU machine: where a batch-route GEMV's warps wait. For each "N K FMT TOKENS" shape, ncu reads one launch
# of scripts/device/gemv_ncu.py: duration, DRAM throughput, issue slots busy, warps per scheduler, L1/L2 hit rates
# and the stall reasons as cycles per issued instruction (docs/performance.md, tenth session).
# Usage: bash scripts/device/gemv_stalls.sh ["5120 17408 q5_g64_fp16 1" ...]   (default: 27B down and gate_up, T = 1, 8)
set -uo pipefail
metrics='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|l1tex__t_sector_hit_rate.pct'
metrics+='|lts__t_sector_hit_rate.pct|smsp__warps_active.avg.per_cycle_active|smsp__issue_active.avg.pct_of_peak_sustained_active'
metrics+='|dram__throughput.avg.pct_of_peak_sustained_elapsed|gpu__time_duration.sum|smsp__inst_executed.sum'
[ $# -gt 0 ] || set -- "5120 17408 q5_g64_fp16 1" "34816 5120 q4_g64_fp16 1" "34816 5120 q4_g64_fp16 8" \
  "5120 17408 q5_g64_fp16 8"
for shape in "$@"; do
  echo "=== N K FMT T = $shape"
  # shellcheck disable=SC2086
  ncu --clock-control none -k regex:_gemv_batch --launch-skip 10 --launch-count 1 --metrics "$metrics" \
    python3 scripts/device/gemv_ncu.py $shape 2>&1 | grep -E "^\s+(smsp|l1tex|lts|dram|gpu__)" \
    | awk '$1 !~ /(\.peak_sustained|per_second|sum\.pct_of|sum\.per_cycle)/ && $NF != "0"'
done
