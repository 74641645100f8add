"""FP32 decoder ONNX -> INT4 weight-only ONNX (``MatMulNBits``): the project's quantizer (``exporters.int4`` chooses
among it and genai's builder, ``exporters.int4_gate`` gates).

Every MatMul with a constant weight (the linear layers; the LM head, whose tied weight a key/value-cache graph reads
through a Transpose, made a constant first) becomes ``MatMulNBits``: weights in blocks of ``block_size`` input
channels, each block with its own FP32 scale. ``Scheme.method`` picks how: ``minmax`` (the default, computed here
in numpy: llama.cpp's Q4_1, each block's minimum and step, the minimum added back by a small FP32 MatMul of the
input's block sums, so the codes run on onnxruntime's fast kernel), or one of onnxruntime's quantizers
(``onnxruntime.quantization.matmul_nbits_quantizer``: ``rtn``, ``k_quant``, ``hqq``, ``gptq``). The LM head is INT8
by default (``lm_head``). Each MatMul's output error (SQNR on the FP32 graph's own activations, calibration
windows) can choose MatMuls to leave float (``keep_float``: the N worst) or find the outliers (``int8_outliers_db``:
far below the graph's median), which by default stay 4-bit with GPTQ's error feedback (``error_feedback``,
``exporters.int4_grid``) or else go to 8 bits; the graph's metadata names each with its reason. Activations stay
float: ``accuracy_level`` is MatMulNBits' compute type on the CPU, 4 quantizes them to INT8 per block inside the
kernel (the fast path for decode on x86), 0/1 computes in FP32. Embedding Gathers, norms, rotary embedding and
attention stay FP32. On SmolLM2-135M (a Q4_1 GGUF, dequantized) the default reproduces the weights' grid and
passes the gate where round to nearest fails (docs/BENCHMARKS.md, INT4 on real SmolLM2-135M).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.base.steps import phases
from corp_deploy.exporters.int4_gate import LOGITS, prefill_feeds
from corp_deploy.exporters.int4_grid import gptq_grid, minmax_grid, zero_points
from corp_deploy.exporters.onnx_export import add_metadata, check_onnx, graph_precision, load_onnx, read_metadata

BLOCK_SIZE = 32
"""Input channels per scale: 32 is llama.cpp's Q4_0/Q4_1 block and onnxruntime-genai's builder default for CPU."""
ACCURACY_LEVEL = 4
"""MatMulNBits computes with INT8-quantized activations (per block): the fast CPU path for decoding."""
QUANTIZED_OP = "MatMulNBits"

METHODS = {
    "minmax": "minimum and step per block (llama.cpp's Q4_1): 4-bit codes in MatMulNBits (zero point 0) and the block "
    "minimum as an FP32 offset, a [K/block, N] MatMul of the input's block sums",
    "rtn": "round to nearest (onnxruntime's default MatMulNBits quantizer)",
    "k_quant": "llama.cpp's k-quant search of scale and minimum per block, integer zero point (onnxruntime)",
    "hqq": "half-quadratic quantization: scale and float zero point per block fitted to the weight (onnxruntime)",
    "gptq": "GPTQ: rounding errors corrected through the activations' Hessian on calibration windows (onnxruntime)",
}
"""``--int4-method``: onnxruntime.quantization.matmul_nbits_quantizer's algorithms for MatMulNBits, and ``minmax``
(computed here, in numpy: onnxruntime's quantizers have no float offset that its fast CPU kernel runs; HQQ's float
zero point makes the kernel dequantize every weight on every call)."""
ASYMMETRIC_ONLY = ("minmax", "hqq", "k_quant")
"""Methods that always fit a zero point per block (minmax's and HQQ's a float, k-quant's a 4-bit integer)."""
CALIBRATED = ("gptq",)
"""Methods that read calibration windows."""
LM_HEAD = ("int4", "int8", "fp32")
"""The LM head (the tied embedding: 49,152 x 576 in SmolLM2): INT4 like the rest, 8-bit MatMulNBits (round to
nearest, symmetric, blocks of ``block_size``), or float (the graph's own, sharing the embedding's weight)."""
DEFAULT_METHOD = "minmax"
DEFAULT_LM_HEAD = "int8"
CALIB_WINDOWS = 64
"""Calibration windows (GPTQ's Hessians, error feedback's ``X^T X``) when the caller gives none: 64 x 128 tokens
(error feedback on the pruned SmolLM2's down_proj, K = 1072: top-1 agreement 0.817 with 16, 0.843 with 64)."""
RANK_WINDOWS = 16
"""The error ranking (``keep_float``, the outliers) reads the first this many: it only has to separate MatMuls that
reproduce their weight (SmolLM2: 300+ dB) from those off the grid (21-26 dB), and each window is one FP32 prefill."""
OUTLIERS_DB = 10.0
"""A MatMul whose INT4 output SQNR is this many dB below the graph's median is an outlier: its weight is off
minmax's grid. By default (``Scheme.error_feedback``) it stays 4-bit, quantized with GPTQ's error feedback;
without, in 8 bits. On the pruned SmolLM2 the 30 CORP-compensated down_proj sit at 21-26 dB rounded, every other
MatMul reproduces its weight (docs/BENCHMARKS.md, INT4 error feedback)."""
OUTLIER_CEILING_DB = 30.0
"""...and only below this: a MatMul at 30 dB or more is not worth 8 bits, whatever the median."""


@dataclass(frozen=True)
class Scheme:
    """How the weights are quantized: what the graph's metadata and the sidecar record."""

    block_size: int = BLOCK_SIZE
    symmetric: bool | None = None
    """None: the method's own (RTN and GPTQ symmetric; HQQ and k-quant always fit a zero point)."""
    accuracy_level: int = ACCURACY_LEVEL
    method: str = DEFAULT_METHOD
    lm_head: str = DEFAULT_LM_HEAD
    keep_float: int = 0
    """The MatMuls with the lowest output SQNR (measured on calibration windows) left float, worst first."""
    keep_nodes: tuple[str, ...] = ()
    """MatMul nodes left float by name (recorded as named by the caller)."""
    int8_outliers_db: float | None = OUTLIERS_DB
    """MatMuls whose output SQNR (calibration windows) is more than this many dB below the graph's median and
    below ``OUTLIER_CEILING_DB`` go to 8-bit MatMulNBits (round to nearest, symmetric); None: none."""
    error_feedback: bool = True
    """``minmax``: the outliers stay 4-bit, quantized with GPTQ's error feedback on a block-32 grid whose minimum
    MatMulNBits' uint4 zero point holds (``int4_grid.gptq_grid``, no offset nodes), instead of going to 8 bits."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CorpError(f"--int4-method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.method not in ASYMMETRIC_ONLY)
        if self.symmetric and self.method in ASYMMETRIC_ONLY:
            raise CorpError(f"--int4-method {self.method} fits a zero point per block; it has no symmetric form")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise CorpError(f"--int4-block-size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise CorpError(f"--int4-accuracy-level must be 0..4 (MatMulNBits), got {self.accuracy_level}")
        if self.lm_head not in LM_HEAD:
            raise CorpError(f"--int4-lm-head must be one of {', '.join(LM_HEAD)}, got {self.lm_head!r}")
        if self.keep_float < 0:
            raise CorpError(f"--int4-keep-float must be >= 0, got {self.keep_float}")
        if self.int8_outliers_db is not None and self.int8_outliers_db < 0:
            raise CorpError(f"--int4-int8-outliers-db must be >= 0, got {self.int8_outliers_db}")
        object.__setattr__(self, "keep_nodes", tuple(self.keep_nodes))

    @property
    def calibrated(self) -> bool:
        """Whether quantizing reads calibration windows (GPTQ, or the error ranking of MatMuls)."""
        return self.method in CALIBRATED or self.ranked

    @property
    def ranked(self) -> bool:
        """Whether MatMuls are chosen by their measured error (``keep_float``, ``int8_outliers_db``)."""
        return self.keep_float > 0 or self.int8_outliers_db is not None

    def describe(self) -> dict[str, Any]:
        zero_point = "none (signed int4)"
        if not self.symmetric:
            zero_point = {"hqq": "float per block", "minmax": "float offset per block (the block minimum)"}.get(
                self.method, "uint4 per block"
            )
        activations = "float; int8 per block inside the kernel" if self.accuracy_level == 4 else "float"
        if self.method == "hqq":
            activations = "float (onnxruntime's CPU kernel dequantizes float zero points: no int8 path)"
        return {
            "format": f"{QUANTIZED_OP} (onnxruntime contrib op), weight only",
            "bits": 4,
            "method": self.method,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "zero_point": zero_point,
            "activations": activations,
            "lm_head": {
                "int4": "int4 (the method)",
                "int8": "int8 (MatMulNBits bits 8, round to nearest, symmetric)",
                "fp32": "fp32 (the embedding's weight, not quantized)",
            }[self.lm_head],
            "keep_float": self.keep_float,
            "keep_nodes": list(self.keep_nodes),
            "int8_outliers_db": self.int8_outliers_db,
            "error_feedback": self.error_feedback and self.method == "minmax" and self.int8_outliers_db is not None,
            "quantizer": f"corp-deploy (numpy): {METHODS[self.method]}"
            if self.method == "minmax"
            else f"onnxruntime.quantization.matmul_nbits_quantizer: {METHODS[self.method]}",
        }


def decoder_graph(src: str | Path):
    """The FP32 decoder graph to quantize (without weights): one line for anything else (a vision model or an
    encoder, an FP16 or already quantized graph)."""
    proto = load_onnx(src, weights=False)
    outputs = [o.name for o in proto.graph.output]
    if LOGITS not in outputs or "input_ids" not in [i.name for i in proto.graph.input]:
        raise CorpError(
            f"{src} is not a decoder graph (no input_ids -> logits); INT4 weights are for OPT/Llama-family decoders"
        )
    if read_metadata(proto).get("precision", "fp32") != "fp32" or graph_precision(proto) != "fp32":
        raise CorpError(f"{src} is not an FP32 graph; quantize the FP32 decoder graph it came from")
    if any(n.op_type == QUANTIZED_OP for n in proto.graph.node):
        raise CorpError(f"{src} already holds {QUANTIZED_OP}; quantize the FP32 decoder graph instead")
    return proto


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The quantizer logs a line per node at INFO through its own logger, its k-quant port logs through
    neural-compressor's (and prints a progress bar); keep the terminal ours."""
    loggers = [logging.getLogger(n) for n in ("onnxruntime.quantization.matmul_nbits_quantizer", "neural_compressor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def weight_matmuls(proto) -> list[str]:
    """Names of the MatMuls whose second input is a constant (what MatMulNBits replaces), in graph order."""
    constants = {t.name for t in proto.graph.initializer}
    return [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in constants]


def lm_head(proto, base_dir: str = "") -> str | None:
    """Name of the MatMul that writes ``logits``, after its weight is made a constant: a key/value-cache graph reads
    the tied embedding through ``Transpose``, which hides it from the quantizer, so the transposed weight becomes
    its own initializer (the embedding's Gather keeps the original). None when no MatMul writes the logits."""
    from onnx import numpy_helper

    producers = {o: n for n in proto.graph.node for o in n.output}
    head = producers.get(LOGITS)
    if head is None or head.op_type != "MatMul":
        return None
    constants = {t.name: t for t in proto.graph.initializer}
    feed = producers.get(head.input[1])
    tied = feed is not None and feed.op_type == "Transpose" and feed.input[0] in constants
    if head.input[1] not in constants and tied and len(constants[feed.input[0]].dims) == 2:
        weight = numpy_helper.to_array(constants[feed.input[0]], base_dir).T.copy()
        proto.graph.initializer.append(numpy_helper.from_array(weight, f"{feed.input[0]}.transposed"))
        head.input[1] = f"{feed.input[0]}.transposed"
        if not any(feed.output[0] in n.input for n in proto.graph.node):
            proto.graph.node.remove(feed)
    return head.name if head.input[1] in {t.name for t in proto.graph.initializer} else None


class _Windows:
    """onnxruntime's CalibrationDataReader over token windows (each a prefill from an empty cache)."""

    def __init__(self, session, windows: np.ndarray) -> None:
        self.session, self.windows, self.i = session, windows, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.windows):
            return None
        self.i += 1
        return prefill_feeds(self.session, self.windows[self.i - 1][None])

    def rewind(self) -> None:
        self.i = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter(self.get_next, None)

    def __deepcopy__(self, memo: dict) -> _Windows:  # the quantizer copies its reader; the session stays shared
        return _Windows(self.session, self.windows)


def _quantizer(nbits, proto, scheme: Scheme, exclude: set[str], calibration: np.ndarray | None):
    """onnxruntime's MatMulNBits quantizer for ``scheme``'s method over every weight MatMul outside ``exclude``."""
    common = {"op_types_to_quantize": ("MatMul",)}
    kwargs = {
        "bits": 4,
        "block_size": scheme.block_size,
        "is_symmetric": scheme.symmetric,
        "accuracy_level": scheme.accuracy_level,
        "nodes_to_exclude": sorted(exclude),
    }
    if scheme.method == "hqq":
        config = nbits.HQQWeightOnlyQuantConfig(block_size=scheme.block_size, **common)
        return nbits.MatMulNBitsQuantizer(proto, nodes_to_exclude=sorted(exclude), algo_config=config)
    if scheme.method == "k_quant":
        return nbits.MatMulNBitsQuantizer(proto, **kwargs, algo_config=nbits.KQuantWeightOnlyQuantConfig(**common))
    if scheme.method == "gptq":
        ort = require("onnxruntime", "GPTQ calibration")
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        config = nbits.GPTQWeightOnlyQuantConfig(_Windows(session, calibration), **common)
        return nbits.MatMulNBitsQuantizer(proto, **kwargs, algo_config=config)
    return nbits.MatMulNBitsQuantizer(proto, **kwargs, op_types_to_quantize=("MatMul",))


MINS = ".block_min"
"""Suffix of a ``minmax`` MatMul's offsets initializer ([K/block, N]: each block's minimum)."""


def minmax_int4(
    proto,
    block: int,
    accuracy_level: int,
    exclude: set[str],
    grids: dict[str, tuple] | None = None,
    base_dir: str = "",
) -> None:
    """Rewrite, in place, every weight MatMul of ``proto`` outside ``exclude`` as llama.cpp's Q4_1 does: per block
    of ``block`` input channels and output column, the minimum ``m`` and step ``d = (max - min) / 15``, codes
    ``q = round((w - m) / d)`` in 0..15 (``int4_grid.minmax_grid``), or the codes, minima and steps ``grids`` gives
    for that MatMul (``int4_grid.gptq_grid`` with ``integer_zero``: error feedback; its minima, whole steps below
    0, go into MatMulNBits' uint4 zero point, with no offset nodes). ``MatMulNBits`` (zero point 0: ``d * q``) runs the
    codes on onnxruntime's fast kernel; the minimum adds ``(x @ S) @ M``, ``S`` the [K, K/block] block indicator
    (one per K, shared by the MatMuls of one input) and ``M`` the [K/block, N] minima, two small FP32 MatMuls and
    an Add. A weight already on such a grid (a GGUF Q4_1 model, dequantized) comes back exactly. A K that is not a
    multiple of ``block`` ends in a short block (MatMulNBits pads it). A weight the graph keeps outside is read from
    ``base_dir`` when its MatMul's turn comes, one at a time (the 1.7B shape's 6.4 GiB never held whole)."""
    from onnx import helper, numpy_helper

    constants = {t.name: t for t in proto.graph.initializer}
    grids = grids or {}
    sums: dict[str, str] = {}
    nodes, new, used = [], [], set()
    for node in proto.graph.node:
        weight = constants.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or len(weight.dims) != 2 or node.name in exclude:
            nodes.append(node)
            continue
        k, n = weight.dims
        blocks, x, out = -(-k // block), node.input[0], node.output[0]
        grid = grids.get(node.name)
        codes, low, step = grid or minmax_grid(numpy_helper.to_array(weight, base_dir).astype(np.float32), block)
        if k % block:  # the short last block's padding takes its first row's codes (MatMulNBits ignores them)
            codes = np.concatenate([codes, np.repeat(codes[(blocks - 1) * block][None], blocks * block - k, 0)])
        codes = codes.reshape(blocks, block, n).transpose(2, 0, 1)
        base = node.name
        inputs = [x, f"{base}.q4", f"{base}.scales", f"{base}.zero_points"]
        attrs = {"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": accuracy_level}
        new += [
            numpy_helper.from_array(codes[..., ::2] | (codes[..., 1::2] << 4), f"{base}.q4"),
            numpy_helper.from_array(np.ascontiguousarray(step.T), f"{base}.scales"),
        ]
        used.add(weight.name)
        if grid is not None:  # its minima are whole steps below 0: MatMulNBits' uint4 zero point, no offset
            z = np.concatenate([zero_points(low, step), np.zeros((blocks % 2, n), np.uint8)]).T
            new.append(numpy_helper.from_array(z[:, ::2] | (z[:, 1::2] << 4), f"{base}.zero_points"))
            nodes.append(helper.make_node(QUANTIZED_OP, inputs, [out], f"{base}_Q4", domain="com.microsoft", **attrs))
            continue
        indicator = f"block_indicator_{k}x{blocks}"
        if indicator not in constants:
            ones = np.kron(np.eye(blocks, dtype=np.float32), np.ones((block, 1), np.float32))[:k]
            constants[indicator] = numpy_helper.from_array(ones, indicator)
            new.append(constants[indicator])
        if x not in sums:
            sums[x] = f"{x}.block_sums"
            nodes.append(helper.make_node("MatMul", [x, indicator], [sums[x]], name=f"{x}.block_sums"))
        new += [
            numpy_helper.from_array(np.zeros((n, (blocks + 1) // 2), np.uint8), f"{base}.zero_points"),
            numpy_helper.from_array(low, f"{base}{MINS}"),
        ]
        nodes += [
            helper.make_node(QUANTIZED_OP, inputs, [f"{out}.codes"], f"{base}_Q4", domain="com.microsoft", **attrs),
            helper.make_node("MatMul", [sums[x], f"{base}{MINS}"], [f"{out}.offsets"], name=f"{base}.offsets"),
            helper.make_node("Add", [f"{out}.codes", f"{out}.offsets"], [out], name=f"{base}.add"),
        ]
    still = {i for n in nodes for i in n.input}
    kept = [t for t in proto.graph.initializer if t.name not in used or t.name in still]
    del proto.graph.node[:], proto.graph.initializer[:]
    proto.graph.node.extend(nodes)
    proto.graph.initializer.extend(kept + new)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))


HIDDEN = ".kept_float"


@contextlib.contextmanager
def _hidden(proto, names: set[str]) -> Iterator[None]:
    """The weights of the MatMuls ``names`` read through an Identity while inside: no longer constants to a
    quantizer that would otherwise take them (``_unhide`` removes the Identities from its output)."""
    from onnx import helper

    nodes = []
    for node in proto.graph.node:
        if node.op_type == "MatMul" and node.name in names:
            nodes.append(
                helper.make_node("Identity", [node.input[1]], [node.input[1] + HIDDEN], name=node.name + HIDDEN)
            )
            node.input[1] += HIDDEN
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    yield


def _unhide(proto) -> None:
    identities = {
        n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity" and n.name.endswith(HIDDEN)
    }
    nodes = [n for n in proto.graph.node if n.output[0] not in identities]
    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = identities.get(name, name)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def _run_quantizer(quantizer, src: str | Path) -> Any:
    try:
        with quiet():
            quantizer.process()
    except Exception as e:
        raise CorpError(f"INT4 quantization of {src} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return quantizer.model.model


def dequantize(node, constants: dict[str, np.ndarray]) -> np.ndarray:
    """The float weight (K, N) a ``MatMulNBits`` node multiplies by, as its CPU kernel reads it: ``bits``-bit
    codes in blocks of ``block_size`` along K, a scale per block, and a zero point per block (packed unsigned
    integers or floats; without one, the middle of the range)."""
    attrs = {a.name: a.i for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    blocks = -(-k // block)
    packed = constants[node.input[1]].reshape(n, blocks, -1)
    codes = packed  # 8 bits: a byte per code
    if bits == 4:
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(n, blocks, -1)[:, :, :block]
    scales = constants[node.input[2]].astype(np.float32).reshape(n, blocks, 1)
    zero = np.full((n, blocks, 1), 2 ** (bits - 1), np.float32)
    if len(node.input) > 3 and node.input[3]:
        z = constants[node.input[3]]
        if z.dtype == np.uint8 and bits == 4:
            z = np.stack([z & 15, z >> 4], -1).reshape(n, -1)[:, :blocks]
        zero = z.astype(np.float32).reshape(n, blocks, 1)
    return ((codes.astype(np.float32) - zero) * scales).reshape(n, -1)[:, :k].T


def _activations(fp32, names: set[str], windows: np.ndarray, base_dir: str = "") -> Iterator[dict[str, np.ndarray]]:
    """The FP32 graph's tensors ``names`` on each window (a prefill from an empty cache), one dict a window.
    ``fp32`` may leave its weights in external data beside the graph, in ``base_dir`` (onnxruntime reads them)."""
    import onnx

    ort = require("onnxruntime", "INT4 calibration")
    augmented = onnx.ModelProto()
    augmented.CopyFrom(fp32)
    outputs = sorted(set(names) - {o.name for o in augmented.graph.output})
    augmented.graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir or "."))
    session = ort.InferenceSession(augmented.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del augmented
    names = sorted(names)
    for window in windows:
        yield dict(zip(names, session.run(names, prefill_feeds(session, window[None])), strict=True))


ACTIVATION_BYTES = 2**30
"""The error ranking holds each weight MatMul's input on the ranking windows, as rows, up to this many bytes: beyond,
it reads fewer windows (the 1.7B shape's 16 x 128 tokens at 24 layers are 2.8 GB in full: 6 windows are read). The
ranking only has to separate MatMuls that reproduce their weight from those off the grid (tens of dB apart), and each
window is a prefill of the FP32 graph (16 took 4-5 min at the 1.7B shape, loaded); small models read every window
(SmolLM2-135M: 0.8 GB)."""


def _input_widths(fp32) -> dict[str, int]:
    """{input name: K} of every weight MatMul's input."""
    constants = {t.name: t for t in fp32.graph.initializer}
    return {
        n.input[0]: constants[n.input[1]].dims[0]
        for n in fp32.graph.node
        if n.op_type == "MatMul" and n.input[1] in constants and len(constants[n.input[1]].dims) == 2
    }


def ranking_windows(fp32, calibration: np.ndarray) -> np.ndarray:
    """The calibration windows the error ranking reads: the first ``RANK_WINDOWS``, fewer where their rows of every
    weight MatMul's input would pass ``ACTIVATION_BYTES``."""
    window = 4 * calibration.shape[1] * sum(_input_widths(fp32).values())  # bytes of one window's rows
    return calibration[: max(1, min(RANK_WINDOWS, ACTIVATION_BYTES // window))]


def ranking_activations(fp32, windows: np.ndarray, base_dir: str = "") -> dict[str, np.ndarray]:
    """{input name: rows (tokens, K)} of every weight MatMul's input in the FP32 graph on ``windows``, each token a
    row: computed once, in one FP32 session, before any quantized copy is made, and read by ``matmul_errors`` for
    every MatMul."""
    rows: dict[str, list[np.ndarray]] = {name: [] for name in _input_widths(fp32)}
    for acts in _activations(fp32, set(rows), windows, base_dir):
        for name, x in acts.items():
            rows[name].append(x.reshape(-1, x.shape[-1]).astype(np.float32))
    return {name: np.concatenate(r) for name, r in rows.items()}


def input_moments(fp32, matmuls: set[str], windows: np.ndarray, base_dir: str = "") -> dict[str, np.ndarray]:
    """{MatMul: X^T X} (float64, (K, K)) of each named MatMul's input X in the FP32 graph on ``windows`` (every
    token of every window a row): the Hessian of its output error, for ``gptq_grid``."""
    inputs = {n.name: n.input[0] for n in fp32.graph.node if n.name in matmuls}
    moments: dict[str, np.ndarray] = {}
    for acts in _activations(fp32, set(inputs.values()), windows, base_dir):
        for act, x in acts.items():
            x = x.reshape(-1, x.shape[-1]).astype(np.float64)
            moments[act] = moments.get(act, 0) + x.T @ x
    return {name: moments[act] for name, act in inputs.items()}


def matmul_errors(
    fp32, quantized, windows: np.ndarray, base_dir: str = "", activations: dict[str, np.ndarray] | None = None
) -> list[tuple[str, float]]:
    """(quantized MatMul, output SQNR in dB), worst first: each MatMulNBits' output from the FP32 graph's own
    activation (its input in the FP32 graph, on ``windows``, or the ``ranking_activations`` given) and the dequantized
    weight, against the same activation through the float weight. Local, as ``int8_quant.gemm_errors`` for INT8: it
    ranks where precision is lost, not where the loss arrives. One MatMul's float and dequantized weights are held at
    a time (the float one read from ``base_dir`` where the graph keeps it outside)."""
    from onnx import numpy_helper

    acts = activations if activations is not None else ranking_activations(fp32, windows, base_dir)
    float_weights = {t.name: t for t in fp32.graph.initializer}
    originals = {n.name: n for n in fp32.graph.node if n.op_type == "MatMul"}
    constants = {t.name: t for t in quantized.graph.initializer}
    errors = []
    for node in quantized.graph.node:
        base = node.name.rsplit("_Q", 1)[0]  # every quantizer names the node <MatMul>_Q<bits>
        if node.op_type != QUANTIZED_OP or base not in originals:
            continue
        original = originals[base]
        weight = numpy_helper.to_array(float_weights[original.input[1]], base_dir).astype(np.float32)
        dequantized = dequantize(node, {i: numpy_helper.to_array(constants[i]) for i in node.input[1:] if i})
        if f"{base}{MINS}" in constants:  # minmax: the block minima come in through their own MatMul
            low = numpy_helper.to_array(constants[f"{base}{MINS}"])
            block = next(a.i for a in node.attribute if a.name == "block_size")
            dequantized += np.repeat(low, block, axis=0)[: dequantized.shape[0]]
        x = acts[original.input[0]]
        reference = x @ weight
        signal = float(np.square(reference, dtype=np.float64).sum())
        noise = float(np.square(reference - x @ dequantized, dtype=np.float64).sum())
        errors.append((original.name, float("inf") if signal == 0 else 10 * np.log10(signal / max(noise, 1e-30))))
    return sorted(errors, key=lambda e: e[1])


def _quantize(
    nbits,
    fp32,
    scheme: Scheme,
    exclude: set[str],
    int8: set[str],
    calibration,
    src,
    base_dir: str = "",
    grids: dict | None = None,
) -> Any:
    """A copy of ``fp32`` with every weight MatMul outside ``exclude`` in INT4 by ``scheme`` (``minmax``: on the
    codes, minima and steps ``grids`` gives for a MatMul), then those of ``int8`` (a subset of ``exclude``) in 8
    bits (round to nearest, symmetric, blocks of ``block_size``). ``fp32`` may keep its weights outside, in
    ``base_dir``: ``minmax`` reads them one at a time and the copy takes in only what stays float (the embedding,
    the norms, the LM head); onnxruntime's quantizers take the whole graph in memory."""
    from onnx.external_data_helper import load_external_data_for_model

    proto = type(fp32)()
    proto.CopyFrom(fp32)
    if scheme.method == "minmax":
        minmax_int4(proto, scheme.block_size, scheme.accuracy_level, exclude, grids, base_dir)
    load_external_data_for_model(proto, base_dir)  # what stays float; all of it for onnxruntime's quantizers
    if scheme.method == "minmax":
        quantized = proto
    elif scheme.method == "gptq":  # onnxruntime's GPTQ ignores nodes_to_exclude: hide their weights instead
        with _hidden(proto, exclude):
            quantized = _run_quantizer(_quantizer(nbits, proto, scheme, exclude, calibration), src)
        _unhide(quantized)
    else:
        quantized = _run_quantizer(_quantizer(nbits, proto, scheme, exclude, calibration), src)
    if int8:
        others = [n for n in weight_matmuls(quantized) if n not in int8]
        quantizer = nbits.MatMulNBitsQuantizer(
            quantized,
            bits=8,
            block_size=scheme.block_size,
            is_symmetric=True,
            accuracy_level=scheme.accuracy_level,
            nodes_to_exclude=others,
            op_types_to_quantize=("MatMul",),
        )
        quantized = _run_quantizer(quantizer, src)
    return quantized


def _chosen(errors: list[tuple[str, float]], scheme: Scheme, taken: set[str], windows: int) -> tuple[dict, dict]:
    """From measured errors (worst first): the ``keep_float`` worst MatMuls outside ``taken`` ({name: reason}),
    and the outliers (more than ``int8_outliers_db`` below the median SQNR, and below the ceiling) for 8 bits."""
    ranked = [e for e in errors if e[0] not in taken]
    floats = {
        name: f"output SQNR {db:.1f} dB, #{rank} lowest of {len(errors)} on {windows} calibration windows"
        for rank, (name, db) in enumerate(ranked[: scheme.keep_float], 1)
    }
    int8 = {}
    if scheme.int8_outliers_db is not None and errors:
        median = float(np.median([db for _, db in errors]))
        bound = min(median - scheme.int8_outliers_db, OUTLIER_CEILING_DB)
        for name, db in ranked[scheme.keep_float :]:
            if db < bound:
                int8[name] = (
                    f"output SQNR {db:.1f} dB on {windows} calibration windows: below {bound:.1f} dB (the median "
                    f"{median:.1f} dB less {scheme.int8_outliers_db:g}, at most {OUTLIER_CEILING_DB:g})"
                )
    return floats, int8


def error_feedback_grids(
    fp32, names: set[str], windows: np.ndarray, block: int, base_dir: str = ""
) -> dict[str, tuple]:
    """minmax's grid with GPTQ's error feedback (``int4_grid.gptq_grid``) for the MatMuls ``names``: each from its
    FP32 weight and its input's second moment in the FP32 graph on ``windows``."""
    from onnx import numpy_helper

    weights = {t.name: t for t in fp32.graph.initializer}
    moments = input_moments(fp32, names, windows, base_dir)
    return {
        node.name: gptq_grid(
            numpy_helper.to_array(weights[node.input[1]], base_dir).astype(np.float32),
            moments[node.name],
            block,
            integer_zero=True,
        )
        for node in fp32.graph.node
        if node.name in names
    }


def _with_feedback(before, after, names, windows: int) -> dict[str, str]:
    """{MatMul: why it is in 4 bits with error feedback}, from its measured errors rounded and with it."""
    was, now = dict(before), dict(after)
    return {
        name: f"off minmax's grid: output SQNR {was[name]:.1f} dB rounded, {now[name]:.1f} dB with error feedback "
        f"(GPTQ, a uint4 zero point) on {windows} calibration windows"
        for name in names
    }


def needs_calibration(scheme: Scheme, calibration: np.ndarray | None) -> None:
    if scheme.calibrated and (calibration is None or not len(calibration)):
        raise CorpError(
            f"--int4-method {scheme.method} and the error ranking (--int4-keep-float, --int4-int8-outliers-db) "
            "need calibration windows (--calib-dir)"
        )


def quantize_int4(
    src: str | Path,
    out: str | Path,
    scheme: Scheme = Scheme(),
    calibration: np.ndarray | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write the INT4 weight-only graph of the FP32 decoder graph ``src`` to ``out`` (one file), checked; callers
    stage ``out``. ``calibration`` (token windows, disjoint from the gate's) feeds GPTQ and the error ranking of
    ``keep_float`` and ``int8_outliers_db``. Returns what it added to the graph's metadata (the scheme, the LM
    head, the MatMuls kept float or in 8 bits and why). ``say`` gets a line as each phase starts."""
    nbits = require("onnxruntime.quantization.matmul_nbits_quantizer", "INT4 quantization")
    decoder_graph(src)
    needs_calibration(scheme, calibration)
    fp32 = load_onnx(src, weights=False)  # the weights read one MatMul at a time (``minmax_int4``)
    base = str(Path(src).parent)
    phase = phases(f"INT4 {scheme.method}", say)
    ranking = ranking_windows(fp32, calibration) if scheme.ranked else None
    if scheme.ranked:
        phase(f"the FP32 graph's MatMul inputs on {len(ranking)} calibration windows")
    acts = ranking_activations(fp32, ranking, base) if scheme.ranked else None  # the FP32 session alone
    head = lm_head(fp32, base) if scheme.lm_head != "fp32" else _head_name(fp32)
    matmuls = weight_matmuls(fp32)
    if unknown := [n for n in scheme.keep_nodes if n not in matmuls]:
        raise CorpError(f"--int4 keep_nodes {', '.join(unknown)}: no weight MatMul of that name in {src}")
    kept = {n: "named by the caller" for n in scheme.keep_nodes}
    int8 = {head} if head and scheme.lm_head == "int8" else set()
    exclude = set(kept) | ({head} if head and scheme.lm_head != "int4" else set())
    phase(f"{scheme.method} over {len(matmuls)} MatMuls")
    quantized = _quantize(nbits, fp32, scheme, exclude, int8, calibration, src, base)
    errors: list[tuple[str, float]] = []
    outliers: dict[str, str] = {}
    refined: dict[str, str] = {}
    grids: dict[str, tuple] = {}
    if scheme.ranked:
        phase("each MatMul's output error")
        errors = [e for e in matmul_errors(fp32, quantized, ranking, base, acts) if e[0] != head]  # --int4-lm-head
        floats, outliers = _chosen(errors, scheme, set(kept), len(ranking))
        kept |= floats
        if outliers and scheme.method == "minmax" and scheme.error_feedback:
            grids = error_feedback_grids(fp32, set(outliers), calibration, scheme.block_size, base)
            outliers = {}
        if floats or outliers or grids:
            # again without them: each MatMul's quantization reads only its own weight (and, for GPTQ, the FP32
            # graph's activations), so the others come out as in the first pass
            exclude |= set(floats) | set(outliers)
            quantized = None  # let the first pass go before the second is made
            quantized = _quantize(nbits, fp32, scheme, exclude, int8 | set(outliers), calibration, src, base, grids)
        if grids:
            refined = _with_feedback(errors, matmul_errors(fp32, quantized, ranking, base, acts), grids, len(ranking))
    import onnx

    for node in quantized.graph.node:  # HQQ's nodes carry none; onnxruntime's GPTQ adds no opset for its op
        if node.op_type == QUANTIZED_OP and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", scheme.accuracy_level))
    if not any(o.domain == "com.microsoft" for o in quantized.opset_import):
        quantized.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    bits = [
        next(a.i for a in n.attribute if a.name == "bits") for n in quantized.graph.node if n.op_type == QUANTIZED_OP
    ]
    count = bits.count(4)
    if not count:
        raise CorpError(f"{src} has no MatMul with a constant weight; nothing to quantize to INT4")
    floats = [{"node": n, "reason": r} for n, r in kept.items()]
    if head and scheme.lm_head == "fp32":
        floats.append({"node": head, "reason": "the LM head (--int4-lm-head fp32)"})
    extra = {"int4_scheme": scheme.describe(), "int4_matmuls": count, "int4_kept_float": floats}
    extra["int4_int8"] = [{"node": n, "reason": r} for n, r in outliers.items()]
    extra["int4_error_feedback"] = [{"node": n, "reason": r} for n, r in refined.items()]
    extra["int4_lm_head"] = {"node": head, "precision": scheme.lm_head} if head else None
    if errors:
        shown = max(10, scheme.keep_float + len(outliers))
        extra["int4_worst_sqnr_db"] = [[n, round(db, 2)] for n, db in errors[:shown]]
        extra["int4_median_sqnr_db"] = round(float(np.median([db for _, db in errors])), 2)
    add_metadata(quantized, {"precision": "int4", **extra})
    phase("writing the INT4 graph")
    onnx.save(quantized, str(out))
    check_onnx(out)
    phase(None)
    return extra


def _head_name(proto) -> str | None:
    """The MatMul that writes ``logits`` (None when another op does)."""
    head = next((n for n in proto.graph.node if LOGITS in n.output), None)
    return head.name if head is not None and head.op_type == "MatMul" else None
