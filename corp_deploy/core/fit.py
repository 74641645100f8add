"""The fit step: every selected part's compensated weights, from the statistics, by a registered compensation
(``fit``: a block's ``Cut`` parts and replaced modules in, their ``Fold`` out). Tensors only: ``pruner.install``
builds the modules.

A compensation predicts the removed channels of a Linear's input from the kept ones, ``x_P ~ B x_S + c``, and
folds the prediction into the Linear that reads x (fc2 for MLP channels, proj for V channels): one closed form
at two readers. It has two forms, one per calibration mode: from one pass's moments (``affine``), and regressing
the dense stream's activation from the pruned stream's kept part (``regression``, ``blockwise``'s sequential mode),
which reduces to the first with no upstream error (``compensation.regression_affine``). Q/K are compensated in logit
space (``compensation.logit_compensation``) only by a compensation that says so (``logits``): the mean shift has no
logit-space analogue.

A new compensation is its ``affine`` and ``regression`` closed forms (pure functions, in ``compensation``) and a
``register``; ``--compensation`` offers every registered name. Every part's report carries the error of every
registered compensation, so one prune compares them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from corp_deploy.core import compensation as C
from corp_deploy.core.stats import BranchStats, CalibrationStats, MlpStats, PairStats, QKStats

Affine = Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
"""(``E[x]``, ``E[x x^T]``, kept, removed, alpha) -> (B, c) of ``x_P ~ B x_S + c``; fold with ``fold_mlp``."""
Regression = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
"""(``E[x~]``, ``E[x~ x~^T]``, ``E[x]``, ``E[x x~^T]``, kept, alpha) -> (D, c) of ``x ~ (J + D) x~_S + c``; fold with
``fold_regression``."""


@dataclass(frozen=True)
class Compensation:
    """One way to predict removed channels: its closed form in each calibration mode, and whether Q/K get one."""

    affine: Affine
    regression: Regression
    logits: bool
    """Q/K: fold CORP's logit compensation M (``I + M`` factored into W_q, W_k), or cut the dims plainly."""
    constant: bool
    """Whether ``c`` can be non-zero: the reader then needs a bias to take ``W_P c`` (``Adapter.check_parts``)."""


COMPENSATIONS: dict[str, Compensation] = {}
"""Compensations by name, in the order ``--compensation`` lists them: ``corp`` (the paper's closed form), ``mean``
(VBP's mean shift), ``none`` (plain removal)."""


def register(name: str, compensation: Compensation) -> Compensation:
    COMPENSATIONS[name] = compensation
    return compensation


register("corp", Compensation(C.mlp_affine, C.regression_affine, logits=True, constant=True))
register("mean", Compensation(C.mean_shift, C.mean_shift_regression, logits=False, constant=True))
register("none", Compensation(C.removal, C.removal_regression, logits=False, constant=False))


@dataclass(frozen=True)
class Cut:
    """One part of a block, selected: its report's size entry, the kept and removed indices (MLP: fc2's input
    channels; V: proj's input channels, the heads end to end; Q/K: dims per head, (heads, kept)) and the float64
    weights the fit folds into (the reader's (w, b); Q/K: (q_w, q_b, k_w, k_b) as (heads, head_dim, in)). A per-head
    part kept whole has no indices: nothing is fitted or installed."""

    size: dict[str, int]
    keep: Tensor | None = None
    prune: Tensor | None = None
    weights: tuple[Tensor | None, ...] = ()


@dataclass(frozen=True)
class Fold:
    """One part's compensated weights (a replaced module's stand-in: W and b) in float64, which ``pruner.install``
    puts in the block, and its report entry."""

    weights: tuple[Tensor | None, ...]
    report: dict[str, Any]


def fit(
    cuts: dict[str, Cut],
    branches: dict[str, str],
    stats: CalibrationStats,
    i: int,
    compensation: str,
    alpha: float,
    targets: tuple[Tensor, Tensor] | None = None,
) -> tuple[dict[str, Fold], dict[str, Fold]]:
    """Block ``i``'s fits, all in float64 from the statistics: every cut part's compensated weights, by
    ``compensation`` damped by ``alpha`` (a part kept whole reports no error and has no weights), and the stand-in
    of every replaced module (``branches``: module -> its ``DEPTH_FITS`` kind)."""
    replaced = {}
    for module, kind in branches.items():
        w, b, error = fit_branch(stats.depth[(i, module)], kind, alpha)
        replaced[module] = Fold((w, b), {"fit": kind, "rel_error": error})
    folds = {}
    for part, cut in cuts.items():
        if cut.keep is None:
            errors = dict.fromkeys(("none", "corp") if part == "qk" else COMPENSATIONS, 0.0)
            folds[part] = Fold((), {**cut.size, "rel_error": errors})
        elif part == "qk":
            weights, errors, max_m = fit_qk(stats.qk[i], cut.weights, cut.keep, cut.prune, compensation, alpha, targets)
            folds[part] = Fold(weights, {**cut.size, "rel_error": errors, "max_m_norm": max_m})
        else:
            s = stats.mlp[i] if part == "mlp" else stats.proj[i]
            w, b, errors = fit_reader(s, *cut.weights, cut.keep, cut.prune, compensation, alpha)
            folds[part] = Fold((w, b), {**cut.size, "rel_error": errors})
    return folds, replaced


