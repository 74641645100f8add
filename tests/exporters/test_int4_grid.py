"""minmax's Q4_1 grid with and without error feedback (``exporters.int4_grid``): plain numpy on tiny layers, the
output error measured directly on the inputs whose second moment GPTQ reads, against brute force where it fits."""

from __future__ import annotations

import itertools

import numpy as np

from corp_deploy.exporters.int4_grid import block_range, gptq_grid, grid_weight, minmax_grid, zero_points


def _error(x: np.ndarray, w: np.ndarray, q: np.ndarray) -> float:
    return float(np.square(x.astype(np.float64) @ (w - q)).sum())


def _correlated(rng, tokens: int, k: int) -> np.ndarray:
    """Inputs whose channels are strongly correlated (a few shared factors), as a decoder's activations are."""
    return (
        rng.standard_normal((tokens, 3)) @ rng.standard_normal((3, k)) + 0.1 * rng.standard_normal((tokens, k))
    ).astype(np.float32)


def test_with_uncorrelated_inputs_error_feedback_is_plain_minmax_short_block_included() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 6)).astype(np.float32)  # blocks of 16: the last one short (8 rows)
    hessian = np.diag(rng.uniform(0.5, 2.0, 40))
    for ours, plain in zip(gptq_grid(w, hessian, 16), minmax_grid(w, 16), strict=True):
        assert ours.dtype == plain.dtype and np.array_equal(ours, plain)
    codes, lows, steps = minmax_grid(w, 16)
    assert codes.shape == (40, 6) and lows.shape == steps.shape == (3, 6) and codes.max() == 15 and codes.min() == 0
    assert np.abs(grid_weight(codes, lows, steps, 16) - w).max() <= steps.max() / 2 + 1e-6


def test_a_weight_on_a_q4_1_grid_comes_back_exactly_whatever_the_inputs() -> None:
    rng = np.random.default_rng(1)
    k, n, block = 48, 5, 16
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    codes[::block], codes[1::block] = 0, 15  # every block spans its grid, as a Q4_1 block does
    lows = rng.standard_normal((k // block, n)).astype(np.float32)
    steps = rng.uniform(0.01, 0.1, (k // block, n)).astype(np.float32)
    w = grid_weight(codes, lows, steps, block)
    x = _correlated(rng, 200, k)
    back = gptq_grid(w, x.T.astype(np.float64) @ x, block)
    assert np.array_equal(back[0], codes)
    assert np.allclose(grid_weight(*back, block), w, rtol=0, atol=1e-6)


def test_on_correlated_inputs_error_feedback_beats_rounding_and_brute_force_bounds_it() -> None:
    """Blocks of 4 input channels, 200 outputs: a single block's grid is fixed before any update, so brute force
    over all 16^4 codes of each output on that grid is the least error any rounding can reach."""
    rng = np.random.default_rng(2)
    k, n = 4, 200
    x = (rng.standard_normal((64, 2)) @ rng.standard_normal((2, k)) + 0.1 * rng.standard_normal((64, k))).astype(
        np.float32
    )
    w = rng.standard_normal((k, n)).astype(np.float32)
    hessian = x.T.astype(np.float64) @ x
    ours = _error(x, w, grid_weight(*gptq_grid(w, hessian, k, damp=0.0), k))
    plain = _error(x, w, grid_weight(*minmax_grid(w, k), k))
    low, step = block_range(w)
    every = np.array(list(itertools.product(range(16), repeat=k)), np.float32)  # (65536, k)
    best = 0.0
    for c in range(n):
        e = w[:, c].astype(np.float64) - (low[c] + step[c] * every)
        best += float(np.einsum("ij,jk,ik->i", e, hessian, e).min())
    assert best <= ours < 0.7 * plain  # measured: 18.3 <= 39.2 < 68.1


def test_on_a_wider_layer_error_feedback_lowers_the_output_error_and_stays_on_its_grid() -> None:
    rng = np.random.default_rng(3)
    k, n, block = 72, 16, 32  # 3 blocks, the last short
    x = _correlated(rng, 400, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    codes, lows, steps = gptq_grid(w, x.T.astype(np.float64) @ x, block)
    assert codes.dtype == np.uint8 and codes.max() <= 15 and lows.shape == steps.shape == (3, n)
    assert _error(x, w, grid_weight(codes, lows, steps, block)) < 0.5 * _error(
        x, w, grid_weight(*minmax_grid(w, block), block)
    )
    first = w[:block]  # the first block's grid is fixed before any update: the original weights' own range
    assert np.array_equal(lows[0], first.min(0)) and np.allclose(steps[0], np.ptp(first, 0) / 15)


def test_an_integer_zero_grid_holds_its_minimum_in_a_uint4_zero_point() -> None:
    rng = np.random.default_rng(4)
    k, n, block = 40, 8, 16
    w = (rng.standard_normal((k, n)) + 0.5).astype(np.float32)
    x = _correlated(rng, 300, k)
    codes, lows, steps = gptq_grid(w, x.T.astype(np.float64) @ x, block, integer_zero=True)
    z = zero_points(lows, steps)
    assert np.array_equal(-z.astype(np.float32) * steps, lows) and z.max() <= 15  # the minimum: whole steps below 0
    plain = gptq_grid(w, np.eye(k), block, integer_zero=True)  # no feedback: rounding on that grid
    for b in range(3):
        low, step = block_range(w[b * block : (b + 1) * block], integer_zero=True)
        assert np.array_equal(plain[1][b], low) and np.array_equal(plain[2][b], step)
        assert (low <= 0).all() and (low + 15 * step >= 0).all()
    dense = grid_weight(*plain, block)
    assert np.abs(dense - w).max() <= plain[2].max() + 1e-6  # the zero point's rounding moves a grid <= step / 2
    assert _error(x, w, grid_weight(codes, lows, steps, block)) < _error(x, w, dense)
