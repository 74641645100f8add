"""What to prune and how: the parts, the budget, the kept widths of a block, and ``PruneConfig``, each checked once,
on its own (against a model: ``api.check``).

The one vocabulary of the code, the CLI and ``corp.json``: a saved report records ``PruneConfig.to_dict()``, so its
field names are the artifact's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from corp_deploy.base.errors import CorpError
from corp_deploy.core import compensation as C
from corp_deploy.core.fit import COMPENSATIONS
from corp_deploy.core.ranking import RANKERS, SELECTIONS

PARTS = ("mlp", "qk", "v")
"""Prunable structures: MLP hidden channels, attention Q/K dims per head, attention V channels per head.
The one vocabulary of the code, the CLI (``--target mlp,qk,v``) and ``corp.json`` (block report keys)."""
PART_NAMES = {"mlp": "MLP channels", "qk": "Q/K dims per head", "v": "V channels per head"}
DEFAULT_TARGET = ("mlp", "qk")
"""What a config prunes when its target is left out (and no latency budget asks for V too)."""
TARGET_ALIASES = {"attn": ("qk",), "both": ("mlp", "qk"), "joint": ("mlp", "qk"), "all": PARTS}
"""Older and shorter spellings of ``--target``: ``attn`` and ``both`` keep their pre-V meanings."""
LAYOUTS = ("auto", "standard")
"""The folder a text model's plan may lead to: whichever its widths allow (``families.hf.folder``: the family's own
format when they are uniform and attention keeps the config's head width, else remote code), or the family's own
format only (uniform widths of the parts its config expresses)."""
BUDGET_KINDS = ("macs", "latency")
"""What a budget bounds: the closed-form MACs, or the time predicted by a latency table measured on a backend."""
CRITERIA = ("sensitivity", "local")
"""How errors of different blocks are put on one scale: measured end-to-end sensitivity, or none."""
MODULES = ("attn", "mlp")
"""What ``--depth`` may replace whole: a block's attention or its MLP (``families.layers.AffineBranch``)."""
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
    parsed once into a tuple in ``PARTS`` order; left out (None) it is ``DEFAULT_TARGET``, every part under a latency
    budget (V channels are time too), which ``api.for_model`` narrows to what the model's family prunes. ``budget``
    (``"macs=F"`` or a ``Budget``) is parsed once into a ``Budget``. A budget replaces the uniform sparsity: every
    block's widths of every targeted part are chosen by ``allocation`` to keep fraction F of the dense MACs (the
    per-part sparsities must stay unset).
    ``allocation`` picks how block errors are compared: ``sensitivity`` weights them by their measured effect on
    the final features, from ``sensitivity_images`` held-out calibration images; ``local`` does not.
    ``selection="global"`` keeps VBP's network-wide choice of MLP channels: one score threshold across all
    blocks removes ``mlp_sparsity`` of all MLP channels (each block's count rounded to ``round_to``).
    """

    sparsity: float = 0.5
    mlp_sparsity: float | None = None
    qk_sparsity: float | None = None
    v_sparsity: float | None = None
    target: tuple[str, ...] | str | None = None
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
    chose_target: bool = field(init=False, repr=False, compare=False)
    """Whether ``target`` was given (not recorded: a saved config's target is the one pruned). ``replace`` passes the
    target on, so a copy has chosen it: narrow a default (``api.for_model``) before copying."""

    def __post_init__(self) -> None:
        if isinstance(self.budget, str):
            object.__setattr__(self, "budget", parse_budget(self.budget))
        object.__setattr__(self, "chose_target", self.target is not None)
        if self.target is None:
            latency = self.budget is not None and self.budget.kind == "latency"
            object.__setattr__(self, "target", PARTS if latency else DEFAULT_TARGET)
        object.__setattr__(self, "target", parse_target(self.target))
        object.__setattr__(self, "depth", parse_depth(self.depth))
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
        if SELECTIONS[self.selection].scored and not self.prunes("mlp"):
            raise CorpError(f"--selection {self.selection} chooses MLP channels across blocks; add mlp to --target")
        refits = RANKERS[self.ranker].refits and (self.prunes("mlp") or self.prunes("v"))
        if refits and (self.compensation != "corp" or SELECTIONS[self.selection].scored):
            raise CorpError(
                f"--ranker {self.ranker} orders each block's channels by the error CORP's compensation leaves: "
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
        if SELECTIONS[self.selection].scored:
            raise CorpError(f"--layout standard keeps every layer's MLP width equal; drop --selection {self.selection}")

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
        if SELECTIONS[self.selection].scored:
            raise CorpError(
                f"--budget allocates every block's widths itself; drop --selection {self.selection} or --budget"
            )
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
        return {k: v for k, v in asdict(self).items() if k != "chose_target"} | {
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
