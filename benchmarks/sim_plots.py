"""Plots of a simulate_replicas run: one PNG, a row per sweep, a line per routing policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRICS = (("output_throughput", "output tokens/s"), ("ttft_p50_s", "TTFT p50 (s)"),
           ("ttft_p99_s", "TTFT p99 (s)"), ("prefix_cache_hit_rate", "prefix-cache hit rate"))
SWEEPS = (("replicas", "num_replicas", "replicas N (offered rate grows with N)"),
          ("rate", "rate", "offered rate (req/s)"),
          ("prefixes", "system_prompts", "distinct system prompts"),
          ("skew", "prefix_skew", "Zipf skew of system prompts"))
STYLE = {"prefix-aware": "o-", "power-of-two": "s--", "round-robin": "^:",
         "prefix-aware-no-overload-check": "x-."}


def plot_all(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in SWEEPS if any(r["sweep"] == s[0] for r in data["results"])]
    fig, axes = plt.subplots(len(rows), len(METRICS), figsize=(18, 3.6 * len(rows)),
                             squeeze=False)
    for axrow, (sweep, key, label) in zip(axes, rows, strict=True):
        results = [r for r in data["results"] if r["sweep"] == sweep]
        for ax, (metric, ylabel) in zip(axrow, METRICS, strict=True):
            _panel(ax, results, key, metric)
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            if metric.startswith("ttft"):
                ax.set_yscale("log")
            if key in ("num_replicas", "system_prompts"):
                ax.set_xscale("log", base=2)
        axrow[0].set_title(f"sweep: {sweep}", loc="left", fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Simulated replicas ({data['device']} step-cost profile, "
                 f"{data['num_kv_blocks']} KV blocks/replica)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _panel(ax: Any, results: list[dict[str, Any]], key: str, metric: str) -> None:
    for policy, style in STYLE.items():
        pts = sorted((r[key], r[metric]) for r in results if r["policy"] == policy)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=policy, markersize=4)
    ax.grid(True, alpha=0.3)
