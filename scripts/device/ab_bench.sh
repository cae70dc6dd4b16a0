#!/usr/bin/env bash
# On the GPU machine: `ninfer bench` of this tree against an older one, the runs interleaved on one machine.
# Usage: bash scripts/device/ab_bench.sh OLD_TREE ROUNDS PRESET:RECIPE:BENCH-FLAGS ...
#   OLD_TREE: a folder holding the old `ninfer` package (e.g. `git archive COMMIT ninfer | tar -x -C old` here, the
#   folder ignored through .git/info/exclude and named in the call's carry). Each job runs new, old, new, old, …
#   ROUNDS times each; a line per run: tree, decode ms a step per batch size, fraction of the bandwidth limit.
#   AB_NEW_FLAGS (environment): bench flags for the new tree's runs only; with OLD_TREE "." it compares one tree
#   with and without them (e.g. AB_NEW_FLAGS="--state-dtype bf16").
# The old tree starts from its own folder: `python3 -m` puts the current directory first on sys.path, so naming it
# in PYTHONPATH alone would run the new code twice (docs/performance.md, ninth session).
set -uo pipefail
old=$(realpath "$1"); rounds=$2; shift 2
export PYTHONUNBUFFERED=1
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && site=/tmp/site
fi
new=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for job in "$@"; do
  IFS=: read -r preset recipe flags <<<"$job"
  artifact="/tmp/$preset-$recipe.ninfer"
  [ -f "$artifact" ] || (cd "$new" && PYTHONPATH=".:$site" python3 -m ninfer synth --preset "$preset" --recipe "$recipe" \
    --device cuda --out "$artifact" --quiet)
  for round in $(seq "$rounds"); do
    for name in new old; do
      tree=$([ "$name" = new ] && echo "$new" || echo "$old")
      extra=$([ "$name" = new ] && echo "${AB_NEW_FLAGS:-}")
      log="$OUT/ab-$preset-$name-$round.log"
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=".:$site" python3 -m ninfer bench "$artifact" --device cuda $flags $extra --json \
        >"$log.json" 2>"$log")
      python3 - "$name" "$log.json" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
try:
    report = json.load(open(path))
except (OSError, ValueError) as error:
    print(f"{name}: no report ({error})")
    raise SystemExit
cells = [f"bw {report['limits']['read_bytes_per_second'] / 1e12:.2f} TB/s"]
for row in report["decode"]:
    cells.append(f"b{row['batch']} {1000 * row['seconds_per_step']:.3f} ms {row['tokens_per_second']:.1f} tok/s "
                 f"({row['fraction_of_bandwidth_limit']:.3f})")
for row in report["prefill"]:
    cells.append(f"p{row['tokens']} {row['tokens_per_second']:.1f} tok/s ({row['fraction_of_matmul_limit']:.3f})")
if report.get("graph_memory_bytes"):  # trees before 037ba76 do not report it
    cells.append(f"graphs {report['graph_memory_bytes'] / 2**20:.1f} MiB")
print(f"{name}: " + ", ".join(cells))
EOF
    done
  done
done
