"""FP32 ONNX -> static INT8 ONNX in Q/DQ form, calibrated on real inputs (images, or a text encoder's documents) and
verified on held-out ones.

The quantizer is onnxruntime's (``onnxruntime.quantization.quantize_static``); nothing here
computes a scale. Its settings are the ones TensorRT accepts, so ONE graph serves onnxruntime's CPU
INT8 kernels and TensorRT(-RTX) INT8 engines: Q/DQ format, signed INT8 activations and weights,
symmetric (zero point 0) for both, per-channel weight scales, float bias. Quantized are the inputs of the GEMMs
with a weight (``INT8_OPS`` with a constant input: the linear layers and the patch embedding), which
hold ~90% of a ViT's MACs; their outputs, and every other reader of their inputs (``float_elsewhere``), stay
float, as NVIDIA's Q/DQ placement for TensorRT has it. Float stay LayerNorm, Softmax, GELU, the residual adds
and the two attention matmuls (both inputs activations): on DINOv2-S quantizing those too dropped the worst
held-out feature cosine from 0.990 to 0.939 (docs/BENCHMARKS.md, INT8). Calibration is min-max:
percentile clipping (99.999) did worse (0.929) on DINOv2's outlier channels and held 10 GB. What
stayed float is written into the graph's ``metadata_props`` (``int8_float_ops``).

Outliers (DINOv2 under calibration shift, BERT-family encoders): when the all-GEMM graph misses the gate, each
GEMM input's outlier channels are first migrated into its weights (SmoothQuant, ``corp_deploy.exporters.smooth``,
an exact transform) and the graph quantized again; while it still misses, the worst-quantized GEMMs stay float,
one at a time, until it passes (``quantize_verified``). Each GEMM's local
error is measured once on calibration data, as the signal-to-quantization-noise ratio of its output under Q/DQ
of its input and weight (``gemm_errors``, from onnxruntime's ``qdq_loss_debug``), and ranked worst first;
the ranges are calibrated once (``calibration_cache_path``), so each step is a re-quantization and a check.
The GEMMs kept float and why are in the graph's metadata (``int8_float_gemms``) and its record.

Calibration uses the same seeded sample CORP reads (``corp_deploy.formats.data.sample``), read through
``corp_deploy.formats.calibration.folder_split``: the first ``num_calib`` images of the seeded permutation
calibrate, the next ``num_verify`` (never seen by the calibrator) verify, so ``--num-calib 256`` calibrates on a
subset of a 4000-image CORP calibration.
Text encoders take feeds of ``input_ids`` and ``attention_mask`` instead (built by the caller from the text
folder's calibration and held-out documents, ``corp_deploy.formats.text.int8_feeds``); their gate compares the last
hidden state at real tokens only.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.compare import Comparison, Feed, Runner, Tolerance, check, compare_runners, summary
from corp_deploy.exporters.onnx_export import (
    add_metadata,
    check_onnx,
    graph_precision,
    input_shape,
    load_onnx,
    onnx_bytes,
    onnx_files,
    onnx_sha256,
    read_metadata,
)
from corp_deploy.exporters.smooth import SMOOTH_ALPHA, smooth
from corp_deploy.formats.calibration import ImageSplit, folder_split, noise_split
from corp_deploy.formats.data import SYNTHETIC
from corp_deploy.formats.run_folder import write_sidecar

INT8_OPS = ("MatMul", "Gemm", "Conv")
"""Op types quantized where one input is a weight (linear layers, patch embedding)."""
ATTENTION_MATMUL = "MatMul (attention: both inputs are activations)"

QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearMatMul",
        "QLinearConv",
        "MatMulInteger",
        "ConvInteger",
        "MatMulIntegerToFloat",
    }
)
"""Ops that mark a graph as already quantized (Q/DQ, QOperator or dynamic quantization)."""

SCHEME = {
    "format": "QDQ",
    "activations": "int8 symmetric, per tensor, read by the GEMMs only",
    "gemm_outputs": "float",
    "weights": "int8 symmetric, per channel",
    "bias": "float",
    "quantizer": "onnxruntime.quantization.quantize_static",
}
CALIB_METHODS = ("minmax", "percentile", "entropy")
ImageBatches = Iterable[np.ndarray]
Batches = Iterable[Feed]
"""Calibration batches: image arrays, or a text encoder's feeds by input name."""
HeldOut = ImageBatches | dict[str, np.ndarray]
"""Held-out data: image batches (run as one), or one text feed."""
Data = tuple[list[Feed], HeldOut, dict[str, dict[str, int]]]
"""(calibration batches, held-out data, how many of each came from every folder)."""
IMAGE_CALIB = 64
"""Calibration images of static INT8 by default (``--int8-calib``). Min-max ranges only widen with more images, and
the held-out gate did not improve with them: on DINOv2 ViT-S/14 (real weights, digits, the same 64 held-out images)
static calibrated on the first 64 images read a worst cosine of 0.9867 (dense) and 0.9953 (pruned), on 256 0.9768 and
0.9948, in 3-6x the time (docs/BENCHMARKS.md, "Scale: time to artifact")."""
TEXT_CALIB = 256
"""A text encoder's calibration documents by default: no evidence on text for fewer (smoothing reads their maxima)."""
RANK_SAMPLES = 8
"""Calibration samples whose activations rank the GEMMs by quantization error (all activations are held)."""
CALIB_CHUNK = 8
"""Samples per call of min-max calibration: onnxruntime's calibration session (its own arena, graph unoptimized)
held over 1.5 GB at deit_small's batch 32; the ranges are the same at any split (a min and a max merge exactly)."""


