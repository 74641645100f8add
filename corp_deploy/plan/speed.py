"""Measured speed on the deployment backend: the latency table (``latency``) and the closed loop's timing.

The models a table times are built here (uniform widths through the family adapter, random weights: values do not
change a dense GEMM's time); where they run is handed in (``Meter``: ``bench.meter.BackendMeter`` exports and loads
them on a bench backend), so the plan never imports the exporters or the benchmarks and a plain sparsity prune
never loads them. Times are taken with ``base.timing``'s interleaved method; ``allocation`` plans on the result.

One code path for every family the table can time, through the family adapter (``families.adapter_for``): timm
ViTs (images of the model's input size) and BERT-family encoders (``families.hf.bert``: full-length random token ids
of ``seq_len`` tokens, the key's sequence length; its blocks are the BERT layers and its fixed cost the embeddings
and pooler). Decoders are refused (``timed_adapter``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from corp_deploy.base.env import module_versions
from corp_deploy.base.errors import CorpError
from corp_deploy.base.timing import Method, Step, Workload, interleaved
from corp_deploy.base.version import __version__
from corp_deploy.families import Adapter, adapter_for
from corp_deploy.formats.text import check_seq_len
from corp_deploy.plan import latency
from corp_deploy.plan.latency import LatencyTable, Shape, Timing

TABLE_METHOD = Method(warmup_iters=1, warmup_seconds=0.0, min_iters=4, min_seconds=0.0, round_iters=1)
"""Timing of a grid model against the dense one (``time_against``): 4 iterations each, alternating."""
LOOP_METHOD = Method(warmup_iters=2, warmup_seconds=0.0, min_iters=12, min_seconds=0.0, round_iters=2)
"""Timing of dense against pruned in the closed loop (rounds of 2, alternating)."""
MIN_BAND = 0.03
"""The smallest noise band claimed for a measured speedup: +-3%."""


class Meter(Protocol):
    """Where models are timed: what the plan needs of a runtime, handed in by whoever wires the API
    (``bench.meter.check_backend`` builds one on a bench backend), so the plan never loads the export stack."""

    @property
    def name(self) -> str:
        """What a table's key and the messages call it (``ort-cpu-fp32``)."""
        ...

    @property
    def equal_heads(self) -> bool:
        """Whether its fast attention needs one head width for Q, K and V: the table then measures tied widths."""
        ...

    def key_fields(self) -> dict[str, Any]:
        """What a block's time depends on here besides the model and workload: ``device``, ``precision``,
        ``libraries`` (module names whose versions the key records) and ``rewrites``."""
        ...

    def loaded(self, models: dict[str, nn.Module], workload: Workload) -> AbstractContextManager[dict[str, Step]]:
        """A timed step per model on ``workload`` (its batch, threads, rewrites and a text encoder's tokens)."""
        ...


