"""How long CORP pruning takes, split into calibration / ranking / compensation, and its peak memory.

    python -m studies.prune_time deit_small --num-calib 256                 # CPU figure
    python -m studies.prune_time deit_base --num-calib 4000 --device cuda   # GPU target: <= 30 s

Weights are random unless --checkpoint is given: the time of a calibration pass and of the solves
does not depend on the weights' values. Images are noise unless --calib-dir is given (then image
decoding is included, as in real use). Prints one markdown row for docs/BENCHMARKS.md and, with
--json, writes the full report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings

import torch

import corp_deploy
from corp_deploy.api import device_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="deit_small")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--calib-batch-size", type=int, default=64)
    p.add_argument("--calib-dir", help="real images (default: noise, decoding excluded)")
    p.add_argument("--checkpoint")
    p.add_argument("--device", default="auto")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--json", help="write the full report here")
    a = p.parse_args()

    warnings.simplefilter("ignore")
    device = corp_deploy.resolve_device(a.device)
    model = corp_deploy.create_model(a.model, weights="random", checkpoint=a.checkpoint)
    batches, total = corp_deploy.calibration_batches(model, a.calib_dir or "synthetic", a.num_calib, a.calib_batch_size)
    result = corp_deploy.prune(model, batches, corp_deploy.PruneConfig(sparsity=a.sparsity), device, total=total)
    r = result.report
    t, mem = r["seconds"], r["memory"]
    images = r["calibration"]["images"]
    peak = f"{mem['cuda_peak_mib']:.0f} MiB CUDA" if "cuda_peak_mib" in mem else f"{mem['host_rss_mib']:.0f} MiB RSS"
    print(
        f"| {datetime.date.today()} | {device_name(device)} | {a.model} | {images} | {a.sparsity} "
        f"| {sum(t.values()):.1f} | {t['calibration']:.1f} ({images / t['calibration']:.1f} img/s) "
        f"| {t['ranking']:.2f} | {t['compensation']:.2f} | {mem['statistics_mib']:.0f} MiB | {peak} "
        f"| torch {torch.__version__} |"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
