"""One benchmark: every backend x batch size, dense and pruned interleaved, repeated; a versioned record."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from corp_deploy.base import env
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.timing import Method, interleaved, median_of_repeats, summarize
from corp_deploy.bench.backends import MODELS, Backend, RunFolder
from corp_deploy.exporters import targets as export_targets
from corp_deploy.exporters.tensorrt_engine import FLAVOURS
from corp_deploy.formats.run_folder import BASELINE

SCHEMA = "corp-deploy/bench"
SCHEMA_VERSION = 2
"""2: a decoder's results also hold ``phase`` (prefill, decode), ``prompt_len`` and ``tokens_per_s``."""


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise CorpError(f"--batch-sizes takes a comma-separated list of sizes >= 1 (e.g. 1,8,32), got {text!r}")
    return sorted(set(sizes))


def environment(threads: int) -> dict[str, Any]:
    """Everything a latency number depends on that is not in the model, TensorRT flavours included."""
    targets = export_targets.load().values()  # each export target's runtime (OpenVINO...) is named too
    found = env.module_versions(m for t in targets for m in t.modules)
    return env.environment(threads, {flavour.name: flavour.module for flavour in FLAVOURS.values()}) | found


def new_record(
    run: RunFolder,
    method: Method,
    repeats: int,
    threads: int | None,
    skipped: dict[str, str] | None,
    **how: Any,
) -> dict[str, Any]:
    """A bench record with no results yet: schema, date, run, model, environment and ``method`` (plus ``how``).
    Checks ``repeats`` and sets torch's ``threads`` first, since the environment records them."""
    if repeats < 1:
        raise CorpError(f"--repeats must be >= 1, got {repeats}")
    if threads:
        torch.set_num_threads(threads)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "run": str(run.root),
        "model": run.meta["model"]["name"],
        "environment": environment(torch.get_num_threads()) | {"onnxruntime_threads": threads or "default"},
        "method": {
            **method.as_dict(),
            "repeats": repeats,
            **how,
            "statistic": "median over repeats of each statistic" if repeats > 1 else "single measurement",
        },
        "skipped": dict(skipped or {}),
        "results": [],
    }


def benchmark(
    run: RunFolder,
    backends: Sequence[Backend],
    batch_sizes: Sequence[int],
    method: Method | None = None,
    repeats: int = 1,
    include_copies: bool = False,
    threads: int | None = None,
    skipped: dict[str, str] | None = None,
    progress: Callable[[str], None] = lambda line: None,
    baseline: Mapping[str, Callable] | None = None,
) -> dict[str, Any]:
    """Measure; return the record that ``--json`` writes and the gate compares.

    A text run's results also hold ``seq_len`` (tokens per sequence); their throughput is sentences/s.
    ``baseline``: the quantize-only baseline's loader by runtime (``bench.baseline.quantize_only_baseline``), timed
    as a third model, ``baseline``, in the same loop as dense and pruned on that runtime's CPU backends.
    """
    from corp_deploy.bench.baseline import runs_beside

    method = method or Method()
    width = max((len(b.name) for b in backends), default=0)  # names padded alike: their numbers line up
    record = new_record(run, method, repeats, threads, skipped, include_copies=include_copies)
    tokens = {} if run.text is None else {"seq_len": run.text.seq_len}
    shape = "" if run.text is None else f" x {run.text.seq_len} tokens"
    for backend in backends:
        try:
            loaders = {m: backend.load(run, m, include_copies, threads) for m in MODELS}
            if baseline and runs_beside(backend, baseline):
                loaders[BASELINE] = baseline[backend.runtime](run, BASELINE, include_copies, threads)
        except (torch.cuda.OutOfMemoryError, CorpError) as e:  # this backend cannot run: the others still do
            record["skipped"][backend.name] = first_line(e)
            progress(f"{backend.name:{width}s} skipped ({first_line(e)})")
            continue
        device = record["environment"]["gpu"] if backend.device == "cuda" else "cpu"
        for batch in batch_sizes:
            try:
                steps = {m: loaders[m](batch) for m in loaders}
                repeats_ = [interleaved(steps, method, warm_up=i == 0) for i in range(repeats)]
            except (torch.cuda.OutOfMemoryError, CorpError) as e:
                record["skipped"][f"{backend.name}@{batch}"] = first_line(e)
                progress(f"{backend.name:{width}s} batch {batch:4d}{shape}: skipped ({first_line(e)})")
                continue
            measured = {}
            for m in loaders:
                stats = median_of_repeats([summarize(r[m], batch) for r in repeats_])
                record["results"].append(
                    {
                        "backend": backend.name,
                        "device": device,
                        "precision": backend.precision,
                        "model": m,
                        "batch": batch,
                        **tokens,
                        **asdict(stats),
                    }
                )
                measured[m] = stats.p50_ms
            dense, pruned = measured["dense"], measured["pruned"]
            base = f", quantize-only baseline {measured[BASELINE]:8.2f} ms" if BASELINE in measured else ""
            progress(
                f"{backend.name:{width}s} batch {batch:4d}{shape}: p50 dense {dense:8.2f} ms, "
                f"pruned {pruned:8.2f} ms ({dense / pruned:.2f}x){base}"
            )
        del loaders
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return record


def measurement(r: dict[str, Any]) -> tuple:
    """What one measurement is of, models aside: (backend, batch), and a decoder's (phase, prompt length)."""
    return (r["backend"], r["batch"], *((r["phase"], r["prompt_len"]) if "phase" in r else ()))


def label(key: tuple) -> str:
    """``measurement``'s key in words: ``ort batch 8`` or ``torch-cpu-fp32 batch 1 decode at prompt 128``."""
    backend, batch, *decode = key
    return f"{backend} batch {batch}" + (f" {decode[0]} at prompt {decode[1]}" if decode else "")


def pairs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Dense and pruned side by side per ``measurement``, with the pruned/dense ratios; a text run's rows
    also hold ``seq_len`` and tokens/s (sentences/s x tokens per sequence), a decoder's its phase, prompt length and
    tokens/s (``bench.decode``)."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in record["results"]:
        by_key.setdefault(measurement(r), {})[r["model"]] = r
    out = []
    for (backend, batch, *_), models in by_key.items():
        if not set(MODELS) <= set(models):
            continue
        d, p = models["dense"], models["pruned"]
        tokens = d.get("seq_len")
        text = {} if tokens is None else {"seq_len": tokens}
        text |= {f"{m}_tokens_per_s": models[m]["throughput"] * tokens for m in MODELS} if tokens else {}
        if "phase" in d:
            text |= {"phase": d["phase"], "prompt_len": d["prompt_len"]}
            text |= {f"{m}_tokens_per_s": models[m]["p50_tokens_per_s"] for m in MODELS}
        out.append(
            {
                "backend": backend,
                "device": d["device"],
                "precision": d["precision"],
                "batch": batch,
                "dense_p50_ms": d["p50_ms"],
                "pruned_p50_ms": p["p50_ms"],
                "p50_speedup": d["p50_ms"] / p["p50_ms"],
                "dense_throughput": d["throughput"],
                "pruned_throughput": p["throughput"],
                "throughput_ratio": p["throughput"] / d["throughput"],
                **text,
                **_beside_baseline(models),
            }
        )
    return out


def _beside_baseline(models: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The quantize-only baseline's p50 and pruned's speed against it, where it was measured in this loop."""
    if BASELINE not in models:
        return {}
    base = models[BASELINE]["p50_ms"]
    return {"baseline_p50_ms": base, "pruned_vs_baseline": base / models["pruned"]["p50_ms"]}
