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
from corp_deploy.allocation import CRITERIA, parse_budget
from corp_deploy.errors import CorpError
from corp_deploy.ranking import RANKERS, attn_scores, kept_width, mlp_scores, split_top
from corp_deploy.stats import AttnStats, CalibrationStats, MlpStats, PairStats, collect, empty_stats
from corp_deploy.surgery import check_v_prunable, fill_attention, fill_mlp, fill_values, linear_float64

PARTS = ("mlp", "qk", "v")
"""Prunable structures: MLP hidden channels, attention Q/K dims per head, attention V channels per head."""
TARGET_ALIASES = {"attn": ("qk",), "both": ("mlp", "qk"), "all": PARTS}
"""Older and shorter spellings of ``--target``: ``attn`` and ``both`` keep their pre-V meanings."""
COMPENSATIONS = ("corp", "mean", "none")
DEFAULT_RIDGE = 1e-3
"""Relative ridge damping alpha: lam = alpha * mean(diag(system)); see docs/BENCHMARKS.md."""


@dataclass(frozen=True)
class PruneConfig:
    """What to prune and how. ``mlp_sparsity``/``attn_sparsity`` (Q/K)/``v_sparsity`` override ``sparsity`` per part.

    ``target`` is a comma-separated combination of ``PARTS`` and ``TARGET_ALIASES`` (``mlp,qk,v``, ``all``).

    ``budget`` (``"macs=F"``) replaces the uniform sparsity: every block's widths of every targeted part
    are chosen by ``allocation`` to keep fraction F of the dense MACs, and ``sparsity`` is then ignored
    (the per-part sparsities must stay unset). ``allocation`` picks how block errors are compared:
    ``sensitivity`` weights them by their measured effect on the final features, which needs the first
    ``sensitivity_images`` calibration images held out (``api.prune`` does it); ``local`` does not.
    """

    sparsity: float = 0.5
    mlp_sparsity: float | None = None
    attn_sparsity: float | None = None
    v_sparsity: float | None = None
    target: str = "both"
    ranker: str = "combined"
    compensation: str = "corp"
    ridge: float = DEFAULT_RIDGE
    round_to: int = 8
    budget: str | None = None
    allocation: str = "sensitivity"
    sensitivity_images: int = 32
    sequential: bool = False
    """Error-correcting calibration (``blockwise``): block i's statistics come from the stream pruned up to it and
    its compensation regresses the dense model's targets. Costs about 4 block passes per block instead of one."""

    def __post_init__(self) -> None:
        for label, value in (
            ("--sparsity", self.sparsity),
            ("--mlp-sparsity", self.mlp_sparsity),
            ("--attn-sparsity", self.attn_sparsity),
            ("--v-sparsity", self.v_sparsity),
        ):
            if value is not None and not 0.0 <= value < 1.0:
                raise CorpError(f"{label} must be in [0, 1), got {value:g}")
        parse_target(self.target)
        choices = (
            ("--ranker", self.ranker, RANKERS),
            ("--compensation", self.compensation, COMPENSATIONS),
            ("--allocation", self.allocation, CRITERIA),
        )
        for label, value, allowed in choices:
            if value not in allowed:
                raise CorpError(f"{label} must be one of {', '.join(allowed)}, got {value!r}")
        if self.ridge < 0:
            raise CorpError(f"--ridge must be >= 0, got {self.ridge:g}")
        if self.round_to < 1:
            raise CorpError(f"--round-to must be >= 1, got {self.round_to}")
        if self.budget is not None:
            self._check_budget()

    def _check_budget(self) -> None:
        """A budget chooses every width, so nothing else may fix one; it ranks widths by CORP's error."""
        parse_budget(self.budget)
        fixed = [
            n
            for n, v in (
                ("--mlp-sparsity", self.mlp_sparsity),
                ("--attn-sparsity", self.attn_sparsity),
                ("--v-sparsity", self.v_sparsity),
            )
            if v is not None
        ]
        if fixed:
            raise CorpError(f"--budget chooses every block's widths; drop {', '.join(fixed)} or drop --budget")
        if self.compensation != "corp":
            raise CorpError("--budget allocates widths by CORP's compensated error; use --compensation corp")
        if self.allocation == "sensitivity" and self.sensitivity_images < 1:
            raise CorpError(
                f"--sensitivity-images must be >= 1 with --allocation sensitivity, got {self.sensitivity_images}"
            )

    @property
    def prunes_mlp(self) -> bool:
        return "mlp" in parse_target(self.target)

    @property
    def prunes_attn(self) -> bool:
        """Q/K dims (the paper's attention pruning)."""
        return "qk" in parse_target(self.target)

    @property
    def prunes_v(self) -> bool:
        return "v" in parse_target(self.target)

    def _effective(self, pruned: bool, override: float | None) -> float | None:
        """None under a budget: the widths differ per block (see the report's ``allocation``)."""
        if self.budget is not None:
            return None
        return (self.sparsity if override is None else override) if pruned else 0.0

    @property
    def effective_mlp_sparsity(self) -> float | None:
        return self._effective(self.prunes_mlp, self.mlp_sparsity)

    @property
    def effective_attn_sparsity(self) -> float | None:
        return self._effective(self.prunes_attn, self.attn_sparsity)

    @property
    def effective_v_sparsity(self) -> float | None:
        return self._effective(self.prunes_v, self.v_sparsity)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "sparsity": None if self.budget is not None else self.sparsity,
            "mlp_sparsity": self.effective_mlp_sparsity,
            "attn_sparsity": self.effective_attn_sparsity,
            "v_sparsity": self.effective_v_sparsity,
        }


