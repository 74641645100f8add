"""Budgeted per-block widths: spend a MACs budget where the compensated error grows least.

Uniform sparsity removes the same fraction everywhere, yet blocks differ widely in how well CORP's
compensation recovers what is removed. The calibration statistics already give the exact
compensated reconstruction error of every block and part at every width, so the widths can be
chosen per block from the statistics alone:

1. ``error_curves``: for every (block, part) the relative compensated error at each candidate width.
   The ranking order does not depend on the width (``split_top`` takes the top-k of fixed scores),
   so kept sets are nested and one Cholesky factor gives the MLP/V errors at ALL widths
   (``compensation.affine_errors``; Q/K: ``compensation.logit_errors``).
2. weights: a per-(block, part) sensitivity (``sensitivity.measure``: how much a local error moves
   the final features), or 1 for plain local errors.
3. ``allocate``: greedy from full widths, remove the step with the smallest weighted error increase
   per MAC saved until the MACs fit, then give back any step that still fits.

Everything here is pure (statistics, weights and shapes in, widths out); the forward passes live in
``sensitivity``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.config import MODULES, PARTS, PruneConfig, Widths
from corp_deploy.core.pruner import rank
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.families import adapter_for
from corp_deploy.plan.latency import REMOVED, LatencyTable

Key = tuple[int, str]
"""(block, part)."""
Curve = tuple[list[int], list[float]]
"""Candidate widths (descending, the full width first) and the relative error at each."""
BlockCost = Callable[[int, Mapping[str, int]], float]
"""A block's cost (MACs, seconds) given the widths of its targeted parts (the others as they are)."""
QKV = "qk=v"
"""Q/K and V moved as one part, when the backend's fused attention needs equal widths."""
MODULE_KEYS = {m: f"{m}-module" for m in MODULES}
"""``--depth``: the allocator's part for keeping (width 1) or replacing (width 0) a block's whole module. Its error
at 0 is the fit's residual energy, weighted by the measured end-to-end sensitivity of that very replacement."""
KEEP, REPLACE = 1, 0


# ------------------------------------------------------------------------------------------ MACs


def tokens(model: nn.Module) -> int:
    """Tokens every block sees (a ViT: patches plus class/distillation/register tokens)."""
    return adapter_for(model).tokens(model)


def block_parts(model: nn.Module) -> list[dict[str, Any]]:
    """Per block: its dim, heads, current width of every part (MLP channels; Q/K and V per head) and the MACs per
    unit of each width at the model's tokens (``Adapter.unit_macs``)."""
    adapter, n = adapter_for(model), tokens(model)
    out = []
    for block in adapter.blocks(model):
        qk, v = adapter.head_widths(block)
        widths = {"mlp": adapter.mlp_out(block).in_features, "qk": qk, "v": v}
        unit = adapter.unit_macs(block, n)
        out.append({"dim": adapter.dim(block), "heads": adapter.heads(block), "widths": widths, "unit": unit})
    return out


def block_macs(unit: dict[str, int], widths: dict[str, int]) -> int:
    """Closed-form MACs of one block for one input (equals ``model_size``'s counted per-block MACs)."""
    return sum(unit[part] * widths[part] for part in PARTS)


