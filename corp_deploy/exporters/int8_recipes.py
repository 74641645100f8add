"""INT8 recipes, and the choice among them: the fastest INT8 graph that passes the gate on this CPU (issue 43).

A user's one-line alternative to the project's INT8 is onnxruntime's own ``quantize_dynamic``; on MiniLM it is faster
than the static Q/DQ graph (docs/BENCHMARKS.md, "INT8 recipes"), on a ViT it is not, and which recipe is fastest
depends on the CPU's INT8 instructions (AVX-512 VNNI, AMX). So no recipe is chosen once for all: each is a small
function registered by name (``RECIPES``, ``register``), and ``choose_int8`` writes every candidate, races them on
onnxruntime's CPU provider in one race (``RACE``: successive elimination, interleaved, ``ort_timer``), and gates them
fastest first against the FP32 graph on the held-out data (the existing INT8 gate, ``int8_quant.compare_on``): the
first that passes is kept. Its cost is bounded: one race of three to eight calls a candidate and, in the usual case,
one gate (issue 49: seven recipes timed at batch 32 and all gated took 608 s of a deit_small run). The choice, every
candidate's timing and gate figures (where gated), and the CPU's features are written into the graph's metadata
(``int8_recipe``) and its sidecar; one line per graph says what was chosen and why.

Fusions: the FP32 graph is also put through onnxruntime's transformer optimizer (``fuse``: SkipLayerNormalization,
BiasGelu; ``bert`` for text encoders, ``vit`` for images); each fusable recipe is then a candidate on both graphs,
and the fused graph is kept only where it matches the FP32 graph within the FP32 tolerance on the held-out data,
checked once a candidate on it comes up to be gated (where a plain one passes first, the check, the fused FP32 graph
over every held-out sample, is not run: the record says so), so a fusion ships only where it is verified and faster.
The optimizer fuses no ``Attention`` in our exported graphs (its patterns expect the mask as ``(1 - mask) * -10000``
added to the scores and Q K^T scaled after the MatMul, while torch's exported SDPA scales Q and K each by sqrt(scale)
and masks with ``Where``), so ``attention.fuse_attention`` rewrites each layer's attention as ``MultiHeadAttention``
first; it also keeps ``quantize_dynamic`` from quantizing the two activation-by-activation MatMuls of every layer.

TensorRT parses Q/DQ graphs only: an INT8 engine is built where the chosen recipe is ``static`` (``int8_scheme``'s
format ``QDQ``), and skipped, saying how to get one, where the fastest passing recipe is another.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.base.env import cpu_features, describe_cpu
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import check_writable, staged
from corp_deploy.base.steps import each
from corp_deploy.base.timing import Method, Race, interleaved, race
from corp_deploy.exporters.compare import FP32, Comparison, Feed, Runner, Tolerance
from corp_deploy.exporters.int8_quant import (
    IMAGE_CALIB,
    Data,
    HeldOut,
    _inferred_copy_removed,
    _quiet_logging,
    _unit,
    calibration_data,
    compare_on,
    counted,
    float_graph,
    head,
    int8_record,
    quantize_int8,
    quantize_verified,
)
from corp_deploy.exporters.onnx_export import add_metadata, input_shape, load_onnx, onnx_files, read_metadata
from corp_deploy.exporters.runners import Memo, OrtRunner
from corp_deploy.exporters.smooth import SMOOTH_ALPHA, smooth
from corp_deploy.formats.run_folder import BASELINE, onnx_name, write_sidecar

TIME_BATCH = 32
"""The batch INT8 candidates are timed at (``--int8-batch-size``); a text graph's at its exported sequence length."""
TIME_METHOD = Method(warmup_iters=2, warmup_seconds=0.2, min_iters=5, min_seconds=0.5, round_iters=1)
TIME_REPEATS = 3
TRIAL_METHOD = Method(warmup_iters=0, warmup_seconds=0.0, min_iters=3, min_seconds=0.0, round_iters=1)
"""``prune-export``'s speed table: three interleaved calls per graph at the batch the graphs are timed at, their
median the p50, after one untimed call at batch 1 (``ort_timer``: the session's lazy set-up at a thirty-second of a
call's cost; the first full-batch call's larger buffers are the one outlier the median drops). Three calls where the
full timing makes 21 (``TIME_METHOD`` x ``TIME_REPEATS``: ``bench`` and the studies)."""
TRIAL_REPEATS = 1
RACE = Race()
"""The race of the candidates, at the batch the graphs are timed at, after the same untimed call: three calls each,
up to eight for those within reach of the leader (``base.timing.Race``). Three calls each picked deit_small's pruned
INT8 graph 4.5% slower than the exhaustive choice on the quiet Intel machine (static and dynamic raced 0.1% apart,
4.5% apart timed in full: docs/BENCHMARKS.md, "Scale: time to artifact"). Raced at batch 4 instead, deit_small's
candidates came out in another order than at batch 32 (dynamic per tensor first, static 12% faster at 32)."""
BASELINE_WHAT = "onnxruntime.quantization.quantize_dynamic(dense.onnx, per_channel=True, weight_type=QInt8)"


