"""CORP end to end on one model: calibrate once, then rank, compensate and cut every block.

``calibrate`` is the only step that sees images; ``prune_model`` works from the statistics alone,
so a sweep calibrates once and prunes at many sparsities (on copies of the dense model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.env import exact_fp32
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PART_NAMES, PruneConfig, Widths
from corp_deploy.core.fit import COMPENSATIONS, fit_qk, fit_reader
from corp_deploy.core.ranking import (
    channel_scores,
    global_widths,
    kept_width,
    qk_scores,
    split_top,
    value_scores,
)
from corp_deploy.core.stats import BranchStats, CalibrationStats, MlpStats, QKStats, collect, empty_stats
from corp_deploy.families import Adapter, adapter_for
from corp_deploy.families.timm import modules as surgery
from corp_deploy.families.timm.modules import AffineBranch, linear_float64


@dataclass
class Timer:
    """Wall-clock seconds per phase; synchronises CUDA so GPU work is charged to its phase."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, since: float) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now


def calibrate(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, int]],
    config: PruneConfig,
    device: torch.device | str,
    total: int | None = None,
    progress: bool = True,
    merge: Callable[[CalibrationStats], CalibrationStats] | None = None,
) -> CalibrationStats:
    """One forward pass over the calibration batches, collecting what ``config`` needs.

    ``merge`` combines this process's sums with other processes' (``distributed.all_reduce_stats``)
    before the emptiness check, so a rank with no readable images still joins the reduction. The
    pass runs in exact float32 (``env.exact_fp32``): TF32 would put ~1e-3 relative error into sums
    that the Q/K systems (condition numbers of 1e10 and more) are solved from.
    """
    stats = empty_stats(
        model,
        mlp=config.prunes("mlp"),
        qk=config.prunes("qk"),
        device=device,
        proj=config.prunes("v"),
        depth=config.depth,
    )
    with exact_fp32():
        collect(model, batches, stats, device, total=total, progress=progress)
    if merge is not None:
        stats = merge(stats)
    if stats.images == 0:
        raise CorpError(f"none of the {stats.skipped} calibration images could be read; check the files")
    return stats


def check_parts(model: nn.Module, config: PruneConfig) -> None:
    """What every width rule needs of the blocks (``Adapter.check_parts``: a compensated MLP fold takes the
    constant term in a bias, V pruning folds into proj) and ``--depth`` (``Adapter.check_depth``). Data-free, so a
    refusal comes before calibration."""
    adapter = adapter_for(model)
    if config.layout == "standard":
        check_standard(adapter, config)
    for i, block in enumerate(adapter.blocks(model)):
        adapter.check_parts(block, i, config.target, config.compensation)
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
    """Every block's kept widths at ``config``'s sparsities: the same fraction in every block, or with
    ``selection="global"`` VBP's one threshold over all blocks' MLP channel scores (needs ``stats``).

    Data-free for the per-layer rule: call it before calibrating so an impossible sparsity or an
    unsupported block fails in a second. A budget's widths come from ``allocation.plan_budget``.
    """
    if config.budget is not None:
        raise CorpError("a --budget config's widths come from corp_deploy.plan.allocation.plan_budget, not plan_widths")
    check_parts(model, config)
    adapter = adapter_for(model)
    plan = []
    for i, block in enumerate(adapter.blocks(model)):
        qk, v = adapter.head_widths(block)
        full = {"mlp": adapter.mlp_out(block).in_features, "qk": qk, "v": v}
        kept = {
            p: kept_width(full[p], config.part_sparsity(p), config.round_to, f"{PART_NAMES[p]} (block {i})")
            for p in config.target
        }
        plan.append(Widths(**kept))
    if config.selection == "global":
        if stats is None:
            raise CorpError("--selection global chooses MLP widths from the calibration statistics; pass them")
        scores = [
            channel_scores(config.ranker, stats.mlp[i], linear_float64(adapter.mlp_out(b), stats.mlp[i].sum.device)[0])
            for i, b in enumerate(adapter.blocks(model))
        ]
        counts = global_widths(scores, config.part_sparsity("mlp"), config.round_to)
        plan = [replace(w, mlp=n) for w, n in zip(plan, counts, strict=True)]
    return plan


