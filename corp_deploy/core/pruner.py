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
from corp_deploy.core.ranking import (
    channel_scores,
    global_widths,
    kept_width,
    qk_scores,
    split_top,
    value_scores,
)
from corp_deploy.core.stats import BranchStats, CalibrationStats, MlpStats, PairStats, QKStats, collect, empty_stats
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

    ``stats`` holds at least block i's sums; ``PairStats`` and ``logit_targets`` make the fits sequential.
    Q/K are pruned before V; they touch disjoint weights (the query and key projections; the value projection and
    proj's columns). ``adapter`` (the model's family) finds and rebuilds the layers.
    """
    entry: dict[str, Any] = {"block": i}
    if widths.replace:
        entry["replaced"] = {m: replace_module(adapter, block, i, stats, m, config, timer) for m in widths.replace}
    if widths.mlp is not None:
        entry["mlp"] = _prune_mlp(adapter, block, stats.mlp[i], widths.mlp, config, timer)
    if widths.qk is not None:
        entry["qk"] = _prune_qk(adapter, block, stats.qk[i], widths.qk, config, timer, logit_targets)
    if widths.v is not None:
        entry["v"] = _prune_v(adapter, block, stats.proj[i], widths.v, config, timer)
    return entry


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


def _compensate(
    s: MlpStats, w: Tensor, b: Tensor, keep: Tensor, prune: Tensor, config: PruneConfig
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Fold ``x_P ~ B x_S + c`` into the Linear (w, b) that reads x; errors of every compensation.

    Shared by the MLP (x = fc2's input) and V (x = proj's input): the same closed form at a
    different Linear.
    """
    if isinstance(s, PairStats):
        return _regress(s, w, b, keep, config)
    mean, second = s.mean(), s.second_moment()
    zero_b = torch.zeros(prune.numel(), keep.numel(), dtype=torch.float64, device=mean.device)
    candidates = {"none": (zero_b, torch.zeros_like(mean[prune])), "mean": (zero_b, mean[prune])}
    candidates["corp"] = C.mlp_affine(mean, second, keep, prune, config.ridge)
    errors = {k: float(C.mlp_output_error(mean, second, w, b, keep, prune, *bc)) for k, bc in candidates.items()}
    new_w, new_b = C.fold_mlp(w, b, keep, prune, *candidates[config.compensation])
    return new_w, new_b, errors


