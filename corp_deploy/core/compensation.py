"""CORP's closed-form compensation as pure tensor functions (tensors in, tensors out).

Everything here is float64 and works on *statistics*, never on raw activations, so it is cheap,
exact for the calibration set, and independent of how the statistics were gathered.

MLP (paper eq. 9): predict the pruned hidden channels from the kept ones, ``x_P ~ B x_S + c``,
and fold the prediction into fc2.

Attention (paper eq. 44/45): per head, find ``M`` so that ``Q_S M K_S^T ~ Q_P K_P^T`` summed over
images, then factor ``I + M`` by SVD into the query and key projections. The system is built from
the packed 4th-order moment ``T[i,k,j,l] = sum_b (Q_b^T Q_b)[i,k] (K_b^T K_b)[j,l]`` (see
``stats.QKStats``), so one calibration pass serves every sparsity.

Values (beyond the paper): proj's input is ``z = [o_1 | ... | o_H]`` with ``o_h = A_h v_h``, ``A_h``
head h's softmax map. Removing V channels P (the same number in every head) removes those columns
of z. Predict them from the kept columns of ALL heads, ``z_P ~ B z_S + c``, by the same ridge fit
on proj-input token statistics, and fold into proj: ``W_S' = W_S + W_P B``, ``b' = b + W_P c``. It
is exactly the MLP compensation at proj's input, so ``mlp_affine`` / ``fold_mlp`` /
``mlp_output_error`` serve both; only the kept set is structured (``head_channels``). Why fitting
on z is right: rows of ``A_h`` sum to 1, so an affine relation among v-channels carries over to
o-channels exactly (``A (V b + 1 c) = (A V) b + 1 c``); fitting on z captures it and any relation
the attention mixing adds.

Sequential calibration (beyond the paper; ``blockwise``): the block's inputs come from the PRUNED
stream (earlier blocks already pruned), and the fit regresses the DENSE model's targets, so it also
undoes upstream error. Each fit is ridge-shrunk towards "keep the kept channels as they are", not
towards zero: then, with no upstream error, it is CORP's fit exactly, for any damping (a fit
shrunk towards zero would reduce to CORP only at lam = 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ridge_solve(gram: Tensor, rhs: Tensor, alpha: float) -> Tensor:
    """Solve ``(gram + lam I) X = rhs`` with ``lam = alpha * mean(diag(gram))``.

    Damping relative to the system's own scale is what keeps this meaningful: real ViT Q/K systems
    have condition numbers of 1e10-1e12 and entries summed over tens of thousands of tokens, so an
    absolute lambda would be no regularisation at all. ``alpha = 0`` gives the minimum-norm
    least-squares solution (used to check the closed form against a direct fit).
    """
    lam = alpha * torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1).clamp_min(0)
    system = gram.clone()  # + lam I on the diagonal only: an n x n identity is 250 MB more at n = 5734
    torch.diagonal(system, dim1=-2, dim2=-1).add_(lam[..., None])
    chol, info = torch.linalg.cholesky_ex(system)
    if alpha > 0 and not bool(info.any()):
        return torch.cholesky_solve(rhs, chol)
    return torch.linalg.pinv(system, hermitian=True) @ rhs


# ----------------------------------------------------------------------------------------- MLP


def mlp_affine(mean: Tensor, second: Tensor, keep: Tensor, prune: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """Ridge fit of ``x_P ~ B x_S + c`` from token statistics (paper eq. 9).

    ``mean = E[x]`` and ``second = E[x x^T]`` over all calibration tokens. Returns ``B`` (|P| x |S|)
    and ``c`` (|P|).
    """
    cov = second - torch.outer(mean, mean)
    cov_ss = cov[keep][:, keep]
    cov_sp = cov[keep][:, prune]
    b = ridge_solve(cov_ss, cov_sp, alpha).T
    c = mean[prune] - b @ mean[keep]
    return b, c


def mlp_linear(second: Tensor, keep: Tensor, prune: Tensor, alpha: float) -> Tensor:
    """Ridge fit of ``x_P ~ B x_S`` WITHOUT a constant: for a reader that has no bias to take ``W_P c``.

    Why it is ``mlp_affine`` with the moments taken about 0 instead of the mean: the least-squares
    problem ``min_B E||x_P - B x_S||^2`` has the normal equations ``B E[x_S x_S^T] = E[x_P x_S^T]``
    (set the derivative ``-2 E[(x_P - B x_S) x_S^T]`` to 0), i.e. eq. 9's system with the covariance
    ``E[x x^T] - mu mu^T`` replaced by the raw second moment ``E[x x^T]`` (the "uncentred" ridge), and
    ``c = mu_P - B mu_S`` replaced by 0. The affine fit is this fit on ``[x_S; 1]`` with the constant
    unpenalised, so its error is never larger; the gap is ``E``-weighted by how far the kept channels'
    mean is from predicting the removed ones' (``|W_P (mu_P - B mu_S)|^2``), which is what the bias buys.
    Returns ``B`` (|P| x |S|); fold it with ``fold_mlp(..., b=B, c=0)``.
    """
    return ridge_solve(second[keep][:, keep], second[keep][:, prune], alpha).T


def mean_shift(mean: Tensor, second: Tensor, keep: Tensor, prune: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """VBP's mean shift, ``x_P ~ mu_P``: ``mlp_affine`` with B fixed at 0, whose best constant is the mean.

    Why: with ``B = 0`` the error ``E||W_P (x_P - c)||^2`` is ``E||W_P (x_P - mu_P)||^2 + ||W_P (mu_P - c)||^2``
    (the cross term has mean 0), least at ``c = mu_P`` for any W_P. ``second`` and ``alpha`` are unused.
    """
    return mean.new_zeros(prune.numel(), keep.numel()), mean[prune]


def removal(mean: Tensor, second: Tensor, keep: Tensor, prune: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """Plain removal, ``x_P ~ 0``: B and c both 0, so ``fold_mlp`` keeps ``W_S`` and ``b`` as they are."""
    return mean.new_zeros(prune.numel(), keep.numel()), torch.zeros_like(mean[prune])


def fold_mlp(w2: Tensor, b2: Tensor, keep: Tensor, prune: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Fold the affine prediction into fc2: ``W_S + W_P B`` and ``b + W_P c``."""
    w_p = w2[:, prune]
    return w2[:, keep] + w_p @ b, b2 + w_p @ c


