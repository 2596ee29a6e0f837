"""``python -m grcompile.explain --model hstu [--preset ml1m]``: what grcompile does to a model.

Captures one training step of the model's retrieval loss on a small synthetic batch (random
length mix incl. an empty, a length-1 and a full row), runs the pipeline, prints the report (every
rewrite and fallback with the user's source line and the reason) and the op count of the captured
graph before and after each pass. ``--dump DIR`` keeps the per-pass graphs as readable Python.

``--model path/to/file.py:factory`` does the same on a user's model (grcompile/user_model.py):
one step of forward + ``user.step_loss`` + backward on ``user.batch(B, N, seed)``.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

import grcompile
from grcompile.passes import PIPELINES
from grcompile.user_model import StepLoss, UserModelSpecError, is_user_spec, load_user_model
from models import PRESETS, SampledSoftmaxRetrieval, build_encoder

_CALL = re.compile(r"^\s*\w+(?:\s*:\s*\"[^\"]*\")?\s*=\s*([\w.]+)\(")


def op_counts(path: Path) -> Counter[str]:
    """Count calls by op name in a dumped graph file (``torch.ops.*`` in full, others by name)."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        match = _CALL.match(line)
        if match is None:
            continue
        call = match.group(1)
        if call.startswith(("l_", "L_")):
            continue
        counts[call if call.startswith("torch.ops") else call.rsplit(".", 1)[-1]] += 1
    return counts


def main(argv: list[str] | None = None) -> grcompile.Report:
    p = argparse.ArgumentParser(prog="python -m grcompile.explain", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hstu", metavar="{%s} | FILE.py:FACTORY" % ",".join(sorted(PRESETS)),
                   help="a built-in model, or a user's factory (grcompile/user_model.py)")
    p.add_argument("--preset", default="ml1m", help="preset of a built-in model")
    p.add_argument("--max-len", type=int, default=32, help="N (a user's factory gets max_len=N if it takes it)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="weights, and the seed of a user's make_batch")
    p.add_argument("--pipeline", choices=sorted(PIPELINES), default="jagged")
    p.add_argument("--dump", type=Path, default=None, help="keep the per-pass graphs here")
    args = p.parse_args(argv)
    user_spec = is_user_spec(args.model)
    if not user_spec and args.model not in PRESETS:
        p.error(f"--model {args.model!r}: choose from {', '.join(sorted(PRESETS))} or give FILE.py:FACTORY")
    if args.max_len < 1 or args.batch_size < 1:
        p.error("--max-len and --batch-size must be >= 1")

    torch.manual_seed(args.seed)
    N = args.max_len
    if user_spec:
        B = args.batch_size
        try:
            user = load_user_model(args.model, max_len=N)
        except UserModelSpecError as exc:
            p.error(str(exc))
        task: torch.nn.Module = StepLoss(user)
        inputs = user.batch(B, N, args.seed)
        title = f"{args.model} ({user.name})"
    else:
        B = max(args.batch_size, 3)
        encoder = build_encoder(args.model, args.preset, num_items=100, max_len=N, dropout=0.0)
        task = SampledSoftmaxRetrieval(encoder)
        ids = torch.randint(1, 101, (B, N))
        for row, length in enumerate([0, 1, N] + [int(x) for x in torch.randint(1, N + 1, (B - 3,))]):
            ids[row, length:] = 0
        timestamps = torch.cumsum(torch.randint(0, 10**5, (B, N)), dim=1)
        negatives = torch.randint(1, 101, (B, 16))
        inputs = (ids, timestamps, negatives)
        title = f"{args.model}/{args.preset}"

    dump = args.dump or Path(tempfile.mkdtemp(prefix="grcompile-explain-"))
    optimized = grcompile.optimize(task, passes=PIPELINES[args.pipeline](), dump_dir=dump, lowering="eager")
    optimized(*inputs).backward()
    report = grcompile.report(optimized)
    print(f"grcompile.explain: {title}, N={N}, B={B}, pipeline '{args.pipeline}'\n")
    print(report)
    for graph_dir in sorted(dump.glob("graph_*")):
        files = sorted(graph_dir.glob("*.py"))
        print(f"\n{graph_dir.name}: op counts per stage (calls in the graph)")
        base = op_counts(files[0])
        for f in files:
            counts = op_counts(f)
            changed = {k: counts[k] - base[k] for k in set(counts) | set(base) if counts[k] != base[k]}
            delta = ", ".join(f"{k} {v:+d}" for k, v in sorted(changed.items())) or "unchanged"
            print(f"  {f.stem:28s} {sum(counts.values()):4d} calls   vs captured: {delta}")
    print(f"\nper-pass graphs: {dump}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
