"""Where a decode step's time goes: onnxruntime's own profiler over the decode steps of genai folders' graphs.

    python -m studies.decode_profile runs/smollm2-mlp30/dense-genai runs/smollm2-mlp30-int4/pruned-genai-int4 \
        --out studies/results/decode-profile

Each folder's ``model.onnx`` (a key/value-cache graph, ``exporters.kv_cache``) runs one decode step at a time at
batch 1 after ``--past`` cached tokens (random cache values: a step's work does not depend on them) in a plain
onnxruntime CPU session with the graph optimizations onnxruntime-genai uses (all), first unprofiled (the step's
wall p50) and then profiled: the kernel time of every node, summed by operator type, and the nodes a step runs
after onnxruntime's own fusions. The question it answers: how much of a step is the weight GEMMs an INT4 format
makes cheaper, and how much is the hundreds of small nodes around them, which no weight format touches.
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
import onnx
import onnxruntime as ort

from corp_deploy.base.tables import markdown_table

WEIGHT_OPS = ("MatMulNBits",)
"""Operators that only ever read a weight (an FP32 graph's weight GEMMs are plain MatMuls, counted with attention's)."""


def session(path: Path, threads: int, profile_dir: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(profile_dir) / "step")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def decode_feed(model: onnx.ModelProto, past: int) -> dict[str, np.ndarray]:
    """One new token after ``past`` cached ones, at batch 1; every cache input at its own layer's heads and width."""
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {
        "input_ids": np.array([[42]], np.int64),
        "attention_mask": np.ones((1, past + 1), np.int64),
        "position_ids": np.array([[past]], np.int64),
    }
    names = {i.name for i in model.graph.input}
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            _, heads, _, width = (d.dim_value for d in i.type.tensor_type.shape.dim)
            feed[i.name] = rng.standard_normal((1, heads, past, width), dtype=np.float32)
    return {k: v for k, v in feed.items() if k in names}


def profile(folder: Path, past: int, steps: int, threads: int) -> dict[str, Any]:
    path = folder / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    feed = decode_feed(model, past)
    plain = session(path, threads)
    for _ in range(5):
        plain.run(None, feed)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        plain.run(None, feed)
        walls.append(time.perf_counter() - t)
    del plain
    with tempfile.TemporaryDirectory() as tmp:
        profiled = session(path, threads, tmp)
        for _ in range(steps):
            profiled.run(None, feed)
        events = json.loads(Path(profiled.end_profiling()).read_text())
    kernel_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            kernel_us[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    total = sum(kernel_us.values())
    ops = {
        op: {"ms": us / steps / 1e3, "share": us / total, "nodes": count[op] // steps}
        for op, us in sorted(kernel_us.items(), key=lambda kv: -kv[1])
    }
    return {
        "folder": str(folder),
        "nodes_in_file": len(model.graph.node),
        "nodes_per_step": sum(count.values()) // steps,
        "wall_p50_ms": 1e3 * float(np.median(walls)),
        "profiled_p50_ms": float(np.median(runs[-steps:])) / 1e3,
        "kernels_ms": total / steps / 1e3,
        "weight_share": sum(ops[o]["share"] for o in WEIGHT_OPS if o in ops),
        "ops": ops,
    }


def report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, top: int) -> str:
    head = ["graph", "nodes (file / run)", "step p50 ms", "kernels ms (profiled)", "MatMulNBits", "largest other ops"]
    body = []
    for r in rows:
        others = [f"{op} {100 * v['share']:.0f}% x{v['nodes']}" for op, v in r["ops"].items() if op not in WEIGHT_OPS]
        body.append(
            [
                f"{Path(r['folder']).parent.name}/{Path(r['folder']).name}",
                f"{r['nodes_in_file']} / {r['nodes_per_step']}",
                f"{r['wall_p50_ms']:.1f}",
                f"{r['kernels_ms']:.1f} of {r['profiled_p50_ms']:.1f}",
                f"{100 * r['weight_share']:.0f}%",
                ", ".join(others[:top]),
            ]
        )
    title = (
        f"Decode step at batch 1 after {meta['past']} tokens, onnxruntime {ort.__version__} CPU, {meta['threads']} "
        f"threads, {meta['steps']} steps; {meta['cpu']}; load {meta['load'][0]:.1f} -> {meta['load'][1]:.1f}"
    )
    text = f"{title}\n\n{markdown_table(head, body)}\n"
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"title": title, **meta, "rows": rows}, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="genai folders (each with a key/value-cache model.onnx)")
    p.add_argument("--past", type=int, default=128, help="cached tokens before the step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=5, help="other operators named per row")
    p.add_argument("--out", type=Path, default=Path("studies/results/decode-profile"))
    a = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = [profile(f, a.past, a.steps, a.threads) for f in a.folders]
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "cpu")
    meta = {"past": a.past, "steps": a.steps, "threads": a.threads, "cpu": cpu, "load": [load, os.getloadavg()[0]]}
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(report(rows, meta, a.out, a.top))


if __name__ == "__main__":
    main()
