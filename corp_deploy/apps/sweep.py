"""Sparsity sweep: calibrate once, prune at every sparsity, export, bench; the paper's Table-10 rows.

CORP's statistics do not depend on the sparsity, so one calibration pass serves all of them. Each
sparsity gets a run folder (``s0.50/``: pruned artifact, dense and pruned ONNX, ``bench.json``)
benched dense-vs-pruned in its own interleaved run, so every speedup has its own same-run baseline.

A sweep of speed targets (``Speedups``, ``corp-deploy sweep --speedups 1.5,2,2.5``) gets ``x2.00/`` folders
instead: one latency table, one calibration, each target's widths allocated from the same statistics and,
with the closed loop, timed against the dense model on the latency backend and corrected while they miss.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir, atomic_file, check_writable
from corp_deploy.base.steps import Steps, check_resume
from corp_deploy.base.tables import text_table
from corp_deploy.base.timing import Method
from corp_deploy.bench.backends import RunFolder, select_backends
from corp_deploy.bench.run import benchmark, pairs
from corp_deploy.core.config import Budget, PruneConfig
from corp_deploy.core.recover import Kept, Recovery
from corp_deploy.exporters.pipeline import export_verified
from corp_deploy.families import adapter_for
from corp_deploy.formats.artifact import read_meta
from corp_deploy.formats.calibration import Heldout
from corp_deploy.formats.run_folder import ARTIFACT, onnx_name
from corp_deploy.plan.latency import LatencyTable
from corp_deploy.plan.loop import LatencyLoop
from corp_deploy.plan.report import model_size, verdict

if TYPE_CHECKING:
    from corp_deploy.apps.floor import Accuracy

ACCURACY_FILE = "accuracy.json"
"""A sweep point's held-out figures (``floor.Accuracy.score``), written before ``bench.json``."""

DEFAULT_SPARSITIES = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7"


def parse_sparsities(text: str) -> list[float]:
    try:
        values = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        values = []
    if not values or not all(0 <= s < 1 for s in values):
        raise CorpError(f"--sparsities takes a comma-separated list in [0, 1) (e.g. 0,0.3,0.5), got {text!r}")
    return values


def parse_speedups(text: str) -> list[float]:
    try:
        values = sorted({float(s) for s in text.split(",") if s.strip()})
    except ValueError:
        values = []
    if not values or not all(s >= 1 for s in values):
        raise CorpError(f"--speedups takes a comma-separated list of speedups >= 1 (e.g. 1.5,2,2.5), got {text!r}")
    return values


@dataclass(frozen=True)
class Speedups:
    """A sweep over speed targets instead of sparsities: each is a latency budget (``latency=1/S``) allocated
    against the one ``table`` from the one calibration's statistics; ``loop`` (the closed loop) times each model
    against the dense one and corrects it, else the speedup is predicted only."""

    targets: Sequence[float]
    table: LatencyTable
    heldout: Heldout | None = None
    loop: LatencyLoop | None = None


def _configs(
    model: nn.Module, config: PruneConfig, sparsities: Sequence[float], speedups: Speedups | None
) -> dict[str, tuple[dict[str, float], PruneConfig]]:
    """Folder name -> (what the row is for, its config); every one checked (``api.check``) before the calibration
    pass: a sparsity that empties a part, a speedup no widths reach, in one line."""
    if speedups is None:
        out = {
            f"s{s:.2f}": (
                {"sparsity": s},
                replace(config, sparsity=s, mlp_sparsity=None, qk_sparsity=None, v_sparsity=None),
            )
            for s in sparsities
        }
    else:
        out = {
            f"x{t:.2f}": ({"speedup": t}, replace(config, budget=Budget("latency", 1 / t))) for t in speedups.targets
        }
    table, loop = (None, None) if speedups is None else (speedups.table, speedups.loop)
    macs = model_size(model)["macs"]
    for _, c in out.values():
        api.check(model, c, macs, table=table, loop=loop)
    return out


