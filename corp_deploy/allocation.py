"""Budgeted per-block widths: spend a MACs budget where the compensated error grows least.

Uniform sparsity removes the same fraction everywhere, yet blocks differ widely in how well CORP's
compensation recovers what is removed. The calibration statistics already give the exact
compensated reconstruction error of every block and part at every width, so the widths can be
chosen per block from the statistics alone:

1. ``error_curves``: for every (block, part) the relative compensated error at each candidate width.
   The ranking order does not depend on the width (``split_top`` takes the top-k of fixed scores),
   so kept sets are nested and one Cholesky factor gives the MLP/V errors at ALL widths.
2. weights: a per-(block, part) sensitivity (``sensitivity.measure``: how much a local error moves
   the final features), or 1 for plain local errors.
3. ``allocate``: greedy from full widths, remove the step with the smallest weighted error increase
   per MAC saved until the MACs fit, then give back any step that still fits.

Everything here is pure (statistics, weights and shapes in, widths out); the forward passes live in
``sensitivity``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy import compensation as C
from corp_deploy.errors import CorpError
from corp_deploy.family import adapter_for
from corp_deploy.pruner import PARTS, PruneConfig, Widths
from corp_deploy.ranking import channel_scores, qk_scores
from corp_deploy.stats import CalibrationStats, MlpStats, QKStats
from corp_deploy.surgery import linear_float64

CHOLESKY_JITTER = 1e-10
"""Relative diagonal jitter for the ridge-free Cholesky: dead or duplicated channels make covariances singular."""

Key = tuple[int, str]
"""(block, part)."""


# ------------------------------------------------------------------------------------------ MACs


def tokens(model: nn.Module) -> int:
    """Tokens every block sees (a ViT: patches plus class/distillation/register tokens)."""
    return adapter_for(model).tokens(model)


def unit_macs(tokens: int, dim: int, heads: int) -> dict[str, int]:
    """MACs per image added by one unit of each width: an MLP channel, or one per-head Q/K or V dim.

    Every MAC of a block is linear in its widths: qkv ``N D H (2 qk + v)``, the attention matmuls
    ``H N^2 (qk + v)``, proj ``N H v D`` and the MLP ``2 N D m``. That is what ``report.model_size``
    counts (the math attention backend; norms, softmax and activations are not MACs). A Q/K dim and a
    V channel cost the same: two D-wide projections (q and k; v and proj) and one N x N matmul.
    """
    head_unit = heads * (2 * tokens * dim + tokens * tokens)
    return {"mlp": 2 * tokens * dim, "qk": head_unit, "v": head_unit}


def block_parts(model: nn.Module) -> list[dict[str, Any]]:
    """Per block: its dim, heads and current width of every part (MLP channels; Q/K and V per head)."""
    adapter = adapter_for(model)
    out = []
    for block in adapter.blocks(model):
        qk, v = adapter.head_widths(block)
        widths = {"mlp": adapter.mlp_out(block).in_features, "qk": qk, "v": v}
        out.append({"dim": adapter.dim(block), "heads": adapter.heads(block), "widths": widths})
    return out


def block_macs(tokens: int, dim: int, heads: int, widths: dict[str, int]) -> int:
    """Closed-form MACs of one block for one image (equals ``model_size``'s counted per-block MACs)."""
    unit = unit_macs(tokens, dim, heads)
    return sum(unit[part] * widths[part] for part in PARTS)


def candidate_widths(width: int, round_to: int) -> list[int]:
    """Allowed kept widths, descending: the full width, then every multiple of ``round_to`` below it."""
    return [width] + list(range((width - 1) // round_to * round_to, 0, -round_to))


# ---------------------------------------------------------------------------------- error curves


def affine_curve(s: MlpStats, w: Tensor, b: Tensor, order: Tensor, kept: list[int]) -> list[float]:
    """Relative output error of the compensated (ridge-free) fit keeping the first k of ``order``, per k.

    Pruning fits with the ridge; the curve is ridge-free because only that has one factor for every width.
    Measured on DINOv2-S's real statistics (``make ridge-curves``, docs/BENCHMARKS.md): median relative gap
    0.08%, the largest gaps only where errors are below 6e-4, and the same allocation at MACs 0.5/0.6/0.7.

    With the covariance in ``order`` factored as ``L L^T``, ``x_c = L z`` with white z, and the first k
    channels span the first k coordinates of z (L is lower triangular). The best affine prediction of
    the rest leaves exactly ``L_PP z_P``, whose output error is ``sum_{j >= k} ||(W L)[:, j]||^2``:
    every width from one Cholesky and one GEMM. Equals ``compensation.mlp_output_error`` at lam = 0.
    """
    mean, second = s.mean(), s.second_moment()
    cov = (second - torch.outer(mean, mean))[order][:, order]
    scale = cov.diagonal().mean().clamp_min(torch.finfo(cov.dtype).tiny)
    eye = torch.eye(len(order), dtype=cov.dtype, device=cov.device)
    for jitter in (CHOLESKY_JITTER, 1e-6, 1e-4, 1e-2):  # few tokens: rank-deficient, rounding makes it indefinite
        chol, info = torch.linalg.cholesky_ex(cov + jitter * scale * eye)
        if not info:
            break
    energy = ((w[:, order] @ chol) ** 2).sum(0)
    tail = torch.cat([energy.flip(0).cumsum(0).flip(0), energy.new_zeros(1)])
    return (tail[kept] / C.output_energy(mean, second, w, b)).tolist()


def logit_curve(s: QKStats, scores: Tensor, widths: list[int], alpha: float) -> list[float]:
    """Relative compensated logit error of a layer at every per-head Q/K width: the exact ridge solves.

    Exact per width, the same solve as pruning (``compensation.logit_compensation``): candidate widths
    are few (head_dim / round_to) and the ridge matters on real Q/K systems (condition numbers 1e10+).
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    all_dims = torch.arange(s.head_dim, device=scores.device)
    total = sum(float(C.pair_energy(s.moment[h], s.index, all_dims)) for h in range(s.heads))
    out = []
    for width in widths:
        keep, prune = order[:, :width].sort(-1).values, order[:, width:].sort(-1).values
        err = sum(
            float(C.logit_compensation(s.moment[h], s.index, keep[h], prune[h], alpha)[2])
            for h in range(s.heads)
            if prune.shape[1]
        )
        out.append(err / total)
    return out


def error_curves(
    model: nn.Module, stats: CalibrationStats, config: PruneConfig, parts: frozenset[str]
) -> dict[Key, tuple[list[int], list[float]]]:
    """(candidate widths descending, relative compensated errors) of every block and targeted part."""
    curves = {}
    adapter = adapter_for(model)
    for i, block in enumerate(adapter.blocks(model)):
        if "mlp" in parts:
            s = stats.mlp[i]
            w, b = linear_float64(adapter.mlp_out(block), s.sum.device)
            order = torch.sort(channel_scores(config.ranker, s, w), descending=True, stable=True).indices
            widths = candidate_widths(w.shape[1], config.round_to)
            curves[(i, "mlp")] = (widths, affine_curve(s, w, b, order, widths))
        if "qk" in parts:
            s = stats.qk[i]
            q_w, _, k_w, _ = (
                None if x is None else x.detach().to(s.moment.device, torch.float64) for x in adapter.qk_weights(block)
            )
            scores = qk_scores(config.ranker, C.logit_energy(s.moment, s.index), q_w, k_w)
            widths = candidate_widths(s.head_dim, config.round_to)
            curves[(i, "qk")] = (widths, logit_curve(s, scores, widths, config.ridge))
        if "v" in parts:
            s, heads = stats.proj[i], adapter.heads(block)
            w, b = linear_float64(adapter.proj(block), s.sum.device)
            d = w.shape[1] // heads
            ranks = torch.sort(
                channel_scores(config.ranker, s, w).view(heads, d), dim=-1, descending=True, stable=True
            ).indices
            order = (ranks + d * torch.arange(heads, device=ranks.device)[:, None]).T.flatten()  # rank-major
            widths = candidate_widths(d, config.round_to)
            curves[(i, "v")] = (widths, affine_curve(s, w, b, order, [k * heads for k in widths]))
    return curves


# ------------------------------------------------------------------------------------- allocator


def allocate(
    curves: dict[Key, tuple[list[int], list[float]]],
    weights: dict[Key, float],
    unit: dict[Key, int],
    fixed_macs: int,
    limit: int,
) -> dict[Key, int]:
    """Greedy widths with ``fixed_macs + sum unit * width <= limit``; pure.

    From full widths, repeatedly take the step (one candidate width down) with the smallest weighted
    error increase per MAC saved; then give back, best first, every step that still fits, so no
    single step can be given back without exceeding the limit. Ties go to the earlier key, so
    identical blocks end within one step of each other.
    """
    pos = dict.fromkeys(curves, 0)

    def cost(key: Key, frm: int, to: int) -> tuple[float, int]:
        widths, errors = curves[key]
        return weights[key] * (errors[to] - errors[frm]), unit[key] * (widths[frm] - widths[to])

    macs = fixed_macs + sum(unit[k] * curves[k][0][0] for k in curves)
    while macs > limit:
        steps = [(k, *cost(k, pos[k], pos[k] + 1)) for k in curves if pos[k] + 1 < len(curves[k][0])]
        if not steps:
            raise CorpError(f"the budget of {limit} MACs is below the smallest allowed widths")  # check_budget first
        key, _, saved = min(steps, key=lambda t: t[1] / t[2])
        pos[key] += 1
        macs -= saved
    while True:
        back = [(k, *cost(k, pos[k], pos[k] - 1)) for k in curves if pos[k] > 0]
        back = [(k, gain, added) for k, gain, added in back if macs - added <= limit]  # added < 0: MACs grow
        if not back:
            break
        key, _, added = min(back, key=lambda t: t[1] / -t[2])
        pos[key] -= 1
        macs -= added
    return {k: curves[k][0][pos[k]] for k in curves}


# ------------------------------------------------------------------------------------- planning


def macs_layout(model: nn.Module, dense_macs: int, parts: frozenset[str]) -> tuple[dict[Key, int], int, dict[Key, int]]:
    """(MACs per width unit of each targeted part, MACs that no targeted width changes, current widths)."""
    n = tokens(model)
    unit, widths, variable = {}, {}, 0
    for i, b in enumerate(block_parts(model)):
        per = unit_macs(n, b["dim"], b["heads"])
        for part in parts:
            unit[(i, part)], widths[(i, part)] = per[part], b["widths"][part]
            variable += per[part] * b["widths"][part]
    return unit, dense_macs - variable, widths


def check_budget(model: nn.Module, config: PruneConfig, dense_macs: int) -> int:
    """Data-free: the MACs limit of ``config.budget``; a budget no allowed widths can meet fails here.

    Call it before calibrating. The smallest model keeps ``round_to`` channels of every targeted part.
    """
    parts = config.target
    adapter = adapter_for(model)
    for i, block in enumerate(adapter.blocks(model)):
        adapter.check_parts(block, i, [p for p in parts if p == "v"], config.compensation)
    limit = int(config.budget.fraction * dense_macs)
    unit, fixed, widths = macs_layout(model, dense_macs, parts)
    smallest = fixed + sum(unit[k] * min(w, config.round_to) for k, w in widths.items())
    if smallest > limit:
        raise CorpError(
            f"--budget {config.budget} is below the smallest model --target {','.join(config.target)} allows "
            f"({smallest / dense_macs:.3f} of the dense MACs, every part at --round-to {config.round_to}); "
            "raise the budget, add targets or lower --round-to"
        )
    return limit


def plan_budget(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    dense_macs: int,
    weights: dict[Key, float] | None = None,
    curves: dict[Key, tuple[list[int], list[float]]] | None = None,
) -> tuple[list[tuple[int | None, int | None, int | None]], dict[str, Any]]:
    """Widths for ``pruner.prune_model`` (``plan``) meeting ``config.budget``, and what to record about them.

    ``weights``: per-(block, part) sensitivity (``sensitivity.measure``); None = plain local errors.
    ``curves``: ``error_curves`` already computed (a study planning several budgets from one calibration).
    """
    limit = check_budget(model, config, dense_macs)
    parts = config.target
    curves = error_curves(model, stats, config, parts) if curves is None else curves
    unit, fixed, _ = macs_layout(model, dense_macs, parts)
    chosen = allocate(curves, weights or dict.fromkeys(curves, 1.0), unit, fixed, limit)
    plan = [Widths(**{p: chosen[(i, p)] for p in parts}) for i in range(len(adapter_for(model).blocks(model)))]
    record = {
        "budget": str(config.budget),
        "criterion": "local" if weights is None else "sensitivity",
        "dense_macs": dense_macs,
        "limit_macs": limit,
        "planned_macs": fixed + sum(unit[k] * w for k, w in chosen.items()),
        "planned_error": {
            p: [curves[(i, p)][1][curves[(i, p)][0].index(chosen[(i, p)])] for i in range(len(plan))]
            for p in PARTS
            if p in parts
        },
    }
    if weights is not None:
        record["sensitivity"] = {p: [weights[(i, p)] for i in range(len(plan))] for p in PARTS if p in parts}
    return plan, record
