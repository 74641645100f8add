"""The accuracy-speed frontier: which points no other point beats, as a table and a plot.

A point is a model (dense, CORP at a target, plain removal, the dense model quantized) at a precision, with its
measured speed against dense FP32 and its held-out drop (``bench.drop``). It is on the frontier (Pareto) when no
other point is at least as fast and at least as accurate, and strictly better in one of the two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corp_deploy.base.tables import text_table


def dominated(p: dict[str, Any], q: dict[str, Any]) -> bool:
    """Whether ``q`` beats ``p``: no slower, no larger drop, and strictly better in one."""
    no_worse = q["speedup"] >= p["speedup"] and q["drop"] <= p["drop"]
    return no_worse and (q["speedup"] > p["speedup"] or q["drop"] < p["drop"])


def mark_pareto(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``points`` with ``pareto``: True where no other point beats it (``dominated``)."""
    return [p | {"pareto": not any(dominated(p, q) for q in points if q is not p)} for p in points]


def _name(p: dict[str, Any]) -> str:
    return "dense" if p["method"] == "dense" else f"{p['row']} {p['method']}"


def format_frontier(points: list[dict[str, Any]], metric: str, chosen: dict[str, Any] | None = None) -> str:
    """One line per point, fastest first: speed, metric, drop, on the frontier or not (and the floor's choice)."""
    lines = [("model", "precision", "speedup", metric, "drop", "frontier")]
    for p in sorted(points, key=lambda p: -p["speedup"]):
        mark = "yes" if p["pareto"] else ""
        if chosen is not None and all(p[k] == chosen[k] for k in ("row", "method", "precision")):
            mark += " <- chosen"
        lines.append((_name(p), p["precision"], f"{p['speedup']:.2f}x", f"{p[metric]:.4f}", f"{p['drop']:.4f}", mark))
    return text_table(lines)


STYLE = {"dense": ("k", "s"), "corp": ("tab:blue", "o"), "removal": ("tab:red", "x")}


def plot_frontier(points: list[dict[str, Any]], path: Path, title: str, metric: str, max_drop: float | None) -> None:
    """Held-out drop against measured speedup: one marker per method and precision (INT8 hollow), each pruned point
    labelled with its row, the frontier joined."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, (color, marker) in STYLE.items():
        for precision, fill in (("fp32", color), ("int8", "none")):
            mine = [p for p in points if p["method"] == method and p["precision"] == precision]
            if mine:
                xs, ys = [p["speedup"] for p in mine], [p["drop"] for p in mine]
                ax.plot(
                    xs, ys, marker, color=color, markerfacecolor=fill, linestyle="none", label=f"{method} {precision}"
                )
            for p in mine if method != "dense" else ():
                ax.annotate(p["row"], (p["speedup"], p["drop"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["speedup"])
    ax.plot([p["speedup"] for p in front], [p["drop"] for p in front], ":", color="0.4", label="frontier (Pareto)")
    if max_drop is not None:
        ax.axhline(max_drop, color="tab:green", linestyle="--", label=f"--max-drop {max_drop:g}")
    ax.set_xlabel("measured speedup over dense FP32 (same run)")
    ax.set_ylabel(f"held-out {metric} drop (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