def _pruned(
    calib: api.Calibrated,
    configs: dict[str, tuple[dict[str, float], PruneConfig]],
    speedups: Speedups | None,
    recovery: Recovery | None = None,
    kept: Kept | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, dict[str, float], api.PruneResult]]:
    """(folder, label, result with its model on the CPU) per config, from the one calibration: speed targets share
    one planner and, with the closed loop, are each timed against the dense model (``api.Calibrated``); with
    ``recovery``, each then trained towards the dense model on the calibration inputs ``kept`` from the pass."""
    table, loop = (None, None) if speedups is None else (speedups.table, speedups.loop)
    for name, (label, c) in configs.items():
        result = calib.prune(c, table, loop)
        if recovery is not None:
            api.recover_pruned(result, calib.dense, kept.batches, recovery, calib.heldout, say)
        result.model = result.model.to("cpu")
        yield name, label, result


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
    speedups: Speedups | None = None,
    rewrites: Sequence[str] = (),
    resume: str | None = None,
    accuracy: Accuracy | None = None,
    recovery: Recovery | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``out/s<sparsity>/`` per sparsity (or ``out/x<speedup>/`` per speed target, ``speedups``) and
    ``out/sweep.json``; return the sweep record. ``rewrites`` go into every exported graph (``exporters.rewrites``).

    An existing ``out`` is refused unless ``overwrite`` (the files of the same names are replaced) or ``resume``
    (the command that continues it, said when a point stops): then its finished points (``bench.json`` written,
    last) are kept and read back, the others made again. A point that stops leaves the finished ones whole.
    ``accuracy`` (``floor.Accuracy``) adds each row's held-out drop and INT8 graphs, for the frontier; a resumed
    point keeps the figures it wrote (``accuracy.json``, before ``bench.json``). ``recovery`` trains every pruned
    model after CORP (``api.recover_pruned``, on the first calibration inputs, kept as the one pass reads them), so
    each point's graphs and figures are the recovered model's; plain removal's figures stay unrecovered.
    ``options`` (the command's result-changing options, ``cli.options.result_options``) go into every point's
    ``bench.json`` and ``sweep.json``; a resume whose options differ from a finished point's is refused in one line.
    """
    if resume is None or not out.is_dir():
        check_writable(out, overwrite)
    config = api.for_model(config, model)
    configs = _configs(model, config, sparsities, speedups)  # every row must be possible before calibrating
    finished = {name for name in configs if resume is not None and (out / name / "bench.json").is_file()}
    for name in sorted(finished) if options is not None else ():
        check_resume(out / name, json.loads((out / name / "bench.json").read_text()).get("options"), options)
    steps = Steps(out, lambda: resume or "run the same command again with --resume", progress)
    if finished:
        progress(f"resuming {out}: {', '.join(sorted(finished))} finished, kept")
    heldout = None if speedups is None else speedups.heldout
    dense_size = model_size(model)
    rows = {
        name: _row(label, out / name, dense_size, speedups, accuracy is not None)
        for name, (label, _) in configs.items()
        if name in finished
    }
    todo = {name: value for name, value in configs.items() if name not in finished}
    if todo:
        kept = None if recovery is None else Kept(batches, adapter_for(model).count)
        calib = api.calibrated(
            model, kept or batches, config, device, total, progress=total is not None, heldout=heldout
        )
        model = model.to("cpu")
        out.mkdir(parents=True, exist_ok=True)
        dense_onnx = out / onnx_name("dense")
        with steps("dense ONNX"), atomic_file(dense_onnx, overwrite=True) as tmp:  # never a graph of an earlier run
            export_verified(model, tmp, description, rewrites=rewrites)
    if accuracy is not None:
        with steps("dense held-out reference"):
            accuracy.start(out / onnx_name("dense"))
    if todo:
        points = _pruned(calib, todo, speedups, recovery, kept, progress)
        for name, (label, cfg) in todo.items():
            with steps(f"sweep point {name}"):
                _, _, result = next(points)
                score = None if accuracy is None else partial(accuracy.score, calib=calib, config=cfg, result=result)
                _point(
                    result,
                    out / name,
                    dense_onnx,
                    description,
                    rewrites,
                    backends,
                    batch_sizes,
                    method,
                    progress,
                    accuracy,
                    score,
                    options,
                )
            rows[name] = _row(label, out / name, dense_size, speedups, accuracy is not None)
    result = {
        "model": description["model"],
        "dense": dense_size,
        "rows": [rows[name] for name in configs],
        "method": (method or Method()).as_dict(),
        "rewrites": list(rewrites),
        **({"accuracy": accuracy.record()} if accuracy is not None else {}),
        **({"recovery": asdict(recovery)} if recovery is not None else {}),
        **({"options": options} if options is not None else {}),
    }
    with atomic_file(out / "sweep.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _point(
    result: api.PruneResult,
    folder: Path,
    dense_onnx: Path,
    description: dict[str, Any],
    rewrites: Sequence[str],
    backends: str,
    batch_sizes: Sequence[int],
    method: Method | None,
    progress: Callable[[str], None],
    accuracy: Accuracy | None = None,
    score: Callable[[Path], dict[str, Any]] | None = None,
    options: dict[str, Any] | None = None,
) -> None:
    """One point's run folder: pruned artifact and graphs (staged as one; with ``accuracy`` its INT8 graph too), then
    its held-out figures (``score``: ``accuracy.json``), then its bench, ``bench.json`` last (the finished mark)."""
    with atomic_dir(folder, overwrite=True) as tmp:
        api.save(
            result, tmp / ARTIFACT, description["model"], description["model_args"], weights=description["weights"]
        )
        export_verified(
            result.model, tmp / onnx_name("pruned"), {**description, "weights": "corp-pruned"}, rewrites=rewrites
        )
        if accuracy is not None:
            accuracy.quantize(tmp / onnx_name("pruned"))
        for f in dense_onnx.parent.glob(f"{dense_onnx.name}*"):  # the graph, its sidecar and external weights
            shutil.copyfile(f, tmp / f.name)  # not linked: onnx refuses external data with several hard links
    if score is not None:
        with atomic_file(folder / ACCURACY_FILE, overwrite=True) as tmp:
            tmp.write_text(json.dumps(score(folder), indent=2) + "\n")
    run = RunFolder.open(folder)
    chosen, skipped = select_backends(backends, run)
    size = result.report["pruned"]
    progress(f"{folder.name}: params {size['params'] / 1e6:.2f}M, MACs {size['macs'] / 1e9:.3f}G")
    record = benchmark(run, chosen, batch_sizes, method, skipped=skipped, progress=progress)
    record |= {"options": options} if options is not None else {}
    with atomic_file(folder / "bench.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


def _row(
    label: dict[str, float], folder: Path, dense_size: dict[str, Any], speedups: Speedups | None, scored: bool
) -> dict:
    """A finished point's row of the sweep table, read back from its folder (prune report, ``bench.json`` and, when
    ``scored``, ``accuracy.json``)."""
    report = read_meta(folder / ARTIFACT)["report"]
    size = report["pruned"]
    if scored and not (folder / ACCURACY_FILE).is_file():
        raise CorpError(
            f"{folder} was swept without held-out figures (--frontier/--max-drop); resume it with the flags it was "
            "started with, or start again with --overwrite"
        )
    return {
        **label,
        "params": size["params"],
        "macs": size["macs"],
        "flop_ideal_speedup": dense_size["macs"] / size["macs"],
        "bench": pairs(json.loads((folder / "bench.json").read_text())),
        **({"latency": _latency_row(report)} if speedups is not None else {}),
        **(
            {"recovery": {k: v for k, v in report["recovery"].items() if k != "history"}}
            if "recovery" in report
            else {}
        ),
        **({"accuracy": json.loads((folder / ACCURACY_FILE).read_text())} if scored else {}),
    }


def _latency_row(report: dict[str, Any]) -> dict[str, Any]:
    """A speed target's row: predicted speedup, and (closed loop) the measured one with its band and verdict."""
    planned = report["allocation"]["latency"]
    row = {"backend": planned["backend"], "batch": planned["batch"], "predicted_speedup": planned["predicted_speedup"]}
    if check := report.get("latency"):
        row |= {
            k: check[k] for k in ("predicted_speedup", "measured_speedup", "spread", "rounds", "met", "within_band")
        }
    return row