def is_quantized(proto) -> bool:
    return read_metadata(proto).get("precision") == "int8" or any(n.op_type in QUANTIZED_OPS for n in proto.graph.node)


def data_config(proto) -> dict[str, Any]:
    """The timm eval preprocessing recorded in the graph by ``export``; without it, no calibration."""
    meta = read_metadata(proto)
    if "preprocessing" not in meta:
        raise CorpError(
            "the ONNX graph has no preprocessing metadata (mean/std); export it with `corp-deploy export` "
            "or `prune-export` so calibration images are preprocessed as the model expects"
        )
    return {"input_size": tuple(input_shape(proto)), **meta["preprocessing"]}


class _Reader:
    """onnxruntime's ``CalibrationDataReader`` protocol over in-memory batches (an image array goes to the
    graph's one input, a text feed is already by name)."""

    def __init__(self, name: str, batches: Batches) -> None:
        self.name, self.batches = name, iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        x = next(self.batches, None)
        if x is None:
            return None
        return x if isinstance(x, dict) else {self.name: x}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self.get_next, None)


def samples(x: Feed) -> int:
    """Images or sequences in a batch."""
    return len(x["input_ids"] if isinstance(x, dict) else x)


def chunks(batches: Batches, n: int) -> Iterator[Feed]:
    """``batches`` as batches of at most ``n`` samples, in order."""
    for x in batches:
        for i in range(0, samples(x), n):
            yield head(x, n, i)


def head(x: Feed, n: int, start: int = 0) -> Feed:
    """``n`` samples of a batch from ``start`` (the first ``n``)."""
    end = start + n
    return {k: v[start:end] for k, v in x.items()} if isinstance(x, dict) else x[start:end]


def activation_gemms(proto) -> list[str]:
    """Names of the ``INT8_OPS`` nodes without a constant input: attention's Q K^T and A V, kept float."""
    constants = {t.name for t in proto.graph.initializer}
    constants |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in proto.graph.node if n.op_type in INT8_OPS and not constants & set(n.input)]


