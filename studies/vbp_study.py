"""VBP as its paper describes it, against CORP, through the same code, on real weights (MLP channels).

    python -m studies.vbp_study --dataset digits --out studies/results/vbp-study-digits          # make vbp-study
    python -m studies.vbp_study --dataset fashion-mnist --out docs/vbp-study-fashion-mnist

DINOv2 ViT-S/14 (real weights) is calibrated once; at each MLP sparsity a copy is pruned by:
- VBP: variance ranking (centred second moment), one threshold across all blocks (``--selection global``),
  mean-shift compensation: ``--ranker variance --compensation mean --selection global``;
- VBP, per layer: the same with the same fraction removed in every block;
- CORP: the paper's ranking (energy x magnitude), per layer, ridge compensation (the default);
- CORP with VBP's variance ranking;
- plain removal (variance ranking, no compensation).
Each is scored by the dense model's linear probe on held-out labelled images; top-1 comes with its binomial
standard error ``sqrt(p (1 - p) / n)``. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import math
from typing import Any

from corp_deploy.apps.real import RealSetup, sparsity_study
from corp_deploy.core.config import PruneConfig

METHODS = {
    "VBP (variance, global, mean shift)": {"ranker": "variance", "selection": "global", "compensation": "mean"},
    "VBP per layer": {"ranker": "variance", "compensation": "mean"},
    "CORP": {},
    "CORP, variance ranking": {"ranker": "variance"},
    "plain removal": {"ranker": "variance", "compensation": "none"},
}


def sweep(setup: RealSetup, sparsities: list[float], log=print) -> list[dict[str, Any]]:
    rows = []
    for s in sparsities:
        for method, knobs in METHODS.items():
            config = PruneConfig(sparsity=s, target="mlp", **knobs)
            row = {"method": method, "sparsity": s} | setup.score(config)
            rows.append(row)
            log(f"{s:.1f} {method:36s} top-1 {row['top1']:.1%} cosine {row['cosine_mean']:.4f}")
    return rows


def _cell(top1: float, n: int) -> str:
    return f"{100 * top1:.1f} ± {100 * math.sqrt(top1 * (1 - top1) / n):.1f}"


def format_table(rows: list[dict[str, Any]], dense: dict[str, Any]) -> str:
    """Probe top-1 ± standard error (and MLP channels kept) per method (rows) and sparsity (columns)."""
    sparsities = sorted({r["sparsity"] for r in rows})
    n = dense["images"]
    lines = [
        "| method | " + " | ".join(f"MLP {s:.0%}" for s in sparsities) + " |",
        "|---|" + "---|" * len(sparsities),
    ]
    for method in METHODS:
        cells = [next(r for r in rows if (r["method"], r["sparsity"]) == (method, s)) for s in sparsities]
        lines.append(f"| {method} | " + " | ".join(_cell(c["top1"], n) for c in cells) + " |")
    lines.append(f"\ndense: {_cell(dense['top1'], n)} probe top-1 on {n} test images")
    return "\n".join(lines)


def main() -> None:
    title = "VBP vs CORP, MLP channels, "
    sparsity_study(__doc__, "studies/results/vbp-study", "0.3,0.5,0.7", sweep, format_table, title)


if __name__ == "__main__":
    main()
