"""``minmax``'s 4-bit grid (llama.cpp's Q4_1): per block of input channels and output column a minimum ``m`` and a
step ``d``, the weight ``m + d * q`` with codes ``q`` in 0..15; the codes by rounding to nearest, or with error
feedback (GPTQ) where the weight is not on such a grid.

Both return the same three arrays over a weight ``w`` of shape (K, N) (``x @ w``: K input channels): codes (K, N)
uint8, minima and steps (ceil(K / block), N) float32; a K that is not a multiple of ``block`` ends in a short block.
``exporters.int4_quant.minmax_int4`` writes them as ``MatMulNBits`` (the codes times the steps) plus the minima's
FP32 offset MatMul.
"""

from __future__ import annotations

import numpy as np

LEVELS = 15
"""The largest 4-bit code."""
DAMP = 0.01
"""GPTQ's damping: this fraction of the mean diagonal of ``X^T X`` added to its diagonal, so that an input channel
the calibration windows barely excite cannot make the inverse blow up (GPTQ's and SparseGPT's default)."""


def block_range(rows: np.ndarray, integer_zero: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and step of a block of rows (one of each per column), float32; a flat column gets step 1.
    ``integer_zero``: the range widened to hold 0 and its minimum moved to a whole number of steps below 0 (``-z *
    step``, z in 0..15), so that ``MatMulNBits``' own uint4 zero point holds it and no offset MatMul is needed."""
    low, high = rows.min(0).astype(np.float32), rows.max(0).astype(np.float32)
    if integer_zero:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
    step = ((high - low) / LEVELS).astype(np.float32)
    step[step == 0] = 1
    if integer_zero:
        low = (-zero_points(low, step).astype(np.float32) * step).astype(np.float32)
    return low, step


def zero_points(low: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The uint4 zero point ``z`` of an ``integer_zero`` grid (its minimum is ``-z * step``)."""
    return np.clip(np.round(-low / step), 0, LEVELS).astype(np.uint8)


def _round(row: np.ndarray, low: np.ndarray, step: np.ndarray) -> np.ndarray:
    return np.clip(np.round((row.astype(np.float32) - low) / step), 0, LEVELS).astype(np.uint8)


def _empty(shape: tuple[int, int], block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (K, N) and per-block minima and steps (ceil(K / block), N) to fill."""
    k, n = shape
    blocks = -(-k // block)
    return np.empty((k, n), np.uint8), np.empty((blocks, n), np.float32), np.empty((blocks, n), np.float32)


def minmax_grid(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's own minimum and step, every weight rounded to its nearest code: a weight already on such a grid
    (a dequantized GGUF Q4_1) comes back exactly, any other within half a step."""
    codes, lows, steps = _empty(w.shape, block)
    for b in range(len(lows)):
        rows = w[b * block : (b + 1) * block]
        lows[b], steps[b] = block_range(rows)
        codes[b * block : (b + 1) * block] = _round(rows, lows[b], steps[b])
    return codes, lows, steps


def gptq_grid(
    w: np.ndarray, hessian: np.ndarray, block: int, damp: float = DAMP, integer_zero: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The codes that GPTQ's error feedback picks: greedily minimizes the output error ``||X w - X w_q||^2`` on the
    calibration inputs ``X`` (``hessian`` = X^T X, (K, K)), one input channel at a time.

    Rounding channel ``i`` leaves the error ``e = w_i - w_q,i``; the channels not yet rounded absorb it by the update
    that minimizes the output error given channel ``i`` fixed (OBQ: ``w_j -= e * H^-1_ij / H^-1_ii``). GPTQ runs the
    channels in order and reads every update from the upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``):
    ``w_j -= U_ij * e / U_ii`` for j > i. A block's minimum and step are fixed when the sweep reaches it, from the
    weights updated so far (GPTQ with groups): minmax's grid, or with ``integer_zero`` ``block_range``'s (a uint4
    zero point). ``H`` is damped (``damp`` x its mean diagonal) and in float64. With a diagonal ``H`` (inputs
    uncorrelated) ``U`` is diagonal, nothing is updated, and the codes are plain rounding's (``minmax_grid``'s)."""
    k, n = w.shape
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) == 0  # a channel the windows never excite: any code is as good (GPTQ's convention)
    h[dead, dead] = 1
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    w = w.astype(np.float64).copy()
    codes, lows, steps = _empty((k, n), block)
    for b in range(len(lows)):
        first, last = b * block, min((b + 1) * block, k)
        lows[b], steps[b] = low, step = block_range(w[first:last], integer_zero)
        errors = np.empty((last - first, n))
        for i in range(first, last):
            codes[i] = _round(w[i], low, step)
            errors[i - first] = (w[i] - (low + step * codes[i].astype(np.float32))) / u[i, i]
            w[i + 1 : last] -= np.outer(u[i, i + 1 : last], errors[i - first])
        w[last:] -= u[first:last, last:].T @ errors  # the later blocks absorb this block's errors at once
    return codes, lows, steps


def grid_weight(codes: np.ndarray, lows: np.ndarray, steps: np.ndarray, block: int) -> np.ndarray:
    """The float weight (K, N) the grid stands for: ``m + d * q`` per block."""
    k = codes.shape[0]
    return np.repeat(lows, block, 0)[:k] + np.repeat(steps, block, 0)[:k] * codes.astype(np.float32)
