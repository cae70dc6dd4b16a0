#!/usr/bin/env bash
# On the GPU machine: codec CUDA checks, then build, inspect and verify a real-shape synthetic artifact,
# timing each step and the peak host memory. Usage: bash scripts/device/foundation.sh PRESET RECIPE
set -uo pipefail
preset=${1:-qwen3.8-27b}
recipe=${2:-q4}
out=/tmp/ninfer-synth
rm -rf "$out" && mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
df -h /tmp | tail -1
python3 -m pytest -q -m gpu tests/test_quant_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error"
python3 scripts/device/timed.py synth python3 -m ninfer synth --preset "$preset" --recipe "$recipe" \
    --device cuda --artifact-id 00000000000000000000000000000001 --out "$out/$preset-$recipe.ninfer" --quiet
ls -l "$out"
python3 -m ninfer inspect "$out/$preset-$recipe.ninfer" | tail -14
python3 scripts/device/timed.py verify python3 -m ninfer verify --device cuda --quiet \
    "$out/$preset-$recipe.ninfer"
python3 - "$out/$preset-$recipe.ninfer.conversion.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("report seconds", r["seconds"], "components", {k: (v["bytes"], v["bits_per_weight"]) for k, v in r["components"].items()})
PY