@dataclass(frozen=True)
class Job:
    """What every recipe may read: the calibration and held-out data of one FP32 graph, and the gate."""

    calibration: list[Feed]
    held_out: HeldOut
    tol: Tolerance
    method: str = "minmax"
    info: dict[str, Any] = field(default_factory=dict)
    smooth_alpha: float = SMOOTH_ALPHA
    say: Callable[[str], None] = print
    reference: Runner | None = None
    """The FP32 graph in onnxruntime (``choose_int8`` sets it, a ``runners.Memo``): run once per held-out input."""


@dataclass(frozen=True)
class Recipe:
    name: str
    write: Callable[[Path, Path, Job], None]
    """(FP32 graph, INT8 file, job): writes the INT8 graph with its ``int8_scheme`` metadata; raises ``CorpError``
    where it cannot (the static recipe when its own fallbacks still miss the gate)."""
    fusable: bool
    """Also a candidate on the fused FP32 graph (onnxruntime contrib ops: not a graph TensorRT parses)."""
    rescues: str | None = None
    """The recipe this one is a slower variant of, for where that one misses the gate (``smooth-dynamic`` is
    ``dynamic`` behind one more ``Mul`` per GEMM input): written and gated only after that one missed on the same
    graph, never raced against it."""
    stand_in: Callable[[Path, Path, Job], None] | None = None
    """Writes, cheaply, a graph with the nodes ``write``'s graph has (so as fast) for the race; ``write`` then runs
    only where the candidate comes up to be gated (static: its calibration pass over every calibration image)."""


RECIPES: dict[str, Recipe] = {}
AUTO = "auto"


def register(name: str, fusable: bool = True, rescues: str | None = None, stand_in: Callable | None = None) -> Callable:
    """Add a recipe to ``RECIPES`` under ``name`` (``--int8-recipe``); ``auto`` tries them all."""

    def add(write: Callable[[Path, Path, Job], None]) -> Callable[[Path, Path, Job], None]:
        RECIPES[name] = Recipe(name, write, fusable, rescues, stand_in)
        return write

    return add


STAND_IN_SAMPLES = 4
"""Calibration images (text: documents) of static's stand-in in the race: its ranges are never shipped."""


def _static_stand_in(src: Path, out: Path, job: Job) -> None:
    """Static's graph calibrated on ``STAND_IN_SAMPLES`` samples: the same Q/DQ nodes around the same GEMMs as
    calibrated on all of them (only the scales' values differ, and the INT8 kernels run the same whatever they are),
    so as fast. Its calibration over 256 images was the INT8 step's longest part where static then lost the race."""
    quantize_int8(src, out, [head(job.calibration[0], STAND_IN_SAMPLES)], job.method, job.info)


@register("static", fusable=False, stand_in=_static_stand_in)
def _static(src: Path, out: Path, job: Job) -> None:
    """The project's static Q/DQ (``int8_quant.quantize_verified``): symmetric, GEMM inputs only, SmoothQuant and
    float GEMMs while it misses the gate."""
    calibration, held_out, tol, info = job.calibration, job.held_out, job.tol, job.info
    quantize_verified(src, out, calibration, held_out, tol, job.method, info, job.say, job.smooth_alpha, job.reference)