def _label(row: dict[str, Any]) -> str:
    return f"{row['sparsity']:.2f}" if "sparsity" in row else f"{row['speedup']:.2f}x"


def format_sweep(result: dict[str, Any]) -> str:
    """Table 10 of the paper: one line per sparsity (or speed target) and backend; batch 1 latency, largest-batch
    throughput. A sweep of speed targets adds their predicted and measured speedups on the latency backend."""
    header = (
        "sparsity" if "sparsity" in result["rows"][0] else "target",
        "params",
        "MACs",
        "backend",
        "p50 b1 ms",
        "b1 speedup",
        f"{_unit(result)} (batch)",
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
                    _label(row),
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
    tables = [text_table(lines)]
    if any("latency" in row for row in result["rows"]):
        tables.append(_format_targets(result["rows"]))
    return "\n".join(tables)


def _unit(result: dict[str, Any]) -> str:
    """What the throughput column counts: sentences (a text sweep: its pairs hold ``seq_len``) or images."""
    text = any("seq_len" in p for row in result["rows"] for p in row["bench"])
    return "sent/s" if text else "img/s"


def _format_targets(rows: list[dict[str, Any]]) -> str:
    """Per speed target: predicted and (closed loop) measured speedup on the latency backend, band, verdict."""
    lines = [("target", "latency on (batch)", "predicted", "measured", "band", "rounds", "verdict")]
    for row in rows:
        t = row["latency"]
        measured = "measured_speedup" in t
        lines.append(
            (
                _label(row),
                f"{t['backend']} ({t['batch']})",
                f"{t['predicted_speedup']:.2f}x",
                f"{t['measured_speedup']:.2f}x" if measured else "-",
                f"+-{t['spread']:.1%}" if measured else "-",
                str(t["rounds"]) if measured else "-",
                verdict({**t, "target_speedup": row["speedup"]}) if measured else "predicted only",
            )
        )
    return text_table(lines)


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    """Measured largest-batch throughput ratio vs sparsity, per backend, beside the FLOP-ideal line."""
    from corp_deploy.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x = "sparsity" if "sparsity" in result["rows"][0] else "speedup"
    xs = [r[x] for r in result["rows"]]
    ax.plot(xs, [r["flop_ideal_speedup"] for r in result["rows"]], "k--", label="FLOP ideal (dense MACs / pruned)")
    for backend in sorted({p["backend"] for r in result["rows"] for p in r["bench"]}):
        points = [  # a backend skipped at some sparsity has no point there
            (r[x], max(mine, key=lambda p: p["batch"])["throughput_ratio"])
            for r in result["rows"]
            if (mine := [p for p in r["bench"] if p["backend"] == backend])
        ]
        ax.plot(*zip(*points, strict=True), "o-", label=f"{backend} (largest batch)")
    ax.set_xlabel("sparsity" if x == "sparsity" else "target speedup")
    ax.set_ylabel("pruned / dense throughput")
    ax.set_title(f"{result['model']}: speedup vs {x if x == 'sparsity' else 'target speedup'}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
