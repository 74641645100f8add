"""Which defaults hold up on real weights: ridge damping, ranker, calibration images, width rounding.

    python -m studies.knob_study --out studies/results/knob-study        # make knob-study

Each knob is varied alone around the defaults (50% joint sparsity, CORP), on DINOv2 ViT-S/14 with
real weights, scored by the dense model's linear probe on held-out labelled images and by the
feature cosine to the dense model. One calibration serves the ridge, ranker and rounding rows;
the calibration-size rows recalibrate on seeded subsets of the same training images.
Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from corp_deploy.apps.real import add_setup_arguments, calibration, real_setup, write_study
from corp_deploy.core.config import DEFAULT_RIDGE, PruneConfig
from corp_deploy.core.ranking import RANKERS

RIDGES = (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
CALIBRATION_SIZES = (32, 64, 128, 256, 500)
ROUNDINGS = (1, 8, 16, 32)  # 64 would leave 0 of 64 Q/K dims at 50%


def study(setup, sparsity: float, log=print) -> list[dict[str, Any]]:
    base = PruneConfig(sparsity=sparsity)
    rows = []

    def add(knob: str, value: Any, config: PruneConfig, calib=None) -> None:
        row = {"knob": knob, "value": value, **setup.score(config, calib)}
        rows.append(row)
        log(f"{knob:12s} {value!s:8s} top-1 {row['top1']:.1%} cosine {row['cosine_mean']:.4f}")

    for ridge in RIDGES:
        add("ridge", ridge, replace(base, ridge=ridge))
    add("compensation", "mean", replace(base, compensation="mean"))
    add("compensation", "none", replace(base, compensation="none"))
    for ranker in RANKERS:
        add("ranker", ranker, replace(base, ranker=ranker))
    for rounding in ROUNDINGS:
        add("round_to", rounding, replace(base, round_to=rounding))
    for num in CALIBRATION_SIZES:
        add("calib images", num, base, calibration(setup.dense, setup.train_dir, num))
    return rows


def format_table(rows: list[dict[str, Any]], dense: dict[str, float]) -> str:
    lines = [
        "| knob | value | probe top-1 | agreement w/ dense | feature cosine | rel. error | params | GMACs |",
        "|---|---|---|---|---|---|---|---|",
        f"| dense | - | {dense['top1']:.1%} | 100% | 1 | 0 | - | - |",
    ]
    for r in rows:
        lines.append(
            f"| {r['knob']} | {r['value']} | {r['top1']:.1%} | {r['top1_agreement']:.1%} | {r['cosine_mean']:.4f} | "
            f"{r['rel_error']:.4f} | {r['params'] / 1e6:.2f}M | {r['macs'] / 1e9:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/knob-study"), help="prefix of .md/.json")
    add_setup_arguments(p)
    p.add_argument("--sparsity", type=float, default=0.5)
    a = p.parse_args()
    start = time.perf_counter()
    setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
    rows = study(setup, a.sparsity)
    dense = setup.task.score()
    title = (
        f"Knob study: vit_small_patch14_dinov2 (real weights), {a.sparsity:.0%} joint sparsity, {setup.dataset} "
        f"probe on {dense['images']} test images; defaults: ridge {DEFAULT_RIDGE:g}, ranker combined, round_to 8, "
        f"{setup.stats.samples} calibration images"
    )
    write_study(a.out, title, dense, rows, format_table(rows, dense), vars(a), start)


if __name__ == "__main__":
    main()