def parse_target(target: str) -> frozenset[str]:
    """``"mlp,qk,v"`` / ``"all"`` / ``"both"`` -> the set of ``PARTS`` it names."""
    parts: set[str] = set()
    for word in target.split(","):
        word = word.strip()
        if word not in PARTS and word not in TARGET_ALIASES:
            raise CorpError(
                f"--target must be a comma-separated combination of {', '.join(PARTS)} "
                f"(or {', '.join(TARGET_ALIASES)}), got {target!r}"
            )
        parts.update(TARGET_ALIASES.get(word, (word,)))
    return frozenset(parts)


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
    stats = empty_stats(model, mlp=config.prunes_mlp, attn=config.prunes_attn, device=device, proj=config.prunes_v)
    collect(model, batches, stats, device, total=total, progress=progress)
    if merge is not None:
        stats = merge(stats)
    if stats.images == 0:
        raise CorpError(f"none of the {stats.skipped} calibration images could be read; check the files")
    return stats


def plan_widths(model: nn.Module, config: PruneConfig) -> list[tuple[int | None, int | None, int | None]]:
    """Kept (MLP channels, Q/K dims per head, V channels per head) of every block, None where not pruned.

    Cheap and data-free: call it before calibrating so an impossible sparsity or an unsupported block
    fails in a second. Uniform sparsity only: a budget's widths come from ``allocation.plan_budget``.
    """
    if config.budget is not None:
        raise CorpError("a --budget config's widths come from corp_deploy.allocation.plan_budget, not plan_widths")
    plan = []
    for i, block in enumerate(model.blocks):
        mlp_kept = attn_kept = v_kept = None
        if config.prunes_mlp:
            if block.mlp.fc2.bias is None and config.compensation != "none":
                raise CorpError(
                    f"MLP pruning with --compensation {config.compensation} is not supported for block {i}: its fc2 "
                    "has no bias to take the compensation's constant; use --compensation none or --target qk"
                )
            width = block.mlp.fc2.in_features
            mlp_kept = kept_width(width, config.effective_mlp_sparsity, config.round_to, f"MLP channels (block {i})")
        if config.prunes_attn:
            d = block.attn.head_dim
            attn_kept = kept_width(d, config.effective_attn_sparsity, config.round_to, f"Q/K dims per head (block {i})")
        if config.prunes_v:
            check_v_prunable(block.attn, i)
            d = block.attn.head_dim
            v_kept = kept_width(d, config.effective_v_sparsity, config.round_to, f"V channels per head (block {i})")
        plan.append((mlp_kept, attn_kept, v_kept))
    return plan


Widths = tuple[int | None, int | None, int | None]
"""Kept (MLP channels, Q/K dims per head, V channels per head) of one block, None where not pruned."""


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
    plan = plan_widths(model, config) if plan is None else plan
    return [prune_block(model.blocks[i], i, stats, widths, config, timer) for i, widths in enumerate(plan)]


