"""CORP end to end on one model: calibrate once, then rank, compensate and cut every block.

``calibrate`` is the only step that sees images; ``prune_model`` works from the statistics alone,
so a sweep calibrates once and prunes at many sparsities (on copies of the dense model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy import compensation as C
from corp_deploy.errors import CorpError
from corp_deploy.ranking import RANKERS, attn_scores, kept_width, mlp_scores, split_top
from corp_deploy.stats import AttnStats, CalibrationStats, MlpStats, collect, empty_stats
from corp_deploy.surgery import fill_attention, fill_mlp

TARGETS = ("mlp", "attn", "both")
COMPENSATIONS = ("corp", "mean", "none")
DEFAULT_RIDGE = 1e-3
"""Relative ridge damping alpha: lam = alpha * mean(diag(system)); see docs/BENCHMARKS.md."""


@dataclass(frozen=True)
class PruneConfig:
    """What to prune and how. ``mlp_sparsity``/``attn_sparsity`` override ``sparsity`` per part."""

    sparsity: float = 0.5
    mlp_sparsity: float | None = None
    attn_sparsity: float | None = None
    target: str = "both"
    ranker: str = "combined"
    compensation: str = "corp"
    ridge: float = DEFAULT_RIDGE
    round_to: int = 8

    def __post_init__(self) -> None:
        for label, value in (
            ("--sparsity", self.sparsity),
            ("--mlp-sparsity", self.mlp_sparsity),
            ("--attn-sparsity", self.attn_sparsity),
        ):
            if value is not None and not 0.0 <= value < 1.0:
                raise CorpError(f"{label} must be in [0, 1), got {value:g}")
        choices = (
            ("--target", self.target, TARGETS),
            ("--ranker", self.ranker, RANKERS),
            ("--compensation", self.compensation, COMPENSATIONS),
        )
        for label, value, allowed in choices:
            if value not in allowed:
                raise CorpError(f"{label} must be one of {', '.join(allowed)}, got {value!r}")
        if self.ridge < 0:
            raise CorpError(f"--ridge must be >= 0, got {self.ridge:g}")
        if self.round_to < 1:
            raise CorpError(f"--round-to must be >= 1, got {self.round_to}")

    @property
    def prunes_mlp(self) -> bool:
        return self.target in ("mlp", "both")

    @property
    def prunes_attn(self) -> bool:
        return self.target in ("attn", "both")

    @property
    def effective_mlp_sparsity(self) -> float:
        return (self.sparsity if self.mlp_sparsity is None else self.mlp_sparsity) if self.prunes_mlp else 0.0

    @property
    def effective_attn_sparsity(self) -> float:
        return (self.sparsity if self.attn_sparsity is None else self.attn_sparsity) if self.prunes_attn else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "mlp_sparsity": self.effective_mlp_sparsity,
            "attn_sparsity": self.effective_attn_sparsity,
        }


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
    before the emptiness check, so a rank with no readable images still joins the reduction.
    """
    stats = empty_stats(model, mlp=config.prunes_mlp, attn=config.prunes_attn, device=device)
    collect(model, batches, stats, device, total=total, progress=progress)
    if merge is not None:
        stats = merge(stats)
    if stats.images == 0:
        raise CorpError(f"none of the {stats.skipped} calibration images could be read; check the files")
    return stats


def plan_widths(model: nn.Module, config: PruneConfig) -> list[tuple[int | None, int | None]]:
    """Kept (MLP channels, Q/K dims per head) of every block, None where not pruned.

    Cheap and data-free: call it before calibrating so an impossible sparsity fails in a second.
    """
    plan = []
    for i, block in enumerate(model.blocks):
        mlp_kept = attn_kept = None
        if config.prunes_mlp:
            width = block.mlp.fc2.in_features
            mlp_kept = kept_width(width, config.effective_mlp_sparsity, config.round_to, f"MLP channels (block {i})")
        if config.prunes_attn:
            d = block.attn.head_dim
            attn_kept = kept_width(d, config.effective_attn_sparsity, config.round_to, f"Q/K dims per head (block {i})")
        plan.append((mlp_kept, attn_kept))
    return plan