def mlp_output_error(
    mean: Tensor,
    second: Tensor,
    w2: Tensor,
    b2: Tensor,
    keep: Tensor,
    prune: Tensor,
    b: Tensor,
    c: Tensor,
    energy: Tensor | None = None,
) -> Tensor:
    """Relative fc2 output error ``E||y - y_hat||^2 / E||y||^2`` on the calibration tokens.

    ``y_hat`` uses the prediction ``x_P ~ B x_S + c``; ``B = 0, c = 0`` is plain removal and
    ``B = 0, c = mu_P`` is VBP's mean shift. Exact, from second moments only. ``energy``: ``output_energy``
    when the caller has it (one reader, several compensations: it is the costliest product here).

    The residual ``r = x_P - B x_S - c`` has mean ``m = mu_P - B mu_S - c`` and covariance
    ``S_PP - B S_SP - S_PS B^T + B S_SS B^T`` (S the covariance), and the error is ``<G, cov(r)> + m^T G m``
    with ``G = W_P^T W_P`` (|P| x |P|): every product is over the removed channels, none over fc2's outputs
    times the full width (a 2048 x 8192 fc2: 5x fewer float64 FLOPs than ``W_P [-B | I]`` times the moments).
    """
    w_p = w2[:, prune]
    g = w_p.T @ w_p
    cov = second - torch.outer(mean, mean)
    m = mean[prune] - b @ mean[keep] - c
    err = (g * cov[prune][:, prune]).sum() + m @ (g @ m)
    if bool(b.any()):  # the mean shift and plain removal have B = 0
        gb = g @ b
        err = err - 2 * (gb * cov[prune][:, keep]).sum() + (gb * (b @ cov[keep][:, keep])).sum()
    if energy is None:
        energy = output_energy(mean, second, w2, b2)
    return err.clamp_min(0) / energy


