"""The pruning sections: CUDA tests, pruning time, dense-vs-pruned latency and where the time goes."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.tables import markdown_table
from corp_deploy.formats.data import input_size
from tools.gpu_suite.core import (
    DTYPES,
    PRUNED,
    Context,
    create,
    measure,
    on_device,
    precision_mode,
    prune,
    pruned_model,
    sync,
    warm_device,
)

REPO = Path(__file__).resolve().parents[2]


def run_tests(ctx: Context) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess; counts, and every failure and skip reason from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += list(ctx.plan.pytest_args)
        ctx.log("$ " + " ".join(cmd))
        # the package and the tests come from REPO, carried wheels from the PYTHONPATH that ``wheels.activate`` set
        # for this process and its children
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(ctx.time_left(), 60))
        ctx.log(proc.stdout + proc.stderr)
        cases = _junit_cases(junit) if junit.is_file() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    record = {"command": "pytest " + " ".join(ctx.plan.pytest_args), "exit_code": proc.returncode, **counts}
    record["cases"] = cases
    if proc.returncode not in (0, 5):  # 5: nothing collected
        record["error"] = f"pytest exited {proc.returncode}: {counts['failed']} failed"
    return record


def _junit_cases(path: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = ((node.get("message") or node.text or "").strip().splitlines() or [""])[0][:300]
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    return cases


def tests_markdown(t: dict[str, Any]) -> list[str]:
    lines = [f"**`{t['command']}`**: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped."]
    return lines + [f"- {c['outcome']}: `{c['test']}`: {c['message']}" for c in t["cases"] if c["outcome"] != "passed"]


def run_prune(ctx: Context) -> dict[str, Any]:
    """CORP on noise images, 50% joint sparsity: time split, images/s and peak memory per model."""
    warm_device(ctx)
    rows = []
    for name in ctx.plan.models:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        start = time.perf_counter()
        model, report = prune(ctx, name, ctx.plan.prune_images)
        wall = time.perf_counter() - start
        ctx.pruned[name] = model.cpu()
        t, mem, images = report["seconds"], report["memory"], report["calibration"]["images"]
        rows.append(
            {
                "model": name,
                "images": images,
                "calib_batch": ctx.plan.calib_batch,
                "seconds": t,
                "total_seconds": sum(t.values()),
                "wall_seconds": wall,
                "images_per_second": images / t["calibration"],
                "statistics_mib": mem["statistics_mib"],
                "cuda_peak_mib": mem.get("cuda_peak_mib"),
                "host_rss_mib": mem["host_rss_mib"],
                "params": [report["dense"]["params"], report["pruned"]["params"]],
                "macs": [report["dense"]["macs"], report["pruned"]["macs"]],
                "device": report["device"],
            }
        )
        ctx.log(f"prune {name}: {images} images, {rows[-1]['total_seconds']:.1f} s ({t}), {mem}")
    return {"sparsity": 0.5, "calibration": "standard-normal noise images made on the host", "rows": rows}


def prune_markdown(p: dict[str, Any]) -> list[str]:
    head = ["model", "images", "batch", "total s", "calibration s", "img/s", "ranking s", "compensation s"]
    head += ["statistics MiB", "peak CUDA MiB"]
    rows = [
        [r["model"], r["images"], r["calib_batch"], f"{r['total_seconds']:.1f}", f"{r['seconds']['calibration']:.1f}"]
        + [f"{r['images_per_second']:.0f}", f"{r['seconds']['ranking']:.2f}", f"{r['seconds']['compensation']:.2f}"]
        + [f"{r['statistics_mib']:.0f}", "-" if r["cuda_peak_mib"] is None else f"{r['cuda_peak_mib']:.0f}"]
        for r in p["rows"]
    ]
    return [f"**Pruning time** (50% MLP + Q/K; {p['calibration']}):", "", markdown_table(head, rows)]


def _pair(ctx: Context, models: dict[str, nn.Module], precision: str, batch: int, graphed: bool) -> dict[str, Any]:
    x = torch.randn(batch, *input_size(models["dense"]), device=ctx.device, dtype=DTYPES[precision])
    from corp_deploy.bench.backends import torch_forward

    stats = measure(ctx, {k: torch_forward(m, x, graphed) for k, m in models.items()}, batch)
    d, p, v = stats["dense"], stats["pruned"], stats["pruned_v"]
    return {
        "batch": batch,
        "precision": precision,
        "dense": d,
        "pruned": p,
        "p50_ratio": p["p50_ms"] / d["p50_ms"],
        "throughput_ratio": p["throughput"] / d["throughput"],
        "pruned_v": v,
        "v_p50_ratio": v["p50_ms"] / d["p50_ms"],
        "v_throughput_ratio": v["throughput"] / d["throughput"],
    }


def run_latency(ctx: Context) -> dict[str, Any]:
    """Dense vs pruned in the same loop: eager, CUDA graph and compiled, every precision and batch size."""
    warm_device(ctx)
    rows, skipped = [], []
    graphs = (False, True) if ctx.device.type == "cuda" else (False,)
    for name, args in ctx.plan.models.items():
        plain = {"dense": create(name, args)} | {v: pruned_model(ctx, name, v) for v in PRUNED}
        for precision in ctx.plan.precisions:
            pair = on_device(ctx, plain, precision)
            modes = [("eager", pair, ctx.plan.batches)]
            if precision in ctx.plan.compile_precisions:
                from corp_deploy.bench.backends import compile_model

                compiled = {k: compile_model(m, ctx.plan.compile_backend) for k, m in pair.items()}
                modes.append(("compile", compiled, ctx.plan.compile_batches))
            for (mode, models, batches), graphed in [(m, g) for m in modes for g in graphs]:
                mode = f"{mode}+graph" if graphed else mode
                for batch in batches:
                    key = f"{name} {mode} {precision} batch {batch}"
                    if ctx.time_left() < 0:
                        skipped.append({"what": key, "why": "time budget spent"})
                        continue
                    try:
                        with precision_mode(precision):
                            start = time.perf_counter()
                            row = _pair(ctx, models, precision, batch, graphed)
                    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # one shape failing is a finding
                        skipped.append({"what": key, "why": str(e).strip().splitlines()[0][:300]})
                        ctx.log(f"latency {key}: FAILED {skipped[-1]['why']}")
                        continue
                    rows.append(row | {"model": name, "mode": mode, "seconds": time.perf_counter() - start})
                    ctx.log(
                        f"latency {key}: p50 {row['dense']['p50_ms']:.3f} -> {row['pruned']['p50_ms']:.3f} ms "
                        f"(+V {row['pruned_v']['p50_ms']:.3f}), {row['dense']['throughput']:.0f} -> "
                        f"{row['pruned']['throughput']:.0f} img/s (+V {row['pruned_v']['throughput']:.0f})"
                    )
            del pair, modes
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "pruned": "pruned: MLP hidden channels and attention Q/K dims at 50% (V and proj dense); "
        "+V: MLP, Q/K and V channels at 50% (equal Q/K and V head widths)",
        "modes": "eager; +graph: the same forward captured once in a CUDA graph and replayed; compile: "
        f"torch.compile(backend={ctx.plan.compile_backend!r}, dynamic=False)",
        "timing": "CUDA events per iteration" if ctx.device.type == "cuda" else "perf_counter per iteration",
        "rows": rows,
        "skipped": skipped,
    }


def _v_cells(row: dict[str, Any]) -> list[str]:
    """The MLP+Q/K+V columns; '-' for records made before the suite timed that variant."""
    if "pruned_v" not in row:
        return ["-"] * 3
    v = row["pruned_v"]
    return [f"{v['p50_ms']:.3f}", f"{v['throughput']:.0f}", f"{row['v_throughput_ratio']:.2f}x"]


def latency_markdown(lat: dict[str, Any]) -> list[str]:
    head = ["model", "mode", "precision", "batch", "dense p50 ms", "pruned p50 ms", "p50 ratio"]
    head += ["dense img/s", "pruned img/s", "throughput", "+V p50 ms", "+V img/s", "+V throughput"]
    rows = [
        [
            r["model"],
            r["mode"],
            r["precision"],
            r["batch"],
            f"{r['dense']['p50_ms']:.3f}",
            f"{r['pruned']['p50_ms']:.3f}",
        ]
        + [f"{r['p50_ratio']:.2f}", f"{r['dense']['throughput']:.0f}", f"{r['pruned']['throughput']:.0f}"]
        + [f"{r['throughput_ratio']:.2f}x"]
        + _v_cells(r)
        for r in lat["rows"]
    ]
    title = f"**Latency, dense vs pruned in the same run** ({lat['pruned']}; {lat['modes']}; {lat['timing']}):"
    lines = [title, "", markdown_table(head, rows)]
    return lines + [f"- not measured: {s['what']}: {s['why']}" for s in lat["skipped"]]


KINDS = (  # first match wins; CUDA kernel names on a GPU, aten op names on a CPU
    ("attention", re.compile(r"sdpa|attention|fmha|flash|softmax")),
    ("patch_conv", re.compile(r"conv|fprop|nchwtonhwc|nhwctonchw")),  # cuDNN convolutions and their layout copies
    ("gemm", re.compile(r"gemm|addmm|aten::mm|bmm|matmul|nvjet|xmma|cutlass")),
    ("layer_norm", re.compile(r"layer_?norm")),
    ("gelu", re.compile(r"gelu")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if pattern.search(low)), "other")


def by_kind(kernels: dict[str, float]) -> dict[str, float]:
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def run_profile(ctx: Context) -> dict[str, Any]:
    """Kernel time of dense and pruned by kind: what pruning shrinks, and what it leaves as it was."""
    from torch.profiler import ProfilerActivity, profile

    name, precision, batch = ctx.plan.profile
    cuda = ctx.device.type == "cuda"
    plain = {"dense": create(name, ctx.plan.models[name])} | {v: pruned_model(ctx, name, v) for v in PRUNED}
    out: dict[str, Any] = {"model": name, "precision": precision, "batch": batch, "iterations": 5, "models": {}}
    for which, model in on_device(ctx, plain, precision).items():
        x = torch.randn(batch, *input_size(model), device=ctx.device, dtype=DTYPES[precision])
        from corp_deploy.bench.backends import torch_forward

        run = torch_forward(model, x)
        with precision_mode(precision):
            for _ in range(3):
                run()
            sync(ctx.device)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    run()
                sync(ctx.device)
        kernels: dict[str, float] = {}  # ms per forward
        for e in prof.key_averages():
            us = e.self_device_time_total if cuda else e.self_cpu_time_total
            if us > 0 and (e.device_type.name == "CUDA" if cuda else e.key.startswith("aten::")):
                kernels[e.key] = kernels.get(e.key, 0.0) + us / 5e3
        out["models"][which] = {
            "kinds": by_kind(kernels),
            "top": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:16]),
        }
        ctx.log(f"profile {name} {precision} batch {batch} {which}: {out['models'][which]['kinds']} (ms per forward)")
    return out


def profile_markdown(p: dict[str, Any]) -> list[str]:
    models = {which: m["kinds"] for which, m in p["models"].items()}  # dense, pruned (and pruned_v where timed)
    kinds = list(dict.fromkeys(k for m in models.values() for k in m))
    rows = [[k, *(f"{m.get(k, 0):.3f}" for m in models.values())] for k in kinds]
    rows.append(["total", *(f"{sum(m.values()):.3f}" for m in models.values())])
    title = f"**Where the time goes** ({p['model']}, {p['precision']}, batch {p['batch']}, eager; ms per forward):"
    return [title, "", markdown_table(["kernel kind", *(f"{w} ms" for w in models)], rows)]