def prune_model(
    model: nn.Module, stats: CalibrationStats, config: PruneConfig, timer: Timer | None = None
) -> list[dict]:
    """Prune ``model`` in place from ``stats``; returns per-block diagnostics.

    Widths are planned for every block before any block is changed, so a bad sparsity never
    leaves a half-pruned model.
    """
    timer = timer or Timer()
    plan = plan_widths(model, config)
    report = []
    for i, (block, (mlp_kept, attn_kept)) in enumerate(zip(model.blocks, plan, strict=True)):
        entry: dict[str, Any] = {"block": i}
        if mlp_kept is not None:
            entry["mlp"] = _prune_mlp(block.mlp, stats.mlp[i], mlp_kept, config, timer)
        if attn_kept is not None:
            entry["attn"], new_attn = _prune_attn(block.attn, stats.attn[i], attn_kept, config, timer)
            if new_attn is not None:
                block.attn = new_attn
        report.append(entry)
    return report


def _prune_mlp(mlp: nn.Module, s: MlpStats, kept: int, config: PruneConfig, timer: Timer) -> dict:
    t = time.perf_counter()
    dev = s.sum.device
    mean, second = s.mean(), s.second_moment()
    w2 = mlp.fc2.weight.detach().to(dev, torch.float64)
    b2 = mlp.fc2.bias.detach().to(dev, torch.float64)
    scores = mlp_scores(config.ranker, second.diagonal(), s.active / s.count, w2)
    keep, prune = split_top(scores, kept)
    t = timer.add("ranking", t)

    zero_b = torch.zeros(prune.numel(), kept, dtype=torch.float64, device=dev)
    candidates = {"none": (zero_b, torch.zeros_like(mean[prune])), "mean": (zero_b, mean[prune])}
    candidates["corp"] = C.mlp_affine(mean, second, keep, prune, config.ridge)
    errors = {k: float(C.mlp_output_error(mean, second, w2, b2, keep, prune, *bc)) for k, bc in candidates.items()}
    new_w2, new_b2 = C.fold_mlp(w2, b2, keep, prune, *candidates[config.compensation])
    dtype, wdev = mlp.fc2.weight.dtype, mlp.fc2.weight.device
    fill_mlp(mlp, keep.to(wdev), new_w2.to(wdev, dtype), new_b2.to(wdev, dtype))
    timer.add("compensation", t)
    return {"width": w2.shape[1], "kept": kept, "rel_error": errors}


def _prune_attn(attn: nn.Module, s: AttnStats, kept: int, config: PruneConfig, timer: Timer) -> tuple[dict, Any]:
    heads, d = s.heads, s.head_dim
    info: dict[str, Any] = {"head_dim": d, "kept": kept}
    if kept == d:
        info["rel_error"] = {"none": 0.0, "corp": 0.0}
        return info, None
    t = time.perf_counter()
    dev = s.moment.device
    w = attn.qkv.weight.detach().to(dev, torch.float64).unflatten(0, (3, heads, d))
    b = None if attn.qkv.bias is None else attn.qkv.bias.detach().to(dev, torch.float64).unflatten(0, (3, heads, d))
    scores = attn_scores(config.ranker, C.logit_energy(s.moment, s.index), w[0], w[1])
    keep, prune = split_top(scores, kept)
    t = timer.add("ranking", t)

    all_dims = torch.arange(d, device=dev)
    q_w, k_w, q_b, k_b = [], [], [], []
    total = err_none = err_corp = 0.0
    max_m = 0.0
    for h in range(heads):
        moment = s.moment[h]
        a, r = C.logit_system(moment, s.index, keep[h], prune[h])
        removed = C.pair_energy(moment, s.index, prune[h])
        m = C.solve_logit_compensation(a, r, config.ridge)
        total += float(C.pair_energy(moment, s.index, all_dims))
        err_none += float(removed)
        err_corp += float(C.logit_error(a, r, removed, m))
        if config.compensation != "corp":  # VBP's mean shift has no logit-space analogue: plain removal
            m = torch.zeros_like(m)
        max_m = max(max_m, float(m.norm()))
        fq, fk = C.qk_factors(m)
        for j, factor, ws, bs in ((0, fq, q_w, q_b), (1, fk, k_w, k_b)):
            wn, bn = C.fold_projection(w[j, h, keep[h]], None if b is None else b[j, h, keep[h]], factor)
            ws.append(wn)
            bs.append(bn)
    dtype, wdev = attn.qkv.weight.dtype, attn.qkv.weight.device
    cast = lambda xs: None if xs[0] is None else torch.stack(xs).to(wdev, dtype)  # noqa: E731
    new = fill_attention(attn, cast(q_w), cast(q_b), cast(k_w), cast(k_b))
    timer.add("compensation", t)
    info["rel_error"] = {"none": err_none / total, "corp": err_corp / total}
    info["max_m_norm"] = max_m
    return info, new