def prune_model(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    timer: Timer | None = None,
    plan: list[Widths] | None = None,
) -> list[dict]:
    """Prune ``model`` in place from ``stats``; returns per-block diagnostics.

    Widths are planned for every block before any block is changed (``plan_widths``, or ``plan``
    given: a budget's ``allocation.plan_budget``), so a bad sparsity never leaves a half-pruned model.
    """
    timer = timer or Timer()
    plan = plan_widths(model, config, stats) if plan is None else plan
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    return [prune_block(adapter, blocks[i], i, stats, widths, config, timer) for i, widths in enumerate(plan)]


LogitTargets = Callable[[Tensor], tuple[Tensor, Tensor]]
"""Sequential Q/K: kept dims (heads, d') -> (``sum_b (Q~_S^T Q)(K^T K~_S)`` per head, dense logit energy per head)."""


def prune_block(
    adapter: Adapter,
    block: nn.Module,
    i: int,
    stats: CalibrationStats,
    widths: Widths,
    config: PruneConfig,
    timer: Timer,
    logit_targets: LogitTargets | None = None,
) -> dict[str, Any]:
    """Prune block ``i`` in place to ``widths``; its diagnostics, keyed by part (``mlp``, ``qk``, ``v``) and
    ``replaced`` (module -> its fit and relative residual energy).

    Three steps, each over every part: ``select`` the kept channels (ranking, on the dense block's weights), ``fit``
    their compensations from the statistics (float64, ``core.fit``), ``install`` the folded weights in the family's
    modules. The parts touch disjoint weights (fc1/fc2; the query and key projections; the value projection and
    proj's columns), so every selection sees the dense block. ``stats`` holds at least block i's sums;
    ``PairStats`` and ``logit_targets`` make the fits sequential.
    """
    entry: dict[str, Any] = {"block": i}
    if widths.replace:
        entry["replaced"] = {m: replace_module(adapter, block, i, stats, m, config, timer) for m in widths.replace}
    t = time.perf_counter()
    cuts = select(adapter, block, i, stats, widths, config)
    t = timer.add("ranking", t)
    targets = None
    if logit_targets is not None and "qk" in cuts and cuts["qk"].keep is not None:
        targets = logit_targets(cuts["qk"].keep)
        t = timer.add("calibration", t)
    folds = fit(cuts, stats, i, config, targets)
    install(adapter, block, cuts, folds)
    timer.add("compensation", t)
    return entry | {part: fold.report for part, fold in folds.items()}


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
    """One part's compensated weights in float64 (``install`` puts them in the block) and its report entry."""

    weights: tuple[Tensor | None, ...]
    report: dict[str, Any]


def select(
    adapter: Adapter, block: nn.Module, i: int, stats: CalibrationStats, widths: Widths, config: PruneConfig
) -> dict[str, Cut]:
    """Every targeted part's ``Cut``, ranked by ``config.ranker`` (``ranking``) on the dense block's weights."""
    cuts = {}
    if widths.mlp is not None:
        s = stats.mlp[i]
        w, b = linear_float64(adapter.mlp_out(block), s.sum.device)
        keep, prune = split_top(channel_scores(config.ranker, s, w, config.ridge), widths.mlp)
        cuts["mlp"] = Cut({"width": w.shape[1], "kept": widths.mlp}, keep, prune, (w, b))
    if widths.qk is not None:
        cuts["qk"] = _select_qk(adapter, block, stats.qk[i], widths.qk, config)
    if widths.v is not None:
        cuts["v"] = _select_v(adapter, block, stats.proj[i], widths.v, config)
    return cuts


def _select_qk(adapter: Adapter, block: nn.Module, s: QKStats, kept: int, config: PruneConfig) -> Cut:
    """Q/K dims per head, by the logit energy (``ranking.qk_scores``)."""
    size = {"head_dim": s.head_dim, "kept": kept}
    if kept == s.head_dim:
        return Cut(size)
    weights = tuple(
        None if x is None else x.detach().to(s.moment.device, torch.float64) for x in adapter.qk_weights(block)
    )
    scores = qk_scores(config.ranker, C.logit_energy(s.moment, s.index), weights[0], weights[2])
    return Cut(size, *split_top(scores, kept), weights)