def _regress(
    s: PairStats, w: Tensor, b: Tensor, keep: Tensor, config: PruneConfig
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``_compensate``'s sequential form: regress the dense stream's activation from the pruned stream's kept part."""
    mean_s, second_s = s.mean(), s.second_moment()
    mean_t, second_t, cross = s.target.mean(), s.target.second_moment(), s.cross / s.count
    zero_d = torch.zeros(mean_t.numel(), keep.numel(), dtype=torch.float64, device=mean_t.device)
    candidates = {
        "none": (zero_d, torch.zeros_like(mean_t)),
        "mean": (zero_d, mean_t - C.embed_kept(mean_s[keep], keep, mean_t.numel())),
        "corp": C.regression_affine(mean_s, second_s, mean_t, cross, keep, config.ridge),
    }
    moments = (mean_t, second_t, mean_s, second_s, cross)
    errors = {k: float(C.regression_error(*moments, w, b, keep, *dc)) for k, dc in candidates.items()}
    new_w, new_b = C.fold_regression(w, b, keep, *candidates[config.compensation])
    return new_w, new_b, errors


def _prune_mlp(adapter: Adapter, block: nn.Module, s: MlpStats, kept: int, config: PruneConfig, timer: Timer) -> dict:
    t = time.perf_counter()
    out = adapter.mlp_out(block)
    w2, b2 = linear_float64(out, s.sum.device)
    keep, prune = split_top(channel_scores(config.ranker, s, w2, config.ridge), kept)
    t = timer.add("ranking", t)
    new_w2, new_b2, errors = _compensate(s, w2, b2, keep, prune, config)
    dtype, wdev = out.weight.dtype, out.weight.device
    new_b2 = None if out.bias is None and not adapter.adds_bias else new_b2.to(wdev, dtype)
    adapter.set_mlp(block, keep.to(wdev), new_w2.to(wdev, dtype), new_b2)
    timer.add("compensation", t)
    return {"width": w2.shape[1], "kept": kept, "rel_error": errors}


def _prune_v(adapter: Adapter, block: nn.Module, s: MlpStats, kept: int, config: PruneConfig, timer: Timer) -> dict:
    """Remove V channels per head; predict them from the kept channels of ALL heads at proj's input.

    Every head keeps ``kept`` channels (ranked within the head) so attention stays one batched op; query heads
    that share a V head (``value_groups``) keep the same channels, ranked by their summed scores. The
    compensation is the MLP's, applied to proj (see ``compensation``).
    """
    heads, group = adapter.heads(block), adapter.value_groups(block)
    d = s.sum.numel() // heads
    info: dict[str, Any] = {"head_dim": d, "kept": kept}
    if kept == d:
        info["rel_error"] = {"none": 0.0, "mean": 0.0, "corp": 0.0}
        return info
    t = time.perf_counter()
    dev = s.sum.device
    proj = adapter.proj(block)
    w, b = linear_float64(proj, dev)
    keep_g, _ = split_top(value_scores(config.ranker, s, w, heads, group, config.ridge), kept)
    keep, prune = C.head_channels(keep_g.repeat_interleave(group, 0), d)
    t = timer.add("ranking", t)
    new_w, new_b, info["rel_error"] = _compensate(s, w, b, keep, prune, config)
    dtype, wdev = proj.weight.dtype, proj.weight.device
    adapter.set_values(block, keep.to(wdev), new_w.to(wdev, dtype), new_b.to(wdev, dtype))
    timer.add("compensation", t)
    return info


def _prune_qk(
    adapter: Adapter,
    block: nn.Module,
    s: QKStats,
    kept: int,
    config: PruneConfig,
    timer: Timer,
    logit_targets: LogitTargets | None,
) -> dict:
    """Q/K dims per head. With ``logit_targets`` (sequential) ``s`` is the pruned stream's moment and the fit
    regresses the dense logits (``compensation.sequential_logit_system``) instead of the pruned pairs'."""
    heads, d = s.heads, s.head_dim
    info: dict[str, Any] = {"head_dim": d, "kept": kept}
    if kept == d:
        info["rel_error"] = {"none": 0.0, "corp": 0.0}
        return info
    t = time.perf_counter()
    dev = s.moment.device
    raw = adapter.qk_weights(block)
    wdev, dtype = raw[0].device, raw[0].dtype
    q_w, q_b, k_w, k_b = (None if x is None else x.detach().to(dev, torch.float64) for x in raw)
    w, b = (q_w, k_w), (q_b, k_b)
    scores = qk_scores(config.ranker, C.logit_energy(s.moment, s.index), q_w, k_w)
    keep, prune = split_top(scores, kept)
    t = timer.add("ranking", t)
    targets = None if logit_targets is None else logit_targets(keep)
    t = timer.add("calibration", t)

    all_dims = torch.arange(d, device=dev)
    new_q_w, new_k_w, new_q_b, new_k_b = [], [], [], []
    total = err_none = err_corp = 0.0
    max_m = 0.0
    for h in range(heads):
        if targets is None:
            m, removed, err = C.logit_compensation(s.moment[h], s.index, keep[h], prune[h], config.ridge)
            energy = C.pair_energy(s.moment[h], s.index, all_dims)
        else:
            a, r = C.logit_system(s.moment[h], s.index, keep[h], prune[h])
            energy = targets[1][h]
            r, removed = C.sequential_logit_system(a, targets[0][h], energy)
            m = C.solve_logit_compensation(a, r, config.ridge)
            err = C.logit_error(a, r, removed, m)
        total += float(energy)
        err_none += float(removed)
        err_corp += float(err)
        if config.compensation != "corp":  # VBP's mean shift has no logit-space analogue: plain removal
            m = torch.zeros_like(m)
        max_m = max(max_m, float(m.norm()))
        fq, fk = C.qk_factors(m)
        for j, factor, ws, bs in ((0, fq, new_q_w, new_q_b), (1, fk, new_k_w, new_k_b)):
            wn, bn = C.fold_projection(w[j][h, keep[h]], None if b[j] is None else b[j][h, keep[h]], factor)
            ws.append(wn)
            bs.append(bn)
    cast = lambda xs: None if xs[0] is None else torch.stack(xs).to(wdev, dtype)  # noqa: E731
    adapter.set_qk(block, cast(new_q_w), cast(new_q_b), cast(new_k_w), cast(new_k_b))
    timer.add("compensation", t)
    info["rel_error"] = {"none": err_none / total, "corp": err_corp / total}
    info["max_m_norm"] = max_m
    return info
