"""Compensation-aware channel selection: greedy Optimal Brain Surgeon for whole channels (pure tensor functions).

CORP keeps channels S of a Linear's input x, predicts the removed ones by the ridge fit ``x_P ~ B x_S + c`` and folds
it into the kept weights (``compensation.mlp_affine`` / ``fold_mlp``). A diagonal score (``ranking``) chooses S blind
to what that fit restores; this module chooses S by the error the fit leaves.

The objective. With Sigma the covariance of x (the constant c absorbs the mean, so it is Sigma, not the raw second
moment) and ``H = Sigma + lam I``, the ridge solution is ``B = Sigma_PS (Sigma_SS + lam I)^-1 = H_PS H_SS^-1``
(H's off-diagonal blocks are Sigma's). Ridge is least squares on inputs with white noise of variance lam added,
whose covariance is H, so the error of the folded layer on those inputs is the Schur complement

    E_lam(S) = tr(W_P (H / H_SS) W_P^T),    H / H_SS = H_PP - H_PS H_SS^-1 H_SP,

i.e. ``compensation.mlp_output_error`` on the moments (mean, second + lam I) with ``mlp_affine``'s B at alpha 0 on
them (the same B the ridge fit gives on the plain moments). At lam = 0 it is compensation's error itself, exactly.
On clean inputs the same fold errs by ``E_lam(S) - lam ||W_P B||^2 - lam ||W_P||^2``: E_lam adds the ridge penalty
and the noise of the removed channels, so it is the ridge problem's own objective, not a proxy.

The greedy step. Let K = H_SS^-1 and W' = the folded weights on the current kept set. The residual of x_P is
H-orthogonal to x_S (the normal equations), so errors add, and removing a unit Q of S from the layer ``W' x_S`` is
the same problem one size down:

    gain(Q)  = tr(W'_Q K_QQ^-1 W'_Q^T)                         (exact increase of E_lam; ||W'_j||^2 / K_jj for one)
    W'      -= W'_Q K_QQ^-1 K_Q,:                              (the OBS update = fold_mlp's W_S + W_P B, step by step)
    K       -= K_:,Q K_QQ^-1 K_Q,:                             (inverse of the smaller H_SS; rows/cols Q become 0)

A unit is one channel, or the channels that must go together (query heads sharing a V head). The gains read W' only
through its Gram ``A = W'^T W'`` (n x n, updated by the same rank-|Q| terms), so out never enters a step. The downdates
are kept as low-rank factors (``K0 - V V^T``, V's new columns ``K_:,Q L^-T`` with ``L L^T = K_QQ``) and applied by one
GEMM every ``lazy`` columns, as GPTQ's lazy batches: a step costs O(n * rank), the n^3 work runs as matrix products,
and the result is that of rank-1 downdates. H^-1 comes from a Cholesky of H. SparseGPT's Cholesky of the inverse
serves a FIXED column order; a greedy order is chosen as it goes, so the inverse is downdated explicitly.

The damping is relative, as compensation's: ``lam = alpha * mean(diag(Sigma))`` over all channels (SparseGPT's
choice), where the fold later uses the kept channels' mean (``ridge_solve``); at CORP's alpha = 1e-3 the two differ by
the ratio of those means, a perturbation of a 1e-3 damping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from corp_deploy.base.errors import CorpError

JITTERS = (1e-10, 1e-8, 1e-6, 1e-4, 1e-2)
"""Relative damping tried in turn when alpha is too small for a Cholesky (dead or duplicated channels)."""


def damped_inverse(cov: Tensor, alpha: float) -> Tensor:
    """``(Sigma + lam I)^-1`` via Cholesky, ``lam = alpha * mean(diag(Sigma))``, alpha raised to the first of
    ``JITTERS`` above it that makes the system positive definite when alpha alone does not."""
    scale = float(cov.diagonal().mean().clamp_min(torch.finfo(cov.dtype).tiny))
    eye = torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    for rel in (alpha, *(j for j in JITTERS if j > alpha)):
        chol, info = torch.linalg.cholesky_ex(cov + rel * scale * eye)
        if not info:
            return torch.cholesky_solve(eye, chol)  # cholesky_inverse is 20x slower on CPU
    raise CorpError("the calibration statistics are not finite (NaN or inf activations); check the model and inputs")


def greedy_removal(kinv: Tensor, gram: Tensor, units: Tensor, heads: Tensor, lazy: int = 128) -> tuple[Tensor, Tensor]:
    """Remove every unit, each time the one whose removal raises ``E_lam`` least; (unit ids in removal order, gains).

    ``kinv``: H^-1 (n x n); ``gram``: ``W^T W`` of the reading Linear's weight (n x n); ``units``: (U, g) column ids,
    g per unit; ``heads``: (U,) group label: only units of the groups with the most units left are eligible, so every
    group (attention head) loses one unit per round and the kept sets at every width keep equal counts per group.
    ``cumsum(gains)[t]`` is ``E_lam`` after the first t + 1 removals (absolute, in the output's units).

    The gains read only ``A = W'^T W'``, so W' is never formed: with ``v = K_:,Q L^-T`` and ``a = A_:,Q L^-T``, the
    OBS update gives ``A - v a^T - a v^T + v m v^T`` (``m = L^-1 a_Q``), kept as ``A0 - V Bf^T - Bf V^T`` with
    ``Bf``'s new columns ``a - v m / 2``, beside ``K = K0 - V V^T``: a step costs O(n * rank), independent of out.
    """
    k0, a0, cols = kinv.clone(), gram.clone(), units.clone()
    n_units, g = units.shape
    lazy = max(lazy, g)
    vs, bs, r = k0.new_zeros(k0.shape[0], lazy), k0.new_zeros(k0.shape[0], lazy), 0  # the pending factors' columns
    idx = (cols[:, :, None], cols[:, None, :])
    kq, aq = k0[idx], a0[idx]  # K_QQ and A_QQ of every unit, kept current
    alive = torch.ones(n_units, dtype=torch.bool, device=k0.device)
    left = torch.bincount(heads)
    order, gains = [], []
    for _ in range(n_units):
        eligible = (alive & (left[heads] == left.max())).nonzero().squeeze(1)
        gain, pick = unit_gains(kq[eligible], aq[eligible]).min(0)
        q = int(eligible[pick])
        cq = cols[q]
        inv_lt = torch.linalg.inv(torch.linalg.cholesky(kq[q])).T  # L^-T, g x g (small solves cost more)
        vp, bp = vs[:, :r], bs[:, :r]
        v = (k0[cq].T - vp @ vp[cq].T) @ inv_lt  # K_:,Q L^-T (K and A are symmetric: rows are contiguous)
        a = (a0[cq].T - vp @ bp[cq].T - bp @ vp[cq].T) @ inv_lt  # A_:,Q L^-T
        b = a - v @ (inv_lt.T @ a[cq]) / 2
        vs[:, r : r + g], bs[:, r : r + g] = v, b
        r += g
        vu, bu = v[cols], b[cols]
        kq -= vu @ vu.transpose(1, 2)
        aq -= vu @ bu.transpose(1, 2) + bu @ vu.transpose(1, 2)
        alive[q] = False
        left[heads[q]] -= 1
        order.append(q)
        gains.append(gain)
        if r + g > lazy and alive.any():
            k0, a0, cols, vs, bs = _compact(k0, a0, cols, vs[:, :r], bs[:, :r], alive, lazy)
            r = 0
    return torch.tensor(order, device=k0.device), torch.stack(gains)


def unit_gains(kq: Tensor, aq: Tensor) -> Tensor:
    """``tr(K_QQ^-1 A_QQ) = tr(W'_Q K_QQ^-1 W'_Q^T)`` per unit, from (U, g, g) blocks.

    One channel per unit (the MLP) is ``||W'_j||^2 / K_jj``: a division, where batched solves of 1 x 1 systems would
    cost a LAPACK call each."""
    if kq.shape[-1] == 1:
        return (aq / kq).flatten()
    return torch.linalg.solve(kq, aq).diagonal(dim1=1, dim2=2).sum(-1)


def _compact(
    k0: Tensor, a0: Tensor, cols: Tensor, vs: Tensor, bs: Tensor, alive: Tensor, lazy: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Apply the pending downdates and drop the removed columns (their rows of K and A are 0)."""
    kept = torch.zeros(k0.shape[0], dtype=torch.bool, device=k0.device)
    kept[cols[alive]] = True
    idx = kept.nonzero().squeeze(1)
    v, b = vs[idx], bs[idx]
    k0 = k0[idx][:, idx] - v @ v.T
    vb = v @ b.T
    a0 = a0[idx][:, idx] - vb - vb.T
    remap = (kept.cumsum(0) - 1).clamp_min(0)  # removed units' columns point anywhere: they are never read again
    return k0, a0, remap[cols], vs.new_zeros(idx.numel(), lazy), vs.new_zeros(idx.numel(), lazy)


def removal_order(
    mean: Tensor, second: Tensor, w: Tensor, alpha: float, units: Tensor | None = None, heads: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Greedy OBS over a Linear's input channels from its token moments ``E[x]``, ``E[x x^T]`` and weight (out x n).

    Returns (unit ids in removal order, ``E_lam`` after each removal, absolute: ``compensation.output_energy`` is the
    denominator of the relative error). Units default to single channels; alpha is compensation's relative ridge.
    """
    n = mean.numel()
    units = torch.arange(n, device=mean.device)[:, None] if units is None else units
    heads = torch.zeros(units.shape[0], dtype=torch.long, device=mean.device) if heads is None else heads
    kinv = damped_inverse(second - torch.outer(mean, mean), alpha)
    order, gains = greedy_removal(kinv, w.T @ w, units, heads)
    return order, gains.cumsum(0)


def rank_scores(order: Tensor) -> Tensor:
    """Scores from a removal order: the step at which each unit goes (higher is kept longer), for ``split_top``."""
    scores = torch.empty(order.numel(), dtype=torch.float64, device=order.device)
    scores[order] = torch.arange(order.numel(), dtype=torch.float64, device=order.device)
    return scores


def value_units(heads: int, group: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """V channels at proj's input ``[o_1 | ... | o_H]`` as units: channel j of K/V head k is column j of each of its
    ``group`` query heads, removed together; returns ((heads // group * head_dim, group) columns, their K/V head)."""
    kv = torch.arange(heads // group)
    cols = (kv[:, None, None] * group + torch.arange(group)[None, None, :]) * head_dim
    cols = cols + torch.arange(head_dim)[None, :, None]  # (kv, head_dim, group)
    return cols.reshape(-1, group), kv.repeat_interleave(head_dim)
