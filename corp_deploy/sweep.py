"""Sparsity sweep: calibrate once, prune at every sparsity, export, bench; the paper's Table-10 rows.

CORP's statistics do not depend on the sparsity, so one calibration pass serves all of them. Each
sparsity gets a run folder (``s0.50/``: pruned artifact, dense and pruned ONNX, ``bench.json``)
benched dense-vs-pruned in its own interleaved run, so every speedup has its own same-run baseline.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy import api
from corp_deploy.bench.backends import RunFolder, select
from corp_deploy.bench.measure import Method
from corp_deploy.bench.run import benchmark, pairs
from corp_deploy.errors import CorpError
from corp_deploy.exporters.pipeline import export_verified
from corp_deploy.fsio import atomic_dir, atomic_file, check_writable
from corp_deploy.pruner import PruneConfig, calibrate, plan_widths, prune_model
from corp_deploy.report import model_size
from corp_deploy.tables import text_table


def parse_sparsities(text: str) -> list[float]:
    try:
        values = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        values = []
    if not values or not all(0 <= s < 1 for s in values):
        raise CorpError(f"--sparsities takes a comma-separated list in [0, 1) (e.g. 0,0.3,0.5), got {text!r}")
    return values


def sweep(
    model: nn.Module,
    description: dict[str, Any],
    batches: Iterable[tuple[Tensor, int]],
    sparsities: Sequence[float],
    config: PruneConfig,
    out: Path,
    backends: str = "auto",
    batch_sizes: Sequence[int] = (1, 32),
    method: Method | None = None,
    device: torch.device | str = "cpu",
    total: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``out/s<sparsity>/`` per sparsity and ``out/sweep.json``; return the sweep record.

    An existing ``out`` is refused unless ``overwrite``; then the files of the same names are replaced.
    """
    check_writable(out, overwrite)
    configs = [replace(config, sparsity=s, mlp_sparsity=None, qk_sparsity=None, v_sparsity=None) for s in sparsities]
    for c in configs:
        plan_widths(model, c)  # every sparsity must be possible before the calibration pass
    dense_size = model_size(model)
    stats = calibrate(model.to(device).eval(), batches, config, device, total=total, progress=total is not None)
    model = model.to("cpu")
    out.mkdir(parents=True, exist_ok=True)
    dense_onnx = out / "dense.onnx"
    with atomic_file(dense_onnx, overwrite=True) as tmp:  # never reuse a dense graph from an earlier sweep
        export_verified(model, tmp, description)
    rows = []
    for s, c in zip(sparsities, configs, strict=True):
        pruned = copy.deepcopy(model).to(device)
        blocks = prune_model(pruned, stats, c)
        pruned = pruned.to("cpu")
        size = model_size(pruned)
        folder = out / f"s{s:.2f}"
        with atomic_dir(folder, overwrite=True) as tmp:
            report = {"config": c.to_dict(), "dense": dense_size, "pruned": size, "blocks": blocks}
            api.save(
                api.PruneResult(pruned, report),
                tmp / "pruned",
                description["model"],
                description["model_args"],
                weights=description["weights"],
            )
            export_verified(pruned, tmp / "pruned.onnx", {**description, "weights": "corp-pruned"})
            for f in out.glob(f"{dense_onnx.name}*"):  # the graph, its sidecar and external weights, if any
                shutil.copyfile(f, tmp / f.name)  # not linked: onnx refuses external data with several hard links
        run = RunFolder.open(folder)
        chosen, skipped = select(backends, run)
        progress(f"sparsity {s:.2f}: params {size['params'] / 1e6:.2f}M, MACs {size['macs'] / 1e9:.3f}G")
        record = benchmark(run, chosen, batch_sizes, method, skipped=skipped, progress=progress)
        (folder / "bench.json").write_text(json.dumps(record, indent=2) + "\n")
        rows.append(
            {
                "sparsity": s,
                "params": size["params"],
                "macs": size["macs"],
                "flop_ideal_speedup": dense_size["macs"] / size["macs"],
                "bench": pairs(record),
            }
        )
    result = {
        "model": description["model"],
        "dense": dense_size,
        "rows": rows,
        "method": (method or Method()).as_dict(),
    }
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_sweep(result: dict[str, Any]) -> str:
    """Table 10 of the paper: one line per sparsity and backend; batch 1 latency, largest-batch throughput."""
    header = (
        "sparsity",
        "params",
        "MACs",
        "backend",
        "p50 b1 ms",
        "b1 speedup",
        "img/s (batch)",
        "speedup",
        "FLOP ideal",
    )
    lines = [header]
    for row in result["rows"]:
        for backend in sorted({p["backend"] for p in row["bench"]}):
            mine = sorted((p for p in row["bench"] if p["backend"] == backend), key=lambda p: p["batch"])
            small, large = mine[0], mine[-1]
            lines.append(
                (
                    f"{row['sparsity']:.2f}",
                    f"{row['params'] / 1e6:.2f}M",
                    f"{row['macs'] / 1e9:.3f}G",
                    backend,
                    f"{small['pruned_p50_ms']:.2f}",
                    f"{small['p50_speedup']:.2f}x",
                    f"{large['pruned_throughput']:.1f} ({large['batch']})",
                    f"{large['throughput_ratio']:.2f}x",
                    f"{row['flop_ideal_speedup']:.2f}x",
                )
            )
    return text_table(lines)


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    """Measured largest-batch throughput ratio vs sparsity, per backend, beside the FLOP-ideal line."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs = [r["sparsity"] for r in result["rows"]]
    ax.plot(xs, [r["flop_ideal_speedup"] for r in result["rows"]], "k--", label="FLOP ideal (dense MACs / pruned)")
    for backend in sorted({p["backend"] for r in result["rows"] for p in r["bench"]}):
        points = [  # a backend skipped at some sparsity has no point there
            (r["sparsity"], max(mine, key=lambda p: p["batch"])["throughput_ratio"])
            for r in result["rows"]
            if (mine := [p for p in r["bench"] if p["backend"] == backend])
        ]
        ax.plot(*zip(*points, strict=True), "o-", label=f"{backend} (largest batch)")
    ax.set_xlabel("sparsity")
    ax.set_ylabel("pruned / dense throughput")
    ax.set_title(f"{result['model']}: speedup vs sparsity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
