"""What the genai cache padding costs: a decoder's decode step with each layer's K and V cache at its own width
(what onnxruntime itself can run) against the graph genai needs (each layer's narrower of K and V zero-padded to
the wider), timed in onnxruntime, interleaved.

    python -m studies.kv_padding runs/smollm-mlpv --past 256,1024 --batches 1,8

Both graphs come from ``exporters.kv_cache.export_decoder_onnx`` (``padded`` False / True) and are checked
against torch over a prefill and 4 decode steps first. One single-token decode step at a past of P tokens is
timed per (batch, P), warm-up excluded; prints the cache floats per token and one markdown row per (batch, P)
with the load before and after, for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from corp_deploy.base.env import cpu_model
from corp_deploy.base.timing import Method, interleaved
from corp_deploy.exporters.kv_cache import DecodeStep, export_decoder_onnx, positions, verify_decoder_onnx
from corp_deploy.formats import sources

METHOD = Method(warmup_iters=5, warmup_seconds=1.0, min_iters=30, min_seconds=3.0, round_iters=5)


def feeds(step: DecodeStep, names: list[str], batch: int, past: int) -> dict[str, np.ndarray]:
    """One decode step's inputs: a token per sequence after ``past`` cached tokens (random cache values)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, past + 1, dtype=torch.long)
    first = [torch.randint(3, 100, (batch, 1), generator=g), mask]
    first += [positions(mask)[:, -1:]] if step.positions else []
    cache = [torch.randn(t.shape, generator=g) for t in step.empty_past(batch, past)]
    return {name: t.numpy() for name, t in zip(names, first + cache, strict=True)}


def measure(model: torch.nn.Module, folder: Path, batches: list[int], pasts: list[int]) -> list[dict[str, Any]]:
    """p50 ms of one decode step, unpadded against padded, per (batch, past), interleaved in one loop."""
    steps, sessions = {}, {}
    for padded in (False, True):
        name = "padded" if padded else "unpadded"
        path = folder / f"{name}.onnx"
        steps[name] = export_decoder_onnx(model, path, padded=padded)
        worst = max(verify_decoder_onnx(model, path, padded=padded)["max_rel_error_per_step"])
        print(f"{name}: verified against torch, max relative error {worst:.1e}; {steps[name].lay.padding}")
        sessions[name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = []
    for batch in batches:
        for past in pasts:
            inputs = {n: feeds(steps[n], [i.name for i in sessions[n].get_inputs()], batch, past) for n in steps}
            timed = {n: _timer(sessions[n], inputs[n]) for n in steps}
            times = interleaved(timed, METHOD)
            p50 = {n: float(np.median(t)) * 1e3 for n, t in times.items()}
            rows.append({"batch": batch, "past": past, **p50, "ratio": p50["padded"] / p50["unpadded"]})
    return rows


def _timer(session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> Callable[[], float]:
    """A ``base.timing`` step: one ``session.run``, wall clock (CPU)."""

    def step() -> float:
        begin = time.perf_counter()
        session.run(None, inputs)
        return time.perf_counter() - begin

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a decoder prune artifact or transformers folder")
    parser.add_argument("--past", default="256,1024", help="cached tokens before the timed step")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args(argv)
    model, _ = sources.text_model(args.source)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(
            model, Path(tmp), [int(b) for b in args.batches.split(",")], [int(p) for p in args.past.split(",")]
        )
    after = os.getloadavg()
    print(
        f"{datetime.date.today()} {cpu_model()} ({os.cpu_count()} cores), onnxruntime {ort.__version__} CPU FP32, "
        f"load {load[0]:.1f} before, {after[0]:.1f} after"
    )
    print("| batch | past tokens | unpadded ms/step | padded (genai) ms/step | padded / unpadded |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['past']} | {r['unpadded']:.2f} | {r['padded']:.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
