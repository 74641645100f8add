"""Comparators: how far one backend's outputs are from a reference's, and whether that is acceptable.

The metrics are scale-free where it matters: ``cosine`` (the worst sample's) and ``rel_error``
(max |a - b| / max |ref|) mean the same for logits and for backbone features, so one tolerance
fits classifiers and DINOv2-style backbones alike. ``top1`` is reported, not gated: near-ties in a
random-weight model flip under harmless FP16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from corp_deploy.base.env import exact_fp32
from corp_deploy.base.errors import CorpError
from corp_deploy.exporters.text_onnx import example_inputs

Feed = np.ndarray | dict[str, np.ndarray]
"""One batch as a graph takes it: an FP32 NCHW image array, or arrays by input name (a text encoder's
``input_ids`` and ``attention_mask``)."""
Runner = Callable[[Feed], np.ndarray]
"""Anything that maps a batch to an FP32 output array (logits or features): the runners in
``corp_deploy.exporters.runners``, ``TrtRunner``; the one definition, used by the comparators and by
``corp_deploy.bench.accuracy``."""
Inputs = Callable[[int], Feed]
"""Batch size -> a seeded batch, the same for every runner compared on it."""
TEXT_VERIFY_SEQ = 19
"""Tokens per sequence a text graph is verified at: neither the traced length (``text_onnx.EXAMPLE``) nor 1."""


@dataclass(frozen=True)
class Tolerance:
    min_cosine: float
    max_rel_error: float


FP32 = Tolerance(min_cosine=0.99999, max_rel_error=1e-3)
"""Same math in another runtime: only summation order differs."""
FP16 = Tolerance(min_cosine=0.999, max_rel_error=5e-2)
"""Half-precision weights and activations against the FP32 graph (also for TF32 engines)."""
INT8 = Tolerance(min_cosine=0.97, max_rel_error=0.25)
"""Static INT8 (Q/DQ) against its FP32 graph on held-out real images; measured in docs/BENCHMARKS.md (INT8)."""


@dataclass(frozen=True)
class Comparison:
    batch: int
    max_abs: float
    rel_error: float
    cosine: float
    top1: float

    def within(self, tol: Tolerance) -> bool:
        return self.cosine >= tol.min_cosine and self.rel_error <= tol.max_rel_error

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(reference: np.ndarray, candidate: np.ndarray) -> Comparison:
    """Metrics of ``candidate`` against ``reference``; both (batch, ...) arrays of the same shape.

    A sample that is all zeros in one and not in the other has cosine 0 (a dead output must fail the
    gate, even where its values are small next to the batch's largest); zeros in both match (1).
    """
    if reference.shape != candidate.shape:
        raise CorpError(f"output shapes differ: {reference.shape} vs {candidate.shape}")
    ref = reference.reshape(len(reference), -1).astype(np.float64)
    got = candidate.reshape(len(candidate), -1).astype(np.float64)
    diff = np.abs(ref - got)
    norm_ref, norm_got = np.linalg.norm(ref, axis=1), np.linalg.norm(got, axis=1)
    cosine = (ref * got).sum(axis=1) / np.maximum(norm_ref * norm_got, 1e-300)
    cosine[(norm_ref == 0) & (norm_got == 0)] = 1.0
    return Comparison(
        batch=len(ref),
        max_abs=float(diff.max()),
        rel_error=float(diff.max() / max(np.abs(ref).max(), 1e-12)),
        cosine=float(cosine.min()),
        top1=float((ref.argmax(axis=1) == got.argmax(axis=1)).mean()),
    )


def random_inputs(batch: int, input_size: Sequence[int], seed: int = 0) -> np.ndarray:
    """Normalised-image-like inputs, N(0, 1), seeded per batch size so every backend sees the same."""
    return np.random.default_rng(seed + batch).standard_normal((batch, *input_size), dtype=np.float32)


def image_inputs(input_size: Sequence[int], seed: int = 0) -> Inputs:
    """``random_inputs`` at each batch size."""
    return lambda batch: random_inputs(batch, input_size, seed)


def text_inputs(vocab: int, max_positions: int, seed: int = 0) -> Inputs:
    """Random token ids of ``TEXT_VERIFY_SEQ`` tokens (fewer if the positions end sooner), every sequence after
    the first padded from a random length on: what padding and an untraced shape do to a graph shows."""

    def make(batch: int) -> dict[str, np.ndarray]:
        ids, mask = example_inputs(vocab, batch, min(TEXT_VERIFY_SEQ, max_positions), seed + batch)
        return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}

    return make


def compare_runners(reference: Runner, candidate: Runner, inputs: Iterable[Feed]) -> list[Comparison]:
    """Both runners on each input batch. The reference runs in exact FP32 (``env.exact_fp32``): TF32 in a
    PyTorch reference on a GPU would be rounding of its own, blamed on the candidate."""
    comparisons = []
    for x in inputs:
        with exact_fp32():
            expected = reference(x)
        comparisons.append(compare(expected, candidate(x)))
    return comparisons


def verify(reference: Runner, candidate: Runner, inputs: Inputs, batches: Sequence[int] = (1, 4)) -> list[Comparison]:
    """Run both on the same inputs at each batch size (two or more exercise the dynamic axis)."""
    return compare_runners(reference, candidate, (inputs(b) for b in batches))


def check(comparisons: Sequence[Comparison], tol: Tolerance, what: str) -> None:
    """Raise with the worst case named when any comparison is outside ``tol``."""
    for c in comparisons:
        if not c.within(tol):
            raise CorpError(
                f"{what} does not match at batch {c.batch}: cosine {c.cosine:.9f} (min {tol.min_cosine}), "
                f"relative error {c.rel_error:.2e} (max {tol.max_rel_error:g}); if this is expected, "
                "loosen --tol-cosine/--tol-rel, else report it with the model name"
            )


def summary(comparisons: Sequence[Comparison]) -> dict[str, float]:
    """Worst case over batch sizes, for tables and JSON."""
    return {
        "batches": [c.batch for c in comparisons],
        "max_abs": max(c.max_abs for c in comparisons),
        "rel_error": max(c.rel_error for c in comparisons),
        "cosine": min(c.cosine for c in comparisons),
        "top1": min(c.top1 for c in comparisons),
    }
