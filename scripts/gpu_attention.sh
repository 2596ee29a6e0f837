#!/usr/bin/env bash
# One call on a lent CUDA GPU (the `device` tool): environment, the H100 figures of issue 11
# (fused attention with the HSTU RAB, bf16, 8K tokens per row, against torch's SDPA without a bias),
# the table-gradient ablation, the kernel-vs-reference tests run natively, then native tile sweeps.
# Logs and JSON go to $OUT.
#   bash scripts/gpu_attention.sh [bench] [ablation] [check] [sweep]     (default: all)
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
steps=${*:-bench ablation check sweep}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
kernel() { python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 --dtype bf16 "$@"; }
for step in $steps; do
  case $step in
    bench)
      for bias in hstu none; do for act in silu softmax; do
        kernel --bias $bias --activation $act --baseline --json "$OUT/attn-$bias-$act.json"
      done; done 2>&1 | grep -v "^wrote" | tee "$OUT/bench.log" ;;
    ablation)  # table gradients: hot-index rounds x replicas (bwd of the HSTU RAB)
      for rr in "0 1" "4 1" "0 32" "4 32" "8 32"; do set -- $rr
        echo "rounds $1 replicas $2"
        GRCOMPILE_TABLE_GRAD_ROUNDS=$1 GRCOMPILE_TABLE_GRAD_REPLICAS=$2 kernel --bias hstu --activation silu \
          --iters 10 --json "$OUT/ablation-$1-$2.json" | grep bwd
      done 2>&1 | tee "$OUT/ablation.log" ;;
    check)
      GRCOMPILE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -n 8 tests/lowering/attention/test_triton.py \
        -k "matches_reference or every_bias or bias_only or gpu_tiles or non_contiguous" 2>&1 | tee "$OUT/check.log" | tail -15 ;;
    sweep)
      kernel --bias none --activation silu --sweep fwd,bwd_kv,bwd_q --iters 10 --warmup 2 \
        --json "$OUT/sweep-none-silu.json" 2>&1 | grep -v "^  sweep" | tee "$OUT/sweep.log"
      kernel --bias hstu --activation silu --sweep bwd_kv,fwd --iters 10 --warmup 2 \
        --json "$OUT/sweep-hstu-silu.json" 2>&1 | grep -v "^  sweep" | tee -a "$OUT/sweep.log" ;;
  esac
done
