"""How long CORP pruning takes, split into calibration / ranking / compensation, and the memory it holds.

    python -m studies.prune_time deit_small --num-calib 256                 # CPU figure
    python -m studies.prune_time deit_base --num-calib 4000 --device cuda   # GPU target: <= 30 s
    python -m studies.prune_time deit_base --mode bounded --max-stats-gib 0.5 --num-calib 16 --calib-batch-size 8
    python -m studies.prune_time deit_base --mode sequential --num-calib 16 --calib-batch-size 8

Weights are random unless --checkpoint is given: the time of a calibration pass and of the solves
does not depend on the weights' values. Images are noise unless --calib-dir is given (then image
decoding is included, as in real use). ``--mode`` picks the calibration: one pass over every block
(the default), bounded (blocks in groups whose statistics fit ``--max-stats-gib``; the same artifact)
or sequential (block by block from the model pruned so far). Prints one markdown row for
docs/BENCHMARKS.md; for the block-by-block modes its statistics cell adds the bound, what one pass
would hold (sized on the meta device, never allocated) and the token cache. Run each mode in its own
process: the peak RSS is the process's. With --json, writes the full report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings
from typing import Any

import torch

import corp_deploy
from corp_deploy.api import device_name
from corp_deploy.core import blockwise

MODES = ("one-pass", "bounded", "sequential")


def one_pass_mib(model: torch.nn.Module, target: str) -> float:
    """What one pass would hold for every block of the (dense) model, sized on the meta device, never allocated."""
    stats = blockwise.block_stats(model, corp_deploy.PruneConfig(target=target), range(len(model.blocks)), "meta")
    return stats.nbytes() / 2**20


def table_row(a: argparse.Namespace, device: torch.device, report: dict[str, Any], one_pass: float) -> str:
    """The markdown row of docs/BENCHMARKS.md's pruning-time table; a block-by-block mode's statistics cell adds
    the bound, what one pass would hold and the token cache."""
    t, mem, images = report["seconds"], report["memory"], report["calibration"]["images"]
    held = f"{mem['statistics_mib']:.0f} MiB"
    if a.mode != "one-pass":
        bound = f", {a.max_stats_gib:g} GiB bound" if a.mode == "bounded" else ""
        cache = report["calibration"]["cache_mib"]
        held += f" ({a.mode}{bound}; one-pass {one_pass:.0f} MiB; token cache {cache:.1f} MiB)"
    peak = f"{mem['cuda_peak_mib']:.0f} MiB CUDA" if "cuda_peak_mib" in mem else f"{mem['host_rss_mib']:.0f} MiB RSS"
    return (
        f"| {datetime.date.today()} | {device_name(device)} | {a.model} | {images} | {a.sparsity} "
        f"| {sum(t.values()):.1f} | {t['calibration']:.1f} ({images / t['calibration']:.1f} img/s) "
        f"| {t['ranking']:.2f} | {t['compensation']:.2f} | {held} | {peak} | torch {torch.__version__} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="deit_small")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--calib-batch-size", type=int, default=64)
    p.add_argument("--calib-dir", help="real images (default: noise, decoding excluded)")
    p.add_argument("--checkpoint")
    p.add_argument("--device", default="auto")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--target", default="both", help="what to prune, as `corp-deploy prune --target`")
    p.add_argument("--mode", choices=MODES, default="one-pass", help="how the blocks are calibrated")
    p.add_argument("--max-stats-gib", type=float, help="--mode bounded: the statistics held at a time")
    p.add_argument("--json", help="write the full report here")
    a = p.parse_args(argv)
    if (a.mode == "bounded") != (a.max_stats_gib is not None):
        p.error("--max-stats-gib goes with --mode bounded, and --mode bounded needs it")

    warnings.simplefilter("ignore")
    device = corp_deploy.resolve_device(a.device)
    model = corp_deploy.create_model(a.model, weights="random", checkpoint=a.checkpoint)
    one_pass = one_pass_mib(model, a.target)
    config = corp_deploy.PruneConfig(sparsity=a.sparsity, target=a.target, sequential=a.mode == "sequential")
    batches, total = corp_deploy.calibration_batches(model, a.calib_dir or "synthetic", a.num_calib, a.calib_batch_size)
    result = corp_deploy.prune(model, batches, config, device, total=total, max_stats_gib=a.max_stats_gib)
    print(table_row(a, device, result.report, one_pass))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result.report | {"mode": a.mode, "one_pass_statistics_mib": one_pass}, f, indent=2)


if __name__ == "__main__":
    main()
