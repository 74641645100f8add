"""The numerics production runs on: the damped solve, float32 statistics, and determinism.

``test_compensation.py`` checks the closed forms at ridge 0 in float64. Production solves with a
relative ridge (Cholesky, with a pseudo-inverse fallback) on systems with condition numbers of
1e10-1e12, and accumulates statistics from float32 activations. Here each of those is compared
with a direct computation: the damped solve against ``(G + lam I)^-1 R`` built from a known
eigendecomposition, float32 sums against float64 ground truth on activations whose means dwarf
their spread, and the ``active`` counts against a direct count.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_batches, tiny_vit

from corp_deploy.core import compensation as C
from corp_deploy.core import stats as stats_module
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.stats import ACTIVE_EPS, MlpStats, QKStats
from corp_deploy.plan.width_plan import plan_widths

F64 = torch.float64


def spd(eigenvalues: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric matrix with the given eigenvalues and a random orthogonal basis: (G, basis)."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=g, dtype=F64))
    return (basis * eigenvalues) @ basis.T, basis


def damped_truth(eigenvalues: torch.Tensor, basis: torch.Tensor, rhs: torch.Tensor, lam: float) -> torch.Tensor:
    """``(G + lam I)^-1 R`` from the eigendecomposition G was built from (exact up to rounding)."""
    return (basis / (eigenvalues + lam)) @ (basis.T @ rhs)


SPECTRA = {
    "well-conditioned": torch.linspace(1.0, 10.0, 12, dtype=F64),
    "condition-1e12": torch.logspace(0, -12, 12, dtype=F64),
    "rank-deficient": torch.cat([torch.linspace(1.0, 3.0, 6, dtype=F64), torch.zeros(6, dtype=F64)]),
}


@pytest.mark.parametrize("spectrum", list(SPECTRA))
@pytest.mark.parametrize("alpha", [1e-3, 1e-1])
def test_damped_solve_is_the_relative_ridge_solution(spectrum, alpha) -> None:
    """``ridge_solve`` = ``(G + alpha * mean(diag G) I)^-1 R``, and the damping visibly matters."""
    scale = 3e4  # Grams are sums over tens of thousands of tokens: the damping must scale with them
    eigenvalues = SPECTRA[spectrum] * scale
    gram, basis = spd(eigenvalues, seed=0)
    rhs = torch.randn(12, 5, generator=torch.Generator().manual_seed(1), dtype=F64) * scale
    lam = alpha * float(gram.diagonal().mean())
    assert lam == pytest.approx(alpha * float(eigenvalues.mean()))  # trace is basis-invariant
    truth = damped_truth(eigenvalues, basis, rhs, lam)
    got = C.ridge_solve(gram, rhs, alpha)
    torch.testing.assert_close(got, truth, rtol=1e-8, atol=1e-10 * float(truth.abs().max()))
    direct = torch.linalg.solve(gram + lam * torch.eye(12, dtype=F64), rhs)
    torch.testing.assert_close(got, direct, rtol=1e-8, atol=1e-10 * float(truth.abs().max()))
    # The test can tell damping from none: the undamped answer is far from the damped one.
    undamped = torch.linalg.pinv(gram, hermitian=True) @ rhs
    assert float((undamped - truth).norm()) > 1e-3 * float(truth.norm())


def test_undamped_solve_of_a_rank_deficient_system_is_the_minimum_norm_solution() -> None:
    eigenvalues = SPECTRA["rank-deficient"]
    gram, basis = spd(eigenvalues, seed=2)
    rhs = gram @ torch.randn(12, 3, generator=torch.Generator().manual_seed(3), dtype=F64)  # consistent system
    got = C.ridge_solve(gram, rhs, 0.0)
    kept = basis[:, :6]
    torch.testing.assert_close(got, (kept / eigenvalues[:6]) @ (kept.T @ rhs), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gram @ got, rhs, rtol=1e-8, atol=1e-9)
    assert float((basis[:, 6:].T @ got).abs().max()) < 1e-10  # nothing in the null space


def test_indefinite_system_falls_back_to_the_damped_pseudo_inverse() -> None:
    """Cholesky fails on a system that rounding left indefinite; the fallback still damps it."""
    eigenvalues = torch.tensor([10.0, 8.0, 6.0, 4.0, -1.0], dtype=F64)
    gram, basis = spd(eigenvalues, seed=4)
    alpha = 1e-2
    lam = alpha * float(gram.diagonal().mean())
    assert int(torch.linalg.cholesky_ex(gram + lam * torch.eye(5, dtype=F64)).info) > 0  # the fallback path
    rhs = torch.randn(5, 2, generator=torch.Generator().manual_seed(5), dtype=F64)
    torch.testing.assert_close(C.ridge_solve(gram, rhs, alpha), damped_truth(eigenvalues, basis, rhs, lam))


def test_all_zero_statistics_give_zero_compensation_not_nan() -> None:
    """Dead kept channels give a zero Gram: lam is 0 too, Cholesky fails, and the answer must be 0."""
    out = C.ridge_solve(torch.zeros(4, 4, dtype=F64), torch.zeros(4, 2, dtype=F64), 1e-3)
    assert torch.equal(out, torch.zeros(4, 2, dtype=F64))


def test_mlp_affine_damps_with_the_kept_covariance() -> None:
    """B = Sigma_PS (Sigma_SS + lam I)^-1 with lam = alpha * mean(diag Sigma_SS), c = mu_P - B mu_S."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3000, 10, generator=g, dtype=F64) @ torch.randn(10, 10, generator=g, dtype=F64) + 2.0
    keep, prune = torch.tensor([0, 2, 3, 5, 8]), torch.tensor([1, 4, 6, 7, 9])
    mean, cov = x.mean(0), torch.cov(x.T, correction=0)
    alpha = 0.1
    cov_ss = cov[keep][:, keep]
    lam = alpha * float(cov_ss.diagonal().mean())
    b_truth = torch.linalg.solve(cov_ss + lam * torch.eye(5, dtype=F64), cov[keep][:, prune]).T
    b, c = C.mlp_affine(mean, cov + torch.outer(mean, mean), keep, prune, alpha)
    torch.testing.assert_close(b, b_truth, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(c, mean[prune] - b_truth @ mean[keep], rtol=1e-9, atol=1e-12)


def test_damped_logit_compensation_equals_brute_force_ridge() -> None:
    """The attention solve with ridge: min_M sum_b ||Q_P K_P^T - Q_S M K_S^T||^2 + lam ||M||^2, directly."""
    g = torch.Generator().manual_seed(7)
    d, keep, prune = 6, torch.tensor([0, 1, 3]), torch.tensor([2, 4, 5])
    mix = torch.randn(d, d, generator=g, dtype=F64)
    q = torch.randn(4, 9, 1, d, generator=g, dtype=F64) @ mix + 0.5
    k = torch.randn(4, 9, 1, d, generator=g, dtype=F64) @ mix.T - 0.2
    stats = QKStats(heads=1, head_dim=d)
    stats.update(q, k)
    a, r = C.logit_system(stats.moment[0], stats.index, keep, prune)
    design = torch.cat([torch.kron(qb[:, keep], kb[:, keep]) for qb, kb in zip(q[:, :, 0], k[:, :, 0], strict=True)])
    target = torch.cat(
        [(qb[:, prune] @ kb[:, prune].T).reshape(-1) for qb, kb in zip(q[:, :, 0], k[:, :, 0], strict=True)]
    )
    normal = design.T @ design
    alpha = 1e-2
    lam = alpha * float(normal.diagonal().mean())
    truth = torch.linalg.solve(normal + lam * torch.eye(9, dtype=F64), design.T @ target).reshape(3, 3)
    torch.testing.assert_close(C.solve_logit_compensation(a, r, alpha), truth, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------- float32 statistics


def large_mean_activations(n: int, width: int, seed: int) -> torch.Tensor:
    """float32 tokens with means in the hundreds and spreads of 1e-2: E[xx^T] - mu mu^T cancels 8 digits."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g, dtype=F64) / width**0.5
    x = (torch.randn(n, width, generator=g, dtype=F64) @ mix) * 1e-2 + 100.0 + 900.0 * torch.rand(width, generator=g)
    return x.float()


@pytest.mark.parametrize("batch", [4096, 700, 64])
def test_float32_mlp_statistics_match_float64_ground_truth(batch) -> None:
    x = large_mean_activations(4096, 16, seed=0)
    truth = x.double()
    stats = MlpStats(16)
    for i in range(0, len(x), batch):
        stats.update(x[i : i + batch])
    assert stats.sum.dtype == F64 and x.dtype == torch.float32
    cov = stats.second_moment() - torch.outer(stats.mean(), stats.mean())
    true_cov = torch.cov(truth.T, correction=0)
    assert float((cov - true_cov).norm() / true_cov.norm()) < 1e-4
    torch.testing.assert_close(stats.mean(), truth.mean(0), rtol=1e-12, atol=0)

    # What the compensation is built from comes out right too: B and c from float32 sums.
    keep, prune = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
    exact = MlpStats(16)
    exact.update(truth)
    b32, c32 = C.mlp_affine(stats.mean(), stats.second_moment(), keep, prune, 1e-3)
    b64, c64 = C.mlp_affine(exact.mean(), exact.second_moment(), keep, prune, 1e-3)
    torch.testing.assert_close(b32, b64, rtol=1e-3, atol=1e-3 * float(b64.abs().max()))
    torch.testing.assert_close(c32, c64, rtol=1e-3, atol=1e-3 * float(c64.abs().max()))


def test_the_gram_in_column_strips_is_symmetric_and_matches_float64(monkeypatch) -> None:
    monkeypatch.setattr(stats_module, "GRAM_STRIP", 5)  # 16 columns: strips of 5, 5, 5 and 1
    x = large_mean_activations(4096, 16, seed=0)
    stats = MlpStats(16)
    stats.update(x)
    torch.testing.assert_close(stats.outer, stats.outer.T, rtol=1e-14, atol=0)  # the mirrored strips: to rounding
    cov = stats.second_moment() - torch.outer(stats.mean(), stats.mean())
    true_cov = torch.cov(x.double().T, correction=0)
    assert float((cov - true_cov).norm() / true_cov.norm()) < 1e-4


def test_float32_attention_moments_match_float64_ground_truth() -> None:
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(6, 50, 2, 8, generator=g) * 0.1 + 3.0).float()
    k = (torch.randn(6, 50, 2, 8, generator=g) * 0.1 - 2.0).float()
    s32, s64 = QKStats(2, 8), QKStats(2, 8)
    s32.update(q, k)
    s64.update(q.double(), k.double())
    torch.testing.assert_close(s32.moment, s64.moment, rtol=1e-5, atol=0)


def test_active_counts_equal_a_direct_count() -> None:
    """Channel j is active on exactly j of 10 tokens; values at +-eps are not active, just above are."""
    x = torch.zeros(10, 6)
    for j in range(6):
        x[:j, j] = torch.tensor([2.0, -0.5, ACTIVE_EPS * 1.01, -ACTIVE_EPS * 1.01, 1.0][:j])
    x[9, :] = ACTIVE_EPS  # on the threshold: not active (|x| > eps)
    x[8, 0] = -ACTIVE_EPS
    stats = MlpStats(6)
    stats.update(x[:4])
    stats.update(x[4:])
    assert stats.active.tolist() == [0, 1, 2, 3, 4, 5]


@torch.no_grad()
def test_active_counts_of_a_real_pass_equal_a_direct_count() -> None:
    model = tiny_vit(act_layer=torch.nn.ReLU)  # exact zeros, so the counts differ per channel
    captured: list[torch.Tensor] = []
    hook = model.blocks[1].mlp.fc2.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    batches = tiny_batches()
    stats = calibrate(model, batches, PruneConfig(target="mlp"), "cpu", progress=False)
    hook.remove()
    x = torch.cat(captured).reshape(-1, 128)
    direct = (x.abs() > ACTIVE_EPS).sum(0).double()
    assert torch.equal(stats.mlp[1].active, direct) and len(set(direct.tolist())) > 10


# -------------------------------------------------------------------------------- determinism


def _pruned_weights(batch: int, threads: int) -> dict[str, torch.Tensor]:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_vit()
        config = PruneConfig(sparsity=0.5, round_to=4)
        stats = calibrate(model, tiny_batches(48, batch), config, "cpu", progress=False)
        pruned = copy.deepcopy(model)
        prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
        return pruned.state_dict()
    finally:
        torch.set_num_threads(old)


def test_same_model_for_any_calibration_batch_size_or_thread_count() -> None:
    """Batch boundaries and thread counts change float32 summation order only: same kept sets, same weights."""
    reference = _pruned_weights(16, 1)
    for batch, threads in ((5, 1), (48, 2), (7, 2)):
        other = _pruned_weights(batch, threads)
        for name, value in reference.items():
            if ".fc1." in name:  # kept rows are copied, not computed: identical kept set, identical bits
                assert torch.equal(other[name], value), (name, batch, threads)
            else:
                torch.testing.assert_close(other[name], value, rtol=1e-4, atol=1e-5, msg=f"{name} {batch} {threads}")
