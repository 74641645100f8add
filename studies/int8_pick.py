"""The INT8 recipe the race picks against the exhaustive choice, in one process (issue 49: "the recipe it picks within
3% of the exhaustive choice's speed, show both").

    corp-deploy prune-export deit_small --weights random --calib synthetic --num-calib 16 \\
        --precision fp32 --out RUN
    python -m studies.int8_pick RUN/pruned.onnx RUN/dense.onnx --calib synthetic --out studies/results/int8-pick

For each FP32 graph: ``int8_recipes.choose_int8`` as ``prune-export`` runs it (every recipe of ``auto``, the race at
``--batch``, static as its stand-in, gated fastest first); then every raced candidate written for real (static
calibrated on all ``--int8-calib`` images) and gated, and all of them timed exhaustively: warmed up, interleaved
(``TIME_METHOD``, ``--repeats`` times; each p50 the median over repeats). The exhaustive choice is the fastest
candidate that passes the gate; the pick's ratio is its exhaustive p50 over the exhaustive choice's (1.000: the same
graph or as fast). Prints and writes ``<out>.md`` / ``<out>.json`` with the CPU, its flags and the load before and
after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from corp_deploy.base.env import cpu_features, describe_cpu
from corp_deploy.exporters.compare import INT8
from corp_deploy.exporters.int8_quant import IMAGE_CALIB, calibration_data, compare_on, float_graph
from corp_deploy.exporters.int8_recipes import (
    AUTO,
    RECIPES,
    TIME_METHOD,
    Job,
    choose_int8,
    fused_graph,
    ort_timer,
    parse_recipes,
    shape_of,
    timing_feed,
)
from corp_deploy.exporters.runners import Memo, OrtRunner


def candidates(src: Path, job: Job, tmp: Path) -> dict[str, Path]:
    """Every candidate the race sees (rescuers are never raced), written for real, by its name in the race."""
    graphs = {"plain": src}
    tmp.mkdir()
    fused, _ = fused_graph(src, tmp / "fused.onnx", job.reference, job.held_out)
    graphs |= {"fused": fused} if fused else {}
    out = {}
    for name in parse_recipes(AUTO):
        recipe = RECIPES[name]
        for graph, path in graphs.items():
            if recipe.rescues or (graph == "fused" and not recipe.fusable):
                continue
            label = name if graph == "plain" else f"{name} (fused)"
            out[label] = tmp / label.replace(" (", "-").rstrip(")") / f"{src.stem}.int8.onnx"
            out[label].parent.mkdir(parents=True)
            recipe.write(path, out[label], job)
    return out


def study(src: Path, source: str, num_calib: int, num_verify: int, batch: int, repeats: int) -> dict[str, Any]:
    calibration, held_out, folders = calibration_data(source, float_graph(src), num_calib, num_verify, seed=0)
    reference = Memo(OrtRunner(src, "cpu"))
    job = Job(calibration, held_out, INT8, info={"folders": folders}, say=lambda line: None, reference=reference)
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="int8-pick-") as tmp:
        start = time.perf_counter()
        record = choose_int8(src, Path(tmp) / f"{src.stem}.int8.onnx", job, (AUTO,), batch)
        seconds = time.perf_counter() - start
        choice = record["int8_recipe"]
        pick = choice["chosen"] + (" (fused)" if choice["graph"] == "fused" else "")
        paths = candidates(src, job, Path(tmp) / "all")
        passed = {
            k: all(c.within(INT8) for c in compare_on(reference, OrtRunner(p, "cpu"), held_out))
            for k, p in paths.items()
        }
        feed = timing_feed(float_graph(src), batch)
        load.append(os.getloadavg())
        p50 = ort_timer(method=TIME_METHOD, repeats=repeats)(paths, feed)
        load.append(os.getloadavg())
    best = min((k for k in p50 if passed[k]), key=p50.__getitem__)
    raced = {c["recipe"] + (" (fused)" if c["graph"] == "fused" else ""): c["p50_ms"] for c in choice["candidates"]}
    rows = [
        {"candidate": k, "race_p50_ms": raced.get(k), "exhaustive_p50_ms": v, "passes": passed[k]}
        for k, v in p50.items()
    ]
    return {
        "graph": str(src),
        "shape": shape_of(feed),
        "choose_int8_seconds": round(seconds, 1),
        "pick": pick,
        "exhaustive_choice": best,
        "pick_p50_ms": p50[pick],
        "exhaustive_p50_ms": p50[best],
        "ratio": p50[pick] / p50[best],
        "rows": sorted(rows, key=lambda r: r["exhaustive_p50_ms"]),
        "load": load,
    }


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [f"# INT8 pick against the exhaustive choice ({header['date']})", ""]
    lines += [
        f"CPU: {header['cpu']}; exhaustive timing {header['method']}, {header['repeats']} repeats, interleaved",
        "",
    ]
    for r in results:
        load = " -> ".join(f"{a[0]:.2f}" for a in r["load"])
        lines += [f"## {r['graph']} ({r['shape']}, load {load}, choose_int8 {r['choose_int8_seconds']} s)", ""]
        lines += [f"pick **{r['pick']}** {r['pick_p50_ms']:.1f} ms, exhaustive choice **{r['exhaustive_choice']}** "]
        lines[-1] += f"{r['exhaustive_p50_ms']:.1f} ms: ratio **{r['ratio']:.3f}**"
        lines += ["", "| candidate | race p50 ms | exhaustive p50 ms | passes |", "|---|---:|---:|---|"]
        for row in r["rows"]:
            race = f"{row['race_p50_ms']:.1f}" if row["race_p50_ms"] else "-"
            lines.append(f"| {row['candidate']} | {race} | {row['exhaustive_p50_ms']:.1f} | {row['passes']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", type=Path)
    parser.add_argument("--calib", default="synthetic", help="'synthetic' or an image folder (CORP's sample, seed 0)")
    parser.add_argument("--int8-calib", type=int, default=IMAGE_CALIB)
    parser.add_argument("--int8-verify", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cpu = cpu_features()
    header = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="minutes"), "cpu": describe_cpu(cpu)}
    header |= {"cpu_flags": cpu, "method": TIME_METHOD.as_dict(), "repeats": args.repeats}
    results = []
    for graph in args.graphs:
        results.append(study(graph, args.calib, args.int8_calib, args.int8_verify, args.batch, args.repeats))
        r = results[-1]
        print(
            f"{graph}: pick {r['pick']} {r['pick_p50_ms']:.1f} ms, exhaustive {r['exhaustive_choice']} "
            f"{r['exhaustive_p50_ms']:.1f} ms, ratio {r['ratio']:.3f} (load {r['load'][0][0]:.2f} -> "
            f"{r['load'][-1][0]:.2f})",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({**header, "results": results}, indent=1))
    Path(f"{args.out}.md").write_text(markdown(results, header))
    print(markdown(results, header))


if __name__ == "__main__":
    main()
