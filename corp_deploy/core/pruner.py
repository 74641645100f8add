"""CORP end to end on one model: calibrate once, then rank, compensate and cut every block.

``calibrate`` is the only step that sees images; ``prune_model`` works from the statistics alone,
so a sweep calibrates once and prunes at many sparsities (on copies of the dense model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.env import exact_fp32
from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.ranking import (
    RANKERS,
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

PARTS = ("mlp", "qk", "v")
"""Prunable structures: MLP hidden channels, attention Q/K dims per head, attention V channels per head.
The one vocabulary of the code, the CLI (``--target mlp,qk,v``) and ``corp.json`` (block report keys)."""
PART_NAMES = {"mlp": "MLP channels", "qk": "Q/K dims per head", "v": "V channels per head"}
TARGET_ALIASES = {"attn": ("qk",), "both": ("mlp", "qk"), "joint": ("mlp", "qk"), "all": PARTS}
"""Older and shorter spellings of ``--target``: ``attn`` and ``both`` keep their pre-V meanings."""
COMPENSATIONS = ("corp", "mean", "none")
SELECTIONS = ("per-layer", "global")
"""How MLP channels are chosen at a sparsity: the same fraction in every block, or VBP's network-wide threshold."""
LAYOUTS = ("auto", "standard")
"""The folder a text model's plan may lead to: whichever its widths allow (``hf_folder``: the family's own format when
they are uniform and attention keeps the config's head width, else remote code), or the family's own format only
(uniform widths of the parts its config expresses)."""
BUDGET_KINDS = ("macs", "latency")
"""What a budget bounds: the closed-form MACs, or the time predicted by a latency table measured on a backend."""
CRITERIA = ("sensitivity", "local")
"""How errors of different blocks are put on one scale: measured end-to-end sensitivity, or none."""
MODULES = ("attn", "mlp")
"""What ``--depth`` may replace whole: a block's attention or its MLP (``surgery.AffineBranch``)."""
DEFAULT_RIDGE = 1e-3
"""Relative ridge damping alpha: lam = alpha * mean(diag(system)); see docs/BENCHMARKS.md."""


@dataclass(frozen=True)
class Budget:
    """What a budget bounds and the fraction of the dense model's cost it keeps."""

    kind: str
    fraction: float

    def __str__(self) -> str:
        return f"{self.kind}={self.fraction:g}"


def parse_budget(text: str) -> Budget:
    """``"macs=0.5"`` -> Budget("macs", 0.5): keep that fraction of the dense model's MACs (``latency=``: time)."""
    kind, sep, value = text.partition("=")
    kind = kind.strip()
    try:
        fraction = float(value)
    except ValueError:
        fraction = float("nan")
    if not sep or kind not in BUDGET_KINDS or not 0.0 < fraction <= 1.0:
        raise CorpError(
            f"--budget must be {'|'.join(BUDGET_KINDS)}=F with F the fraction of the dense MACs or latency to "
            f"keep, 0 < F <= 1 (e.g. macs=0.5), got {text!r}"
        )
    return Budget(kind, fraction)


@dataclass(frozen=True)
class Widths:
    """Kept widths of one block: MLP channels, Q/K dims per head, V channels per head; None = left as is."""

    mlp: int | None = None
    qk: int | None = None
    v: int | None = None
    replace: tuple[str, ...] = ()
    """Modules (``MODULES``) replaced by their fitted branch; their widths are then None."""

    def get(self, part: str) -> int | None:
        return getattr(self, part)


