"""The width plan: how many channels of every part each block keeps, checked before any data and made after it.

One place for every rule: a sparsity per part, the same fraction in every block or by a registered selection
(``ranking.SELECTIONS``: VBP's one threshold over every block's MLP channel scores), or a budget (``allocation``:
errors weighted by ``sensitivity``), re-planned for a corrected latency table or another budget from the same
statistics (``planner``). ``data_free`` is the half before any data, so an impossible plan fails before
calibration; ``plan`` the other, from the statistics. ``pruner.prune_model`` and ``blockwise.walk`` take the widths
it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PART_NAMES, Budget, PruneConfig, Widths
from corp_deploy.core.fit import COMPENSATIONS
from corp_deploy.core.ranking import SELECTIONS, channel_scores, per_layer
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.families import Adapter, adapter_for
from corp_deploy.families.layers import linear_float64
from corp_deploy.formats.calibration import Heldout
from corp_deploy.plan.allocation import budget_limit, error_curves, plan_budget
from corp_deploy.plan.latency import LatencyTable
from corp_deploy.plan.sensitivity import measure


def from_statistics(config: PruneConfig) -> bool:
    """Whether the widths wait for the statistics (a budget, a scored selection) rather than follow the sparsities."""
    return config.budget is not None or SELECTIONS[config.selection].scored


def data_free(
    model: nn.Module, config: PruneConfig, dense_macs: int, table: LatencyTable | None = None
) -> list[Widths] | None:
    """Data-free: refuse what no calibration can fix (a part the blocks cannot take, a sparsity that empties a part,
    a budget no allowed widths meet). Returns the widths when they do not depend on the data, else None (``plan``
    makes them after calibration)."""
    check_parts(model, config)
    if config.budget is None:
        counts = _counts(model, config, None)
        return None if None in counts.values() else _widths(counts, len(adapter_for(model).blocks(model)))
    budget_limit(model, config, dense_macs, table)
    return None


def check_parts(model: nn.Module, config: PruneConfig) -> None:
    """What every width rule needs of the blocks (``Adapter.check_parts``: a compensated MLP fold takes the
    constant term in a bias, V pruning folds into proj), of the family (``--layout standard``) and ``--depth``
    (``Adapter.check_depth``)."""
    adapter = adapter_for(model)
    if config.layout == "standard":
        check_standard(adapter, config)
    constant = config.compensation if COMPENSATIONS[config.compensation].constant else None
    for i, block in enumerate(adapter.blocks(model)):
        adapter.check_parts(block, i, config.target, constant)
        if config.depth:
            adapter.check_depth(block, i)


def check_standard(adapter: Adapter, config: PruneConfig) -> None:
    """``--layout standard``: the targeted parts must be ones the family's own config can express."""
    if not adapter.standard_parts:
        raise CorpError(f"--layout standard is for transformers text models; {adapter.name} artifacts have one layout")
    extra = [p for p in config.target if p not in adapter.standard_parts]
    if extra:
        raise CorpError(
            f"--layout standard: the {adapter.name} config expresses only {', '.join(adapter.standard_parts)} "
            f"pruning, not {', '.join(extra)}; use --target {','.join(adapter.standard_parts)} or drop --layout"
        )


def plan_widths(model: nn.Module, config: PruneConfig, stats: CalibrationStats | None = None) -> list[Widths]:
    """Every block's kept widths at ``config``'s sparsities: Q/K and V the same fraction in every block, MLP channels
    by ``config.selection`` (a scored one reads ``stats``). A budget's widths come from ``plan``."""
    if config.budget is not None:
        raise CorpError("a --budget config's widths come from the statistics: use corp_deploy.plan.width_plan.plan")
    counts = _counts(model, config, stats)
    if None in counts.values():
        raise CorpError(f"--selection {config.selection} chooses MLP widths from the calibration statistics; pass them")
    return _widths(counts, len(adapter_for(model).blocks(model)))


def _counts(model: nn.Module, config: PruneConfig, stats: CalibrationStats | None) -> dict[str, list[int] | None]:
    """Every targeted part's kept width per block; None for a part whose selection needs the absent ``stats``."""
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    full = {"mlp": [adapter.mlp_out(b).in_features for b in blocks]}
    full["qk"], full["v"] = (list(w) for w in zip(*(adapter.head_widths(b) for b in blocks), strict=True))
    sparsity = {part: config.part_sparsity(part) for part in config.target}
    selection = SELECTIONS[config.selection]
    counts: dict[str, list[int] | None] = {}
    for part, s in sparsity.items():
        what = [f"{PART_NAMES[part]} (block {i})" for i in range(len(blocks))]
        if part != "mlp" or not selection.scored:
            counts[part] = per_layer(full[part], s, config.round_to, what)
        elif stats is None:
            counts[part] = None
        else:
            w = [linear_float64(adapter.mlp_out(b), stats.mlp[i].sum.device)[0] for i, b in enumerate(blocks)]
            scores = [channel_scores(config.ranker, stats.mlp[i], w[i]) for i in range(len(blocks))]
            counts[part] = selection.counts(full[part], s, config.round_to, what, scores)
    return counts


def _widths(counts: dict[str, list[int]], blocks: int) -> list[Widths]:
    return [Widths(**{part: kept[i] for part, kept in counts.items()}) for i in range(blocks)]


Replan = Callable[..., tuple[list[Widths], dict[str, Any] | None]]
"""(latency table[, budget]) -> widths and their record (None without a budget), from statistics, error curves and
sensitivities computed once; the budget defaults to the config's."""


def planner(
    model: nn.Module, stats: CalibrationStats, config: PruneConfig, dense_macs: int, heldout: Heldout | None
) -> Replan:
    """The widths from the statistics, re-runnable: a budget's allocation (with sensitivities from ``heldout``) for
    corrected latency tables (the closed loop) or other budgets (a sweep of speedups) without another pass over the
    data; without a budget, ``plan_widths`` (no record). ``model`` must stay dense."""
    if config.budget is None:
        return lambda table=None, budget=None: (plan_widths(model, config, stats), None)
    weights = None if heldout is None else measure(model, stats, config, heldout.images)
    curves = error_curves(model, stats, config, config.target)

    def replan(table: LatencyTable | None, budget: Budget | None = None) -> tuple[list[Widths], dict[str, Any]]:
        budgeted = config if budget is None else replace(config, budget=budget)
        widths, record = plan_budget(model, stats, budgeted, dense_macs, weights, curves, table)
        if heldout is not None:
            record["heldout"] = {"images": adapter_for(model).count(heldout.images), "folders": heldout.folders}
        return widths, record

    return replan


def plan(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    dense_macs: int,
    heldout: Heldout | None,
    table: LatencyTable | None = None,
) -> tuple[list[Widths], dict[str, Any] | None]:
    """Widths from the statistics, once (``planner``): a budget's allocation, or a selection's. Returns the widths and
    what the report records about how they were chosen (None without a budget)."""
    return planner(model, stats, config, dense_macs, heldout)(table)
