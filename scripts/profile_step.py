"""Profile one training step of a built-in model (the bench's workload) and print where the time
goes: the top operators by device time and by host time.

    python scripts/profile_step.py --model hstu --preset large --max-len 1024 --batch-size 4 --device cuda
"""
from __future__ import annotations

import argparse

import torch

from grcompile.bench.worker import DEFAULTS, builtin_workload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="hstu")
    p.add_argument("--preset", default="large")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args()
    cfg = dict(DEFAULTS, model=args.model, preset=args.preset, max_len=args.max_len, batch_size=args.batch_size,
               device=args.device)
    device = torch.device(args.device)
    work = builtin_workload(cfg, device, 3)

    def step(inputs):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = work.task(*inputs)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    step(work.inputs[0])
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step(work.inputs[1])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
