"""Measured speed on the deployment backend: the latency table (``latency``) and the closed loop's timing.

An app beside the core: it builds models by surgery, exports them with ``exporters`` and times them with
``bench``'s interleaved method, so the core's planning (``allocation``) stays pure. Random weights are fine:
values do not change a dense GEMM's time.

One code path for every family the table can time, through the family adapter (``family.adapter_for``): timm
ViTs (images of the model's input size) and BERT-family encoders (``families.bert``: full-length random token ids of
``seq_len`` tokens, the key's sequence length, exported by ``exporters.text_onnx``; its blocks are the BERT
layers and its fixed cost the embeddings and pooler). Decoders are refused (``timed_adapter``).
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from corp_deploy.base.deps import missing
from corp_deploy.base.env import cpu_model, module_versions
from corp_deploy.base.errors import CorpError
from corp_deploy.base.version import __version__
from corp_deploy.bench.backends import BACKENDS, Backend, Text
from corp_deploy.bench.measure import Method, Step, interleaved
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, export_onnx, image_graph
from corp_deploy.exporters.rewrites import rewritten
from corp_deploy.exporters.text_onnx import export_text_onnx, graph
from corp_deploy.families import Adapter, adapter_for
from corp_deploy.formats.data import input_size
from corp_deploy.formats.text import check_seq_len
from corp_deploy.plan import latency
from corp_deploy.plan.latency import LatencyTable, Shape, Timing

TABLE_METHOD = Method(warmup_iters=1, warmup_seconds=0.0, min_iters=4, min_seconds=0.0, round_iters=1)
"""Timing of a grid model against the dense one (``time_against``): 4 iterations each, alternating."""
LOOP_METHOD = Method(warmup_iters=2, warmup_seconds=0.0, min_iters=12, min_seconds=0.0, round_iters=2)
"""Timing of dense against pruned in the closed loop (rounds of 2, alternating)."""
MIN_BAND = 0.03
"""The smallest noise band claimed for a measured speedup: +-3%."""
Convert = Callable[[Path, Path], None]
CONVERTERS: dict[str, Convert] = {}
"""Backend precision other than FP32 -> how an exported FP32 graph (source) becomes the graph an ``ort-`` backend of
that precision runs (destination, ``_Models.onnx``). INT8 plugs in here (a static quantizer calibrated on random
inputs: values do not change an INT8 GEMM's time either); ``check_backend`` refuses a precision without one."""


def check_backend(name: str, rewrites: tuple[str, ...] | None = None) -> Backend:
    """The bench backend a latency budget is measured on, timing models with ``rewrites`` (None: the backend's
    defaults; ``prune-export --rewrites`` passes what it exports); one line when it cannot be here."""
    if name not in BACKENDS:
        raise CorpError(f"--latency-on: unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise CorpError(f"--latency-on {name} cannot run here: no CUDA GPU visible; use ort-cpu-fp32 or torch-cpu-fp32")
    converted = backend.runtime == "onnxruntime" and backend.precision != "fp32"  # a graph made from the FP32 one
    if backend.runtime == "tensorrt" or (converted and backend.precision not in CONVERTERS):
        raise CorpError(
            f"--latency-on {name} is not supported yet: every model of the latency grid would need its own "
            "engine or INT8 calibration; use ort-cpu-fp32, torch-cpu-fp32 or a torch-cuda backend"
        )
    if backend.runtime == "onnxruntime" and (absent := missing("onnx", "onnxscript", "onnxruntime")):
        raise CorpError(f"--latency-on {name} needs {absent}")
    if backend.compiler and (reason := backend.missing(None)):
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
    seq_len: int | None = None,
) -> dict[str, Any]:
    """Everything a block's time depends on besides its widths: what a table is cached under and checked against.

    ``depth``: the modules whose replacement (by a ``depth_fit`` stand-in) the table also measures. ``seq_len``: a
    text encoder's tokens per sequence (attention grows with its square, the GEMMs with it); None for an image model.
    """
    device = torch.cuda.get_device_name() if backend.device == "cuda" else cpu_model()
    ort = backend.runtime == "onnxruntime"
    applied = {"applied": list(backend.rewrites)} if backend.rewrites else {}  # none: the keys cached before them
    models = "timm" if seq_len is None else "transformers"
    libs = module_versions(["torch", models, *(["onnx", "onnxruntime"] if ort else [])])
    return {
        "model": model,
        "args": args,
        "backend": backend.name,
        "device": device,
        "precision": backend.precision,
        "batch": batch,
        **({} if seq_len is None else {"seq_len": seq_len}),
        "threads": threads,
        "versions": libs | {"corp_deploy": __version__},
        "rewrites": ({"opset": DEFAULT_OPSET} if ort else {}) | applied,
    } | ({"depth": {"modules": list(depth), "fit": depth_fit}} if depth else {})


def removals(table_key: dict[str, Any]) -> tuple[list[str], str]:
    """(modules whose replacement a table measures, the stand-in's fit) of a table ``key``."""
    depth = table_key.get("depth", {"modules": [], "fit": "affine-mean"})
    return depth["modules"], depth["fit"]


def timed_adapter(model: nn.Module) -> Adapter:
    """``model``'s family adapter, where a latency table can time it: a decoder is refused in one line."""
    adapter = adapter_for(model)
    if adapter.causal:
        raise CorpError(
            "a latency budget (--speedup, --budget latency=F) times encoders and ViTs: a decoder's time is its "
            "generation (a prefill, then one token at a time from a key/value cache), which one forward of a "
            "latency table does not model; use --budget macs=F or --sparsity"
        )
    return adapter


def text_inputs(model: nn.Module, seq_len: int | None) -> Text | None:
    """What a text encoder is timed on (``seq_len`` tokens, within its positions), None for an image model;
    one line when a text model comes without a sequence length or an image model with one."""
    if timed_adapter(model).modality != "text":
        if seq_len is not None:
            raise CorpError("a sequence length is for text encoders; this latency table times an image model")
        return None
    if seq_len is None:
        raise CorpError("a text encoder's latency is timed at a sequence length: its table key needs seq_len")
    check_seq_len(seq_len, model.config)
    return Text(model.config.vocab_size, seq_len)


def shape_of(model: nn.Module) -> Shape:
    """The dense block shapes a table is measured for; a pruned or mixed-width model is refused."""
    adapter = timed_adapter(model)
    blocks = adapter.blocks(model)
    widths = {(adapter.mlp_out(b).in_features, *adapter.head_widths(b)) for b in blocks}
    if len(widths) != 1 or len(set(next(iter(widths))[1:])) != 1:
        raise CorpError("a latency table is measured from the dense model; this one has mixed or pruned widths")
    mlp, qk, _ = next(iter(widths))
    return Shape(len(blocks), mlp, qk)


def with_widths(dense: nn.Module, widths: list[tuple[int, int, int]] | None, fit: str = "affine-mean") -> nn.Module:
    """A copy of ``dense`` with these (mlp, qk, v) block widths (random weights where they changed); None: no blocks
    (the fixed cost: a ViT's patch embedding, norm and head; an encoder's embeddings and pooler).

    A width of ``latency.REMOVED`` replaces the module by a ``fit`` stand-in (``surgery.AffineBranch``)."""
    model = copy.deepcopy(dense).eval()
    adapter = timed_adapter(model)
    if widths is None:
        del adapter.blocks(model)[:]
        return model
    entries = []
    for m, q, v in widths:
        entry: dict[str, int | str] = {"mlp": fit} if m == latency.REMOVED else {"mlp_hidden": m}
        entry |= {"attn": fit} if q == latency.REMOVED else {"qk_dim": q, "v_dim": v}
        entries.append(entry)
    adapter.apply_structure(model, entries)
    return model


@dataclass
class _Models:
    """Named models as bench's backend loaders read a run folder: ONNX files beside them, torch modules, and the
    inputs (``bench.backends.inputs_for``): images of ``input_size``, or ``text``'s token ids."""

    root: Path
    models: dict[str, nn.Module]
    input_size: tuple[int, ...] | None
    text: Text | None = None
    rewrites: tuple[str, ...] = ()
    """What bench's torch loaders apply: nothing, ``loaded`` applied the rewrites already."""

    def onnx(self, which: str, precision: str = "fp32") -> Path:
        return self.root / (f"{which}.onnx" if precision == "fp32" else f"{which}.{precision}.onnx")

    def torch_model(self, which: str) -> nn.Module:
        """A copy (a loader moves and casts what it gets, and the caller's model must stay as it was, e.g. fp32
        for the closed loop's next round); a text encoder as exported (``text_onnx.graph``)."""
        model = copy.deepcopy(self.models[which])
        return image_graph(model) if self.text is None else graph(model)[0]

    def export(self, which: str, precision: str) -> None:
        """``which``'s ONNX graph (text: dynamic batch and sequence) and, past FP32, ``CONVERTERS``' graph."""
        model, fp32 = self.models[which], self.onnx(which)
        if self.text is None:
            export_onnx(model, fp32, self.input_size)
        else:
            export_text_onnx(model, fp32)
        if precision != "fp32":
            CONVERTERS[precision](fp32, self.onnx(which, precision))


@contextmanager
def loaded(
    models: dict[str, nn.Module],
    backend: Backend,
    batch: int,
    threads: int,
    rewrites: Sequence[str] | None = None,
    seq_len: int | None = None,
) -> Iterator[dict[str, Step]]:
    """A timed step per model at ``batch`` (x ``seq_len`` tokens for a text encoder) on ``backend`` (ONNX files
    exported to a temporary folder for ort).

    Every model runs with ``rewrites`` (default: the backend's, ``Backend.rewrites``) applied where exact, as
    the deployed model would: a latency table and the closed loop time what is deployed.
    """
    if threads:
        torch.set_num_threads(threads)
    first = next(iter(models.values()))
    text = text_inputs(first, seq_len)
    shape = tuple(input_size(first)) if text is None else None
    names = backend.rewrites if rewrites is None else tuple(rewrites)
    models = {name: rewritten(model, names)[0] for name, model in models.items()}
    with tempfile.TemporaryDirectory(prefix="corp-latency-") as tmp:
        run = _Models(Path(tmp), models, shape, text)
        if backend.runtime == "onnxruntime":
            for name in models:
                run.export(name, backend.precision)
        yield {name: backend.load(run, name, False, threads)(batch) for name in models}


def time_models(
    models: dict[str, nn.Module],
    backend: Backend,
    batch: int,
    threads: int,
    method: Method,
    rewrites: Sequence[str] | None = None,
    seq_len: int | None = None,
) -> dict[str, list[float]]:
    """Seconds per forward of every model at ``batch`` on ``backend``, all interleaved in one loop (``loaded``)."""
    with loaded(models, backend, batch, threads, rewrites, seq_len) as steps:
        return interleaved(steps, method)


def time_against(
    reference: str,
    models: dict[str, nn.Module],
    backend: Backend,
    batch: int,
    threads: int,
    method: Method,
    seq_len: int | None = None,
) -> dict[str, float]:
    """Seconds per forward (p50) of every model, each timed in its own loop alternating with ``reference``.

    A model's time is its ratio to the reference in their loop times the reference's median over all loops:
    ratios of neighbouring iterations survive the load drift of a shared machine, which absolute times
    measured minutes apart do not (a grid of 14 deit_small models at batch 32 takes minutes).
    """
    with loaded(models, backend, batch, threads, None, seq_len) as steps:
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
    grid = latency.grid(shape, backend.equal_heads, modules)
    models = {name: with_widths(dense, None if w is None else [w] * shape.depth, fit) for name, w in grid.items()}
    if timer is None:
        dense_name = next(name for name, w in grid.items() if w == (shape.mlp, shape.head_dim, shape.head_dim))
        batch, threads, seq_len = table_key["batch"], table_key["threads"], table_key.get("seq_len")
        seconds = time_against(dense_name, models, backend, batch, threads, method, seq_len)
    else:
        seconds = timer(models)
    return latency.fit(table_key, shape, backend.equal_heads, seconds, modules)


def table_for(
    dense: nn.Module,
    table_key: dict[str, Any],
    backend: Backend,
    path: str | Path | None = None,
    say: Callable[[str], None] = lambda line: None,
    timer: Callable[[dict[str, nn.Module]], dict[str, float]] | None = None,
) -> LatencyTable:
    """``path`` checked against ``table_key``; else the cached table for that key; else measured now and cached.

    A text encoder's key names its sequence length (``key(seq_len=)``), checked against the model's positions."""
    text_inputs(dense, table_key.get("seq_len"))
    if path is not None:
        return latency.read(path, table_key)
    if (table := latency.cached(table_key)) is not None:
        say(f"latency table: cached {latency.cache_path(table_key)}")
        return table
    n = len(latency.grid(shape_of(dense), backend.equal_heads, removals(table_key)[0]))
    say(f"latency table: measuring {n} uniform-width models on {backend.name} at {latency.workload(table_key)}")
    start = time.perf_counter()
    table = build_table(dense, table_key, backend, timer=timer)
    latency.write(table, latency.cache_path(table_key))
    say(f"latency table: measured in {time.perf_counter() - start:.1f} s; cached {latency.cache_path(table_key)}")
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
    dense: nn.Module,
    pruned: nn.Module,
    backend: Backend,
    batch: int,
    threads: int,
    method: Method = LOOP_METHOD,
    seq_len: int | None = None,
) -> Timing:
    """Dense against pruned at ``batch`` (x ``seq_len`` tokens for text) on ``backend``, interleaved; the p50s and
    the noise band."""
    times = time_models({"dense": dense, "pruned": pruned}, backend, batch, threads, method, None, seq_len)
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
    k = table.key
    p50 = time_against("dense", models, backend, k["batch"], k["threads"], method, k.get("seq_len"))
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