def key(
    model: str,
    args: dict[str, Any],
    meter: Meter,
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
    fields = meter.key_fields()
    models = "timm" if seq_len is None else "transformers"
    libs = module_versions(["torch", models, *fields["libraries"]])
    return {
        "model": model,
        "args": args,
        "backend": meter.name,
        "device": fields["device"],
        "precision": fields["precision"],
        "batch": batch,
        **({} if seq_len is None else {"seq_len": seq_len}),
        "threads": threads,
        "versions": libs | {"corp_deploy": __version__},
        "rewrites": fields["rewrites"],
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


def check_inputs(model: nn.Module, seq_len: int | None) -> None:
    """One line when ``model`` cannot be timed at ``seq_len``: a text encoder without a sequence length (or one past
    its positions), an image model with one, a decoder."""
    if timed_adapter(model).modality != "text":
        if seq_len is not None:
            raise CorpError("a sequence length is for text encoders; this latency table times an image model")
        return
    if seq_len is None:
        raise CorpError("a text encoder's latency is timed at a sequence length: its table key needs seq_len")
    check_seq_len(seq_len, model.config)


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

    A width of ``latency.REMOVED`` replaces the module by a ``fit`` stand-in (``families.layers.AffineBranch``)."""
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


def time_models(
    models: dict[str, nn.Module],
    meter: Meter,
    batch: int,
    threads: int,
    method: Method,
    rewrites: Sequence[str] | None = None,
    seq_len: int | None = None,
) -> dict[str, list[float]]:
    """Seconds per forward of every model at ``batch`` on ``meter``, all interleaved in one loop."""
    check_inputs(next(iter(models.values())), seq_len)
    with meter.loaded(
        models, Workload(batch, threads, None if rewrites is None else tuple(rewrites), seq_len)
    ) as steps:
        return interleaved(steps, method)


def time_against(
    reference: str,
    models: dict[str, nn.Module],
    meter: Meter,
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
    check_inputs(models[reference], seq_len)
    with meter.loaded(models, Workload(batch, threads, None, seq_len)) as steps:
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
    meter: Meter,
    method: Method = TABLE_METHOD,
    timer: Callable[[dict[str, nn.Module]], dict[str, float]] | None = None,
) -> LatencyTable:
    """Measure the grid's uniform-width models (p50 of each) and fit the table. ``timer``: seconds per model."""
    shape = shape_of(dense)
    modules, fit = removals(table_key)
    grid = latency.grid(shape, meter.equal_heads, modules)
    models = {name: with_widths(dense, None if w is None else [w] * shape.depth, fit) for name, w in grid.items()}
    if timer is None:
        dense_name = next(name for name, w in grid.items() if w == (shape.mlp, shape.head_dim, shape.head_dim))
        batch, threads, seq_len = table_key["batch"], table_key["threads"], table_key.get("seq_len")
        seconds = time_against(dense_name, models, meter, batch, threads, method, seq_len)
    else:
        seconds = timer(models)
    return latency.fit(table_key, shape, meter.equal_heads, seconds, modules)


def table_for(
    dense: nn.Module,
    table_key: dict[str, Any],
    meter: Meter,
    path: str | Path | None = None,
    say: Callable[[str], None] = lambda line: None,
    timer: Callable[[dict[str, nn.Module]], dict[str, float]] | None = None,
) -> LatencyTable:
    """``path`` checked against ``table_key``; else the cached table for that key; else measured now and cached.

    A text encoder's key names its sequence length (``key(seq_len=)``), checked against the model's positions."""
    check_inputs(dense, table_key.get("seq_len"))
    if path is not None:
        return latency.read(path, table_key)
    if (table := latency.cached(table_key)) is not None:
        say(f"latency table: cached {latency.cache_path(table_key)}")
        return table
    n = len(latency.grid(shape_of(dense), meter.equal_heads, removals(table_key)[0]))
    say(f"latency table: measuring {n} uniform-width models on {meter.name} at {latency.workload(table_key)}")
    start = time.perf_counter()
    table = build_table(dense, table_key, meter, timer=timer)
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
    meter: Meter,
    batch: int,
    threads: int,
    method: Method = LOOP_METHOD,
    seq_len: int | None = None,
) -> Timing:
    """Dense against pruned at ``batch`` (x ``seq_len`` tokens for text) on ``meter``, interleaved; the p50s and
    the noise band."""
    times = time_models({"dense": dense, "pruned": pruned}, meter, batch, threads, method, None, seq_len)
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
    dense: nn.Module, table: LatencyTable, meter: Meter, n: int, seed: int = 0, method: Method = TABLE_METHOD
) -> list[dict[str, float]]:
    """Time ``n`` random mixed-width models, each against the dense one (``time_against``); the table's errors.

    ``error``: predicted / measured time - 1. ``speedup_error``: the same for the speedup over the dense model
    measured in the same loop, which machine-wide drift since the table was measured does not move.
    """
    shape, rng = shape_of(dense), np.random.default_rng(seed)
    widths = {f"mixed{i}": random_widths(shape, table.tied, rng) for i in range(n)}
    models = {"dense": dense} | {name: with_widths(dense, w) for name, w in widths.items()}
    k = table.key
    p50 = time_against("dense", models, meter, k["batch"], k["threads"], method, k.get("seq_len"))
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
    """Where a latency budget is measured: on ``meter`` (``bench.meter.check_backend``) at ``batch`` inputs (of
    ``seq_len`` tokens for a text encoder); ``table``: a table file instead of the cached or newly measured one;
    ``rounds``: the closed loop's rounds (None: the speed is predicted, not checked: ``plan.loop.latency_loop``)."""

    meter: Meter
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
    check_inputs(model, on.seq_len)  # a decoder, or a sequence past the positions: one line, before timing
    table_key = key(name, args, on.meter, on.batch, torch.get_num_threads(), depth, depth_fit, on.seq_len)
    table = table_for(model, table_key, on.meter, on.table, say)
    say(latency.format_table(table))
    return table
