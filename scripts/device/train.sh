#!/usr/bin/env bash
# On the GPU machine: train one small model (tools/train_small.py) and send the checkpoint back under $OUT as
# 15 MB tar pieces (reassemble: cat MODEL.tar.* | tar -x).
# Usage: bash scripts/device/train.sh dense|moe TRAIN-FLAGS...
#   e.g. bash scripts/device/train.sh dense --steps 1718 --chat-steps 300   (the embedded demo model)
set -uo pipefail
model=$1
shift
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/train_small.py --model "$model" --out "/tmp/ckpt/$model" "$@" 2>&1 \
  | grep -v "falling back" | tee "$OUT/train-$model.log"
tar -C /tmp/ckpt -cf - "$model" | split -b 15m -d - "$OUT/$model.tar."
ls -l "$OUT"