def float_ops(proto) -> list[str]:
    """What stays float: every op type but ``INT8_OPS``, and the attention matmuls if there are any."""
    kept = sorted({n.op_type for n in proto.graph.node} - set(INT8_OPS))
    return kept + ([ATTENTION_MATMUL] if activation_gemms(proto) else [])


def float_graph(src: str | Path):
    """The FP32 graph to quantize (without weights), refusing graphs that are already reduced precision."""
    proto = load_onnx(src, weights=False)
    if is_quantized(proto):
        raise CorpError(f"{src} is already quantized (it has Q/DQ or integer ops); quantize its FP32 graph instead")
    if graph_precision(proto) != "fp32":
        raise CorpError(f"{src} is an FP16 graph; quantize the FP32 graph it was converted from")
    return proto


def quantize_int8(
    src: str | Path,
    out: str | Path,
    calibration: Batches,
    method: str = "minmax",
    info: dict | None = None,
    float_gemms: dict[str, str] | None = None,
    cache: Path | None = None,
    smoothing: dict[str, Any] | None = None,
) -> Path:
    """Write the static INT8 Q/DQ graph of ``src`` to ``out``, checked; callers stage ``out``.

    A graph whose weights live in external data (models over protobuf's 2 GB: deit3_huge, ViT-H)
    is quantized to external data too, ``out`` + ``<out>.data``: a single protobuf cannot hold them.
    A single-file FP32 graph is under 2 GB, and its INT8 graph (weights at a quarter) is smaller
    still, so it stays one file. ``info`` (calibration source, seed) is recorded with the sample
    count in ``int8_calibration``. ``float_gemms`` (node name -> why) stay float besides attention's
    matmuls. ``cache``: a file of calibrated ranges, written by the first call and read by later ones.
    ``smoothing``: how ``src`` was smoothed (``smooth``), recorded as ``int8_smoothing``.
    """
    q = require("onnxruntime.quantization", "INT8 quantization")
    methods = {"minmax": q.CalibrationMethod.MinMax, "percentile": q.CalibrationMethod.Percentile}
    methods["entropy"] = q.CalibrationMethod.Entropy
    if method not in methods:
        raise CorpError(f"--calib-method must be one of {', '.join(CALIB_METHODS)}, got {method!r}")
    proto = float_graph(src)
    external = len(onnx_files(src, proto)) > 1
    batches = list(calibration)
    float_gemms = float_gemms or {}
    try:
        with warnings.catch_warnings(), _quiet_logging(), _inferred_copy_removed(Path(src)):
            warnings.simplefilter("ignore")
            q.quantize_static(
                str(src),
                str(out),
                _Reader(proto.graph.input[0].name, chunks(batches, CALIB_CHUNK) if method == "minmax" else batches),
                quant_format=q.QuantFormat.QDQ,
                op_types_to_quantize=list(INT8_OPS),
                nodes_to_exclude=activation_gemms(proto) + list(float_gemms),
                per_channel=True,
                activation_type=q.QuantType.QInt8,
                weight_type=q.QuantType.QInt8,
                calibrate_method=methods[method],
                use_external_data_format=external,
                extra_options={
                    "ActivationSymmetric": True,
                    "WeightSymmetric": True,
                    "QuantizeBias": False,
                    "OpTypesToExcludeOutputQuantization": list(INT8_OPS),
                },
                calibration_cache_path=cache,
            )
    except CorpError:
        raise
    except Exception as e:
        raise CorpError(f"INT8 quantization of {src} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    import onnx

    quantized = load_onnx(out, weights=False)  # weights in external data stay where the quantizer wrote them
    float_elsewhere(quantized)
    calibrated = counted(batches)
    add_metadata(
        quantized,
        {
            "precision": "int8",
            "int8_scheme": SCHEME,
            "int8_ops": list(INT8_OPS),
            "int8_float_ops": float_ops(proto),
            "int8_float_gemms": float_gemms,
            "int8_gemms": f"{len(weight_gemms(proto)) - len(float_gemms)} of {len(weight_gemms(proto))}",
            "int8_calibration": {**calibrated, "method": method, **(info or {})},
            "int8_smoothing": smoothing or {},
        },
    )
    onnx.save(quantized, str(out))
    check_onnx(out)
    return Path(out)


def counted(batches: Sequence[Feed]) -> dict[str, int]:
    """``{"images": n}`` or, for text feeds, ``{"samples": n}``: how much calibration data a record names."""
    return {"samples" if isinstance(batches[0], dict) else "images": sum(samples(x) for x in batches)}


def float_elsewhere(proto) -> None:
    """Rewire every node but a GEMM that reads a dequantized activation to the float tensor.

    onnxruntime's quantizer hands the dequantized copy of a GEMM's input to ALL its consumers (a quantized tensor
    with one quantized consumer replaces it everywhere). In a post-LayerNorm encoder (BERT, MiniLM) a LayerNorm's
    output is both the next GEMM's input and the residual stream, so the residual itself was rounded to 8 bits at
    the per-tensor scale of its outlier channel: on all-MiniLM-L6-v2 (GEMM outputs already float) the worst
    held-out token read 0.887 so, 0.907 rewired (docs/BENCHMARKS.md, MiniLM INT8). INT8 is for the GEMMs; the
    residual add and LayerNorm read float, as the float graph does (pre-LN ViTs give a LayerNorm's output to the
    GEMM alone, so nothing changes there).
    """
    quantized_from = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    dequantized = {
        n.output[0]: quantized_from[n.input[0]]
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in quantized_from
    }
    for node in proto.graph.node:
        if node.op_type not in INT8_OPS:
            for i, name in enumerate(node.input):
                node.input[i] = dequantized.get(name, name)


def weight_gemms(proto) -> list[str]:
    """The ``INT8_OPS`` nodes with a constant input: the GEMMs INT8 may quantize."""
    attention = set(activation_gemms(proto))
    return [n.name for n in proto.graph.node if n.op_type in INT8_OPS and n.name not in attention]


def gemm_errors(src: Path, qdq: Path, batches: Sequence[Feed]) -> list[tuple[str, float]]:
    """(weight GEMM, SQNR of its output in dB), worst quantized first.

    Each GEMM's error is local: its output from the activation before its Q/DQ and the float weight, against
    its output from the dequantized activation and weight, both taken inside the INT8 graph (onnxruntime's
    ``qdq_loss_debug`` collects them). It ranks where precision is lost, not where lost precision arrives.
    The output, not the input, is measured: an outlier channel holds most of its activation's energy, so the
    activation's own SQNR looks fine while every other channel rounds to a few levels; the weights that read
    those channels show it. A Conv (the patch embedding) is ranked by its input's SQNR.
    """
    debug = require("onnxruntime.quantization.qdq_loss_debug", "INT8 outlier ranking")
    proto = float_graph(src)
    gemms = [n for n in proto.graph.node if n.name in set(weight_gemms(proto))]
    with tempfile.TemporaryDirectory(prefix="corp-int8-rank-") as tmp, warnings.catch_warnings(), _quiet_logging():
        warnings.simplefilter("ignore")
        augmented = Path(tmp) / "augmented.onnx"
        debug.modify_model_output_intermediate_tensors(str(qdq), str(augmented), ["QuantizeLinear", "DequantizeLinear"])
        activations = debug.create_activation_matching(
            debug.collect_activations(str(augmented), _Reader(proto.graph.input[0].name, batches))
        )
        weights = debug.create_weight_matching(str(src), str(qdq))
    errors = []
    for n in gemms:
        x, w = n.input[0], n.input[1]
        if x not in activations:
            continue  # an input left float by the quantizer
        pre, post = (np.concatenate(activations[x][k]) for k in ("pre_qdq", "post_qdq"))
        if n.op_type == "Conv" or w not in weights:
            errors.append((n.name, _sqnr(pre, post)))
            continue
        w_float, w_int8 = weights[w]["float"], weights[w]["dequantized"]
        if n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute):
            w_float, w_int8 = w_float.T, w_int8.T
        k = w_float.shape[0]
        errors.append((n.name, _sqnr(pre.reshape(-1, k) @ w_float, post.reshape(-1, k) @ w_int8)))
    return sorted(errors, key=lambda e: e[1])


