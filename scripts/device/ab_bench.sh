#!/usr/bin/env bash
# On the GPU machine: `ninfer bench` of this tree against an older one, the runs interleaved on one machine.
# Usage: bash scripts/device/ab_bench.sh OLD_TREE ROUNDS PRESET:RECIPE:BENCH-FLAGS ...
#   OLD_TREE: a folder holding the old `ninfer` package (e.g. `git archive COMMIT ninfer | tar -x -C old` here, the
#   folder ignored through .git/info/exclude and named in the call's carry). Each job runs new, old, new, old, …
#   ROUNDS times each; a line per run: tree, decode ms a step per batch size, fraction of the bandwidth limit.
#   AB_NEW_FLAGS (environment): bench flags for the new tree's runs only; with OLD_TREE "." it compares one tree
#   with and without them (e.g. AB_NEW_FLAGS="--state-dtype bf16").
# The old tree starts from its own folder: `python3 -m` puts the current directory first on sys.path, so naming it
# in PYTHONPATH alone would run the new code twice (docs/optimizations.md, measurement rows).
set -uo pipefail
old=$(realpath "$1"); rounds=$2; shift 2
export PYTHONUNBUFFERED=1
source scripts/device/common.sh
new=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for job in "$@"; do
  IFS=: read -r preset recipe flags <<<"$job"
  path=$(artifact "$preset" "$recipe")  # synthesized by the new tree (the current directory)
  for round in $(seq "$rounds"); do
    for name in new old; do
      tree=$([ "$name" = new ] && echo "$new" || echo "$old")
      extra=$([ "$name" = new ] && echo "${AB_NEW_FLAGS:-}")
      log="$OUT/ab-$preset-$name-$round.log"
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=".:$SITE" python3 -m ninfer bench "$path" --device cuda $flags $extra --json \
        >"$log.json" 2>"$log")
      python3 scripts/device/bench_line.py "$name" "$log.json"
    done
  done
done