LogitTargets = Callable[[Tensor], tuple[Tensor, Tensor]]
"""Sequential Q/K: kept dims (heads, d') -> (``sum_b (Q~_S^T Q)(K^T K~_S)`` per head, dense logit energy per head)."""


def prune_block(
    block: nn.Module,
    i: int,
    stats: CalibrationStats,
    widths: Widths,
    config: PruneConfig,
    timer: Timer,
    logit_targets: LogitTargets | None = None,
) -> dict[str, Any]:
    """Prune block ``i`` in place to ``widths``; its diagnostics.

    ``stats`` holds at least block i's sums; ``PairStats`` and ``logit_targets`` make the fits sequential.
    Q/K are pruned before V; they touch disjoint weights (Q/K rows of qkv; V rows of qkv and proj's columns).
    """
    mlp_kept, attn_kept, v_kept = widths
    entry: dict[str, Any] = {"block": i}
    if mlp_kept is not None:
        entry["mlp"] = _prune_mlp(block.mlp, stats.mlp[i], mlp_kept, config, timer)
    if attn_kept is not None:
        entry["attn"], new_attn = _prune_attn(block.attn, stats.attn[i], attn_kept, config, timer, logit_targets)
        if new_attn is not None:
            block.attn = new_attn
    if v_kept is not None:
        entry["v"], block.attn = _prune_v(block.attn, stats.proj[i], v_kept, config, timer)
    return entry


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


def _prune_mlp(mlp: nn.Module, s: MlpStats, kept: int, config: PruneConfig, timer: Timer) -> dict:
    t = time.perf_counter()
    w2, b2 = linear_float64(mlp.fc2, s.sum.device)
    scores = mlp_scores(config.ranker, s.second_moment().diagonal(), s.active / s.count, w2)
    keep, prune = split_top(scores, kept)
    t = timer.add("ranking", t)
    new_w2, new_b2, errors = _compensate(s, w2, b2, keep, prune, config)
    dtype, wdev = mlp.fc2.weight.dtype, mlp.fc2.weight.device
    fill_mlp(mlp, keep.to(wdev), new_w2.to(wdev, dtype), None if mlp.fc2.bias is None else new_b2.to(wdev, dtype))
    timer.add("compensation", t)
    return {"width": w2.shape[1], "kept": kept, "rel_error": errors}


def _prune_v(attn: nn.Module, s: MlpStats, kept: int, config: PruneConfig, timer: Timer) -> tuple[dict, nn.Module]:
    """Remove V channels per head; predict them from the kept channels of ALL heads at proj's input.

    Every head keeps ``kept`` channels (ranked within the head) so attention stays one batched op;
    the compensation is the MLP's, applied to proj (see ``compensation``).
    """
    heads, d = attn.num_heads, s.sum.numel() // attn.num_heads
    info: dict[str, Any] = {"head_dim": d, "kept": kept}
    if kept == d:
        info["rel_error"] = {"none": 0.0, "mean": 0.0, "corp": 0.0}
        return info, attn
    t = time.perf_counter()
    dev = s.sum.device
    w, b = linear_float64(attn.proj, dev)
    scores = mlp_scores(config.ranker, s.second_moment().diagonal(), s.active / s.count, w).view(heads, d)
    keep_h, _ = split_top(scores, kept)
    keep, prune = C.head_channels(keep_h, d)
    t = timer.add("ranking", t)
    new_w, new_b, info["rel_error"] = _compensate(s, w, b, keep, prune, config)
    dtype, wdev = attn.proj.weight.dtype, attn.proj.weight.device
    new = fill_values(attn, keep.to(wdev), new_w.to(wdev, dtype), new_b.to(wdev, dtype))
    timer.add("compensation", t)
    return info, new


def _prune_attn(
    attn: nn.Module, s: AttnStats, kept: int, config: PruneConfig, timer: Timer, logit_targets: LogitTargets | None
) -> tuple[dict, Any]:
    """Q/K dims per head. With ``logit_targets`` (sequential) ``s`` is the pruned stream's moment and the fit
    regresses the dense logits (``compensation.sequential_logit_system``) instead of the pruned pairs'."""
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
    targets = None if logit_targets is None else logit_targets(keep)
    t = timer.add("calibration", t)

    all_dims = torch.arange(d, device=dev)
    q_w, k_w, q_b, k_b = [], [], [], []
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