def dynamic_int8(src: Path, out: Path, per_channel: bool, metadata: dict[str, Any] | None = None) -> None:
    """onnxruntime's ``quantize_dynamic`` with its defaults (what a user's one line does): INT8 weights (per output
    channel or per tensor), activations quantized at run time per tensor (``DynamicQuantizeLinear``,
    ``MatMulInteger``/``DynamicQuantizeMatMul``); the scheme, and ``metadata``, recorded in the graph."""
    q = require("onnxruntime.quantization", "INT8 quantization")
    external = len(onnx_files(src)) > 1
    try:
        with warnings.catch_warnings(), _quiet_logging(), _inferred_copy_removed(src):
            warnings.simplefilter("ignore")
            q.quantize_dynamic(
                str(src),
                str(out),
                weight_type=q.QuantType.QInt8,
                per_channel=per_channel,
                use_external_data_format=external,
            )
    except Exception as e:
        raise CorpError(f"dynamic INT8 of {src} failed: {type(e).__name__}: {first_line(e)}") from None
    import onnx

    proto = load_onnx(out, weights=False)
    scheme = {
        "format": "QOperator (dynamic)",
        "activations": "uint8 asymmetric, per tensor, quantized at run time",
        "weights": f"int8 symmetric, per {'channel' if per_channel else 'tensor'}",
        "quantizer": "onnxruntime.quantization.quantize_dynamic",
    }
    add_metadata(proto, {"precision": "int8", "int8_scheme": scheme, "int8_smoothing": {}, **(metadata or {})})
    onnx.save(proto, str(out))


def calibration(job: Job, method: str) -> dict[str, Any]:
    """``int8_calibration`` of a recipe that is not calibrated the static way: the data the choice had (the
    calibration sample, and the held-out one its gate read, per folder) and what ``method`` made of it."""
    return {"int8_calibration": {**counted(job.calibration), "method": method, **job.info}}


DYNAMIC = "none: activation ranges are taken at run time (the calibration sample is not read)"


@register("dynamic")
def _dynamic(src: Path, out: Path, job: Job) -> None:
    dynamic_int8(src, out, per_channel=True, metadata=calibration(job, DYNAMIC))


@register("dynamic-per-tensor")
def _dynamic_per_tensor(src: Path, out: Path, job: Job) -> None:
    dynamic_int8(src, out, per_channel=False, metadata=calibration(job, DYNAMIC))


@register("smooth-dynamic", rescues="dynamic")
def _smooth_dynamic(src: Path, out: Path, job: Job) -> None:
    """SmoothQuant's migration (``smooth``, strength ``--smooth-alpha``) then dynamic INT8: the outlier channels
    (BERT's channel 99) move into the per-channel weight scales, so the per-tensor run-time activation scale fits
    the rest (all-MiniLM-L6-v2: worst held-out token 0.965 dynamic, 0.985 smoothed)."""
    if job.smooth_alpha <= 0:
        raise CorpError("smoothing is off (--smooth-alpha 0)")
    smoothed = out.with_name(f"smoothed-{out.name}")
    inputs = smooth(src, smoothed, job.calibration, job.smooth_alpha)
    smoothing = {"int8_smoothing": {"alpha": job.smooth_alpha, "inputs": inputs}}
    method = "smoothing: each GEMM input's channel max |x| over the calibration sample; activations at run time"
    dynamic_int8(smoothed, out, per_channel=True, metadata=calibration(job, method) | smoothing)
    for f in onnx_files(smoothed):
        f.unlink()


def parse_recipes(text: str) -> tuple[str, ...]:
    """``--int8-recipe``: ``auto`` (every recipe) or a comma list of ``RECIPES``' names. The ONNX graph's recipe is
    chosen for onnxruntime, never narrowed for an engine: an INT8 engine is built only from a Q/DQ graph
    (``pipeline.export_run`` skips it, saying how to get one, where the fastest passing recipe is another)."""
    if text == AUTO:
        return tuple(RECIPES)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise CorpError(f"--int8-recipe takes auto or a comma list of {', '.join(RECIPES)}, got {text!r}")
    return names


def fuse(src: Path, dst: Path) -> dict[str, int]:
    """Attention as ``MultiHeadAttention`` (``attention.fuse_attention``: per-layer and unequal Q/K and V widths),
    then onnxruntime's transformer optimizer (``bert`` for a text encoder, ``vit`` for images; heads and width
    detected per graph, as a pruned graph's differ per layer) -> ``dst``; returns the fused ops' counts.
    Unverified: ``fused_graph`` checks it."""
    from corp_deploy.exporters.attention import fuse_attention  # onnx's protobuf API, read only here

    optimizer = require("onnxruntime.transformers.optimizer", "INT8 fusions")
    graph = load_onnx(src)
    kind = "bert" if read_metadata(graph).get("modality") == "text" else "vit"
    attention = fuse_attention(graph)
    require("onnx", "INT8 fusions").save(graph, str(dst))
    with warnings.catch_warnings(), _quiet_logging():
        warnings.simplefilter("ignore")
        model = optimizer.optimize_model(str(dst), model_type=kind, num_heads=0, hidden_size=0, opt_level=0)
        model.save_model_to_file(str(dst))
    counts = model.get_fused_operator_statistics() | {"MultiHeadAttention": attention}
    return {op: n for op, n in counts.items() if n}