def output_energy(mean: Tensor, second: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``E||W x + b||^2`` over the calibration tokens: the denominator of every relative output error."""
    return ((w @ second) * w).sum() + 2 * torch.dot(b, w @ mean) + torch.dot(b, b)


CHOLESKY_JITTERS = (1e-10, 1e-6, 1e-4, 1e-2)
"""Relative diagonal jitter tried in turn for the ridge-free Cholesky of ``affine_errors``: dead or duplicated
channels make covariances singular."""


def affine_errors(mean: Tensor, second: Tensor, w: Tensor, b: Tensor, order: Tensor, kept: list[int]) -> list[float]:
    """Relative output error of the compensated (ridge-free) fit keeping the first k of ``order``, per k in ``kept``
    (``allocation.error_curves``).

    Pruning fits with the ridge; the curve is ridge-free because only that has one factor for every width.
    Measured on DINOv2-S's real statistics (``make ridge-curves``, docs/BENCHMARKS.md): median relative gap
    0.08%, the largest gaps only where errors are below 6e-4, and the same allocation at MACs 0.5/0.6/0.7.

    With the covariance in ``order`` factored as ``L L^T``, ``x_c = L z`` with white z, and the first k
    channels span the first k coordinates of z (L is lower triangular). The best affine prediction of
    the rest leaves exactly ``L_PP z_P``, whose output error is ``sum_{j >= k} ||(W L)[:, j]||^2``:
    every width from one Cholesky and one GEMM. Equals ``compensation.mlp_output_error`` at lam = 0.
    """
    cov = (second - torch.outer(mean, mean))[order][:, order]
    scale = cov.diagonal().mean().clamp_min(torch.finfo(cov.dtype).tiny)
    eye = torch.eye(len(order), dtype=cov.dtype, device=cov.device)
    for jitter in CHOLESKY_JITTERS:  # few tokens: rank-deficient, rounding makes it indefinite
        chol, info = torch.linalg.cholesky_ex(cov + jitter * scale * eye)
        if not info:
            break
    energy = ((w[:, order] @ chol) ** 2).sum(0)
    tail = torch.cat([energy.flip(0).cumsum(0).flip(0), energy.new_zeros(1)])
    return (tail[kept] / output_energy(mean, second, w, b)).tolist()


def embed_kept(v: Tensor, keep: Tensor, width: int) -> Tensor:
    """``J v``: a kept-channel vector (|S|) or matrix (|S| x k) placed at rows ``keep`` of ``width`` zero rows."""
    out = torch.zeros(width, *v.shape[1:], dtype=v.dtype, device=v.device)
    out[keep] = v
    return out


def regression_affine(
    mean_s: Tensor, second_s: Tensor, mean_t: Tensor, cross: Tensor, keep: Tensor, alpha: float
) -> tuple[Tensor, Tensor]:
    """Sequential MLP/V fit: the dense activation x (all channels) from the pruned stream's kept channels.

    ``x ~ (J + D) x~_S + c`` with ``J`` placing x~_S at the kept rows; ridge on D (shrinks towards J).
    ``mean_s``/``second_s``: the pruned stream's ``E[x~]``, ``E[x~ x~^T]``; ``mean_t = E[x]``;
    ``cross = E[x x~^T]`` over the same tokens. Returns D (width x |S|) and c (width).

    Reduction to CORP: with no upstream error (x~ = x) the residual target ``x - J x_S`` is 0 on S and
    x_P on P, so D is 0 on S and ``mlp_affine``'s B on P, and c is 0 on S and its c on P.
    """
    width = mean_t.numel()
    mu_s = mean_s[keep]
    cov_ss = second_s[keep][:, keep] - torch.outer(mu_s, mu_s)
    cov_ys = cross[:, keep] - torch.outer(mean_t, mu_s) - embed_kept(cov_ss, keep, width)
    d = ridge_solve(cov_ss, cov_ys.T, alpha).T
    c = mean_t - embed_kept(mu_s, keep, width) - d @ mu_s
    return d, c


def mean_shift_regression(
    mean_s: Tensor, second_s: Tensor, mean_t: Tensor, cross: Tensor, keep: Tensor, alpha: float
) -> tuple[Tensor, Tensor]:
    """Sequential mean shift, ``x ~ J x~_S + c`` with ``c = E[x] - J E[x~_S]``: ``regression_affine`` with D fixed at
    0, whose best constant is the residual's mean (as for ``mean_shift``). Reduction: with x~ = x, c is 0 on S and
    ``mu_P`` on P, ``mean_shift``'s constant."""
    width = mean_t.numel()
    return mean_t.new_zeros(width, keep.numel()), mean_t - embed_kept(mean_s[keep], keep, width)


def removal_regression(
    mean_s: Tensor, second_s: Tensor, mean_t: Tensor, cross: Tensor, keep: Tensor, alpha: float
) -> tuple[Tensor, Tensor]:
    """Sequential plain removal, ``x ~ J x~_S``: D and c both 0 (``removal`` on the pruned stream)."""
    return mean_t.new_zeros(mean_t.numel(), keep.numel()), torch.zeros_like(mean_t)


def fold_regression(w: Tensor, b: Tensor, keep: Tensor, d: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Fold ``x ~ (J + D) x~_S + c`` into the Linear (w, b) that reads x: ``W_S + W D`` and ``b + W c``."""
    return w[:, keep] + w @ d, b + w @ c


def regression_error(
    mean_t: Tensor,
    second_t: Tensor,
    mean_s: Tensor,
    second_s: Tensor,
    cross: Tensor,
    w: Tensor,
    b: Tensor,
    keep: Tensor,
    d: Tensor,
    c: Tensor,
) -> Tensor:
    """Relative error of the folded Linear on the pruned stream against the DENSE output, from moments.

    ``E||W x + b - (W' x~_S + b')||^2 / E||W x + b||^2`` with ``x - (J + D) x~_S - c`` the residual.
    ``D = 0, c = 0`` is plain removal, ``D = 0, c = E[x] - J E[x~_S]`` the mean shift.
    """
    g = w @ (embed_kept(torch.eye(keep.numel(), dtype=d.dtype, device=d.device), keep, d.shape[0]) + d)
    wc = w @ c
    second_ss = second_s[keep][:, keep]
    err = (
        ((w @ second_t) * w).sum()
        - 2 * ((w @ cross[:, keep]) * g).sum()
        + ((g @ second_ss) * g).sum()
        - 2 * torch.dot(wc, w @ mean_t - g @ mean_s[keep])
        + torch.dot(wc, wc)
    )
    signal = ((w @ second_t) * w).sum() + 2 * torch.dot(b, w @ mean_t) + torch.dot(b, b)
    return err.clamp_min(0) / signal


def head_channels(keep: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Per-head kept channels (heads, kept) -> (kept, pruned) indices into the concatenated heads.

    proj's input lays the heads out one after another, ``[o_1 | ... | o_H]``; both results are ascending.
    """
    heads = keep.shape[0]
    flat = (keep + head_dim * torch.arange(heads, device=keep.device)[:, None]).flatten()
    pruned = torch.ones(heads * head_dim, dtype=torch.bool, device=keep.device)
    pruned[flat] = False
    return flat, pruned.nonzero().squeeze(1)


# ----------------------------------------------------------------------------------- attention


def packed_index(d: int, device: torch.device | str | None = None) -> Tensor:
    """(d, d) map from a symmetric matrix's entry (i, k) to its upper-triangle packed position."""
    rows, cols = torch.triu_indices(d, d, device=device)
    idx = torch.empty(d, d, dtype=torch.long, device=device)
    pos = torch.arange(rows.numel(), device=device)
    idx[rows, cols] = pos
    idx[cols, rows] = pos
    return idx


def logit_energy(moment: Tensor, idx: Tensor) -> Tensor:
    """Per-dimension logit energy ``sum_b ||q_j,b||^2 ||k_j,b||^2`` (paper sec. 3.3): T[j,j,j,j].

    ``moment``: packed moments (..., P, P). Returns (..., d).
    """
    diag = idx.diagonal()
    return moment[..., diag, diag]


def logit_system(moment: Tensor, idx: Tensor, keep: Tensor, prune: Tensor) -> tuple[Tensor, Tensor]:
    """The summed ridge system of paper eq. 44 in row-major form, for one head.

    ``sum_b GQ_b M GK_b = R`` with ``GQ_b = Q_S,b^T Q_S,b``: element (i, j) of the left side is
    ``sum_{k,l} T[i,k,l,j] M[k,l]``, so with ``m = M.flatten()`` (row-major) the matrix is
    ``A[(i,j),(k,l)] = T[i,k,j,l]`` (GK is symmetric). ``R[i,j] = sum_{p in P} T[i,p,p,j]``.
    Returns ``A`` (d'^2 x d'^2) and ``R`` (d' x d').
    """
    s, p = keep.numel(), prune.numel()
    ss = idx[keep][:, keep].reshape(-1)
    a = moment[ss][:, ss].reshape(s, s, s, s).permute(0, 2, 1, 3).reshape(s * s, s * s)
    if p == 0:
        return a, torch.zeros(s, s, dtype=moment.dtype, device=moment.device)
    sp = idx[keep][:, prune].reshape(-1)
    ps = idx[prune][:, keep].reshape(-1)
    r = torch.einsum("ippj->ij", moment[sp][:, ps].reshape(s, p, p, s))
    return a, r


def pair_energy(moment: Tensor, idx: Tensor, dims: Tensor) -> Tensor:
    """``sum_b ||Q_D,b K_D,b^T||_F^2`` for the dimension subset D: the diagonal of T over D x D."""
    pairs = idx[dims][:, dims].reshape(-1)
    return moment[pairs, pairs].sum()


def solve_logit_compensation(a: Tensor, r: Tensor, alpha: float) -> Tensor:
    """M (d' x d') minimising ``sum_b ||Q_P K_P^T - Q_S M K_S^T||^2 + lam ||M||^2``."""
    s = r.shape[0]
    return ridge_solve(a, r.reshape(s * s, 1), alpha).reshape(s, s)


def logit_error(a: Tensor, r: Tensor, removed_energy: Tensor, m: Tensor) -> Tensor:
    """``sum_b ||Q_P K_P^T - Q_S M K_S^T||^2`` = E0 - 2 <R, M> + m^T A m (exact, from moments)."""
    v = m.reshape(-1)
    return (removed_energy - 2 * (r * m).sum() + v @ (a @ v)).clamp_min(0)


def logit_compensation(
    moment: Tensor, idx: Tensor, keep: Tensor, prune: Tensor, alpha: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One head's M, and its logit error before (plain removal) and after compensation."""
    a, r = logit_system(moment, idx, keep, prune)
    removed = pair_energy(moment, idx, prune)
    m = solve_logit_compensation(a, r, alpha)
    return m, removed, logit_error(a, r, removed, m)


def logit_errors(moment: Tensor, idx: Tensor, order: Tensor, widths: list[int], alpha: float) -> list[float]:
    """Relative compensated logit error of a layer at every per-head Q/K width in ``widths``, keeping the first k of
    each head's ``order`` (heads, head_dim): the exact ridge solves (``allocation.error_curves``).

    Exact per width, the same solve as pruning (``logit_compensation``): candidate widths are few
    (head_dim / round_to) and the ridge matters on real Q/K systems (condition numbers 1e10+).
    """
    heads = moment.shape[0]
    all_dims = torch.arange(idx.shape[0], device=order.device)
    total = sum(float(pair_energy(moment[h], idx, all_dims)) for h in range(heads))
    out = []
    for width in widths:
        keep, prune = order[:, :width].sort(-1).values, order[:, width:].sort(-1).values
        err = sum(
            float(logit_compensation(moment[h], idx, keep[h], prune[h], alpha)[2])
            for h in range(heads)
            if prune.shape[1]
        )
        out.append(err / total)
    return out


def sequential_logit_system(a: Tensor, cross: Tensor, dense_energy: Tensor) -> tuple[Tensor, Tensor]:
    """Right-hand side and target energy for regressing the DENSE logits from the pruned stream, one head.

    Minimises ``sum_b ||Q_b K_b^T - Q~_S,b (I + N) K~_S,b^T||^2 + lam ||N||^2`` (shrinks towards I, the
    uncompensated map). ``a``: ``logit_system``'s matrix from the PRUNED stream's moment;
    ``cross = sum_b (Q~_S,b^T Q_b)(K_b^T K~_S,b)`` (d' x d'); ``dense_energy = sum_b ||Q_b K_b^T||^2``.
    Returns ``r`` and ``E_T = sum_b ||Q K^T - Q~_S K~_S^T||^2`` such that ``solve_logit_compensation(a, r)``
    gives N and ``logit_error(a, r, E_T, N)`` its error: factor ``I + N`` with ``qk_factors`` as in CORP.

    Reduction to CORP: with Q~ = Q, ``cross = sum_b (Q_S^T Q_S)(K_S^T K_S) + sum_b (Q_S^T Q_P)(K_P^T K_S)``
    whose first term is ``a vec(I)``: r is ``logit_system``'s r and E_T the removed pairs' energy.
    """
    s = cross.shape[0]
    eye = torch.eye(s, dtype=a.dtype, device=a.device).reshape(-1)
    a_eye = a @ eye
    r = cross - a_eye.reshape(s, s)
    return r, (dense_energy - 2 * cross.trace() + eye @ a_eye).clamp_min(0)


def qk_factors(m: Tensor) -> tuple[Tensor, Tensor]:
    """Factor ``I + M = F_q F_k^T`` by SVD, splitting the singular values evenly (paper eq. 46).

    ``I + M`` is factored as it is: M is not symmetric, and symmetrising it changes the logits.
    Each singular pair is defined only up to a joint sign flip, which LAPACK and cuSOLVER choose
    differently: the largest entry of every left vector is made positive, so the pruned weights are
    the same whichever device solved them.
    """
    u, sig, vh = torch.linalg.svd(torch.eye(m.shape[0], dtype=m.dtype, device=m.device) + m)
    sign = u.gather(0, u.abs().argmax(0, keepdim=True)).sign().squeeze(0)
    sign[sign == 0] = 1
    root = sig.sqrt() * sign
    return u * root, vh.T * root


def fold_projection(weight: Tensor, bias: Tensor | None, factor: Tensor) -> tuple[Tensor, Tensor | None]:
    """Right-multiply a projection's outputs by ``factor``: ``q' = q_S F`` for ``q_S = x W^T + b``.

    As a Linear layer that is ``W' = F^T W`` and ``b' = F^T b``: the bias must be transformed too, or
    ``q' k'^T`` is not ``q_S (I + M) k_S^T``.
    """
    return factor.T @ weight, None if bias is None else factor.T @ bias


def fold_qk(
    moment: Tensor,
    idx: Tensor,
    weights: tuple[Tensor, Tensor | None, Tensor, Tensor | None],
    keep: Tensor,
    prune: Tensor,
    alpha: float,
    compensate: bool = True,
    targets: tuple[Tensor, Tensor] | None = None,
) -> tuple[tuple[Tensor, Tensor | None, Tensor, Tensor | None], float, float, float]:
    """Every head's kept query and key rows with its logit compensation folded in.

    Per head h: ``M_h`` by ``logit_compensation`` on the packed moments ``moment[h]``, ``I + M_h`` factored by
    ``qk_factors`` and folded into W_q and W_k (``fold_projection``), so the pruned logits are
    ``Q_S (I + M_h) K_S^T``; ``compensate=False`` folds ``M_h = 0``, the kept rows as they are (plain removal).
    ``targets`` (sequential: per head ``sum_b (Q~_S^T Q)(K^T K~_S)`` and the dense logit energy) regress the DENSE
    logits instead (``sequential_logit_system``), which with no upstream error is ``logit_compensation`` exactly.
    ``weights``: (q_w, q_b, k_w, k_b) as (heads, head_dim, in), biases optional. Returns them cut to (heads, kept,
    in), the relative logit error of plain removal and of the compensation, and the largest ``||M_h||``.
    """
    q_w, q_b, k_w, k_b = weights
    all_dims = torch.arange(idx.shape[0], device=moment.device)
    out: list[list[Tensor | None]] = [[], [], [], []]
    total = err_none = err_corp = max_m = 0.0
    for h in range(moment.shape[0]):
        if targets is None:
            m, removed, err = logit_compensation(moment[h], idx, keep[h], prune[h], alpha)
            energy = pair_energy(moment[h], idx, all_dims)
        else:
            a, r = logit_system(moment[h], idx, keep[h], prune[h])
            energy = targets[1][h]
            r, removed = sequential_logit_system(a, targets[0][h], energy)
            m = solve_logit_compensation(a, r, alpha)
            err = logit_error(a, r, removed, m)
        total += float(energy)
        err_none += float(removed)
        err_corp += float(err)
        if not compensate:
            m = torch.zeros_like(m)
        max_m = max(max_m, float(m.norm()))
        fq, fk = qk_factors(m)
        for j, (factor, w, b) in enumerate(((fq, q_w, q_b), (fk, k_w, k_b))):
            wn, bn = fold_projection(w[h, keep[h]], None if b is None else b[h, keep[h]], factor)
            out[2 * j].append(wn)
            out[2 * j + 1].append(bn)
    stacked = tuple(None if xs[0] is None else torch.stack(xs) for xs in out)
    return stacked, err_none / total, err_corp / total, max_m


# --------------------------------------------------------------------------------------- depth

DEPTH_FITS = ("mean", "affine", "affine-mean")
"""What replaces a removed module's branch ``y`` (added to the residual) as a function of its input x:
a constant, an affine map per token, or an affine map of the token and its image's token mean."""


def branch_features(fit: str, dim: int) -> slice:
    """The columns of ``z = [x, x_bar]`` a fit reads: none (mean), x (affine), both (affine-mean)."""
    return slice(0, {"mean": 0, "affine": dim, "affine-mean": 2 * dim}[fit])


def branch_fit(
    mean_z: Tensor, second_z: Tensor, mean_y: Tensor, cross: Tensor, features: slice, alpha: float
) -> tuple[Tensor, Tensor]:
    """Ridge fit of ``y ~ W f + b`` (f = z[features]) from moments; returns W (dim x |f|) and b (dim).

    ``mean_z = E[z]``, ``second_z = E[z z^T]``, ``mean_y = E[y]``, ``cross = E[y z^T]``, over all calibration tokens.
    ``W = C_yf (C_ff + lam I)^-1`` on covariances and ``b = E[y] - W E[f]``: the normal equations of the centred
    problem, so ``alpha = 0`` is the least-squares fit (``ridge_solve``'s minimum-norm solution). With no features
    (``mean``) W is empty and ``b = E[y]``: the affine fit with W fixed at 0, whose best constant is the mean.
    """
    mu_f = mean_z[features]
    if mu_f.numel() == 0:
        return mean_y.new_zeros(mean_y.numel(), 0), mean_y.clone()
    cov_ff = second_z[features, features] - torch.outer(mu_f, mu_f)
    cov_yf = cross[:, features] - torch.outer(mean_y, mu_f)
    w = ridge_solve(cov_ff, cov_yf.T.contiguous(), alpha).T
    return w, mean_y - w @ mu_f


def branch_error(
    mean_z: Tensor,
    second_z: Tensor,
    mean_y: Tensor,
    cross: Tensor,
    energy: Tensor,
    features: slice,
    w: Tensor,
    b: Tensor,
) -> Tensor:
    """Relative residual energy ``E||y - W f - b||^2 / E||y||^2`` on the calibration tokens, exact from moments.

    Expanding the square: ``E||y||^2 - 2 <W, E[y f^T]> + <W E[f f^T], W> - 2 b.(E[y] - W E[f]) + ||b||^2``, with
    ``energy = E||y||^2``. ``W = 0, b = 0`` (the module simply removed) gives 1.
    """
    f = features
    err = (
        energy
        - 2 * (w * cross[:, f]).sum()
        + ((w @ second_z[f, f]) * w).sum()
        - 2 * torch.dot(b, mean_y - w @ mean_z[f])
        + torch.dot(b, b)
    )
    return err.clamp_min(0) / energy


def branch_stand_in(
    mean_z: Tensor, second_z: Tensor, mean_y: Tensor, cross: Tensor, energy: Tensor, kind: str, alpha: float
) -> tuple[Tensor, Tensor, float]:
    """A whole branch's stand-in of ``kind`` (``DEPTH_FITS``) from its moments (``stats.BranchStats.moments``):
    ``branch_fit``'s W and b on the features ``branch_features`` picks of ``z = [x, x_bar]``, and ``branch_error``,
    the relative residual energy they leave."""
    features = branch_features(kind, mean_z.numel() // 2)
    w, b = branch_fit(mean_z, second_z, mean_y, cross, features, alpha)
    return w, b, float(branch_error(mean_z, second_z, mean_y, cross, energy, features, w, b))
