"""Memory and time of one-pass, bounded (block-by-block) and sequential calibration, one mode per process.

    python -m studies.seq_memory deit_base_patch16_224 --mode bounded --max-stats-gib 0.5 --num-calib 16

Random weights and synthetic noise images (memory and time do not depend on them). Prints one JSON line: seconds
per phase, statistics held at a time (the one-pass size for every model, from meta tensors, without allocating it),
token cache, peak process RSS (and CUDA peak on a GPU). Run each mode in its own process: RSS peaks are per process.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

from corp_deploy import api, blockwise
from corp_deploy.models import create_model
from corp_deploy.pruner import PruneConfig

MODES = ("one-pass", "bounded", "sequential")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--mode", choices=MODES, default="bounded")
    p.add_argument("--max-stats-gib", type=float, default=None, help="bounded/sequential: the bound")
    p.add_argument("--num-calib", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--target", default="both")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--attn-sparsity",
        type=float,
        default=None,
        help="0 keeps every Q/K dim: the Q/K statistics are still collected (same memory), their solve is skipped",
    )
    a = p.parse_args()
    warnings.simplefilter("ignore")
    model = create_model(a.model, weights="random")
    config = PruneConfig(0.5, qk_sparsity=a.qk_sparsity, target=a.target, sequential=a.mode == "sequential")
    one_pass = blockwise.block_stats(model, PruneConfig(target=a.target), range(len(model.blocks)), "meta")
    batches, total = api.calibration_batches(model, "synthetic", a.num_calib, a.batch_size)
    bound = a.max_stats_gib if a.mode != "one-pass" else None
    start = time.perf_counter()
    result = api.prune(model, batches, config, a.device, total, progress=False, max_stats_gib=bound)
    report = result.report
    print(
        json.dumps(
            {
                "model": a.model,
                "mode": a.mode,
                "images": a.num_calib,
                "max_stats_gib": bound,
                "wall_s": time.perf_counter() - start,
                "seconds": report["seconds"],
                "one_pass_statistics_mib": one_pass.nbytes() / 2**20,
                "memory": report["memory"],
                "calibration": report["calibration"],
                "device": report["device"],
            }
        )
    )


if __name__ == "__main__":
    main()
