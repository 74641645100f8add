"""Which channels to keep: importance scores (the registered rankers) and how many each block keeps (the registered
selections), pure functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

import torch
from torch import Tensor

from corp_deploy.base.errors import CorpError
from corp_deploy.core import obs
from corp_deploy.core.stats import MlpStats


def nearest_steps(units: float, round_to: int) -> int:
    """``units / round_to`` rounded to the nearest integer, an exact half rounded UP (keep more).

    One rule for every width: Python's ``round`` sends exact halves to even (80 dims at 0.35 sparsity
    would keep 48 = 60%, at 0.65 float noise gives 3.5000000000000004 steps), so the quotient is taken in
    decimal from the shortest repr of ``units`` (the number as typed), where 6.5 is exactly 6.5.
    """
    return math.floor(Decimal(repr(units)) / round_to + Decimal("0.5"))


def kept_width(width: int, sparsity: float, round_to: int, what: str) -> int:
    """Channels kept out of ``width`` at ``sparsity``, rounded to a multiple of ``round_to``.

    Rounding goes to the nearest multiple, exact halves up (``nearest_steps``), so 50% of 64 stays 32, and
    never above ``width``; a result of zero is an error rather than a silent bump, since the user asked
    for that sparsity.
    """
    kept_units = Decimal(width) - Decimal(repr(sparsity)) * width  # (1 - s) * width, exact in decimal
    kept = min(nearest_steps(float(kept_units), round_to) * round_to, width)
    if kept <= 0:
        raise CorpError(
            f"sparsity {sparsity:g} leaves 0 of {width} {what} (with --round-to {round_to}); "
            "lower the sparsity or --round-to"
        )
    return kept


ChannelScores = Callable[[MlpStats, Tensor, float], Tensor]
"""(the sums CORP gathered of a Linear's input, its weight (out, in) in float64, the ridge) -> one score per input
channel (fc2: MLP channels; proj: V channels); higher is kept. Nested kept sets across widths come free: the top k."""
ValueScores = Callable[[MlpStats, Tensor, int, int, float], Tensor]
"""(proj's input sums, its weight, heads, query heads per K/V head, the ridge) -> (heads // group, head_dim)."""
QkScores = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(the logit energy, (heads, head_dim), the query and key weights as (heads, head_dim, in)) -> Q/K scores."""


@dataclass(frozen=True)
class Ranker:
    """One ranker's rule for each part. Only the MLP rule is its own; V and Q/K default to what every diagonal score
    does there, so a ranker that scores V or Q/K otherwise says so where it is registered, not in ``if`` branches."""

    channels: ChannelScores
    values: ValueScores | None = None
    """V scores; None: ``channels`` summed over the query heads that share a V head (they keep the same channels)."""
    qk: QkScores | None = None
    """Q/K scores; None: the paper's logit energy ``E[||q_j||^2 ||k_j||^2]``, the only attention score it defines."""
    refits: bool = False
    """Whether the order reads the error CORP's own compensation leaves, so it holds only under ``--compensation
    corp`` and a per-block selection (``PruneConfig`` refuses the rest)."""


RANKERS: dict[str, Ranker] = {}
"""Rankers by name (paper sec. 3.3, appendix E): a new one is a ``ChannelScores`` function and a ``register``.
``combined`` = energy x magnitude is the paper's default; ``variance`` (centred second moment) is VBP's criterion;
``obs`` is greedy Optimal Brain Surgeon on the error CORP's compensation leaves (Q/K keep the logit energy)."""


def register(
    name: str, values: ValueScores | None = None, qk: QkScores | None = None, refits: bool = False
) -> Callable[[ChannelScores], ChannelScores]:
    def add(channels: ChannelScores) -> ChannelScores:
        RANKERS[name] = Ranker(channels, values, qk, refits)
        return channels

    return add


def _magnitude(weight: Tensor) -> Tensor:
    return weight.double().norm(dim=0)


def _qk_magnitude(logit_energy: Tensor, wq: Tensor, wk: Tensor) -> Tensor:
    """||Wq_j|| ||Wk_j||: the data-free Q/K score."""
    return wq.double().norm(dim=-1) * wk.double().norm(dim=-1)


def _obs_values(s: MlpStats, weight: Tensor, heads: int, group: int, ridge: float) -> Tensor:
    """Greedy OBS with the query heads that share a V head removed together as one unit, one per K/V head per round
    (``obs.value_units``)."""
    units, owner = (t.to(weight.device) for t in obs.value_units(heads, group, weight.shape[1] // heads))
    order = obs.removal_order(s.mean(), s.second_moment(), weight, ridge, units, owner)[0]
    return obs.rank_scores(order).view(heads // group, -1)


@register("energy")
def energy(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """E[x_i^2]."""
    return s.second_moment().diagonal()


@register("magnitude", qk=_qk_magnitude)
def magnitude(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """||W[:, i]||_2: data-free (and so are its Q/K scores)."""
    return _magnitude(weight)


@register("combined")
def combined(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """E[x_i^2] ||W[:, i]||_2: the paper's default."""
    return energy(s, weight, ridge) * _magnitude(weight)


@register("active")
def active(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """P(|x_i| > eps)."""
    return s.active / s.count


@register("variance")
def variance(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """E[x_i^2] - E[x_i]^2 (VBP: a channel's mean is what mean-shift compensation restores, so only its spread is
    lost)."""
    return (energy(s, weight, ridge) - s.mean().double().square()).clamp_min(0)


@register("obs", values=_obs_values, refits=True)
def obs_order(s: MlpStats, weight: Tensor, ridge: float) -> Tensor:
    """The step at which greedy OBS removes each channel (``obs.removal_order`` damped by ``ridge``), so the top k
    are its kept set at width k, and the sets at all widths are nested as every ranker's."""
    return obs.rank_scores(obs.removal_order(s.mean(), s.second_moment(), weight, ridge)[0])


def ranker_named(name: str) -> Ranker:
    """``RANKERS[name]``, or one line naming the choices."""
    if name not in RANKERS:
        raise CorpError(f"unknown ranker {name!r}; choose one of {', '.join(RANKERS)}")
    return RANKERS[name]


def channel_scores(ranker: str, s: MlpStats, weight: Tensor, ridge: float = 0.0) -> Tensor:
    """``ranker``'s scores of a Linear's input channels."""
    return ranker_named(ranker).channels(s, weight, ridge)


def value_scores(ranker: str, s: MlpStats, weight: Tensor, heads: int, group: int, ridge: float = 0.0) -> Tensor:
    """V channel scores per K/V head, (heads // group, head_dim), from proj's input sums and weight: the ranker's
    own V rule, else its channel scores summed over the ``group`` query heads that share a V head."""
    rule = ranker_named(ranker)
    if rule.values is not None:
        return rule.values(s, weight, heads, group, ridge)
    return rule.channels(s, weight, ridge).view(heads // group, group, -1).sum(1)


def qk_scores(ranker: str, logit_energy: Tensor, wq: Tensor, wk: Tensor) -> Tensor:
    """Importance of each Q/K dimension per head, (heads, head_dim); higher is kept: the ranker's own Q/K rule, else
    the paper's logit energy. ``wq``/``wk`` are the query/key weights as (heads, head_dim, in_features)."""
    rule = ranker_named(ranker)
    return logit_energy if rule.qk is None else rule.qk(logit_energy, wq, wk)


def split_top(scores: Tensor, kept: int) -> tuple[Tensor, Tensor]:
    """Indices (kept, pruned), each in ascending order, of the ``kept`` highest scores (last dim).

    A stable sort makes ties deterministic, so the same statistics always give the same model.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :kept].sort(dim=-1).values, order[..., kept:].sort(dim=-1).values


def global_widths(scores: list[Tensor], sparsity: float, round_to: int) -> list[int]:
    """VBP's network-wide selection: one threshold over every block's channel scores removes ``sparsity`` of all
    channels; each block keeps the channels above it, rounded to the nearest multiple of ``round_to``
    (``nearest_steps``), at least ``round_to`` and at most its width, so no block is emptied.

    The threshold is the score of the last channel kept in a stable descending sort of all scores
    (ties broken by block, then channel order), so the counts are deterministic.
    """
    flat = torch.cat([s.double().flatten() for s in scores])
    keep_total = max(1, int(nearest_steps(float((1 - Decimal(repr(sparsity))) * flat.numel()), 1)))
    order = torch.sort(flat, descending=True, stable=True).indices[:keep_total]
    owner = torch.repeat_interleave(torch.arange(len(scores)), torch.tensor([s.numel() for s in scores]))
    counts = torch.bincount(owner[order], minlength=len(scores)).tolist()
    return [min(max(nearest_steps(n, round_to), 1) * round_to, s.numel()) for n, s in zip(counts, scores, strict=True)]


Counts = Callable[[list[int], float, int, list[str], list[Tensor] | None], list[int]]
"""(every block's full width, the sparsity, round_to, what each block's channels are for messages, every block's
channel scores when the selection is ``scored``) -> every block's kept width."""


@dataclass(frozen=True)
class Selection:
    """How many MLP channels each block keeps at a sparsity (Q/K and V keep the same fraction in every block)."""

    counts: Counts
    scored: bool
    """Whether the counts read every block's channel scores: the widths then wait for the calibration statistics."""


SELECTIONS: dict[str, Selection] = {}
"""Selections by name: ``per-layer`` (the same fraction in every block) and ``global`` (VBP's one threshold over all
blocks' scores). A new selection is a ``Counts`` function and a ``@selection(name)``; ``--selection`` offers each."""


def selection(name: str, scored: bool = False) -> Callable[[Counts], Counts]:
    def add(counts: Counts) -> Counts:
        SELECTIONS[name] = Selection(counts, scored)
        return counts

    return add


@selection("per-layer")
def per_layer(widths: list[int], sparsity: float, round_to: int, what: list[str], scores: None = None) -> list[int]:
    """``kept_width`` of every block: the same fraction everywhere."""
    return [kept_width(w, sparsity, round_to, label) for w, label in zip(widths, what, strict=True)]


@selection("global", scored=True)
def global_selection(
    widths: list[int], sparsity: float, round_to: int, what: list[str], scores: list[Tensor]
) -> list[int]:
    """``global_widths``: one threshold over every block's channel scores."""
    return global_widths(scores, sparsity, round_to)
