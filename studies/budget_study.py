"""Uniform vs budget-allocated (vs allocated + sequential) CORP at the same MACs, on real weights (issues 16, 22).

    python -m studies.budget_study --dataset fashion-mnist --out studies/results/budget-study-fashion-mnist
    python -m studies.budget_study --dataset digits --out studies/results/budget-study-digits
    python -m studies.budget_study --plot studies/results/budget-study.png studies/results/budget-study-*.json
    python -m studies.budget_study --methods local,allocated --dataset digits --test 200 --sparsities 0.6,0.7 \
        --out studies/results/alloc-study        # the allocation criteria: plain local vs sensitivity-weighted errors

DINOv2 ViT-S/14 (real weights) is calibrated once (MLP + Q/K, joint) on ``--num-calib`` train images; the
``--heldout`` more images of the same seeded sample, drawn across it (``calibration.calibration_data``, as the CLI draws
them), are the sensitivity pass's. For every uniform sparsity the budget is the MACs uniform CORP reaches
there; uniform CORP and the ``--methods`` at that budget are scored by the dense model's linear probe on the
test images:
- uniform: CORP at that sparsity in every block (one pass, the paper's method; always run: it sets the budget);
- local: per-block widths from ``allocation.plan_budget`` with plain local errors, one-pass CORP;
- allocated: the same with sensitivity-weighted errors (the default criterion), one-pass CORP;
- allocated+sequential: the sensitivity-weighted widths, pruned by the sequential walk (``blockwise``) on the
  same images.
Top-1 comes with its binomial standard error ``sqrt(p (1 - p) / n)``; every model's onnxruntime CPU throughput
is measured in one interleaved run (same-run ratios; the machine's load is printed). The record also holds what
the allocator's choices rest on: the error curves' and the sensitivity pass's cost, the measured sensitivities,
how far the ridge-free MLP curves are from the ridge solves (``mlp_ridge_gap``) and how far the cheap scaled
pair energy is from the exact Q/K curves (``qk_pair_energy_gap``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corp_deploy.apps.real import add_setup_arguments, real_task, write_study
from corp_deploy.base.tables import markdown_table
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.core import blockwise
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.exporters.onnx_export import export_onnx
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.families.timm.surgery import head_widths
from corp_deploy.formats import calibration
from corp_deploy.formats.data import input_size
from corp_deploy.plan.allocation import error_curves, plan_budget
from corp_deploy.plan.report import model_size
from corp_deploy.plan.sensitivity import measure
from corp_deploy.plan.width_plan import plan_widths

ALLOCATED = ("local", "allocated", "allocated+sequential")
METHODS = ("uniform", *ALLOCATED)
THROUGHPUT_BATCH = 16


def build_models(dense: torch.nn.Module, train_dir: Path, a: argparse.Namespace) -> tuple[dict, dict]:
    """Every model of the study, keyed (method, sparsity), and what each lever cost (seconds) and rests on."""
    data = calibration.calibration_data(dense, train_dir, a.num_calib + a.heldout, workers=0, hold_out=a.heldout)
    heldout = data.heldout.images  # drawn across the whole sample (data.split), not its first class folders
    calib = list(data.batches)  # the sequential walks pass over the same images again
    cost: dict[str, Any] = {}
    t = time.perf_counter()
    stats = calibrate(dense, calib, PruneConfig(target="both"), "cpu", progress=False)
    cost["calibration_s"] = time.perf_counter() - t
    base = PruneConfig(target="both", budget="macs=1")
    t = time.perf_counter()
    curves = error_curves(dense, stats, base, frozenset({"mlp", "qk"}))
    cost["curves_s"] = time.perf_counter() - t
    t = time.perf_counter()
    weights = measure(dense, stats, base, heldout)
    cost["sensitivity_s"] = time.perf_counter() - t
    cost["sensitivity"] = {f"{i}:{part}": v for (i, part), v in weights.items()}
    cost["mlp_ridge_gap"] = ridge_effect(dense, stats, curves, base.ridge)
    cost["qk_pair_energy_gap"] = pair_energy_gap(stats, curves)
    dense_macs = model_size(dense)["macs"]
    models: dict[tuple[str, float], torch.nn.Module] = {}
    walk_s = []
    for s in a.sparsities:
        uniform = models[("uniform", s)] = copy.deepcopy(dense)
        config = PruneConfig(sparsity=s, target="both")
        prune_model(uniform, stats, config, plan_widths(uniform, config, stats))
        config = PruneConfig(target="both", budget=f"macs={model_size(uniform)['macs'] / dense_macs:.6f}")
        for method in a.methods:
            plan, _ = plan_budget(dense, stats, config, dense_macs, None if method == "local" else weights, curves)
            model = models[(method, s)] = copy.deepcopy(dense)
            if method == "allocated+sequential":
                t = time.perf_counter()
                cpu = torch.device("cpu")
                blockwise.walk(model, calib, replace(config, sequential=True), plan, cpu, progress=False)
                walk_s.append(time.perf_counter() - t)
                print(f"built s={s}: walk {walk_s[-1]:.0f} s", flush=True)
            else:
                prune_model(model, stats, config, plan)
    if walk_s:
        cost["sequential_walk_s"] = sum(walk_s) / len(walk_s)
    return models, cost


def ridge_effect(dense: torch.nn.Module, stats: CalibrationStats, curves: dict, ridge: float) -> float:
    """Largest relative gap between the ridge-free MLP curve and the exact ridge error (widths 3/4, 1/2, 1/4):
    the allocator ranks MLP widths by one factorisation for all widths, the pruner solves with the ridge."""
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


def pair_energy_gap(stats: CalibrationStats, curves: dict) -> float:
    """Largest |scaled removed pair energy - exact| / exact over Q/K widths, scaled to match at half width:
    how wrong the cheap uncompensated proxy would rank Q/K widths against the exact solves the allocator uses."""
    worst = 0.0
    for (i, part), (widths, errors) in curves.items():
        if part != "qk":
            continue
        s = stats.qk[i]
        order = torch.sort(C.logit_energy(s.moment, s.index), dim=-1, descending=True, stable=True).indices
        removed = [
            sum(float(C.pair_energy(s.moment[h], s.index, order[h, w:])) for h in range(s.heads)) for w in widths
        ]
        ref = min(range(len(widths)), key=lambda j: abs(widths[j] - widths[0] / 2))
        scale = errors[ref] / removed[ref]
        worst = max(worst, *(abs(scale * r - e) / e for r, e in zip(removed[1:], errors[1:], strict=True)))
    return worst


def throughputs(models: dict[str, torch.nn.Module], size: tuple[int, int, int], seconds: float) -> dict[str, float]:
    """onnxruntime CPU images/s at batch ``THROUGHPUT_BATCH`` of every model, measured interleaved in one run."""
    x = np.random.default_rng(0).standard_normal((THROUGHPUT_BATCH, *size), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        runners = {
            k: OrtRunner(export_onnx(m, Path(tmp, f"{i}.onnx"), size), "cpu") for i, (k, m) in enumerate(models.items())
        }

        def step(runner: OrtRunner):
            def run() -> float:
                start = time.perf_counter()
                runner(x)
                return time.perf_counter() - start

            return run

        method = Method(warmup_iters=2, warmup_seconds=0.5, min_iters=5, min_seconds=seconds, round_iters=1)
        times = interleaved({k: step(r) for k, r in runners.items()}, method)
    return {k: summarize(v, THROUGHPUT_BATCH).throughput for k, v in times.items()}


def standard_error(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def run(a: argparse.Namespace) -> None:
    start = time.perf_counter()
    real = real_task(a.dataset, a.train, a.test)
    dense, task, dataset = real.dense, real.task, real.dataset
    n = len(task.labels)
    models, cost = build_models(dense, real.train_dir, a)
    methods = ("uniform", *a.methods)
    named = {"dense": dense} | {f"{m} {s:.1f}": models[(m, s)] for s in a.sparsities for m in methods}
    speed = throughputs(named, input_size(dense), a.seconds)
    dense_macs = model_size(dense)["macs"]
    dense_row = {"macs": dense_macs, "throughput": speed["dense"], **task.score()}
    dense_row["top1_se"] = standard_error(dense_row["top1"], n)
    rows: list[dict[str, Any]] = []
    for s in a.sparsities:
        for m in methods:
            model = models[(m, s)]
            row = {
                "method": m,
                "uniform_sparsity": s,
                "macs": model_size(model)["macs"],
                **task.score(TorchRunner(model)),
            }
            row |= {"top1_se": standard_error(row["top1"], n), "throughput": speed[f"{m} {s:.1f}"]}
            row["widths"] = [(b.mlp.fc1.out_features, *head_widths(b.attn)) for b in model.blocks]  # MLP, Q/K, V
            rows.append(row)
            print(
                f"{s:.1f} {m:22s} MACs {row['macs'] / dense_macs:.3f} top-1 {row['top1']:.1%} +- {row['top1_se']:.1%}"
            )
    load = os.getloadavg()[0]
    title = (
        f"Budgeted allocation ({', '.join(methods)}), DINOv2 ViT-S/14 (real weights), {dataset} probe "
        f"({n} test images); 2-core CPU, load {load:.1f}"
    )
    record = vars(a) | cost | {"dataset": dataset, "test_images": n}
    write_study(Path(a.out), title, dense_row, rows, format_table(rows, dense_row), record, start)


def format_table(rows: list[dict[str, Any]], dense: dict[str, Any]) -> str:
    """One row per model, dense first; MACs as a fraction of dense, top-1 with its standard error."""
    header = [
        "uniform-sparsity MACs",
        "method",
        "MACs / dense",
        "probe top-1 (± s.e.)",
        "agreement",
        "gap to dense closed",
        "feature rel. error",
        "cosine",
        "ORT CPU img/s (b16)",
    ]
    top1 = f"{dense['top1']:.1%} ± {dense['top1_se']:.1%}"
    body = [["-", "dense", "1.000", top1, "100%", "-", "0", "1", f"{dense['throughput']:.1f}"]]
    for r in rows:
        body.append(
            [
                f"{r['uniform_sparsity']:.1f}",
                r["method"],
                f"{r['macs'] / dense['macs']:.3f}",
                f"{r['top1']:.1%} ± {r['top1_se']:.1%}",
                f"{r['top1_agreement']:.1%}",
                _closed(r, rows, dense),
                f"{r['rel_error']:.4f}",
                f"{r['cosine_mean']:.4f}",
                f"{r['throughput']:.1f}",
            ]
        )
    return markdown_table(header, body)


def _closed(row: dict, rows: list[dict], dense: dict) -> str:
    """Share of the uniform model's top-1 gap to dense that ``row`` closes at the same MACs."""
    uniform = next(r for r in rows if r["uniform_sparsity"] == row["uniform_sparsity"] and r["method"] == "uniform")
    gap = dense["top1"] - uniform["top1"]
    return "-" if row is uniform or gap <= 0 else f"{(row['top1'] - uniform['top1']) / gap:.0%}"


