"""oneDNN matmul caches under CPU bf16 autocast: one nn.Linear, forward + backward, a new row count
per step (as jagged [valid tokens, D] linears get) -> RSS grows until the caches (1,024 entries each)
fill; the same row count every step -> flat. docs/precision-memory.md, FP8 / peak RSS.

    python docs/repro/onednn_cache_growth.py distinct|same [D]
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 LRU_CACHE_CAPACITY=1 python docs/repro/onednn_cache_growth.py distinct   # flat
"""
import ctypes, sys, torch
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
def rss():
    libc.malloc_trim(0)
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) / 1024
distinct = sys.argv[1] == "distinct"
D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
lin = torch.nn.Linear(D, 4 * D)
for step in range(1, 801):
    M = 3000 + (step if distinct else 0)
    x = torch.randn(M, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    if step % 50 == 0:
        print(f"{'distinct' if distinct else 'same'} M, step {step}: rss after trim {rss():.0f} MB", flush=True)