@dataclass(frozen=True)
class Latency:
    """Where a latency budget is measured: on ``backend`` (``plan.speed.check_backend``) at ``batch`` inputs (of
    ``seq_len`` tokens for a text encoder); ``table``: a table file instead of the cached or newly measured one;
    ``rounds``: the closed loop's rounds (None: the speed is predicted, not checked: ``plan.loop.latency_loop``)."""

    backend: Backend
    batch: int = 32
    table: str | Path | None = None
    rounds: int | None = None
    seq_len: int | None = None


def latency_table(
    model: nn.Module,
    name: str,
    args: dict[str, Any],
    on: Latency,
    say: Callable[[str], None] = lambda line: None,
    depth: tuple[str, ...] = (),
    depth_fit: str = "affine-mean",
) -> LatencyTable:
    """The latency table a budget is planned with, for the dense ``model`` (``name`` and ``args``: what the cache
    knows it by): given, cached or measured now (with ``depth``, also each block's time with those modules replaced
    by their ``depth_fit`` stand-in: ``PruneConfig.depth``)."""
    text_inputs(model, on.seq_len)  # a decoder, or a sequence past the positions: one line, before timing
    table_key = key(name, args, on.backend, on.batch, torch.get_num_threads(), depth, depth_fit, on.seq_len)
    table = table_for(model, table_key, on.backend, on.table, say)
    say(latency.format_table(table))
    return table