def plot(out: Path, records: list[Path]) -> None:
    """Top-1 (± s.e.) against MACs and against measured ORT CPU throughput, one row per probe dataset."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    loaded = [json.loads(p.read_text()) for p in records]
    fig, axes = plt.subplots(len(loaded), 2, figsize=(11, 4 * len(loaded)), squeeze=False)
    for (ax_macs, ax_speed), rec in zip(axes, loaded, strict=True):
        dense = rec["dense"]
        for method, marker in zip(METHODS, "o^sD", strict=True):
            rs = [r for r in rec["rows"] if r["method"] == method]
            if not rs:
                continue
            for ax, key, scale in ((ax_macs, "macs", dense["macs"]), (ax_speed, "throughput", 1.0)):
                ax.errorbar(
                    [r[key] / scale for r in rs],
                    [r["top1"] for r in rs],
                    [r["top1_se"] for r in rs],
                    marker=marker,
                    capsize=3,
                    label=method,
                )
        for ax, x in ((ax_macs, 1.0), (ax_speed, dense["throughput"])):
            ax.errorbar([x], [dense["top1"]], [dense["top1_se"]], marker="*", color="k", ms=10, label="dense")
            ax.set_ylabel(f"probe top-1, {rec['args']['dataset']}")
            ax.grid(alpha=0.3)
        ax_macs.set_xlabel("MACs / dense")
        ax_speed.set_xlabel(f"onnxruntime CPU images/s, batch {THROUGHPUT_BATCH} (same run)")
        ax_macs.legend()
    fig.suptitle("DINOv2 ViT-S/14, joint MLP + Q/K CORP at equal MACs: uniform vs budget-allocated widths")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in ALLOCATED]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ALLOCATED)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setup_arguments(p)
    p.set_defaults(train=300, test=400, num_calib=128)
    p.add_argument("--heldout", type=int, default=32, help="sensitivity-pass images (drawn across the sample)")
    p.add_argument("--sparsities", default="0.5,0.6,0.7", type=lambda v: [float(x) for x in v.split(",")])
    p.add_argument(
        "--methods",
        default="allocated,allocated+sequential",
        type=_methods,
        help=f"compared with uniform CORP at its MACs, a comma list of {', '.join(ALLOCATED)}",
    )
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per model for the throughput")
    p.add_argument("--out", default="studies/results/budget-study")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"), help="plot PNG from study JSON records, then stop")
    a = p.parse_args(argv)
    if a.plot:
        plot(Path(a.plot[0]), [Path(x) for x in a.plot[1:]])
    else:
        run(a)


if __name__ == "__main__":
    main()
