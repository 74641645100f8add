"""CORP end to end on one model: calibrate once, then select, fit and install every block.

``calibrate`` is the only step that sees images; ``prune_model`` works from the statistics alone, to the widths a
plan gave (``corp_deploy.plan.width_plan``), so a sweep calibrates once and prunes at many sparsities (on copies of the
dense model). One block (``prune_block``) is three steps over its parts: ``select`` (ranking), ``fit`` (the
compensations, ``core.fit``), install (``Adapter.install``: the family's modules).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from corp_deploy.base.env import exact_fp32
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PARTS, PruneConfig, Widths
from corp_deploy.core.fit import Cut, fit
from corp_deploy.core.ranking import channel_scores, qk_scores, split_top, value_scores
from corp_deploy.core.stats import CalibrationStats, collect, empty_stats
from corp_deploy.families import Adapter, adapter_for
from corp_deploy.families.layers import AffineBranch, linear_float64


@dataclass(frozen=True)
class Ranked:
    """One part's channel scores and the float64 weights they were computed on (the fit folds into them)."""

    scores: Tensor
    weights: tuple[Tensor | None, ...]
    group: int = 1
    """V: query heads per K/V head (``Adapter.value_groups``), which keep the same channels."""


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
    if stats.samples == 0:
        raise CorpError(f"none of the {stats.skipped} calibration images could be read; check the files")
    return stats


def prune_model(
    model: nn.Module,
    stats: CalibrationStats,
    config: PruneConfig,
    plan: list[Widths],
    timer: Timer | None = None,
    progress: bool = True,
) -> list[dict]:
    """Prune ``model`` in place from ``stats`` to ``plan`` (every block's widths, made before any block is changed:
    ``corp_deploy.plan.width_plan``, so a bad plan never leaves a half-pruned model); returns per-block diagnostics.
    A bar with an ETA over the blocks: a 1.7B decoder's solves take seconds per block."""
    timer = timer or Timer()
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    steps = tqdm(enumerate(plan), total=len(plan), unit="block", desc="compensation", disable=not progress)
    return [prune_block(adapter, blocks[i], i, stats, widths, config, timer) for i, widths in steps]


def check_tokens(tokens: int, width: int) -> None:
    """A warning when calibration holds fewer tokens than the MLP is wide: the compensation's least squares then fits
    the calibration tokens exactly, every block's error reads 0.000 on them, and nothing is learnt about any other
    input. Said once (block 0: every block sees the same tokens)."""
    if tokens < width:
        warnings.warn(
            f"{tokens} calibration tokens for an MLP width of {width}: the compensation fits them exactly (every "
            "block's error reads 0.000 on them) and says nothing about other inputs; calibrate on more data (at "
            f"least {width} tokens, many times that for a fit that holds)",
            stacklevel=2,
        )


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
    their compensations and the stand-ins of replaced modules from the statistics (float64, ``core.fit``), install
    the stand-ins (``Adapter.replace_branch``) and the folded weights (``Adapter.install``). The parts touch
    disjoint weights (fc1/fc2; the query and key projections; the value projection and proj's columns; a replaced
    module's widths are None), so every selection sees the dense block. ``stats`` holds at least block i's sums;
    ``PairStats`` and ``logit_targets`` make the fits sequential.
    """
    t = time.perf_counter()
    cuts = select(adapter, block, i, stats, widths, config)
    if i == 0 and "mlp" in cuts:
        check_tokens(int(stats.mlp[i].count), cuts["mlp"].size["width"])
    t = timer.add("ranking", t)
    targets = None
    if logit_targets is not None and "qk" in cuts and cuts["qk"].keep is not None:
        targets = logit_targets(cuts["qk"].keep)
        t = timer.add("calibration", t)
    branches = dict.fromkeys(widths.replace, config.depth_fit)
    folds, replaced = fit(cuts, branches, stats, i, config.compensation, config.ridge, targets)
    for module, fold in replaced.items():  # install: the stand-ins, then every cut part's folded weights
        w, b = fold.weights
        adapter.replace_branch(block, module, AffineBranch(b.shape[0], fold.report["fit"]).fill(w.float(), b.float()))
    for part in (p for p in PARTS if p in folds and folds[p].weights):  # Q/K before V: V rebuilds the attention
        adapter.install(block, part, cuts[part].keep, folds[part].weights)
    timer.add("compensation", t)
    entry: dict[str, Any] = {"block": i}
    if replaced:
        entry["replaced"] = {m: f.report for m, f in replaced.items()}
    return entry | {part: folds[part].report for part in PARTS if part in folds}


def rank(
    adapter: Adapter, block: nn.Module, i: int, stats: CalibrationStats, parts: Iterable[str], ranker: str, ridge: float
) -> dict[str, Ranked]:
    """Every part's channel scores by ``ranker`` (``ranking``) on the dense block's weights, higher kept: MLP channels
    (n,), Q/K dims per head (heads, d), V channels per K/V head (heads // group, d). What ``select`` cuts at one width
    and ``allocation`` orders for every width."""
    ranked = {}
    for part in parts:
        if part == "mlp":
            s = stats.mlp[i]
            w, b = linear_float64(adapter.mlp_out(block), s.sum.device)
            ranked[part] = Ranked(channel_scores(ranker, s, w, ridge), (w, b))
        elif part == "qk":
            s = stats.qk[i]
            raw = adapter.qk_weights(block)
            weights = tuple(None if x is None else x.detach().to(s.moment.device, torch.float64) for x in raw)
            ranked[part] = Ranked(qk_scores(ranker, C.logit_energy(s.moment, s.index), weights[0], weights[2]), weights)
        else:
            s, heads, group = stats.proj[i], adapter.heads(block), adapter.value_groups(block)
            w, b = linear_float64(adapter.proj(block), s.sum.device)
            ranked[part] = Ranked(value_scores(ranker, s, w, heads, group, ridge), (w, b), group)
    return ranked


def select(
    adapter: Adapter, block: nn.Module, i: int, stats: CalibrationStats, widths: Widths, config: PruneConfig
) -> dict[str, Cut]:
    """Every targeted part's ``Cut`` at ``widths``, from its ``rank`` scores (a per-head part kept whole is not
    ranked). Every head keeps the same number of Q/K dims and of V channels (ranked within the head) so attention
    stays one batched op; query heads that share a V head (``value_groups``) keep the same channels."""
    full = {}
    if widths.mlp is not None:
        full["mlp"] = adapter.mlp_out(block).in_features
    if widths.qk is not None:
        full["qk"] = stats.qk[i].head_dim
    if widths.v is not None:
        full["v"] = stats.proj[i].sum.numel() // adapter.heads(block)
    cut = [p for p, width in full.items() if p == "mlp" or widths.get(p) < width]
    ranked = rank(adapter, block, i, stats, cut, config.ranker, config.ridge)
    cuts = {}
    for part, width in full.items():
        kept = widths.get(part)
        size = {"width": width, "kept": kept} if part == "mlp" else {"head_dim": width, "kept": kept}
        if part not in ranked:
            cuts[part] = Cut(size)
        elif part == "v":
            keep_g, _ = split_top(ranked[part].scores, kept)
            keep, prune = C.head_channels(keep_g.repeat_interleave(ranked[part].group, 0), width)
            cuts[part] = Cut(size, keep, prune, ranked[part].weights)
        else:
            cuts[part] = Cut(size, *split_top(ranked[part].scores, kept), ranked[part].weights)
    return cuts
