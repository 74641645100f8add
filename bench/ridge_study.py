"""Which ridge damping (and compensation) keeps a real model's features best on HELD-OUT images.

    python -m bench.ridge_study vit_small_patch14_dinov2 --checkpoint dinov2_s.safetensors \
        --model-arg img_size=224 --calib-dir calib/ --eval-dir heldout/ --sparsity 0.5

Calibrates once; prunes a copy of the dense model per setting from the same statistics; compares
the pruned model's final features (``forward_features``) with the dense model's on images that
were not used for calibration. Prints a markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
import torch.nn.functional as F

import corp_deploy
from corp_deploy.models import parse_model_args
from corp_deploy.pruner import PruneConfig, calibrate, prune_model


@torch.no_grad()
def features(model: torch.nn.Module, batches) -> torch.Tensor:
    return torch.cat([model.forward_features(x) for x, _ in batches])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model-arg", action="append", default=[])
    p.add_argument("--calib-dir", required=True)
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--num-calib", type=int, default=4000)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--ridges", default="0,1e-4,1e-3,1e-2,1e-1,1")
    a = p.parse_args()
    warnings.simplefilter("ignore")

    dense = corp_deploy.create_model(a.model, checkpoint=a.checkpoint, model_args=parse_model_args(a.model_arg))
    calib, total = corp_deploy.calibration_batches(dense, a.calib_dir, a.num_calib, batch_size=32)
    held, _ = corp_deploy.calibration_batches(dense, a.eval_dir, 10**6, batch_size=32, workers=0)
    held = list(held)
    reference = features(dense, held)
    stats = calibrate(dense, calib, PruneConfig(), "cpu", total=total)

    settings = [("none", 0.0), ("mean", 0.0)] + [("corp", float(r)) for r in a.ridges.split(",")]
    print(
        f"{a.model}, sparsity {a.sparsity} (mlp+attn), {stats.images} calibration images, "
        f"{sum(x.shape[0] for x, _ in held)} held-out images"
    )
    print(
        "| compensation | ridge alpha | held-out feature rel. error | held-out token cosine | "
        "calib MLP err (mean over blocks) | calib logit err (mean) |"
    )
    print("|---|---|---|---|---|---|")
    for comp, ridge in settings:
        config = PruneConfig(sparsity=a.sparsity, compensation=comp, ridge=ridge)
        pruned = copy.deepcopy(dense)
        blocks = prune_model(pruned, stats, config)
        out = features(pruned, held)
        rel = float((out - reference).norm() / reference.norm())
        cos = float(F.cosine_similarity(out, reference, dim=-1).mean())
        mlp = sum(b["mlp"]["rel_error"][comp] for b in blocks) / len(blocks)
        logit = sum(b["attn"]["rel_error"]["corp" if comp == "corp" else "none"] for b in blocks) / len(blocks)
        print(f"| {comp} | {ridge:g} | {rel:.4f} | {cos:.4f} | {mlp:.4f} | {logit:.4f} |", flush=True)


if __name__ == "__main__":
    main()