def fused_unchecked(src: Path, dst: Path) -> tuple[Path | None, dict]:
    """(the fused graph, its record: the fused ops), or (None, why not); not yet compared with ``src``
    (``check_fused``)."""
    if len(onnx_files(src)) > 1:
        return None, {"skipped": "the graph keeps its weights in external data (over 2 GB); not fused"}
    try:
        fused = fuse(src, dst)
    except Exception as e:  # the optimizer's pattern matching is not ours to fix: the graph stays unfused
        return None, {"skipped": f"onnxruntime's transformer optimizer failed: {type(e).__name__}: {first_line(e)}"}
    if not fused:
        return None, {"skipped": "onnxruntime's transformer optimizer fused nothing"}
    return dst, {"fused": fused}


def check_fused(fused: Path, record: dict, reference: Runner, held_out: HeldOut) -> bool:
    """Whether the fused graph matches the FP32 graph (``reference``) within the FP32 tolerance on the held-out data;
    its figures, and why it is not kept where it misses, go into ``record``."""
    comparisons = compare_on(reference, OrtRunner(fused, "cpu"), held_out)
    record |= {"cosine": min(c.cosine for c in comparisons), "rel_error": max(c.rel_error for c in comparisons)}
    if not all(c.within(FP32) for c in comparisons):
        record["skipped"] = f"the fused graph does not match the FP32 graph within {FP32}"
        return False
    return True


def fused_graph(src: Path, dst: Path, reference: Runner, held_out: HeldOut) -> tuple[Path | None, dict]:
    """(the fused graph, its record), or (None, why not): kept only where it fuses something and matches ``src``
    within the FP32 tolerance on the held-out data."""
    fused, record = fused_unchecked(src, dst)
    return (fused, record) if fused and check_fused(fused, record, reference, held_out) else (None, record)


Timer = Callable[[dict[str, Path], Feed], dict[str, float]]
"""(graphs by name, one batch) -> each graph's p50 latency in ms, all measured in the same run."""


def ort_timer(
    threads: int | None = None, method: Method = TIME_METHOD, repeats: int = TIME_REPEATS, rule: Race | None = None
) -> Timer:
    """onnxruntime's CPU provider: every graph run once on one sample (untimed, cheap), warmed up as ``method``
    says, then timed interleaved (``base.timing.interleaved``), ``repeats`` times; each graph's p50 is the median
    over the repeats. With ``rule``: raced instead (``base.timing.race``), each p50 the median of its calls."""

    def time_graphs(graphs: dict[str, Path], feed: Feed) -> dict[str, float]:
        runners = {name: OrtRunner(path, "cpu", threads) for name, path in graphs.items()}
        for runner in runners.values():
            runner(head(feed, 1))
        steps = {name: _timed(runner, feed) for name, runner in runners.items()}
        if rule is not None:
            return {name: float(np.median(calls)) * 1e3 for name, calls in race(steps, rule).items()}
        runs = [interleaved(steps, method, warm_up=i == 0) for i in range(repeats)]
        return {name: float(np.median([np.median(r[name]) for r in runs]) * 1e3) for name in graphs}

    return time_graphs


def _timed(runner: OrtRunner, feed: Feed) -> Callable[[], float]:
    def step() -> float:
        start = time.perf_counter()
        runner(feed)
        return time.perf_counter() - start

    return step


def timing_feed(proto, batch: int) -> Feed:
    """A batch as the graph is exported for: ``batch`` sequences of its ``seq_len`` tokens (all real), or images."""
    rng = np.random.default_rng(batch)
    meta = read_metadata(proto)
    if meta.get("modality") == "text":
        ids = rng.integers(0, meta["vocab_size"], (batch, meta["seq_len"]))
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return rng.standard_normal((batch, *input_shape(proto)), dtype=np.float32)