@dataclass(frozen=True)
class PruneConfig:
    """What to prune and how. ``mlp_sparsity``/``qk_sparsity``/``v_sparsity`` override ``sparsity`` per part.

    ``target`` names ``PARTS`` (``"mlp,qk,v"``, an alias such as ``"all"``, or a sequence of part names) and is
    parsed once into a tuple in ``PARTS`` order; ``budget`` (``"macs=F"`` or an ``allocation.Budget``) is parsed
    once into a ``Budget``. A budget replaces the uniform sparsity: every block's widths of every targeted part
    are chosen by ``allocation`` to keep fraction F of the dense MACs (the per-part sparsities must stay unset).
    ``allocation`` picks how block errors are compared: ``sensitivity`` weights them by their measured effect on
    the final features, from ``sensitivity_images`` held-out calibration images; ``local`` does not.
    ``selection="global"`` keeps VBP's network-wide choice of MLP channels: one score threshold across all
    blocks removes ``mlp_sparsity`` of all MLP channels (each block's count rounded to ``round_to``).
    """

    sparsity: float = 0.5
    mlp_sparsity: float | None = None
    qk_sparsity: float | None = None
    v_sparsity: float | None = None
    target: tuple[str, ...] | str = ("mlp", "qk")
    ranker: str = "combined"
    compensation: str = "corp"
    ridge: float = DEFAULT_RIDGE
    round_to: int = 8
    budget: Budget | str | None = None
    allocation: str = "sensitivity"
    sensitivity_images: int = 32
    selection: str = "per-layer"
    sequential: bool = False
    """Error-correcting calibration (``blockwise``): block i's statistics come from the stream pruned up to it and
    its compensation regresses the dense model's targets. Costs about 4 block passes per block instead of one."""
    depth: tuple[str, ...] | str = ()
    """Modules (``MODULES``) a latency budget may replace whole by ``depth_fit`` (``"attn,mlp"`` or a sequence)."""
    depth_fit: str = "affine-mean"
    layout: str = "auto"
    """``standard``: keep to what the family's own config expresses (``Adapter.standard_parts``, uniform widths), so
    the artifact loads with plain ``from_pretrained``; refused where the plan could not."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", parse_target(self.target))
        object.__setattr__(self, "depth", parse_depth(self.depth))
        if isinstance(self.budget, str):
            object.__setattr__(self, "budget", parse_budget(self.budget))
        for label, value in (
            ("--sparsity", self.sparsity),
            ("--mlp-sparsity", self.mlp_sparsity),
            ("--qk-sparsity", self.qk_sparsity),
            ("--v-sparsity", self.v_sparsity),
        ):
            if value is not None and not 0.0 <= value < 1.0:
                raise CorpError(f"{label} must be in [0, 1), got {value:g}")
        choices = (
            ("--ranker", self.ranker, RANKERS),
            ("--compensation", self.compensation, COMPENSATIONS),
            ("--allocation", self.allocation, CRITERIA),
            ("--selection", self.selection, SELECTIONS),
            ("--depth-fit", self.depth_fit, C.DEPTH_FITS),
            ("--layout", self.layout, LAYOUTS),
        )
        for label, value, allowed in choices:
            if value not in allowed:
                raise CorpError(f"{label} must be one of {', '.join(allowed)}, got {value!r}")
        if self.ridge < 0:
            raise CorpError(f"--ridge must be >= 0, got {self.ridge:g}")
        if self.round_to < 1:
            raise CorpError(f"--round-to must be >= 1, got {self.round_to}")
        if self.budget is not None:
            self._check_budgeted()
        if self.selection == "global" and "mlp" not in self.target:
            raise CorpError("--selection global chooses MLP channels across blocks; add mlp to --target")
        obs_parts = self.ranker == "obs" and (self.prunes("mlp") or self.prunes("v"))
        if obs_parts and (self.compensation != "corp" or self.selection != "per-layer"):
            raise CorpError(
                "--ranker obs orders each block's channels by the error CORP's compensation leaves: "
                "use --compensation corp and --selection per-layer, or another ranker"
            )
        if self.depth:
            self._check_depth()
        if self.layout == "standard":
            self._check_standard()

    def _check_standard(self) -> None:
        """A family's config has one width per part for all layers: only the same fraction in every block fits."""
        if self.budget is not None:
            raise CorpError(
                "--layout standard keeps every layer's widths equal; a budget allocates them per layer: "
                "prune with --sparsity, or drop --layout standard"
            )
        if self.selection != "per-layer":
            raise CorpError("--layout standard keeps every layer's MLP width equal; drop --selection global")

    def _check_depth(self) -> None:
        """Replacing a module saves fixed costs (kernels, launches) that only a measured latency table sees, and the
        local fit error picks the wrong blocks (late attention gathers the class token), so removals are judged by
        their measured end-to-end effect (the sensitivity pass) against a latency budget, on one pass's statistics."""
        if self.budget is None or self.budget.kind != "latency":
            raise CorpError("--depth replaces modules within a latency budget: add --speedup S (or --budget latency=F)")
        if self.allocation != "sensitivity":
            raise CorpError(
                "--depth judges a removal by its measured end-to-end error: use --allocation sensitivity, not local"
            )
        if self.sequential:
            raise CorpError("--depth fits replacements from one calibration pass; drop --sequential or --depth")

    def _check_budgeted(self) -> None:
        """A budget chooses every width, so nothing else may fix one; it ranks widths by CORP's error."""
        fixed = [
            n
            for n, v in (
                ("--mlp-sparsity", self.mlp_sparsity),
                ("--qk-sparsity", self.qk_sparsity),
                ("--v-sparsity", self.v_sparsity),
            )
            if v is not None
        ]
        if fixed:
            raise CorpError(f"--budget chooses every block's widths; drop {', '.join(fixed)} or drop --budget")
        if self.compensation != "corp":
            raise CorpError("--budget allocates widths by CORP's compensated error; use --compensation corp")
        if self.selection != "per-layer":
            raise CorpError("--budget allocates every block's widths itself; drop --selection global or --budget")
        if self.allocation == "sensitivity" and self.sensitivity_images < 1:
            raise CorpError(
                f"--sensitivity-images must be >= 1 with --allocation sensitivity, got {self.sensitivity_images}"
            )

    def prunes(self, part: str) -> bool:
        return part in self.target

    @property
    def heldout_images(self) -> int:
        """Calibration images the width planning needs kept out of the statistics (the sensitivity pass)."""
        return self.sensitivity_images if self.budget is not None and self.allocation == "sensitivity" else 0

    def part_sparsity(self, part: str) -> float | None:
        """The fraction of ``part`` removed in every block; 0 when not targeted; None under a budget (per block)."""
        if self.budget is not None:
            return None
        if part not in self.target:
            return 0.0
        override = getattr(self, f"{part}_sparsity")
        return self.sparsity if override is None else override

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "target": ",".join(self.target),
            "budget": None if self.budget is None else str(self.budget),
            "depth": ",".join(self.depth),
            "sparsity": None if self.budget is not None else self.sparsity,
            **{f"{p}_sparsity": self.part_sparsity(p) for p in PARTS},
        }


