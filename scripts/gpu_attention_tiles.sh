#!/usr/bin/env bash
# Time whole tile sets (fwd / bwd_kv / bwd_q together) on the HSTU-RAB and the plain kernels:
# a kernel's best tile depends on how much score_mod work each program carries.
set -u
OUT=${OUT:-/tmp/grcompile-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GRCOMPILE_TRITON_CACHE=/tmp/grcompile-triton
sets=("default" "64,64,8,3 64,64,8,3 64,64,8,3" "128,64,8,3 64,64,8,2 128,64,8,3" "64,64,4,3 64,64,4,4 128,64,8,3"
      "64,32,8,3 32,64,8,3 64,32,8,3" "128,64,8,3 64,64,8,3 64,64,8,3")
for set in "${sets[@]}"; do
  if [ "$set" = default ]; then envs=(); else read -r f kv q <<<"$set"
    envs=(GRCOMPILE_TILES_FWD=$f GRCOMPILE_TILES_BWD_KV=$kv GRCOMPILE_TILES_BWD_Q=$q); fi
  for bias in hstu none; do
    echo "tiles [$set] bias $bias"
    env "${envs[@]}" python3 -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 \
      --dtype bf16 --bias $bias --activation silu --iters 10 | grep -E "fwd|bwd"
  done
done 2>&1 | tee "$OUT/tiles.log"
