"""Pruned INT8 against the quantize-only baseline, every graph interleaved in one run (issue 43's done-means).

    corp-deploy prune-export ... --precision fp32,int8 --out RUN
        # RUN/{dense,pruned}.onnx, *.int8.onnx (chosen recipe), baseline.int8.onnx (quantize_dynamic of dense.onnx)
    python -m studies.int8_baseline_study RUN [RUN ...] --out studies/results/int8-baseline-study

For each run folder, on onnxruntime's CPU provider at ``--batch`` (a text run: x its exported sequence length, all
tokens real): dense FP32, pruned FP32, the quantize-only baseline (``baseline.int8.onnx``), ``quantize_dynamic`` of the
same pruned graph (per channel, made here), and the chosen INT8 graphs (dense and pruned, ``int8_recipe`` in their
metadata), all warmed up then timed interleaved (``base.timing.interleaved``), ``--repeats`` times; the p50 of each
is the median over repeats. Prints and writes ``<out>.md`` / ``<out>.json`` with the load average before and after,
the CPU's features, and each graph's speed against dense FP32 and against the baseline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from corp_deploy.base.env import cpu_features, describe_cpu
from corp_deploy.base.timing import Method
from corp_deploy.exporters.int8_recipes import dynamic_int8, ort_timer, shape_of, timing_feed
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata


def graphs(run: Path, tmp: Path) -> dict[str, Path]:
    """The graphs compared, by label; the pruned graph's quantize_dynamic made into ``tmp``."""
    dynamic = tmp / f"{run.name}-pruned.qdyn.onnx"
    dynamic_int8(run / "pruned.onnx", dynamic, per_channel=True)
    return {
        "dense FP32": run / "dense.onnx",
        "pruned FP32": run / "pruned.onnx",
        "dense quantize_dynamic (the quantize-only baseline)": run / "baseline.int8.onnx",
        "pruned quantize_dynamic": dynamic,
        "dense INT8 (chosen recipe)": run / "dense.int8.onnx",
        "pruned INT8 (chosen recipe)": run / "pruned.int8.onnx",
    }


def study(run: Path, batch: int, repeats: int, method: Method) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="int8-baseline-") as tmp:
        paths = graphs(run, Path(tmp))
        feed = timing_feed(load_onnx(run / "pruned.onnx", weights=False), batch)
        load = [os.getloadavg()]
        p50 = ort_timer(method=method, repeats=repeats)(paths, feed)
        load.append(os.getloadavg())
    recipes = {
        m: read_metadata(load_onnx(run / f"{m}.int8.onnx", weights=False))["int8_recipe"] for m in ("dense", "pruned")
    }
    dense, base = p50["dense FP32"], p50["dense quantize_dynamic (the quantize-only baseline)"]
    rows = [{"graph": k, "p50_ms": v, "vs_dense_fp32": dense / v, "vs_baseline": base / v} for k, v in p50.items()]
    chosen = {m: f"{r['chosen']}{' (fused)' if r['graph'] == 'fused' else ''}" for m, r in recipes.items()}
    return {"run": str(run), "shape": shape_of(feed), "load": load, "rows": rows, "chosen": chosen}


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"{header['date']}, {header['cpu']}, onnxruntime CPU, {header['threads']} threads (its default), "
        f"{header['repeats']} repeats",
        "",
    ]
    for r in results:
        lines += [
            f"{r['run']} ({r['shape']}; chosen: dense {r['chosen']['dense']}, pruned {r['chosen']['pruned']}; "
            f"load {' '.join(f'{x:.2f}' for x in r['load'][0])} -> {' '.join(f'{x:.2f}' for x in r['load'][1])})",
            "",
            "| graph | p50 ms | vs dense FP32 | vs quantize-only baseline |",
            "|---|---|---|---|",
            *(
                f"| {row['graph']} | {row['p50_ms']:.1f} | {row['vs_dense_fp32']:.2f}x | {row['vs_baseline']:.2f}x |"
                for row in r["rows"]
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    method = Method(warmup_iters=2, warmup_seconds=1.0, min_iters=10, min_seconds=args.min_seconds, round_iters=2)
    header = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": describe_cpu(cpu_features()),
        "threads": os.cpu_count(),
        "repeats": args.repeats,
        "method": method.as_dict(),
    }
    results = [study(run, args.batch, args.repeats, method) for run in args.runs]
    text = markdown(results, header)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text(text)
    Path(f"{args.out}.json").write_text(json.dumps({**header, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