def _sqnr(signal: np.ndarray, quantized: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; infinite without a signal (a GEMM fed zeros by an upstream one
    that broke has no error of its own to rank)."""
    power = float(np.square(signal, dtype=np.float64).sum())
    noise = float(np.square(signal - quantized, dtype=np.float64).sum())
    return float("inf") if power == 0 else 10 * np.log10(power / max(noise, 1e-30))


@contextlib.contextmanager
def _inferred_copy_removed(src: Path) -> Iterator[None]:
    """Remove the shape-inferred copy onnxruntime's quantizer writes beside ``src``, whatever happens.

    The quantizer writes ``<name>-inferred.onnx`` next to the graph it reads and deletes it when it
    succeeds; on a full disk onnx truncates that copy without an error, the quantizer fails reading
    it and leaves it beside the user's graph. (Pointing the quantizer at links in the stage instead
    fails: onnx refuses external data that is a symbolic or hard link.)
    """
    try:
        yield
    finally:
        src.with_name(f"{src.stem}-inferred{src.suffix}").unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """quantize_static logs advice through the root logger (pre-processing hints); keep the terminal ours."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def compare_on(reference: Runner, candidate: Runner, held_out: HeldOut) -> list[Comparison]:
    """Both graphs on one sample and on all held-out samples in ONE batch: the dynamic axis at its
    minimum and at the largest size verification asks of it (``--int8-verify``, 64 by default).

    The images arrive in decoding batches (32); running those and concatenating the outputs would
    never exercise a batch larger than the decoder's, whatever the README promises. Held-out text is one
    feed, padded to its longest document; its outputs are compared at real tokens only (``real_tokens``).
    """
    if isinstance(held_out, dict):
        reference, candidate = real_tokens(reference), real_tokens(candidate)
        return compare_runners(reference, candidate, (head(held_out, 1), held_out))
    images = np.concatenate(list(held_out))
    return compare_runners(reference, candidate, (images[:1], images))


