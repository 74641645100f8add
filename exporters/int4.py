"""FP32 decoder ONNX -> INT4 weight-only ONNX (``MatMulNBits``), gated on perplexity and greedy agreement.

The quantizer is onnxruntime's (``onnxruntime.quantization.matmul_nbits_quantizer``, round to nearest); nothing
here computes a scale. Every MatMul with a constant weight (the linear layers and the LM head) becomes one
``MatMulNBits`` node: weights in blocks of ``block_size`` input channels, each block with its own FP32 scale,
symmetric by default (signed 4-bit, no zero point; ``symmetric=False`` adds a 4-bit zero point per block).
Activations stay float. ``accuracy_level`` is MatMulNBits' compute type on the CPU: 4 quantizes the activations
to INT8 per block inside the kernel (the fast path for decode on x86), 0/1 computes in FP32. Embedding Gathers,
norms, rotary embedding and attention stay FP32.

A decoder's outputs are next-token distributions, so the gate is a decoder's, not the cosine INT8 uses for
features: on held-out token windows (teacher-forced: every position reads the true tokens before it), the INT4
graph's perplexity over the FP32 graph's (``max_ppl_ratio``) and the share of positions whose top-1 token is the
FP32 graph's (``min_agreement``). Both are recorded in the graph's sidecar; a graph outside them is not written.

Any decoder graph with ``input_ids`` and ``logits`` works: the full-sequence logits graph (``text_onnx``) and a
key/value-cache graph, which is run as a prefill (``position_ids`` from 0, every ``past_key_values.*`` input
empty, past length 0).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.deps import require
from corp_deploy.errors import CorpError
from corp_deploy.exporters.onnx_export import (
    add_metadata,
    check_onnx,
    graph_precision,
    load_onnx,
    onnx_bytes,
    onnx_sha256,
    read_metadata,
)
from corp_deploy.fsio import check_writable, staged
from corp_deploy.tables import text_table

BLOCK_SIZE = 32
"""Input channels per scale: 32 is llama.cpp's Q4_0 block and onnxruntime-genai's builder default for CPU."""
ACCURACY_LEVEL = 4
"""MatMulNBits computes with INT8-quantized activations (per block): the fast CPU path for decoding."""
QUANTIZED_OP = "MatMulNBits"
INT4_SUFFIX = "-int4"
"""A genai folder's INT4 copy: ``pruned-genai/`` -> ``pruned-genai-int4/``."""
LOGITS = "logits"


@dataclass(frozen=True)
class DecoderTolerance:
    """A quantized decoder against its FP32 graph on held-out windows."""

    max_ppl_ratio: float
    """Perplexity of the candidate over the reference's, at most."""
    min_agreement: float
    """Share of positions whose top-1 next token equals the reference's, at least."""


INT4 = DecoderTolerance(max_ppl_ratio=1.25, min_agreement=0.80)
"""INT4 weights (block 32, symmetric) on held-out text. Not yet calibrated on a real model: the SmolLM2 study that
measures it did not finish (docs/BENCHMARKS.md, decoders: INT4 weights and tokens/s); tighten it from that."""


