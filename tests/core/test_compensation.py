"""The closed forms against direct computations on raw tensors (float64, exact checks)."""

from __future__ import annotations

import pytest
import torch
from helpers import attn_moment, correlated_activations, qk_images, split

from corp_deploy.core import compensation as C
from corp_deploy.core.stats import MlpStats


@pytest.fixture(autouse=True)
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def mlp_stats(x: torch.Tensor) -> MlpStats:
    s = MlpStats(x.shape[1])
    s.update(x)
    return s


def test_mlp_ridge_to_zero_equals_least_squares() -> None:
    x = correlated_activations(4000, 24, seed=0)
    keep, prune = split(24, 12)
    s = mlp_stats(x)
    b, c = C.mlp_affine(s.mean(), s.second_moment(), keep, prune, alpha=0.0)
    design = torch.cat([x[:, keep], torch.ones(len(x), 1)], dim=1)
    coef = torch.linalg.lstsq(design, x[:, prune]).solution
    torch.testing.assert_close(b, coef[:-1].T, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(c, coef[-1], rtol=1e-6, atol=1e-8)


def test_mlp_error_formula_matches_direct_error_and_compensation_helps_held_out() -> None:
    width, out = 32, 8
    tokens = correlated_activations(5000, width, seed=1)
    calib, held_out = tokens[:3000], tokens[3000:]
    w2, b2 = torch.randn(out, width), torch.randn(out)
    keep, prune = split(width, 16)
    s = mlp_stats(calib)
    b, c = C.mlp_affine(s.mean(), s.second_moment(), keep, prune, alpha=1e-2)

    def direct(x: torch.Tensor, bb: torch.Tensor, cc: torch.Tensor) -> float:
        y = x @ w2.T + b2
        w_s, b_s = C.fold_mlp(w2, b2, keep, prune, bb, cc)
        return float(((y - (x[:, keep] @ w_s.T + b_s)) ** 2).sum() / (y**2).sum())

    zero_b = torch.zeros_like(b)
    for bb, cc in ((zero_b, torch.zeros_like(c)), (zero_b, s.mean()[prune]), (b, c)):
        formula = C.mlp_output_error(s.mean(), s.second_moment(), w2, b2, keep, prune, bb, cc)
        assert abs(float(formula) - direct(calib, bb, cc)) < 1e-9
    none, mean, corp = (
        direct(held_out, zero_b, torch.zeros_like(c)),
        direct(held_out, zero_b, s.mean()[prune]),
        direct(held_out, b, c),
    )
    assert corp < mean < none
    assert corp < 0.7 * none


def test_mlp_stats_are_exact_and_mergeable() -> None:
    x = correlated_activations(500, 10, seed=3) + 100.0  # large mean against unit variance
    whole, first, second = mlp_stats(x), mlp_stats(x[:200]), mlp_stats(x[200:])
    first += second
    for a, b in zip(whole.tensors(), first.tensors(), strict=True):
        torch.testing.assert_close(a, b)
    cov = first.second_moment() - torch.outer(first.mean(), first.mean())
    torch.testing.assert_close(cov, torch.cov(x.T, correction=0), rtol=1e-6, atol=1e-9)


def test_logit_system_matches_brute_force_least_squares() -> None:
    """Row-major Kronecker layout: solve sum_b ||Q_P K_P^T - Q_S M K_S^T||^2 directly over M."""
    d, kept = 6, 3
    q, k = qk_images(images=5, tokens=7, d=d, seed=0)
    keep, prune = split(d, kept)
    s = attn_moment(q, k)
    a, r = C.logit_system(s.moment[0], s.index, keep, prune)
    m = C.solve_logit_compensation(a, r, alpha=0.0)

    rows, targets = [], []
    for qb, kb in zip(q[:, :, 0], k[:, :, 0], strict=True):
        qs, ks = qb[:, keep], kb[:, keep]
        # vec_row(Q_S M K_S^T) = kron(Q_S, K_S) vec_row(M)
        rows.append(torch.kron(qs, ks))
        targets.append((qb[:, prune] @ kb[:, prune].T).reshape(-1))
    direct = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.reshape(kept, kept)
    torch.testing.assert_close(m, direct, rtol=1e-7, atol=1e-9)

    removed = C.pair_energy(s.moment[0], s.index, prune)
    resid = sum(
        float(((qb[:, prune] @ kb[:, prune].T - qb[:, keep] @ m @ kb[:, keep].T) ** 2).sum())
        for qb, kb in zip(q[:, :, 0], k[:, :, 0], strict=True)
    )
    assert abs(float(C.logit_error(a, r, removed, m)) - resid) < 1e-6 * resid
    total = sum(float(((qb @ kb.T) ** 2).sum()) for qb, kb in zip(q[:, :, 0], k[:, :, 0], strict=True))
    assert abs(float(C.pair_energy(s.moment[0], s.index, torch.arange(d))) - total) < 1e-9 * total


def test_logit_energy_is_paper_ranking_score() -> None:
    q, k = qk_images(images=4, tokens=9, d=5, seed=1)
    s = attn_moment(q, k)
    expected = ((q[:, :, 0] ** 2).sum(1) * (k[:, :, 0] ** 2).sum(1)).sum(0)
    torch.testing.assert_close(C.logit_energy(s.moment[0], s.index), expected)


def test_attention_compensation_reduces_held_out_logit_error() -> None:
    d, kept = 8, 4
    q_all, k_all = qk_images(images=50, tokens=10, d=d, seed=2)
    q, k, q_test, k_test = q_all[:40], k_all[:40], q_all[40:], k_all[40:]
    keep, prune = split(d, kept)
    s = attn_moment(q, k)
    a, r = C.logit_system(s.moment[0], s.index, keep, prune)
    m = C.solve_logit_compensation(a, r, alpha=1e-3)

    def err(mm: torch.Tensor) -> float:
        qq, kk = q_test[:, :, 0], k_test[:, :, 0]
        full = qq @ kk.transpose(1, 2)
        return float(((full - qq[..., keep] @ (torch.eye(kept) + mm) @ kk[..., keep].transpose(1, 2)) ** 2).sum())

    assert err(m) < err(torch.zeros_like(m))


def test_qk_fold_reproduces_compensated_logits_with_biases() -> None:
    dim, d, kept, tokens = 12, 8, 4, 9
    g = torch.Generator().manual_seed(4)
    wq, wk = torch.randn(d, dim, generator=g), torch.randn(d, dim, generator=g)
    bq, bk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    m = torch.randn(kept, kept, generator=g)  # deliberately non-symmetric
    keep = torch.tensor([0, 2, 5, 7])
    x = torch.randn(tokens, dim, generator=g)

    fq, fk = C.qk_factors(m)
    wq2, bq2 = C.fold_projection(wq[keep], bq[keep], fq)
    wk2, bk2 = C.fold_projection(wk[keep], bk[keep], fk)
    q_s, k_s = x @ wq[keep].T + bq[keep], x @ wk[keep].T + bk[keep]
    expected = q_s @ (torch.eye(kept) + m) @ k_s.T
    got = (x @ wq2.T + bq2) @ (x @ wk2.T + bk2).T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_qk_factors_are_canonical_whatever_the_svd_signs() -> None:
    """LAPACK and cuSOLVER flip singular pairs differently; the factors must not depend on it."""
    g = torch.Generator().manual_seed(7)
    m = torch.randn(8, 8, generator=g)
    fq, fk = C.qk_factors(m)
    torch.testing.assert_close(fq @ fk.T, torch.eye(8) + m)
    assert (fq.gather(0, fq.abs().argmax(0, keepdim=True)) > 0).all()
    u, sig, vh = torch.linalg.svd(torch.eye(8) + m)
    torch.testing.assert_close(fq.abs(), (u * sig.sqrt()).abs())  # the SVD's factors, one sign per pair
    fq_id, fk_id = C.qk_factors(torch.zeros(4, 4))
    torch.testing.assert_close(fq_id, torch.eye(4))  # no compensation: the identity, not -I
    torch.testing.assert_close(fk_id, torch.eye(4))


def test_attn_stats_mergeable() -> None:
    q, k = qk_images(images=6, tokens=5, d=4, seed=5)
    whole, a, b = attn_moment(q, k), attn_moment(q[:2], k[:2]), attn_moment(q[2:], k[2:])
    a += b
    for x, y in zip(whole.tensors(), a.tensors(), strict=True):
        torch.testing.assert_close(x, y)
