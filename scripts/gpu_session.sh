#!/usr/bin/env bash
# One call on a lent CUDA GPU (the `device` tool), most valuable first, each step time-boxed:
#   1. the FP8 kernels natively (never run on a GPU before): checks against their references on the
#      device, then timings of HSTU-large's two block GEMMs, FP8 vs the bf16 path (issue 12);
#   2. end-to-end HSTU-large training steps on the GPU, eager vs grcompile, bf16 then FP8 (issue 11's
#      MFU, issue 12's real FP8 step speed);
#   3. the attention kernels at 8K tokens on this card (issue 11), with torch's SDPA beside them.
# Logs and JSON go to $OUT (at most 8 files come back).
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
LOG="$OUT/session.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$LOG"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step fp8 kernels
timeout 150 python3 -m grcompile.bench.fp8_kernel --tokens 32768 --dim 1024 --heads 8 --head-dim 128 \
  --json "$OUT/fp8-kernels.json" 2>&1 | tee -a "$LOG"
e2e() {  # precision, json
  timeout 330 python3 -m grcompile.bench --model hstu --preset large --max-len 2048 --batch-size 8 --device cuda \
    --precision "$1" --modes eager,grcompile --steps 6 --warmup 3 --timeout 150 --no-aot --json "$OUT/$2" 2>&1 \
    | grep -v "^\s*$" | tail -40 | tee -a "$LOG"
}
step e2e bf16; e2e bf16 e2e-hstu-large-bf16.json
step e2e fp8; e2e fp8 e2e-hstu-large-fp8.json
step attention
for bias in hstu none; do
  timeout 60 python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 --dtype bf16 \
    --bias $bias --activation silu --baseline --json "$OUT/attn-$bias-silu.json" 2>&1 | grep -v "^wrote" | tee -a "$LOG"
done
step done
