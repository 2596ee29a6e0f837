"""Bar chart of a benchmark report: median step time and peak memory per mode, ratios vs eager."""
from __future__ import annotations

import os
from typing import Any


def plot_report(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, results, ratios = report["config"], report["results"], report.get("ratios", {})
    modes = list(results)
    colors = {"eager": "#7f7f7f", "inductor": "#1f77b4", "grcompile": "#d62728"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = [("step_ms", "median step time (ms)", "speedup_vs_eager", "speedup {:.2f}x"),
              ("peak_mem_mb", "peak memory (MB)", "mem_vs_eager", "mem {:.2f}x")]
    for ax, (key, label, ratio_key, ratio_fmt) in zip(axes, panels):
        values = [results[m].get(key) or 0.0 for m in modes]
        bars = ax.bar(modes, values, color=[colors.get(m, "#2ca02c") for m in modes])
        top = max(values) if any(values) else 1.0
        for bar, mode, value in zip(bars, modes, values):
            r = results[mode]
            if "error" in r:
                text = "failed"
            else:
                ratio = ratios.get(mode, {}).get(ratio_key)
                text = f"{value:,.0f}" + (f"\n{ratio_fmt.format(ratio)}" if ratio is not None else "")
            ax.text(bar.get_x() + bar.get_width() / 2, max(value, 0) + 0.02 * top, text,
                    ha="center", va="bottom", fontsize=9)
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.25)
        ax.grid(axis="y", alpha=0.3)
    device = next((r.get("device") for r in results.values() if "error" not in r), c.get("device", "?"))
    title = c["model"] if c.get("preset") is None else f"{c['model']}/{c['preset']}"
    fig.suptitle(f"{title}  max_len {c['max_len']}  batch {c['batch_size']}  "
                 f"({device}, median of {c['steps']} steps)")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
