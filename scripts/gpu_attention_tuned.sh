#!/usr/bin/env bash
# Sweep the tiles of the HSTU-RAB and the plain kernels natively, then time both with the fastest
# tiles of the HSTU-RAB sweep (the target). Few files: $OUT keeps at most 8.
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
kernel() { python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 --dtype bf16 "$@"; }
kernel --bias hstu --activation silu --sweep fwd,bwd_kv,bwd_q --iters 10 --warmup 2 --json "$OUT/sweep-hstu-silu.json" \
  2>&1 | grep -v "^  sweep" | tee "$OUT/sweep.log"
kernel --bias none --activation silu --sweep fwd,bwd_kv,bwd_q --iters 10 --warmup 2 --json "$OUT/sweep-none-silu.json" \
  2>&1 | grep -v "^  sweep" | tee -a "$OUT/sweep.log"
best=$(grep "^  best " "$OUT/sweep.log" | head -3 | sed 's/^  best //')
echo "tuned (HSTU sweep): $best"
for bias in hstu none; do for act in silu softmax; do
  env $best python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 --dtype bf16 \
    --bias $bias --activation $act --baseline --json "$OUT/tuned-$bias-$act.json"
done; done 2>&1 | grep -v "^wrote" | tee "$OUT/tuned.log"