def real_tokens(runner: Runner) -> Runner:
    """A text encoder's last hidden state at its real tokens, (tokens, hidden): each token is a sample.

    The gate reads every real token rather than a pooled embedding: the graph's output is per token (pooling
    stays with the caller), and a mean over a document would hide the tokens INT8 breaks. Padding positions
    are excluded, since nothing downstream reads them (a model's padded outputs are arbitrary)."""
    return lambda feed: runner(feed)[feed["attention_mask"].astype(bool)]


def quantize_verified(
    src: Path,
    out: Path,
    calibration: Batches,
    held_out: HeldOut,
    tol: Tolerance,
    method: str = "minmax",
    info: dict | None = None,
    say: Callable[[str], None] = print,
    smooth_alpha: float = SMOOTH_ALPHA,
    reference: Runner | None = None,
) -> dict[str, Any]:
    """Quantize ``src`` to ``out`` and check it against ``src`` on held-out samples; return its record.

    When the INT8 graph is outside ``tol``, every weight GEMM's input is first smoothed (``smooth``, strength
    ``smooth_alpha``; 0: never) and the graph quantized again. While it still misses, the worst-quantized GEMM
    left (``gemm_errors``) stays float too and it is quantized again from the same calibrated ranges; each step
    is said. Raises (one line, measured cosine and gate) when only one GEMM would be left in INT8; callers stage
    ``out`` so that nothing is left. ``reference``: ``src`` in onnxruntime, if the caller has one (``runners.Memo``:
    a recipe choice compares every candidate with the same outputs).
    """
    from corp_deploy.exporters.runners import OrtRunner

    start = time.perf_counter()
    batches, kept, ranked, smoothing = list(calibration), {}, None, None
    reference = reference or OrtRunner(src, "cpu")
    graph = src
    with tempfile.TemporaryDirectory(prefix="corp-int8-ranges-") as tmp:
        while True:
            ranges = Path(tmp) / ("ranges-smoothed.json" if smoothing else "ranges.json")
            quantize_int8(graph, out, batches, method, info, kept, ranges, smoothing)
            candidate = OrtRunner(out, "cpu")
            comparisons = compare_on(reference, candidate, held_out)
            worst = min(comparisons, key=lambda c: (c.within(tol), c.cosine))
            if worst.within(tol):
                break
            miss = f"INT8 missed the gate at cosine {worst.cosine:.4f}, relative error {worst.rel_error:.3f}"
            if smoothing is None and smooth_alpha > 0:
                graph = Path(tmp) / "smoothed.onnx"
                inputs = smooth(src, graph, batches, smooth_alpha)
                smoothing = {"alpha": smooth_alpha, "inputs": inputs, "why": miss}
                say(f"{out.name}: smoothing the inputs of its weight GEMMs (alpha {smooth_alpha}; {miss})")
                continue
            if ranked is None:
                ranked = gemm_errors(graph, out, [head(batches[0], RANK_SAMPLES)])
            if len(ranked) <= 1:
                break  # one GEMM left in INT8 (or none ranked): not an INT8 graph; the check below names the miss
            gemm, db = ranked.pop(0)
            why = f"its output quantizes at {db:.1f} dB SQNR, the worst left; {miss}"
            kept[gemm] = why
            say(f"{out.name}: keeping {gemm} float ({why})")
    seconds = time.perf_counter() - start
    check(comparisons, tol, f"INT8 ONNX {out.name} against {src.name} on held-out {_unit(held_out)}")
    record = int8_record(src, out, comparisons, held_out, tol, seconds, reference.name, candidate.name)
    write_sidecar(out, record)
    return record