def shape_of(feed: Feed) -> str:
    """``batch 32 x 128 tokens`` or ``batch 32``."""
    if isinstance(feed, dict):
        return f"batch {feed['input_ids'].shape[0]} x {feed['input_ids'].shape[1]} tokens"
    return f"batch {len(feed)}"


@dataclass
class Candidate:
    recipe: str
    graph: str
    """``plain`` (the FP32 graph as exported) or ``fused`` (``fused_graph``)."""
    path: Path
    comparisons: list[Comparison] = field(default_factory=list)
    error: str | None = None
    p50_ms: float | None = None
    stand_in: bool = False
    """``path`` holds the recipe's stand-in (``Recipe.stand_in``): raced, not yet written for real."""
    raced_stand_in: bool = False

    @property
    def name(self) -> str:
        return self.recipe if self.graph == "plain" else f"{self.recipe} (fused)"

    def passed(self, tol: Tolerance) -> bool:
        return self.error is None and bool(self.comparisons) and all(c.within(tol) for c in self.comparisons)

    def miss(self) -> str:
        """The gate's figures, or why there are none."""
        if not self.comparisons:
            return self.error or "not gated"
        cosine, rel = min(c.cosine for c in self.comparisons), max(c.rel_error for c in self.comparisons)
        return f"cosine {cosine:.6f}, relative error {rel:.3f}"

    def as_dict(self, tol: Tolerance) -> dict[str, Any]:
        figures = {}
        if self.comparisons:
            figures = {"cosine": min(c.cosine for c in self.comparisons)}
            figures["rel_error"] = max(c.rel_error for c in self.comparisons)
        error = {"error": self.error} if self.error else {}
        passed = self.passed(tol) if self.comparisons or self.error else None  # None: slower than the chosen, not gated
        record = {"recipe": self.recipe, "graph": self.graph, "passed": passed, **figures, **error}
        raced = {"raced": "a stand-in with the same nodes (Recipe.stand_in)"} if self.raced_stand_in else {}
        return record | {"p50_ms": self.p50_ms} | raced


def _write(recipe: Recipe, src: Path, candidate: Candidate, job: Job, stand_in: bool = False) -> Candidate:
    """Write one candidate (``stand_in``: the recipe's stand-in where it has one); a recipe that raises is a failed
    candidate (the static recipe gates itself and refuses in one line with its measured figures)."""
    candidate.path.parent.mkdir(parents=True, exist_ok=True)
    candidate.stand_in = stand_in and recipe.stand_in is not None
    candidate.raced_stand_in |= candidate.stand_in
    try:
        (recipe.stand_in if candidate.stand_in else recipe.write)(src, candidate.path, job)
    except CorpError as e:
        candidate.error = first_line(e)
    return candidate


def _nodes(path: Path) -> list[str]:
    """A graph's operators in order: what its speed depends on (not its weights' or scales' values)."""
    return [n.op_type for n in load_onnx(path, weights=False).graph.node]


def _race(candidates: Sequence[Candidate], feed: Feed, timer: Timer | None) -> None:
    """Race ``candidates`` in one interleaved run (``timer``; onnxruntime CPU, ``RACE``); set their p50s."""
    times = (timer or ort_timer(rule=RACE))({c.name: c.path for c in candidates}, feed)
    for c in candidates:
        c.p50_ms = times[c.name]


def _order(candidate: Candidate) -> float:
    """Gating order: fastest first."""
    return candidate.p50_ms or 0.0


def _gate(candidate: Candidate, job: Job) -> bool:
    """Whether ``candidate`` passes the gate against the FP32 graph (``job.reference``) on the held-out data."""
    candidate.comparisons = compare_on(job.reference, OrtRunner(candidate.path, "cpu"), job.held_out)
    return candidate.passed(job.tol)


