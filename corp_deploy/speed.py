"""Measured speed on the deployment backend: the latency table (``latency``) and the closed loop's timing.

An app beside the core: it builds models by surgery, exports them with ``exporters`` and times them with
``bench``'s interleaved method, so the core's planning (``allocation``) stays pure. Random weights are fine:
values do not change a dense GEMM's time.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from corp_deploy import latency
from corp_deploy.bench.backends import BACKENDS, Backend
from corp_deploy.bench.measure import Method, Step, interleaved
from corp_deploy.data import input_size
from corp_deploy.deps import missing
from corp_deploy.env import cpu_model, module_versions
from corp_deploy.errors import CorpError
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, export_onnx
from corp_deploy.exporters.rewrites import rewritten
from corp_deploy.latency import LatencyTable, Shape, Timing
from corp_deploy.surgery import apply_widths, head_widths
from corp_deploy.version import __version__

TABLE_METHOD = Method(warmup_iters=1, warmup_seconds=0.0, min_iters=4, min_seconds=0.0, round_iters=1)
"""Timing of a grid model against the dense one (``time_against``): 4 iterations each, alternating."""
LOOP_METHOD = Method(warmup_iters=2, warmup_seconds=0.0, min_iters=12, min_seconds=0.0, round_iters=2)
"""Timing of dense against pruned in the closed loop (rounds of 2, alternating)."""
MIN_BAND = 0.03
"""The smallest noise band claimed for a measured speedup: +-3%."""


def check_backend(name: str, rewrites: tuple[str, ...] | None = None) -> Backend:
    """The bench backend a latency budget is measured on, timing models with ``rewrites`` (None: the backend's
    defaults; ``prune-export --rewrites`` passes what it exports); one line when it cannot be here."""
    if name not in BACKENDS:
        raise CorpError(f"--latency-on: unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise CorpError(f"--latency-on {name} cannot run here: no CUDA GPU visible; use ort-cpu-fp32 or torch-cpu-fp32")
    if name.startswith("tensorrt-") or backend.precision == "int8":
        raise CorpError(
            f"--latency-on {name} is not supported yet: every model of the latency grid would need its own "
            "engine or INT8 calibration; use ort-cpu-fp32, torch-cpu-fp32 or a torch-cuda backend"
        )
    if name.startswith("ort-") and (absent := missing("onnx", "onnxscript", "onnxruntime")):
        raise CorpError(f"--latency-on {name} needs {absent}")
    if "compile" in name and (reason := backend.missing(None)):
        raise CorpError(f"--latency-on {name} cannot run here: {reason}")
    return backend if rewrites is None else dataclasses.replace(backend, chosen_rewrites=tuple(rewrites))


def key(
    model: str,
    args: dict[str, Any],
    backend: Backend,
    batch: int,
    threads: int,
    depth: tuple[str, ...] = (),
    depth_fit: str = "affine-mean",
) -> dict[str, Any]:
    """Everything a block's time depends on besides its widths: what a table is cached under and checked against.

    ``depth``: the modules whose replacement (by a ``depth_fit`` stand-in) the table also measures."""
    device = torch.cuda.get_device_name() if backend.device == "cuda" else cpu_model()
    ort = backend.name.startswith("ort-")
    applied = {"applied": list(backend.rewrites)} if backend.rewrites else {}  # none: the keys cached before them
    libs = module_versions(["torch", "timm", *(["onnx", "onnxruntime"] if ort else [])])
    return {
        "model": model,
        "args": args,
        "backend": backend.name,
        "device": device,
        "precision": backend.precision,
        "batch": batch,
        "threads": threads,
        "versions": libs | {"corp_deploy": __version__},
        "rewrites": ({"opset": DEFAULT_OPSET} if ort else {}) | applied,
    } | ({"depth": {"modules": list(depth), "fit": depth_fit}} if depth else {})


def removals(table_key: dict[str, Any]) -> tuple[list[str], str]:
    """(modules whose replacement a table measures, the stand-in's fit) of a table ``key``."""
    depth = table_key.get("depth", {"modules": [], "fit": "affine-mean"})
    return depth["modules"], depth["fit"]


def shape_of(model: nn.Module) -> Shape:
    """The dense block shapes a table is measured for; a pruned or mixed-width model is refused."""
    widths = {(b.mlp.fc1.out_features, *head_widths(b.attn)) for b in model.blocks}
    if len(widths) != 1 or len(set(next(iter(widths))[1:])) != 1:
        raise CorpError("a latency table is measured from the dense model; this one has mixed or pruned widths")
    mlp, qk, _ = next(iter(widths))
    return Shape(len(model.blocks), mlp, qk)


def with_widths(dense: nn.Module, widths: list[tuple[int, int, int]] | None, fit: str = "affine-mean") -> nn.Module:
    """A copy of ``dense`` with these (mlp, qk, v) block widths (random weights where they changed); None: no blocks.

    A width of ``latency.REMOVED`` replaces the module by a ``fit`` stand-in (``surgery.AffineBranch``)."""
    model = copy.deepcopy(dense).eval()
    if widths is None:
        model.blocks = nn.Sequential()
        return model
    entries = []
    for m, q, v in widths:
        entry: dict[str, int | str] = {"mlp": fit} if m == latency.REMOVED else {"mlp_hidden": m}
        entry |= {"attn": fit} if q == latency.REMOVED else {"qk_dim": q, "v_dim": v}
        entries.append(entry)
    apply_widths(model, entries)
    return model


@dataclass
class _Models:
    """Named models as bench's backend loaders read a run folder: ONNX files beside them, torch modules."""

    root: Path
    models: dict[str, nn.Module]
    input_size: tuple[int, int, int]
    rewrites: tuple[str, ...] = ()
    """What bench's torch loaders apply: nothing, ``loaded`` applied the rewrites already."""

    def onnx(self, which: str, precision: str = "fp32") -> Path:
        return self.root / f"{which}.onnx"

    def torch_model(self, which: str) -> nn.Module:
        return self.models[which]


@contextmanager
def loaded(
    models: dict[str, nn.Module], backend: Backend, batch: int, threads: int, rewrites: Sequence[str] | None = None
) -> Iterator[dict[str, Step]]:
    """A timed step per model at ``batch`` on ``backend`` (ONNX files exported to a temporary folder for ort).

    Every model runs with ``rewrites`` (default: the backend's, ``Backend.rewrites``) applied where exact, as
    the deployed model would: a latency table and the closed loop time what is deployed.
    """
    if threads:
        torch.set_num_threads(threads)
    shape = tuple(input_size(next(iter(models.values()))))
    names = backend.rewrites if rewrites is None else tuple(rewrites)
    models = {name: rewritten(model, names)[0] for name, model in models.items()}
    with tempfile.TemporaryDirectory(prefix="corp-latency-") as tmp:
        run = _Models(Path(tmp), models, shape)
        if backend.name.startswith("ort-"):
            for name, model in models.items():
                export_onnx(model, run.onnx(name), shape)
        yield {name: backend.load(run, name, False, threads)(batch) for name in models}


def time_models(
    models: dict[str, nn.Module],
    backend: Backend,
    batch: int,
    threads: int,
    method: Method,
    rewrites: Sequence[str] | None = None,
) -> dict[str, list[float]]:
    """Seconds per forward of every model at ``batch`` on ``backend``, all interleaved in one loop (``loaded``)."""
    with loaded(models, backend, batch, threads, rewrites) as steps:
        return interleaved(steps, method)


def time_against(
    reference: str, models: dict[str, nn.Module], backend: Backend, batch: int, threads: int, method: Method
) -> dict[str, float]:
    """Seconds per forward (p50) of every model, each timed in its own loop alternating with ``reference``.

    A model's time is its ratio to the reference in their loop times the reference's median over all loops:
    ratios of neighbouring iterations survive the load drift of a shared machine, which absolute times
    measured minutes apart do not (a grid of 14 deit_small models at batch 32 takes minutes).
    """
    with loaded(models, backend, batch, threads) as steps:
        ratios, ref = {}, []
        for name in steps:
            if name != reference:
                times = interleaved({reference: steps[reference], name: steps[name]}, method)
                ratios[name] = float(np.median(times[name]) / np.median(times[reference]))
                ref += times[reference]
    seconds = float(np.median(ref))
    return {reference: seconds} | {name: r * seconds for name, r in ratios.items()}


def build_table(
    dense: nn.Module,
    table_key: dict[str, Any],
    backend: Backend,
    method: Method = TABLE_METHOD,
    timer: Callable[[dict[str, nn.Module]], dict[str, float]] | None = None,
) -> LatencyTable:
    """Measure the grid's uniform-width models (p50 of each) and fit the table. ``timer``: seconds per model."""
    shape = shape_of(dense)
    modules, fit = removals(table_key)
    grid = latency.grid(shape, latency.tied(backend.name), modules)
    models = {name: with_widths(dense, None if w is None else [w] * shape.depth, fit) for name, w in grid.items()}
    if timer is None:
        dense_name = next(name for name, w in grid.items() if w == (shape.mlp, shape.head_dim, shape.head_dim))
        seconds = time_against(dense_name, models, backend, table_key["batch"], table_key["threads"], method)
    else:
        seconds = timer(models)
    return latency.fit(table_key, shape, latency.tied(backend.name), seconds, modules)


def table_for(
    dense: nn.Module,
    table_key: dict[str, Any],
    backend: Backend,
    path: str | Path | None = None,
    say: Callable[[str], None] = lambda line: None,
    timer: Callable[[dict[str, nn.Module]], dict[str, float]] | None = None,
) -> LatencyTable:
    """``path`` checked against ``table_key``; else the cached table for that key; else measured now and cached."""
    if path is not None:
        return latency.read(path, table_key)
    if (table := latency.cached(table_key)) is not None:
        say(f"latency table: cached {latency.cache_path(table_key)}")
        return table
    n = len(latency.grid(shape_of(dense), latency.tied(backend.name), removals(table_key)[0]))
    say(f"latency table: measuring {n} uniform-width models on {backend.name} at batch {table_key['batch']}")
    table = build_table(dense, table_key, backend, timer=timer)
    latency.write(table, latency.cache_path(table_key))
    say(f"latency table: cached {latency.cache_path(table_key)}")
    return table


def speedup_band(dense: list[float], pruned: list[float], round_iters: int) -> float:
    """Half the interquartile range of the per-round speedups (median of a round's dense / of its pruned),
    relative to their median; at least ``MIN_BAND``."""
    rounds = min(len(dense), len(pruned)) // round_iters
    ratios = [
        float(np.median(dense[r * round_iters : (r + 1) * round_iters]))
        / float(np.median(pruned[r * round_iters : (r + 1) * round_iters]))
        for r in range(rounds)
    ]
    if len(ratios) < 4:
        return MIN_BAND
    q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
    return max(MIN_BAND, float((q3 - q1) / 2 / q2))


def measure_pair(
    dense: nn.Module, pruned: nn.Module, backend: Backend, batch: int, threads: int, method: Method = LOOP_METHOD
) -> Timing:
    """Dense against pruned at ``batch`` on ``backend``, interleaved; the p50s and the noise band."""
    times = time_models({"dense": dense, "pruned": pruned}, backend, batch, threads, method)
    return Timing(
        float(np.median(times["dense"])),
        float(np.median(times["pruned"])),
        speedup_band(times["dense"], times["pruned"], method.round_iters),
    )


def random_widths(shape: Shape, equal_heads: bool, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """Per block: MLP and per-head Q/K, V widths drawn uniformly from the multiples of 8 the grid spans."""
    mlps = np.arange(latency.grid_width(shape.mlp, min(latency.MLP_GRID)), shape.mlp + 1, 8)
    heads = np.arange(latency.grid_width(shape.head_dim, min(latency.ATTN_GRID)), shape.head_dim + 1, 8)
    out = []
    for _ in range(shape.depth):
        qk = int(rng.choice(heads))
        out.append((int(rng.choice(mlps)), qk, qk if equal_heads else int(rng.choice(heads))))
    return out


def check_table(
    dense: nn.Module, table: LatencyTable, backend: Backend, n: int, seed: int = 0, method: Method = TABLE_METHOD
) -> list[dict[str, float]]:
    """Time ``n`` random mixed-width models, each against the dense one (``time_against``); the table's errors.

    ``error``: predicted / measured time - 1. ``speedup_error``: the same for the speedup over the dense model
    measured in the same loop, which machine-wide drift since the table was measured does not move.
    """
    shape, rng = shape_of(dense), np.random.default_rng(seed)
    widths = {f"mixed{i}": random_widths(shape, table.tied, rng) for i in range(n)}
    models = {"dense": dense} | {name: with_widths(dense, w) for name, w in widths.items()}
    p50 = time_against("dense", models, backend, table.key["batch"], table.key["threads"], method)
    out = []
    for name, w in widths.items():
        predicted = table.predict(w)
        out.append(
            {
                "predicted_s": predicted,
                "measured_s": p50[name],
                "error": predicted / p50[name] - 1,
                "speedup_error": (table.dense_s / predicted) / (p50["dense"] / p50[name]) - 1,
                "widths": w,
            }
        )
    return out