def candidate_widths(width: int, round_to: int) -> list[int]:
    """Allowed kept widths, descending: the full width, then every multiple of ``round_to`` below it."""
    return [width] + list(range((width - 1) // round_to * round_to, 0, -round_to))


# ---------------------------------------------------------------------------------- error curves


def error_curves(
    model: nn.Module, stats: CalibrationStats, config: PruneConfig, parts: frozenset[str]
) -> dict[Key, Curve]:
    """(candidate widths descending, relative compensated errors) of every block and targeted part, each part in the
    order ``pruner.rank`` keeps its channels (the kept sets at all widths are nested)."""
    curves = {}
    adapter = adapter_for(model)
    for i, block in enumerate(adapter.blocks(model)):
        ranked = rank(adapter, block, i, stats, [p for p in PARTS if p in parts], config.ranker, config.ridge)
        for part, r in ranked.items():
            descending = torch.sort(r.scores, dim=-1, descending=True, stable=True).indices
            if part == "mlp":
                widths = candidate_widths(len(descending), config.round_to)
                s = stats.mlp[i]
                errors = C.affine_errors(s.mean(), s.second_moment(), *r.weights, descending, widths)
                curves[(i, part)] = (widths, errors)
            elif part == "qk":
                widths = candidate_widths(stats.qk[i].head_dim, config.round_to)
                s = stats.qk[i]
                curves[(i, part)] = (widths, C.logit_errors(s.moment, s.index, descending, widths, config.ridge))
            else:
                heads, d = descending.shape[0] * r.group, descending.shape[1]
                ranks = descending.repeat_interleave(r.group, 0)
                order = (ranks + d * torch.arange(heads, device=ranks.device)[:, None]).T.flatten()  # rank-major
                widths = candidate_widths(d, config.round_to)
                s = stats.proj[i]
                errors = C.affine_errors(s.mean(), s.second_moment(), *r.weights, order, [k * heads for k in widths])
                curves[(i, part)] = (widths, errors)
        for module in config.depth:
            error = C.branch_stand_in(*stats.depth[(i, module)].moments(), config.depth_fit, config.ridge)[2]
            curves[(i, MODULE_KEYS[module])] = ([KEEP, REPLACE], [0.0, error])
    return curves


# ------------------------------------------------------------------------------------- allocator


def allocate(
    curves: dict[Key, Curve],
    weights: dict[Key, float],
    block_cost: BlockCost,
    fixed: float,
    limit: float,
) -> dict[Key, int]:
    """Greedy widths with ``fixed + sum over blocks of block_cost(block, its widths) <= limit``; pure.

    From full widths, repeatedly take the step (one candidate width down) with the smallest weighted
    error increase per unit of cost saved; then give back, best first, every step that still fits, so no
    single step can be given back without exceeding the limit. Ties go to the earlier key, so
    identical blocks end within one step of each other. A step that saves nothing (a measured latency
    plateau: 1152 MLP channels may cost what 768 do) is taken together with the next ones, down to the
    first width that saves something.
    """
    pos = dict.fromkeys(curves, 0)
    parts: dict[int, list[str]] = {}
    for i, part in curves:
        parts.setdefault(i, []).append(part)

    def widths(i: int, moved: Key | None = None, to: int = 0) -> dict[str, int]:
        return {p: curves[(i, p)][0][to if (i, p) == moved else pos[(i, p)]] for p in parts[i]}

    current = {i: block_cost(i, widths(i)) for i in parts}

    def saved(key: Key, to: int) -> float:
        return current[key[0]] - block_cost(key[0], widths(key[0], key, to))

    def down(key: Key) -> tuple[Key, int, float, float] | None:
        """The next width of ``key`` that saves cost: (key, its index, weighted error added, cost saved)."""
        _, errors = curves[key]
        for to in range(pos[key] + 1, len(errors)):
            if (gain := saved(key, to)) > 0:
                return key, to, weights[key] * (errors[to] - errors[pos[key]]), gain
        return None

    def move(key: Key, to: int) -> None:
        pos[key] = to
        current[key[0]] = block_cost(key[0], widths(key[0]))

    total = fixed + sum(current.values())
    while total > limit:
        steps = [s for k in curves if (s := down(k)) is not None]
        if not steps:
            raise CorpError(f"the budget of {limit:g} is below the smallest allowed widths")  # budget_limit first
        key, to, _, gain = min(steps, key=lambda t: t[2] / t[3])
        move(key, to)
        total -= gain
    while True:
        back = []
        for k in curves:
            if pos[k] > 0 and (added := -saved(k, pos[k] - 1)) + total <= limit:
                error = weights[k] * (curves[k][1][pos[k] - 1] - curves[k][1][pos[k]])
                back.append((k, added, (added > 0, error / added if added > 0 else error)))
        if not back:
            break
        key, added, _ = min(back, key=lambda t: t[2])
        move(key, pos[key] - 1)
        total += added
    return {k: curves[k][0][pos[k]] for k in curves}


# ------------------------------------------------------------------------------------- planning


def macs_layout(model: nn.Module, dense_macs: int, parts: frozenset[str]) -> tuple[dict[Key, int], int, dict[Key, int]]:
    """(MACs per width unit of each targeted part, MACs that no targeted width changes, current widths)."""
    unit, widths, variable = {}, {}, 0
    for i, b in enumerate(block_parts(model)):
        per = b["unit"]
        for part in parts:
            unit[(i, part)], widths[(i, part)] = per[part], b["widths"][part]
            variable += per[part] * b["widths"][part]
    return unit, dense_macs - variable, widths


@dataclass(frozen=True)
class Cost:
    """What a budget bounds, per block: MACs counted in closed form, or seconds predicted by a latency table."""

    unit: str
    fixed: float
    """What no targeted width changes."""
    block: BlockCost
    dense: float
    widths: dict[Key, int]
    """The current (dense) width of every targeted part."""


def per_unit(unit: dict[Key, int]) -> BlockCost:
    """A block cost linear in the widths: ``sum unit * width`` over the block's parts (MACs)."""
    return lambda i, widths: sum(unit[(i, p)] * w for p, w in widths.items())


def macs_cost(model: nn.Module, dense_macs: int, parts: frozenset[str]) -> Cost:
    unit, fixed, widths = macs_layout(model, dense_macs, parts)
    return Cost("MACs", fixed, per_unit(unit), dense_macs, widths)


def latency_cost(model: nn.Module, table: LatencyTable, parts: frozenset[str], depth: tuple[str, ...] = ()) -> Cost:
    """Predicted seconds: the table's block times at the targeted widths, the other widths as they are.

    With a ``tied`` table Q/K and V are one part (``QKV``): the backend's fused attention needs one head size.
    ``depth``: modules that may be replaced (``MODULE_KEYS``); a replaced module's widths no longer cost anything.
    """
    blocks = block_parts(model)
    if [b["widths"]["mlp"] for b in blocks] != [table.shape.mlp] * table.shape.depth or any(
        (b["widths"]["qk"], b["widths"]["v"]) != (table.shape.head_dim,) * 2 for b in blocks
    ):
        raise CorpError("a latency budget plans from the dense model; this one is already pruned")
    keys = allocation_parts(parts, table.tied)
    widths = {(i, p): b["widths"]["qk" if p == QKV else p] for i, b in enumerate(blocks) for p in keys}
    widths |= {(i, MODULE_KEYS[m]): KEEP for i in range(len(blocks)) for m in depth}
    dense = {"mlp": table.shape.mlp, "qk": table.shape.head_dim, "v": table.shape.head_dim}

    def block(i: int, w: Mapping[str, int]) -> float:
        full = dense | dict(w) | ({"qk": w[QKV], "v": w[QKV]} if QKV in w else {})
        if w.get(MODULE_KEYS["attn"]) == REPLACE:
            full |= {"qk": REMOVED, "v": REMOVED}
        if w.get(MODULE_KEYS["mlp"]) == REPLACE:
            full["mlp"] = REMOVED
        return table.scale * table.block_s(full["mlp"], full["qk"], full["v"])

    return Cost("latency", table.fixed_s, block, table.dense_s, widths)


def allocation_parts(parts: frozenset[str] | tuple[str, ...], tie: bool) -> tuple[str, ...]:
    """The parts the allocator moves: Q/K and V as one (``QKV``) when their widths must stay equal."""
    if not tie or not {"qk", "v"} & set(parts):
        return tuple(p for p in PARTS if p in parts)
    if not {"qk", "v"} <= set(parts):
        raise CorpError(
            "this --latency-on backend's fused attention needs equal Q/K and V widths: "
            "--target both qk and v (e.g. mlp,qk,v) or neither"
        )
    return (*(("mlp",) if "mlp" in parts else ()), QKV)


def budget_cost(model: nn.Module, config: PruneConfig, dense_macs: int, table: LatencyTable | None) -> Cost:
    """The cost ``config.budget`` bounds; a latency budget needs its table."""
    if config.budget.kind == "macs":
        return macs_cost(model, dense_macs, config.target)
    if table is None:
        raise CorpError("--budget latency=F needs a latency table: pass --latency-on BACKEND (or --latency-table)")
    return latency_cost(model, table, config.target, config.depth)


def budget_limit(model: nn.Module, config: PruneConfig, dense_macs: int, table: LatencyTable | None = None) -> float:
    """Data-free: the limit of ``config.budget`` (MACs or seconds); a budget no allowed widths can meet fails here
    (``plan.width_plan.data_free``, before calibrating, and every re-plan: the closed loop's corrected tables). The
    smallest model keeps ``round_to`` channels of every targeted part."""
    cost = budget_cost(model, config, dense_macs, table)
    limit = config.budget.fraction * cost.dense
    limit = int(limit) if cost.unit == "MACs" else limit
    floor = {} if table is None or cost.unit == "MACs" else table_floor(table)
    blocks: dict[int, dict[str, int]] = {}
    for (i, p), w in cost.widths.items():
        blocks.setdefault(i, {})[p] = w if p in MODULE_KEYS.values() else min(w, max(config.round_to, floor.get(p, 0)))
    smallest = cost.fixed + sum(_cheapest(cost, i, w) for i, w in blocks.items())
    if smallest > limit:
        where = "its smallest measured width" if floor else f"--round-to {config.round_to}"
        raise CorpError(
            f"--budget {config.budget} is below the smallest model --target {','.join(config.target)} allows "
            f"({smallest / cost.dense:.3f} of the dense {cost.unit}, every part at {where}); "
            "raise the budget, add targets" + ("" if floor else " or lower --round-to")
        )
    return limit


def _cheapest(cost: Cost, i: int, smallest: dict[str, int]) -> float:
    """Block ``i``'s lowest cost, its parts at their ``smallest`` widths: each replaceable module kept or replaced,
    whichever costs less (a replacement is not always cheaper than the module at its smallest width: on an H200
    at batch 1 a block costs its kernel launches, and an MLP's stand-in GEMM measured slower than a narrow MLP)."""
    modules = [p for p in smallest if p in MODULE_KEYS.values()]
    choices = itertools.product((KEEP, REPLACE), repeat=len(modules))
    return min(cost.block(i, smallest | dict(zip(modules, c, strict=True))) for c in choices)


def plan_budget(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    dense_macs: int,
    weights: dict[Key, float] | None = None,
    curves: dict[Key, Curve] | None = None,
    table: LatencyTable | None = None,
) -> tuple[list[Widths], dict[str, Any]]:
    """Widths for ``pruner.prune_model`` (``plan``) meeting ``config.budget``, and what to record about them.

    ``weights``: per-(block, part) sensitivity (``sensitivity.measure``); None = plain local errors.
    ``curves``: ``error_curves`` already computed (a study planning several budgets from one calibration).
    ``table``: the latency table a ``latency=`` budget is predicted with.
    """
    limit = budget_limit(model, config, dense_macs, table)  # again: a corrected table may put the budget out of reach
    cost = budget_cost(model, config, dense_macs, table)
    parts = config.target
    curves = error_curves(model, stats, config, parts) if curves is None else curves
    if config.budget.kind == "latency":
        curves = measured_range(curves, table)
    local = weights is None
    weights = dict.fromkeys(curves, 1.0) if local else weights
    tie = table is not None and table.tied and config.budget.kind == "latency"
    moved, moved_weights = tie_curves(curves, weights) if tie else (curves, weights)
    chosen = untie(allocate(moved, moved_weights, cost.block, cost.fixed, limit))
    plan = [block_widths(chosen, i, parts, config.depth) for i in range(len(adapter_for(model).blocks(model)))]
    record: dict[str, Any] = {
        "budget": str(config.budget),
        "criterion": "local" if local else "sensitivity",
    }
    if config.budget.kind == "macs":
        unit, fixed, _ = macs_layout(model, dense_macs, parts)
        record |= {
            "dense_macs": dense_macs,
            "limit_macs": limit,
            "planned_macs": fixed + sum(unit[k] * w for k, w in chosen.items()),
        }
    else:
        predicted = table.predict([widths_of(model, w) for w in plan])
        record |= {
            "latency": {
                "backend": table.key["backend"],
                "batch": table.key["batch"],
                **({"seq_len": table.key["seq_len"]} if "seq_len" in table.key else {}),
                "equal_qk_v": table.tied,
                "rewrites": table.key.get("rewrites", {}).get("applied", []),
                "dense_s": table.dense_s,
                "limit_s": limit,
                "planned_s": predicted,
                "predicted_speedup": table.dense_s / predicted,
            }
        }
    keys = [p for p in PARTS if p in parts] + [MODULE_KEYS[m] for m in config.depth]
    record["planned_error"] = {
        p: [curves[(i, p)][1][curves[(i, p)][0].index(chosen[(i, p)])] for i in range(len(plan))] for p in keys
    }
    if not local:
        record["sensitivity"] = {p: [weights[(i, p)] for i in range(len(plan))] for p in keys}
    if config.depth:
        record["replaced"] = {m: [i for i, w in enumerate(plan) if m in w.replace] for m in config.depth}
    return plan, record


def table_floor(table: LatencyTable) -> dict[str, int]:
    """Per allocated part, the smallest width the table measured (``QKV``: Q/K and V moved as one)."""
    low = {"mlp": min(table.mlp), "qk": min(q for q, _ in table.attn), "v": min(v for _, v in table.attn)}
    return low | {QKV: max(low["qk"], low["v"])}


def measured_range(curves: dict[Key, Curve], table: LatencyTable) -> dict[Key, Curve]:
    """The curves without the widths below the table's smallest measured ones.

    Below its grid a block's time is extrapolated, not measured, and the allocator chases whatever the extrapolation
    promises: deit_small on ort-cpu-fp32 at batch 32 planned Q/K at 8 of 64 everywhere, predicted 2.00x and
    measured 1.76x. Within the grid the prediction interpolates between measured points.
    """
    low = table_floor(table)
    out = {}
    for key, (widths, errors) in curves.items():
        keep = [j for j, w in enumerate(widths) if key[1] not in low or w >= low[key[1]]]
        out[key] = ([widths[j] for j in keep], [errors[j] for j in keep])
    return out


def block_widths(chosen: dict[Key, int], i: int, parts: tuple[str, ...], depth: tuple[str, ...]) -> Widths:
    """Block ``i``'s ``Widths`` from the allocation: a replaced module's widths are None (nothing left to cut)."""
    replace = tuple(m for m in depth if chosen[(i, MODULE_KEYS[m])] == REPLACE)
    gone = {"mlp"} if "mlp" in replace else set()
    gone |= {"qk", "v"} if "attn" in replace else set()
    return Widths(**{p: chosen[(i, p)] for p in parts if p not in gone}, replace=replace)


def tie_curves(curves: dict[Key, Curve], weights: dict[Key, float]) -> tuple[dict[Key, Curve], dict[Key, float]]:
    """Q/K and V of each block as one part (``QKV``) whose weighted error is the sum of theirs at one width."""
    out, out_weights = {}, {}
    for (i, p), curve in curves.items():
        if p == "v":
            continue
        if p == "qk":
            widths, qk = curve
            _, v = curves[(i, "v")]
            w_qk, w_v = weights[(i, "qk")], weights[(i, "v")]
            out[(i, QKV)], out_weights[(i, QKV)] = (
                (widths, [w_qk * a + w_v * b for a, b in zip(qk, v, strict=True)]),
                1.0,
            )
        else:
            out[(i, p)], out_weights[(i, p)] = curve, weights[(i, p)]
    return out, out_weights


def untie(chosen: dict[Key, int]) -> dict[Key, int]:
    out = {}
    for (i, p), w in chosen.items():
        out |= {(i, "qk"): w, (i, "v"): w} if p == QKV else {(i, p): w}
    return out


def widths_of(model: nn.Module, w: Widths) -> tuple[int, int, int]:
    """(mlp, qk, v) of a planned block; parts left as they are take the model's dense widths, replaced modules
    ``latency.REMOVED``."""
    dense = block_parts(model)[0]["widths"]
    if "attn" in w.replace:
        qk = v = REMOVED
    else:
        qk, v = w.qk or dense["qk"], w.v or dense["v"]
    return (REMOVED if "mlp" in w.replace else w.mlp or dense["mlp"], qk, v)
