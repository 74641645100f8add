"""The INT4 gate: a quantized decoder graph against its FP32 graph on held-out token windows.

A decoder's outputs are next-token distributions, so the gate is a decoder's, not the cosine INT8 uses for
features: on held-out token windows (teacher-forced: every position reads the true tokens before it), the INT4
graph's perplexity over the FP32 graph's (``max_ppl_ratio``) and the share of positions whose top-1 token is the
FP32 graph's (``min_agreement``). Both are recorded in the graph's sidecar; a graph outside them is not written.

Any decoder graph with ``input_ids`` and ``logits`` works: the full-sequence logits graph (``text_onnx``) and a
key/value-cache graph, which is run as a prefill (``position_ids`` from 0, every ``past_key_values.*`` input
empty, past length 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line

LOGITS = "logits"


@dataclass(frozen=True)
class DecoderTolerance:
    """A quantized decoder against its FP32 graph on held-out windows."""

    max_ppl_ratio: float
    """Perplexity of the candidate over the reference's, at most."""
    min_agreement: float
    """Share of positions whose top-1 next token equals the reference's, at least."""


INT4 = DecoderTolerance(max_ppl_ratio=1.25, min_agreement=0.80)
"""INT4 weights on held-out text. On real SmolLM2-135M (docs/BENCHMARKS.md, INT4 on real SmolLM2-135M) the default
scheme measures x1.017 / 0.913 dense and x1.024 / 0.922 MLP-30% pruned; every round-to-nearest variant
x1.22-1.47 / 0.59-0.70: nothing measured fell between 0.79 and 0.91 agreement."""


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


def gate_words(verify: dict[str, Any]) -> str:
    """A sidecar's ``verify`` (the figures and the tolerance they were held to) as its verdict:
    ``passes gate x1.010 / 0.906`` or ``fails gate x1.382 / 0.592``."""
    tol = DecoderTolerance(**verify["tolerance"])
    passes = verify["ppl_ratio"] <= tol.max_ppl_ratio and verify["agreement"] >= tol.min_agreement
    return f"{'passes' if passes else 'fails'} gate x{verify['ppl_ratio']:.3f} / {verify['agreement']:.3f}"


@dataclass(frozen=True)
class Scores:
    """One decoder graph's teacher-forced scores on windows: the summed negative log-likelihood of every true next
    token (float64) and each window's top-1 tokens. A reference's are scored once and compared with every candidate."""

    nll: float
    top1: list[np.ndarray]
    tokens: int


def scores(graph: str | Path, windows: np.ndarray) -> Scores:
    """``graph`` on every window, one at a time (a window's logits are sequence x vocabulary), alone in memory."""
    ort = require("onnxruntime", "decoder verification")
    try:
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's load errors are of many pybind types; an invalid graph is one line
        raise CorpError(f"onnxruntime cannot load {Path(graph).name}: {first_line(e)}") from None
    nll, top1, count = 0.0, [], 0
    for window in windows:
        ids = window[None]
        z = session.run([LOGITS], prefill_feeds(session, ids))[0][0, :-1]
        targets = ids[0, 1:]
        nll -= log_probs(z)[np.arange(len(targets)), targets].sum()
        top1.append(z.argmax(-1))
        count += len(targets)
    if not count:
        raise CorpError("decoder verification needs windows of at least 2 tokens")
    return Scores(float(nll), top1, count)


def compare_decoders(reference: str | Path | Scores, candidate: str | Path, windows: np.ndarray) -> DecoderComparison:
    """The candidate graph against the reference (a graph, or its ``scores`` on the same windows) on every window:
    the negative log-likelihood of each true next token, summed in float64, and top-1 agreement. The two graphs are
    never loaded together (the 1.7B shape's FP32 graph is 6.8 GB)."""
    ref = reference if isinstance(reference, Scores) else scores(reference, windows)
    got = scores(candidate, windows)
    same = sum(int((a == b).sum()) for a, b in zip(ref.top1, got.top1, strict=True))
    ppl = np.exp(np.array([ref.nll, got.nll]) / ref.tokens)
    return DecoderComparison(len(windows), ref.tokens, float(ppl[0]), float(ppl[1]), same / ref.tokens)