def parse_depth(depth: str | Iterable[str]) -> tuple[str, ...]:
    """``"attn,mlp"`` / ``("attn",)`` / ``""`` -> the ``MODULES`` it names, in ``MODULES`` order."""
    words = [w.strip() for w in (depth.split(",") if isinstance(depth, str) else depth) if w.strip()]
    bad = [w for w in words if w not in MODULES]
    if bad:
        raise CorpError(f"--depth takes a comma-separated combination of {', '.join(MODULES)}, got {depth!r}")
    return tuple(m for m in MODULES if m in words)


def parse_target(target: str | Iterable[str]) -> tuple[str, ...]:
    """``"mlp,qk,v"`` / ``"all"`` / ``("mlp", "qk")`` -> the ``PARTS`` it names, in ``PARTS`` order."""
    words = target.split(",") if isinstance(target, str) else list(target)
    parts: set[str] = set()
    for word in words:
        word = word.strip()
        if word not in PARTS and word not in TARGET_ALIASES:
            raise CorpError(
                f"--target must be a comma-separated combination of {', '.join(PARTS)} "
                f"(or {', '.join(TARGET_ALIASES)}), got {target!r}"
            )
        parts.update(TARGET_ALIASES.get(word, (word,)))
    if not parts:
        raise CorpError(f"--target names nothing to prune; use a combination of {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in parts)


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
