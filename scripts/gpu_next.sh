#!/usr/bin/env bash
# What the next GPU session should measure (one call; see docs/precision-memory.md and
# docs/lowering.md, "Measured on an H200"): the FP8 block GEMMs with launch time hidden, then
# grcompile end-to-end on HSTU-large at a larger load, bf16 and FP8. First: the attention kernels
# (interior blocks unmasked, softmax backward reading the forward's statistics) with the
# autotuner off and on (docs/lowering.md).
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
export TRITON_CACHE_DIR=/tmp/grcompile-triton-cache  # read back at the end: what ran, against the AOT report
LOG="$OUT/next.log"
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
# the attention kernels (interior blocks unmasked, softmax backward without the forward rerun;
# autotuner off, then on): compare with docs/lowering.md's H100 / H200 tables
for case in "hstu silu" "none silu" "none softmax" "hstu softmax"; do
  set -- $case
  for tune in 0 1; do
    step attention kernels bias=$1 activation=$2 autotune=$tune
    GRCOMPILE_AUTOTUNE=$tune timeout 100 python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 \
      --head-dim 128 --dtype bf16 --bias $1 --activation $2 --json "$OUT/attn-$1-$2-tune$tune.json" 2>&1 \
      | tee -a "$LOG"
  done
done
# time gaps in int32 (epoch seconds, above) against int64 (milliseconds): the same HSTU kernels
step attention kernels bias=hstu activation=silu autotune=0 timestamps=milliseconds
GRCOMPILE_AUTOTUNE=0 timeout 100 python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 \
  --head-dim 128 --dtype bf16 --bias hstu --activation silu --timestamps milliseconds \
  --json "$OUT/attn-hstu-silu-tune0-ms.json" 2>&1 | tee -a "$LOG"
# head widths that are not multiples of 16 run padded to one (launch_width): width 50 should time
# like width 64, not far slower (before: 2-byte scalar loads, no pipelining; one head as SASRec)
for width in 50 64; do
  step attention kernels softmax one head width $width
  GRCOMPILE_AUTOTUNE=0 timeout 60 python3 -m grcompile.bench.attention_kernel --tokens 8192 --rows 4 --heads 1 --head-dim $width \
    --dtype bf16 --bias none --activation softmax --json "$OUT/attn-width$width.json" 2>&1 | tail -4 | tee -a "$LOG"
done
step fp8 kernels back to back
timeout 90 python3 -m grcompile.bench.fp8_kernel --tokens 32768 --dim 1024 --back-to-back 10 \
  --json "$OUT/fp8-kernels-b2b.json" 2>&1 | tee -a "$LOG"
for precision in bf16 fp8; do
  step e2e grcompile $precision
  timeout 200 python3 -m grcompile.bench --model hstu --preset large --max-len 2048 --batch-size 16 --device cuda \
    --precision $precision --modes grcompile --steps 3 --warmup 1 --timeout 190 --no-aot \
    --json "$OUT/e2e-grcompile-$precision.json" 2>&1 | grep -v "^\s*$" | tail -12 | tee -a "$LOG"
done
step kernels that ran: registers, spills, shared memory, loads "(compare: python -m grcompile.lowering.aot)"
timeout 90 python3 -m grcompile.lowering.aot --from-cache "$TRITON_CACHE_DIR" --kernels '^(fwd|bwd_kv|bwd_q)$' \
  --no-fail --json "$OUT/ran-kernels.json" 2>&1 | tail -80 | tee -a "$LOG"
step done
