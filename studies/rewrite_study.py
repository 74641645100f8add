"""Does an exact rewrite (exporters/rewrites.py) pay on a backend? The dense model with and without it, timed.

    python -m studies.rewrite_study deit_small --backends ort-cpu-fp32,torch-cpu-fp32 --batches 32,1
    python -m studies.rewrite_study deit_base --backends torch-cuda-fp16-graph --batches 64,1

Per backend and batch, the dense model (random weights: values do not change a GEMM's time) and its rewritten
copy run interleaved in one loop (``speed.time_models``), so load drift hits both alike; the ratio of their
p50s and the per-round band (``speed.speedup_band``) say whether the rewrite pays. Prints one markdown row per
(backend, batch) for docs/BENCHMARKS.md "Exact fixed-cost rewrites"; with --json, writes them too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings
from typing import Any

import numpy as np
import torch

import corp_deploy
from corp_deploy.base.env import cpu_model
from corp_deploy.base.timing import Method
from corp_deploy.bench import meter
from corp_deploy.exporters.rewrites import REWRITES, rewritten
from corp_deploy.plan import speed


def measure(
    model: torch.nn.Module, rewrite: str, backend: str, batch: int, threads: int, method: Method
) -> dict[str, Any]:
    """p50 of ``model`` without and with ``rewrite`` on ``backend`` at ``batch``, interleaved; their ratio."""
    candidate, applied = rewritten(model, [rewrite])
    if not applied:
        raise corp_deploy.CorpError(f"{rewrite} does not apply to this model")
    b = meter.check_backend(backend)
    times = speed.time_models({"none": model, rewrite: candidate}, b, batch, threads, method, rewrites=())
    none, new = float(np.median(times["none"])), float(np.median(times[rewrite]))
    band = speed.speedup_band(times["none"], times[rewrite], method.round_iters)
    return {
        "backend": backend,
        "batch": batch,
        "none_ms": none * 1e3,
        "rewrite_ms": new * 1e3,
        "speedup": none / new,
        "band": band,
        "iters": len(times["none"]),
    }


def row(model: str, rewrite: str, r: dict[str, Any]) -> str:
    device = torch.cuda.get_device_name() if r["backend"].startswith("torch-cuda") else cpu_model()
    return (
        f"| {datetime.date.today()} | {device} | {model} | {rewrite} | {r['backend']} | {r['batch']} "
        f"| {r['none_ms']:.2f} | {r['rewrite_ms']:.2f} | {r['speedup']:.3f}x +-{r['band']:.1%} | {r['iters']} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="deit_small")
    p.add_argument("--rewrite", choices=REWRITES, default=REWRITES[0])
    p.add_argument("--backends", default="ort-cpu-fp32,torch-cpu-fp32")
    p.add_argument("--batches", default="32,1")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--iters", type=int, default=40, help="timed iterations per model (rounds of 2, alternating)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)

    warnings.simplefilter("ignore")
    model = corp_deploy.create_model(a.model, weights="random").eval()
    method = Method(warmup_iters=3, warmup_seconds=0.0, min_iters=a.iters, min_seconds=0.0, round_iters=2)
    print("| date | device | model | rewrite | backend | batch | none p50 ms | rewrite p50 ms | speedup | iters |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for backend in a.backends.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            rows.append(measure(model, a.rewrite, backend, batch, a.threads, method))
            print(row(a.model, a.rewrite, rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rewrite": a.rewrite, "threads": a.threads, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
