"""Which channels to keep: importance scores and the kept-width rule (pure functions)."""

from __future__ import annotations

import torch
from torch import Tensor

from corp_deploy.errors import CorpError

RANKERS = ("energy", "magnitude", "combined", "active")
"""MLP rankers (paper sec. 3.3, appendix E). ``combined`` = energy x magnitude is the paper's default."""


def kept_width(width: int, sparsity: float, round_to: int, what: str) -> int:
    """Channels kept out of ``width`` at ``sparsity``, rounded to a multiple of ``round_to``.

    Rounding goes to the nearest multiple (so 50% of 64 stays 32) and never above ``width``;
    a result of zero is an error rather than a silent bump, since the user asked for that sparsity.
    """
    kept = round((1.0 - sparsity) * width / round_to) * round_to
    kept = min(kept, width)
    if kept <= 0:
        raise CorpError(
            f"sparsity {sparsity:g} leaves 0 of {width} {what} (with --round-to {round_to}); "
            "lower the sparsity or --round-to"
        )
    return kept


def mlp_scores(ranker: str, energy: Tensor, active_rate: Tensor, fc2_weight: Tensor) -> Tensor:
    """Importance of each hidden channel; higher is kept.

    energy = E[x_i^2], active_rate = P(|x_i| > eps), magnitude = ||W2[:, i]||_2.
    """
    magnitude = fc2_weight.double().norm(dim=0)
    if ranker == "energy":
        return energy
    if ranker == "magnitude":
        return magnitude
    if ranker == "combined":
        return energy * magnitude
    if ranker == "active":
        return active_rate
    raise CorpError(f"unknown ranker {ranker!r}; choose one of {', '.join(RANKERS)}")


def attn_scores(ranker: str, logit_energy: Tensor, wq: Tensor, wk: Tensor) -> Tensor:
    """Importance of each Q/K dimension per head, (heads, head_dim); higher is kept.

    Every data-driven ranker uses the paper's logit energy ``E[||q_j||^2 ||k_j||^2]``, the only
    attention score the paper defines; ``magnitude`` is the data-free ``||Wq_j|| * ||Wk_j||``.
    ``wq``/``wk`` are the query/key weights as (heads, head_dim, in_features).
    """
    if ranker == "magnitude":
        return wq.double().norm(dim=-1) * wk.double().norm(dim=-1)
    if ranker not in RANKERS:
        raise CorpError(f"unknown ranker {ranker!r}; choose one of {', '.join(RANKERS)}")
    return logit_energy


def split_top(scores: Tensor, kept: int) -> tuple[Tensor, Tensor]:
    """Indices (kept, pruned), each in ascending order, of the ``kept`` highest scores (last dim).

    A stable sort makes ties deterministic, so the same statistics always give the same model.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :kept].sort(dim=-1).values, order[..., kept:].sort(dim=-1).values
