"""Bench outputs: the terminal table, CSV, markdown, and the PNG plot."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from corp_deploy.base.deps import require
from corp_deploy.base.tables import markdown_table, text_table
from corp_deploy.bench.run import pairs

COLUMNS = (
    ("backend", "backend", "{}"),
    ("device", "device", "{}"),
    ("precision", "precision", "{}"),
    ("batch", "batch", "{}"),
    ("dense_p50_ms", "dense p50 ms", "{:.2f}"),
    ("pruned_p50_ms", "pruned p50 ms", "{:.2f}"),
    ("p50_speedup", "p50 speedup", "{:.2f}x"),
    ("dense_throughput", "dense img/s", "{:.1f}"),
    ("pruned_throughput", "pruned img/s", "{:.1f}"),
    ("throughput_ratio", "throughput ratio", "{:.2f}x"),
)
TEXT_COLUMNS = (
    *COLUMNS[:4],
    ("seq_len", "seq-len", "{}"),
    *COLUMNS[4:7],
    ("dense_throughput", "dense sent/s", "{:.1f}"),
    ("pruned_throughput", "pruned sent/s", "{:.1f}"),
    ("dense_tokens_per_s", "dense tok/s", "{:.0f}"),
    ("pruned_tokens_per_s", "pruned tok/s", "{:.0f}"),
    COLUMNS[-1],
)
"""A text run's: tokens per sequence beside the batch; sentences/s and tokens/s instead of images/s."""


DECODE_COLUMNS = (
    *COLUMNS[:4],
    ("prompt_len", "prompt", "{}"),
    ("phase", "phase", "{}"),
    ("dense_p50_ms", "dense p50 ms", "{:.2f}"),
    ("pruned_p50_ms", "pruned p50 ms", "{:.2f}"),
    ("p50_speedup", "p50 speedup", "{:.2f}x"),
    ("dense_tokens_per_s", "dense tok/s", "{:.1f}"),
    ("pruned_tokens_per_s", "pruned tok/s", "{:.1f}"),
)
"""A decoder's: prompt length and phase beside the batch; a decode row's p50 is ms per token, its tokens/s the
p50's (batch / p50), a prefill row's batch x prompt / p50."""


BASELINE_COLUMNS = (
    ("baseline_p50_ms", "quantize-only p50 ms", "{:.2f}"),
    ("pruned_vs_baseline", "pruned vs quantize-only", "{:.2f}x"),
)
"""Where the quantize-only baseline was timed (``bench.baseline``): its p50 and pruned's speed against it."""


def _columns(record: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    columns = DECODE_COLUMNS
    if not any("phase" in r for r in record["results"]):
        columns = TEXT_COLUMNS if any("seq_len" in r for r in record["results"]) else COLUMNS
    return columns + (BASELINE_COLUMNS if any(r["model"] == "baseline" for r in record["results"]) else ())


def _rows(record: dict[str, Any]) -> list[list[str]]:
    """One row per backend and batch; a cell the row has no figure for (the baseline beside torch) is empty."""
    columns = _columns(record)
    return [[fmt.format(p[key]) if key in p else "" for key, _, fmt in columns] for p in pairs(record)]


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    """One line per reason, naming every backend it skipped (nine CUDA variants without a GPU are one line)."""
    names: dict[str, list[str]] = {}
    for name, why in skipped.items():
        names.setdefault(why, []).append(name)
    return [f"skipped {', '.join(group)}: {why}" for why, group in names.items()]


def format_table(record: dict[str, Any]) -> str:
    rows = text_table([[title for _, title, _ in _columns(record)], *_rows(record)], right_from=3)
    what = record.get("quantize_only_baseline")
    return "\n".join([rows, *([f"quantize-only baseline: {what}"] if what else []), *skipped_lines(record["skipped"])])


def format_markdown(record: dict[str, Any]) -> str:
    return markdown_table([title for _, title, _ in _columns(record)], _rows(record)) + "\n"


def to_csv(record: dict[str, Any]) -> str:
    """One line per (backend, model, batch) with every statistic."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(record["results"][0]) if record["results"] else ["backend"])
    writer.writeheader()
    writer.writerows(record["results"])
    return out.getvalue()


def pyplot():
    """matplotlib's pyplot on the file-only backend, or a one-line error saying what to install."""
    require("matplotlib", "a plot").use("Agg")
    return require("matplotlib.pyplot", "a plot")


def plot(record: dict[str, Any], path: Path) -> None:
    """Throughput and p50 latency against batch size; dense dashed, pruned solid, one colour per backend."""
    plt = pyplot()
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    backends = sorted({r["backend"] for r in record["results"]})
    for color, backend in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3, backends, strict=False):
        for model, style in (("dense", "--"), ("pruned", "-")):
            rows = sorted(
                (r for r in record["results"] if r["backend"] == backend and r["model"] == model),
                key=lambda r: r["batch"],
            )
            batches = [r["batch"] for r in rows]
            label = f"{backend} {model}"
            left.plot(batches, [r["throughput"] for r in rows], style, color=color, marker="o", label=label)
            right.plot(batches, [r["p50_ms"] for r in rows], style, color=color, marker="o", label=label)
    unit = "sentences/s" if _columns(record) is TEXT_COLUMNS else "images/s"
    for ax, title in ((left, f"throughput ({unit})"), (right, "p50 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    env = record["environment"]
    fig.suptitle(f"{record['model']}: dense vs pruned on {env.get('gpu', env['cpu'])} ({record['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
