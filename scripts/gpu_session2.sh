#!/usr/bin/env bash
# Second, shorter call: FP8 routes (cuBLAS row-wise / Triton, promoted accumulation, Triton weight
# quantisation), where eager HSTU-large spends a step on the GPU, then grcompile end-to-end.
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
LOG="$OUT/session2.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step imports; python3 -c "import grcompile, grcompile.passes as p; p.default_pipeline(); print('grcompile imports')" 2>&1 | tail -3 | tee -a "$LOG"
step fp8 kernels
timeout 80 python3 -m grcompile.bench.fp8_kernel --tokens 32768 --dim 1024 --heads 8 --head-dim 128 \
  --json "$OUT/fp8-kernels-routes.json" 2>&1 | tee -a "$LOG"
step profile eager
timeout 60 python3 scripts/profile_step.py --preset large --max-len 1024 --batch-size 4 --bf16 --rows 12 2>&1 \
  | grep -v "^\s*$\|USDT\|STAGE" | tee "$OUT/profile-eager.log" | head -22 | tee -a "$LOG"
step e2e grcompile bf16
timeout 190 python3 -m grcompile.bench --model hstu --preset large --max-len 1024 --batch-size 8 --device cuda \
  --precision bf16 --modes grcompile --steps 4 --warmup 2 --timeout 180 --no-aot --json "$OUT/e2e-grcompile-bf16.json" 2>&1 \
  | grep -v "^\s*$" | tail -25 | tee -a "$LOG"
step done