def choose_int8(
    src: Path,
    out: Path,
    job: Job,
    recipes: Sequence[str] = (AUTO,),
    batch: int = TIME_BATCH,
    timer: Timer | None = None,
    keep: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Write the fastest of ``recipes``' INT8 graphs of ``src`` that passes the gate to ``out`` (callers stage it),
    with its sidecar; return its record. Refuses, in one line naming every candidate's miss, where none passes.
    ``keep``: candidate name -> a path its graph is copied to where it was written for real (one file): the
    quantize-only baseline is the ``dynamic`` candidate of ``dense.onnx``, made once.

    Bounded: every candidate is written (seconds each; static as its stand-in, ``Recipe.stand_in``) and raced once
    at ``batch`` (``timer``; onnxruntime CPU, ``TRIAL_METHOD``), then gated fastest first until one passes: the gate
    (the slow part: every held-out sample through two graphs) runs on the chosen candidate and on the faster ones
    that miss it, never on the slower ones, and the FP32 reference runs once for all (``runners.Memo``). A stand-in
    is written for real when it comes up to be gated; where that graph's nodes differ from the stand-in's (static's
    fallbacks: smoothing, GEMMs kept float), it is raced again with the candidates left. A recipe that ``rescues``
    another (``smooth-dynamic``: its own calibration pass, minutes on a ViT) is written only where the one it rescues
    missed the gate. The fused FP32 graph is compared with ``src`` (``check_fused``) only when a candidate on it
    comes up to be gated; where it misses, every candidate on it is dropped.
    """
    start = time.perf_counter()
    names = parse_recipes(",".join(recipes))
    if job.reference is None:
        job = replace(job, reference=Memo(OrtRunner(src, "cpu")))
    with tempfile.TemporaryDirectory(prefix=".int8-recipes-", dir=out.parent) as tmp:
        graphs: dict[str, Path] = {"plain": src}
        fusion: dict[str, Any] = {"skipped": "no recipe that reads a fused graph was asked for"}
        if any(RECIPES[n].fusable for n in names):
            fused, fusion = fused_unchecked(src, Path(tmp) / "fused.onnx")
            graphs |= {"fused": fused} if fused else {}
        todo = [Candidate(n, g, Path(tmp) / f"{n}.{g}" / out.name) for n in names for g in graphs]
        todo = [c for c in todo if RECIPES[c.recipe].fusable or c.graph == "plain"]
        rescuers = {(RECIPES[c.recipe].rescues, c.graph): c for c in todo if RECIPES[c.recipe].rescues in names}
        first = [(c.name, c) for c in todo if c not in rescuers.values()]
        raced = len(first) > 1
        candidates = [
            _write(RECIPES[c.recipe], graphs[c.graph], c, job, stand_in=raced)
            for c in each("INT8 candidate", first, job.say)
        ]
        written = [c for c in candidates if c.error is None]
        feed = timing_feed(load_onnx(src, weights=False), batch)
        if len(written) > 1:
            _race(written, feed, timer)
        best = None
        left = sorted(written, key=_order)
        while left:
            c = left.pop(0)
            unchecked = c.graph == "fused" and "cosine" not in fusion  # checked once, where a fused one may ship
            if unchecked and not check_fused(graphs["fused"], fusion, job.reference, job.held_out):
                for f in [c, *left]:
                    f.error = fusion["skipped"] if f.graph == "fused" else f.error
                left = [f for f in left if f.graph != "fused"]
                continue
            if c.stand_in:
                job.say(f"  INT8 candidate {c.name}: the fastest left of the race; written from all calibration data")
                raced_nodes = _nodes(c.path)
                if _write(RECIPES[c.recipe], graphs[c.graph], c, job).error is not None:
                    continue
                if left and _nodes(c.path) != raced_nodes:  # not the graph raced: race it with those left
                    _race([c, *left], feed, timer)
                    left = sorted([c, *left], key=_order)
                    continue
            if _gate(c, job):
                best = c
                break
            if rescuer := rescuers.pop((c.recipe, c.graph), None):  # as fast as it was, less one Mul per GEMM
                job.say(f"  INT8 candidate {rescuer.name}: {c.name} missed the gate ({c.miss()})")
                candidates.append(_write(RECIPES[rescuer.recipe], graphs[rescuer.graph], rescuer, job))
                if rescuer.error is None and _gate(rescuer, job):
                    best = rescuer
                    break
        if best is None:
            tried = "; ".join(f"{c.name}: {c.miss()}" for c in candidates)
            gate = f"cosine (min {job.tol.min_cosine}), relative error (max {job.tol.max_rel_error:g})"
            raise CorpError(
                f"INT8 ONNX {out.name} against {src.name} on held-out {_unit(job.held_out)}: no INT8 recipe passes "
                f"the gate, {gate}: {tried}; if this is expected, loosen --tol-cosine/--tol-rel"
            )
        if "fused" in fusion and "cosine" not in fusion:
            fusion["checked"] = "no: no candidate on the fused graph came up to be gated (a faster one passed)"
        choice = _choice(best, candidates, job.tol, feed, fusion, recipes)
        for c in [c for c in candidates if c.name in (keep or {}) and c.error is None and not c.stand_in]:
            if len(onnx_files(c.path)) == 1:
                shutil.copyfile(c.path, keep[c.name])
        for f in onnx_files(best.path):
            os.replace(f, out.parent / f.name)
    import onnx

    proto = load_onnx(out, weights=False)
    add_metadata(proto, {"int8_recipe": choice})
    onnx.save(proto, str(out))
    job.say(f"{out.name}: INT8 recipe {best.name}: {choice['why']}")
    record = int8_record(src, out, best.comparisons, job.held_out, job.tol, time.perf_counter() - start)
    write_sidecar(out, record)
    return record


def _choice(
    best: Candidate,
    candidates: list[Candidate],
    tol: Tolerance,
    feed: Feed,
    fusion: dict[str, Any],
    recipes: Sequence[str],
) -> dict[str, Any]:
    """The ``int8_recipe`` record: what was chosen and why, every candidate, how they were timed, and the CPU."""
    cpu = cpu_features()
    failed = [c for c in candidates if c.error or (c.comparisons and not c.passed(tol))]
    raced = [c for c in candidates if c.p50_ms is not None]
    if rescued := [c for c in raced if (c.recipe, c.graph) == (RECIPES[best.recipe].rescues, best.graph)]:
        why = f"{rescued[0].name} behind one Mul per GEMM input, where {rescued[0].name} ({rescued[0].p50_ms:.1f} ms, "
        why += f"the fastest left of {len(raced)} raced at {shape_of(feed)}) missed the gate"
    elif raced:
        others = ", ".join(f"{c.name} {c.p50_ms:.1f} ms" for c in raced if c is not best)
        why = f"the fastest that passes of {len(raced)} raced, {best.p50_ms:.1f} ms against {others}"
        why += f" ({shape_of(feed)}, onnxruntime CPU, {describe_cpu(cpu)}; the slower ones not gated)"
    else:
        why = "the only candidate that passes the gate" if len(candidates) > 1 else "the only candidate asked for"
    if failed:
        why += "; missed the gate: " + ", ".join(f"{c.name} ({c.miss()})" for c in failed)
    timing = {"runtime": "onnxruntime CPU", "shape": shape_of(feed), "statistic": "p50 ms, median of its calls"}
    return {
        "chosen": best.recipe,
        "graph": best.graph,
        "asked": list(recipes),
        "why": why,
        "candidates": [c.as_dict(tol) for c in candidates],
        "fusion": fusion,
        "timing": timing | {"interleaved": True, "race": RACE.as_dict()},
        "cpu": cpu,
    }


def baseline_int8(src: Path, out: Path, job: Job, written: Path | None = None) -> dict[str, Any]:
    """Write the quantize-only baseline of the dense graph ``src`` to ``out`` (callers stage it): what a user gets
    from onnxruntime in one line without pruning (``BASELINE_WHAT``), the reference every pruned INT8 graph is held
    to. Its gate figures are recorded, not enforced: it is the alternative, not an artifact of ours. ``written``: that
    graph as the recipe choice already wrote it (its ``dynamic`` candidate, ``choose_int8(keep=...)``), if it did."""
    start = time.perf_counter()
    if written is not None and written.is_file():
        os.replace(written, out)
    else:
        dynamic_int8(src, out, per_channel=True, metadata=calibration(job, DYNAMIC))
    comparisons = compare_on(job.reference or OrtRunner(src, "cpu"), OrtRunner(out, "cpu"), job.held_out)
    passes = all(c.within(job.tol) for c in comparisons)
    import onnx

    proto = load_onnx(out, weights=False)
    add_metadata(proto, {"int8_baseline": {"what": BASELINE_WHAT, "passes_gate": passes}})
    onnx.save(proto, str(out))
    record = int8_record(src, out, comparisons, job.held_out, job.tol, time.perf_counter() - start)
    write_sidecar(out, record)
    return record


def int8_speed(
    graphs: Sequence[Path],
    records: list[dict[str, Any]],
    batch: int = TIME_BATCH,
    timer: Timer | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time ``graphs`` (the INT8 graphs and the quantize-only baseline, by file) in one run and write into each INT8
    record (by its ``file``) its p50 and its speed against the baseline; returns the timing. The summary's speed
    columns read it. Three calls a graph (``TRIAL_METHOD``, where the full method's 21 were 105 batch-32 calls of a
    deit_small run's five graphs); the FP32 graphs are ``bench``'s to time (they were 11 of this table's 18 s on
    deit_small, for one column nobody gated on), with its own method."""
    paths = {g.name: g for g in graphs}
    feed = timing_feed(load_onnx(graphs[0], weights=False), batch)
    p50 = (timer or ort_timer(method=TRIAL_METHOD, repeats=TRIAL_REPEATS))(paths, feed)
    base = p50.get(onnx_name(BASELINE, "int8"))
    cpu = cpu_features()
    timing = {"shape": shape_of(feed), "runtime": "onnxruntime CPU", "graphs_p50_ms": p50, "cpu": cpu}
    timing |= {"method": TRIAL_METHOD.as_dict(), "repeats": TRIAL_REPEATS, "interleaved": True}
    for r in records:
        if r["file"] in p50:
            ms = p50[r["file"]]
            r["speed"] = timing | {"p50_ms": ms, "vs_baseline": base / ms if base else None}
    say(f"timed {len(p50)} graphs interleaved at {timing['shape']} (their p50s: in the summary)")  # said once, there
    return timing


def quantize_graphs(
    pairs: Sequence[tuple[Path, Path]],
    source: str | Path,
    tol: Tolerance,
    num_calib: int = IMAGE_CALIB,
    num_verify: int = 64,
    seed: int = 0,
    method: str = "minmax",
    workers: int = 0,
    overwrite: bool = False,
    text: Callable[[Any], Data] | None = None,
    say: Callable[[str], None] = print,
    smooth_alpha: float = SMOOTH_ALPHA,
    recipes: Sequence[str] = ("static",),
    batch: int = 32,
    timer: Callable | None = None,
    baseline: bool = False,
) -> list[dict[str, Any]]:
    """Quantize each (FP32 graph, INT8 file) pair, verified; every graph is checked before any data is read.

    Images are decoded once for graphs with the same preprocessing (dense and pruned of one model). A text
    encoder's graph needs ``text``: graph -> its ``Data`` (tokenized by the caller: the tokenizer is the model's,
    which this library does not load). Each INT8 file and its ``.json`` record appear only when verified.
    ``recipes`` (``auto`` or names) are the candidates, the fastest that passes is kept, timed at
    ``batch`` by ``timer`` (onnxruntime CPU by default). ``baseline``: also the quantize-only baseline of the pair
    whose graph is ``dense.onnx`` (``baseline_int8``), and every INT8 graph timed beside it.
    """
    protos = [float_graph(src) for src, _ in pairs]
    for (src, _), proto in zip(pairs, protos, strict=True):
        if text is None and read_metadata(proto).get("modality") == "text":
            raise CorpError(f"{src} is a text encoder: its INT8 calibrates on text documents, which were not given")
    dense = [
        out.with_name(onnx_name(BASELINE, "int8")) for src, out in pairs if baseline and src.name == onnx_name("dense")
    ]
    for out in [out for _, out in pairs] + dense:
        check_writable(out, overwrite)
    info = {"source": str(source), "seed": seed}
    data: dict[str, Data] = {}
    records = []
    for (src, out), proto in zip(pairs, protos, strict=True):
        key = json.dumps([str(proto.graph.input), read_metadata(proto).get("preprocessing")])
        if key not in data:
            load = text or (lambda p: calibration_data(source, p, num_calib, num_verify, seed, workers))
            data[key] = load(proto)
        calib, held, folders = data[key]
        reference = Memo(OrtRunner(src, "cpu"))  # the recipes' gates and the baseline's read it once
        job = Job(calib, held, tol, method, info | {"folders": folders}, smooth_alpha, say, reference)
        is_dense = bool(dense) and src.name == onnx_name("dense")
        with tempfile.TemporaryDirectory(prefix=".baseline-", dir=out.parent) as hold:
            keep = {"dynamic": Path(hold) / BASELINE} if is_dense else {}
            with staged(out, overwrite) as stage:
                records.append(choose_int8(src, stage / out.name, job, recipes, batch, timer, keep))
            if is_dense:
                with staged(dense[0], overwrite) as stage:
                    base = baseline_int8(src, stage / dense[0].name, job, keep["dynamic"])
    if dense:
        records.append(base)  # last: the reference row beside dense and pruned
        int8_speed([*(out for _, out in pairs), *dense], records, batch, timer, say)
    return records