def fit_reader(
    s: MlpStats, w: Tensor, b: Tensor, keep: Tensor, prune: Tensor, compensation: str, alpha: float
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The reader (w, b) of x with ``compensation``'s prediction folded in, and the relative output error of every
    registered compensation. ``PairStats`` (sequential) regress the dense stream's x from the pruned stream's kept
    part; plain ``MlpStats`` predict x_P from x_S on one stream."""
    if isinstance(s, PairStats):
        mean_s, second_s = s.mean(), s.second_moment()
        mean_t, second_t, cross = s.target.mean(), s.target.second_moment(), s.cross / s.count
        fits = {k: m.regression(mean_s, second_s, mean_t, cross, keep, alpha) for k, m in COMPENSATIONS.items()}
        moments = (mean_t, second_t, mean_s, second_s, cross)
        errors = {k: float(C.regression_error(*moments, w, b, keep, *dc)) for k, dc in fits.items()}
        return *C.fold_regression(w, b, keep, *fits[compensation]), errors
    mean, second = s.mean(), s.second_moment()
    fits = {k: m.affine(mean, second, keep, prune, alpha) for k, m in COMPENSATIONS.items()}
    errors = {k: float(C.mlp_output_error(mean, second, w, b, keep, prune, *bc)) for k, bc in fits.items()}
    return *C.fold_mlp(w, b, keep, prune, *fits[compensation]), errors


def fit_qk(
    s: QKStats,
    weights: tuple[Tensor, Tensor | None, Tensor, Tensor | None],
    keep: Tensor,
    prune: Tensor,
    compensation: str,
    alpha: float,
    targets: tuple[Tensor, Tensor] | None = None,
) -> tuple[tuple[Tensor, Tensor | None, Tensor, Tensor | None], dict[str, float], float]:
    """Per head, M with ``Q_S M K_S^T ~ Q_P K_P^T`` factored into the kept query and key rows; (q_w, q_b, k_w, k_b)
    as (heads, kept, in), the relative logit error removed and left, and the largest ``||M||``.

    ``targets`` (sequential: ``blockwise``'s dense-logit cross terms and energies per head) regress the DENSE logits
    from the pruned stream's moment (``compensation.sequential_logit_system``) instead of the pruned pairs'."""
    q_w, q_b, k_w, k_b = weights
    all_dims = torch.arange(s.head_dim, device=s.moment.device)
    out: list[list[Tensor | None]] = [[], [], [], []]
    total = err_none = err_corp = max_m = 0.0
    for h in range(s.heads):
        if targets is None:
            m, removed, err = C.logit_compensation(s.moment[h], s.index, keep[h], prune[h], alpha)
            energy = C.pair_energy(s.moment[h], s.index, all_dims)
        else:
            a, r = C.logit_system(s.moment[h], s.index, keep[h], prune[h])
            energy = targets[1][h]
            r, removed = C.sequential_logit_system(a, targets[0][h], energy)
            m = C.solve_logit_compensation(a, r, alpha)
            err = C.logit_error(a, r, removed, m)
        total += float(energy)
        err_none += float(removed)
        err_corp += float(err)
        if not COMPENSATIONS[compensation].logits:
            m = torch.zeros_like(m)
        max_m = max(max_m, float(m.norm()))
        fq, fk = C.qk_factors(m)
        for j, (factor, w, b) in enumerate(((fq, q_w, q_b), (fk, k_w, k_b))):
            wn, bn = C.fold_projection(w[h, keep[h]], None if b is None else b[h, keep[h]], factor)
            out[2 * j].append(wn)
            out[2 * j + 1].append(bn)
    stacked = tuple(None if xs[0] is None else torch.stack(xs) for xs in out)
    return stacked, {"none": err_none / total, "corp": err_corp / total}, max_m


def fit_branch(s: BranchStats, kind: str, alpha: float) -> tuple[Tensor, Tensor, float]:
    """The stand-in of one whole branch (``--depth``; ``kind`` in ``compensation.DEPTH_FITS``): ``branch_fit``'s W
    and b, and the relative residual energy it leaves."""
    dim = s.sum_x.numel()
    mean_z, second_z, mean_y, cross, energy = s.moments()
    features = C.branch_features(kind, dim)
    w, b = C.branch_fit(mean_z, second_z, mean_y, cross, features, alpha)
    return w, b, float(C.branch_error(mean_z, second_z, mean_y, cross, energy, features, w, b))