def int8_record(
    src: Path,
    out: Path,
    comparisons: Sequence[Comparison],
    held_out: HeldOut,
    tol: Tolerance,
    seconds: float,
    reference: str = "ort-cpu",
    runtime: str = "ort-cpu",
) -> dict[str, Any]:
    """The sidecar record of the INT8 graph ``out`` quantized from ``src``: its metadata, size, and its check on the
    held-out data (``comparisons``, from ``compare_on``)."""
    verify = {"reference": f"{src.name} ({reference})", "runtime": runtime, **summary(comparisons)}
    if isinstance(held_out, dict):
        verify |= {"sequences": samples(held_out), "tokens": comparisons[-1].batch}
    else:
        verify |= {"images": comparisons[-1].batch}
    verify |= {"tolerance": asdict(tol)}
    record = {**read_metadata(load_onnx(out, weights=False)), "file": out.name, "bytes": onnx_bytes(out)}
    record |= {"seconds": round(seconds, 2), "verify": verify, "quantized_from": src.name}
    return record | {"source_sha256": onnx_sha256(src)}


def _unit(held_out: HeldOut) -> str:
    return "documents" if isinstance(held_out, dict) else "images"


def calibration_data(
    source: str | Path, proto, num_calib: int, num_verify: int, seed: int, workers: int = 0
) -> ImageSplit:
    """(calibration, held-out) batches for the graph ``proto`` and the count of each per folder: images of the folder
    ``source`` preprocessed as its metadata says, or noise of its input shape for ``synthetic`` (read by
    ``formats.calibration``)."""
    if str(source) == SYNTHETIC:
        return noise_split(input_shape(proto), num_calib, num_verify, seed)
    return folder_split(source, data_config(proto), num_calib, num_verify, seed, workers)