@dataclass(frozen=True)
class Scheme:
    """How the weights are quantized: what the graph's metadata and the sidecar record."""

    block_size: int = BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = ACCURACY_LEVEL

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise CorpError(f"--int4-block-size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise CorpError(f"--int4-accuracy-level must be 0..4 (MatMulNBits), got {self.accuracy_level}")

    def describe(self) -> dict[str, Any]:
        return {
            "format": f"{QUANTIZED_OP} (onnxruntime contrib op), weight only",
            "bits": 4,
            **asdict(self),
            "zero_point": "none (signed int4)" if self.symmetric else "uint4 per block",
            "activations": "float; int8 per block inside the kernel" if self.accuracy_level == 4 else "float",
            "quantizer": "onnxruntime.quantization.matmul_nbits_quantizer (round to nearest)",
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
def _quiet() -> Iterator[None]:
    """The quantizer logs a line per node at INFO through its own logger; keep the terminal ours."""
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def quantize_int4(src: str | Path, out: str | Path, scheme: Scheme = Scheme()) -> Path:
    """Write the INT4 weight-only graph of the FP32 decoder graph ``src`` to ``out`` (one file), checked; callers
    stage ``out``."""
    nbits = require("onnxruntime.quantization.matmul_nbits_quantizer", "INT4 quantization")
    decoder_graph(src)
    proto = load_onnx(src)
    try:
        with _quiet():
            quantizer = nbits.MatMulNBitsQuantizer(
                proto,
                bits=4,
                block_size=scheme.block_size,
                is_symmetric=scheme.symmetric,
                accuracy_level=scheme.accuracy_level,
                op_types_to_quantize=("MatMul",),
            )
            quantizer.process()
    except Exception as e:
        raise CorpError(f"INT4 quantization of {src} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    quantized = quantizer.model.model
    count = sum(n.op_type == QUANTIZED_OP for n in quantized.graph.node)
    if not count:
        raise CorpError(f"{src} has no MatMul with a constant weight; nothing to quantize to INT4")
    add_metadata(quantized, {"precision": "int4", "int4_scheme": scheme.describe(), "int4_matmuls": count})
    import onnx

    onnx.save(quantized, str(out))
    check_onnx(out)
    return Path(out)


def prefill_feeds(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """What a decoder graph takes to score ``ids`` (batch, sequence) from scratch: the ids, a mask of ones and, for
    a key/value-cache graph, positions from 0 and an empty cache (its dims read from the graph's inputs)."""
    feeds: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        elif i.name.startswith("past_key_values"):
            batch, heads, _, width = i.shape
            dims = [ids.shape[0], heads, 0, width]
            if not all(isinstance(d, int) for d in dims):
                raise CorpError(f"cannot tell the cache shape of {i.name} ({i.shape}); export its widths as numbers")
            dtype = np.float16 if "float16" in i.type else np.float32
            feeds[i.name] = np.zeros(dims, dtype)
    return feeds


def log_probs(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the vocabulary, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class DecoderComparison:
    """Teacher-forced scores of a candidate decoder graph against a reference on the same windows."""

    windows: int
    tokens: int
    """Predicted positions: (sequence - 1) per window."""
    reference_ppl: float
    candidate_ppl: float
    agreement: float
    """Share of positions with the same top-1 next token."""

    @property
    def ppl_ratio(self) -> float:
        return self.candidate_ppl / self.reference_ppl

    def within(self, tol: DecoderTolerance) -> bool:
        return self.ppl_ratio <= tol.max_ppl_ratio and self.agreement >= tol.min_agreement

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ppl_ratio": self.ppl_ratio}


def compare_decoders(reference: str | Path, candidate: str | Path, windows: np.ndarray) -> DecoderComparison:
    """Both graphs on every window (one at a time: a window's logits are sequence x vocabulary): the negative
    log-likelihood of each true next token, summed in float64, and top-1 agreement."""
    ort = require("onnxruntime", "decoder verification")
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    nll, same, count = np.zeros(2), 0, 0
    for window in windows:
        ids = window[None]
        logits = [s.run([LOGITS], prefill_feeds(s, ids))[0][0, :-1] for s in sessions]
        targets = ids[0, 1:]
        for k, z in enumerate(logits):
            nll[k] -= log_probs(z)[np.arange(len(targets)), targets].sum()
        same += int((logits[0].argmax(-1) == logits[1].argmax(-1)).sum())
        count += len(targets)
    if not count:
        raise CorpError("decoder verification needs windows of at least 2 tokens")
    ppl = np.exp(nll / count)
    return DecoderComparison(len(windows), count, float(ppl[0]), float(ppl[1]), same / count)


def quantize_int4_verified(
    src: Path, out: Path, windows: np.ndarray, tol: DecoderTolerance, scheme: Scheme, info: dict | None = None
) -> dict[str, Any]:
    """Quantize ``src`` to ``out``, score it against ``src`` on ``windows``; return its record (also the sidecar).

    Raises one line (measured and allowed) when outside ``tol``; callers stage ``out`` so nothing is left.
    """
    from corp_deploy.exporters.pipeline import write_sidecar

    start = time.perf_counter()
    quantize_int4(src, out, scheme)
    seconds = time.perf_counter() - start
    c = compare_decoders(src, out, windows)
    if not c.within(tol):
        raise CorpError(
            f"INT4 ONNX {out.name} fails its gate against {src.name} on {c.windows} held-out windows: perplexity "
            f"x{c.ppl_ratio:.3f} (max x{tol.max_ppl_ratio}), top-1 agreement {c.agreement:.3f} "
            f"(min {tol.min_agreement}); try --int4-block-size 16 or keep FP32"
        )
    meta = read_metadata(load_onnx(out, weights=False))
    verify = {"reference": src.name, "runtime": "onnxruntime CPUExecutionProvider", **c.as_dict()}
    verify |= {"seq_len": int(windows.shape[1]), "tolerance": asdict(tol), **(info or {})}
    record = {**meta, "file": out.name, "bytes": onnx_bytes(out), "seconds": round(seconds, 2), "verify": verify}
    record |= {"quantized_from": src.name, "source_sha256": onnx_sha256(src)}
    write_sidecar(out, record)
    return record


def int4_genai_folder(
    src: Path, out: Path, windows: np.ndarray, tol: DecoderTolerance, scheme: Scheme, info: dict | None = None
) -> dict[str, Any]:
    """``out`` (created; callers stage it): the onnxruntime-genai folder ``src`` with its decode-step graph's weights
    in INT4, verified against ``src``'s FP32 graph (``quantize_int4_verified``: prefill logits on ``windows``); its
    genai_config.json and tokenizer files copied unchanged (the graph keeps its names and cache layout)."""
    from corp_deploy.exporters.genai import GRAPH

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in (GRAPH, f"{GRAPH}.json"):
            shutil.copy2(f, out / f.name)
    return quantize_int4_verified(src / GRAPH, out / GRAPH, windows, tol, scheme, info) | {"folder": out.name}


def int4_graphs(
    pairs: Sequence[tuple[Path, Path]],
    windows: np.ndarray,
    tol: DecoderTolerance = INT4,
    scheme: Scheme = Scheme(),
    info: dict | None = None,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Quantize each (FP32 graph, INT4 file) pair, verified; every graph and destination is checked before any
    work. Each INT4 file and its ``.json`` record appear only when verified. A pair of folders is an
    onnxruntime-genai folder and its INT4 copy (``int4_genai_folder``)."""
    from corp_deploy.exporters.genai import GRAPH

    for src, out in pairs:
        decoder_graph(src / GRAPH if src.is_dir() else src)
        check_writable(out, overwrite)
    records = []
    for src, out in pairs:
        with staged(out, overwrite) as stage:
            write = int4_genai_folder if src.is_dir() else quantize_int4_verified
            records.append(write(src, stage / out.name, windows, tol, scheme, info))
    return records


def format_int4(records: Sequence[dict[str, Any]]) -> str:
    """One row per INT4 graph: size, the scheme, and its gate figures against FP32."""
    rows = [("file", "MB", "block", "symmetric", "windows x tokens", "ppl FP32", "ppl INT4", "ratio", "top-1 agree")]
    for r in records:
        v, s = r["verify"], r["int4_scheme"]
        rows.append(
            (
                r["file"],
                f"{r['bytes'] / 2**20:.1f}",
                str(s["block_size"]),
                "yes" if s["symmetric"] else "no",
                f"{v['windows']} x {v['seq_len']}",
                f"{v['reference_ppl']:.3f}",
                f"{v['candidate_ppl']:.3f}",
                f"x{v['ppl_ratio']:.4f}",
                f"{v['agreement']:.3f}",
            )
        )
    return text_table(rows)
