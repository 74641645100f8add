"""The fit step: every selected part's compensated weights, from the statistics, by a registered compensation
(``fit``: a block's ``Cut`` parts and replaced modules in, their ``Fold`` out). Tensors only: ``pruner.prune_block``
installs them. The closed forms are ``compensation``'s (``fold_qk``, ``branch_stand_in``, the readers' folds).

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

from torch import Tensor

from corp_deploy.core import compensation as C
from corp_deploy.core.stats import CalibrationStats, MlpStats, PairStats

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
    """One part's compensated weights (a replaced module's stand-in: W and b) in float64, which ``Adapter.install``
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
    folds = {}
    for part, cut in cuts.items():
        if cut.keep is None:
            errors = dict.fromkeys(("none", "corp") if part == "qk" else COMPENSATIONS, 0.0)
            folds[part] = Fold((), {**cut.size, "rel_error": errors})
        elif part == "qk":
            s, logits = stats.qk[i], COMPENSATIONS[compensation].logits
            weights, removed, left, max_m = C.fold_qk(
                s.moment, s.index, cut.weights, cut.keep, cut.prune, alpha, logits, targets
            )
            report = {**cut.size, "rel_error": {"none": removed, "corp": left}, "max_m_norm": max_m}
            folds[part] = Fold(weights, report)
        else:  # the readers of x: fc2 (MLP channels), proj (V channels)
            s = stats.mlp[i] if part == "mlp" else stats.proj[i]
            w, b, errors = fit_reader(s, *cut.weights, cut.keep, cut.prune, compensation, alpha)
            folds[part] = Fold((w, b), {**cut.size, "rel_error": errors})
    replaced = {}
    for module, kind in branches.items():
        w, b, error = C.branch_stand_in(*stats.depth[(i, module)].moments(), kind, alpha)
        replaced[module] = Fold((w, b), {"fit": kind, "rel_error": error})
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
    energy = C.output_energy(mean, second, w, b)
    errors = {k: float(C.mlp_output_error(mean, second, w, b, keep, prune, *bc, energy)) for k, bc in fits.items()}
    return *C.fold_mlp(w, b, keep, prune, *fits[compensation]), errors
