"""``python -m grcompile.train.plot runs/a.json runs/b.json --out curves.png``: training loss and
validation HR@10 / NDCG@10 per epoch of one or more ``grcompile.train --json`` results."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def plot(results: dict[str, dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_hr, ax_ndcg) = plt.subplots(1, 3, figsize=(15, 4))
    for label, r in results.items():
        steps_per_epoch = max(1, round(r["steps_run"] / max(r["epochs_run"], 1e-9)))
        losses = np.asarray(r["losses"])
        epochs = len(losses) // steps_per_epoch
        if epochs:
            ax_loss.plot(np.arange(1, epochs + 1), losses[: epochs * steps_per_epoch].reshape(epochs, -1).mean(1),
                         label=label)
        history = r["valid_history"]
        x = [h["epoch"] for h in history]
        ax_hr.plot(x, [h["hr@10"] for h in history], label=f"{label} (test {r['hr@10']:.4f})")
        ax_ndcg.plot(x, [h["ndcg@10"] for h in history], label=f"{label} (test {r['ndcg@10']:.4f})")
    for ax, title in ((ax_loss, "train loss (epoch mean)"), (ax_hr, "validation HR@10"),
                      (ax_ndcg, "validation NDCG@10")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m grcompile.train.plot", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    results = {path.stem: json.loads(path.read_text()) for path in args.results}
    print(f"wrote {plot(results, args.out)}")


if __name__ == "__main__":
    main()