def _select_v(adapter: Adapter, block: nn.Module, s: MlpStats, kept: int, config: PruneConfig) -> Cut:
    """V channels per head, predicted later from the kept channels of ALL heads at proj's input.

    Every head keeps ``kept`` channels (ranked within the head) so attention stays one batched op; query heads
    that share a V head (``value_groups``) keep the same channels, ranked by their summed scores.
    """
    heads, group = adapter.heads(block), adapter.value_groups(block)
    d = s.sum.numel() // heads
    size = {"head_dim": d, "kept": kept}
    if kept == d:
        return Cut(size)
    w, b = linear_float64(adapter.proj(block), s.sum.device)
    keep_g, _ = split_top(value_scores(config.ranker, s, w, heads, group, config.ridge), kept)
    return Cut(size, *C.head_channels(keep_g.repeat_interleave(group, 0), d), (w, b))


def fit(
    cuts: dict[str, Cut],
    stats: CalibrationStats,
    i: int,
    config: PruneConfig,
    targets: tuple[Tensor, Tensor] | None = None,
) -> dict[str, Fold]:
    """Every part's compensated float64 weights and report entry (``core.fit``, by ``config.compensation``); a
    part kept whole reports no error and has no weights."""
    folds = {}
    for part, cut in cuts.items():
        if cut.keep is None:
            errors = dict.fromkeys(("none", "corp") if part == "qk" else COMPENSATIONS, 0.0)
            folds[part] = Fold((), {**cut.size, "rel_error": errors})
        elif part == "qk":
            weights, errors, max_m = fit_qk(
                stats.qk[i], cut.weights, cut.keep, cut.prune, config.compensation, config.ridge, targets
            )
            folds[part] = Fold(weights, {**cut.size, "rel_error": errors, "max_m_norm": max_m})
        else:
            s = stats.mlp[i] if part == "mlp" else stats.proj[i]
            w, b, errors = fit_reader(s, *cut.weights, cut.keep, cut.prune, config.compensation, config.ridge)
            folds[part] = Fold((w, b), {**cut.size, "rel_error": errors})
    return folds


def install(adapter: Adapter, block: nn.Module, cuts: dict[str, Cut], folds: dict[str, Fold]) -> None:
    """The folded weights into the family's modules, each in its module's device and dtype."""
    if "mlp" in cuts:
        out = adapter.mlp_out(block)
        dev, dtype = out.weight.device, out.weight.dtype
        w, b = folds["mlp"].weights
        b = None if out.bias is None and not adapter.adds_bias else b.to(dev, dtype)
        adapter.set_mlp(block, cuts["mlp"].keep.to(dev), w.to(dev, dtype), b)
    if "qk" in cuts and folds["qk"].weights:
        ref = adapter.qk_weights(block)[0]
        adapter.set_qk(block, *(None if x is None else x.to(ref.device, ref.dtype) for x in folds["qk"].weights))
    if "v" in cuts and folds["v"].weights:
        proj = adapter.proj(block)
        dev, dtype = proj.weight.device, proj.weight.dtype
        w, b = folds["v"].weights
        adapter.set_values(block, cuts["v"].keep.to(dev), w.to(dev, dtype), b.to(dev, dtype))


def fit_branch(s: BranchStats, fit: str, alpha: float) -> tuple[AffineBranch, float]:
    """The fitted stand-in of one branch (``compensation.branch_fit``) and its relative residual energy."""
    dim = s.sum_x.numel()
    mean_z, second_z, mean_y, cross, energy = s.moments()
    features = C.branch_features(fit, dim)
    w, b = C.branch_fit(mean_z, second_z, mean_y, cross, features, alpha)
    error = float(C.branch_error(mean_z, second_z, mean_y, cross, energy, features, w, b))
    return AffineBranch(dim, fit).fill(w.float(), b.float()), error


def replace_module(
    adapter: Adapter, block: nn.Module, i: int, stats: CalibrationStats, module: str, config: PruneConfig, timer: Timer
) -> dict[str, Any]:
    """Replace block ``i``'s ``module`` by its fitted branch (``surgery.replace_branch``); its diagnostics."""
    t = time.perf_counter()
    branch, error = fit_branch(stats.depth[(i, module)], config.depth_fit, config.ridge)
    surgery.replace_branch(block, module, branch)
    timer.add("compensation", t)
    return {"fit": config.depth_fit, "rel_error": error}
