"""How far each block's local error travels: the scale that puts every block's errors on one axis.

A relative reconstruction error of 1% in block 2's MLP and 1% in block 11's Q/K do not cost the same:
what matters is how much each moves the model's final features. For every targeted (block, part),
prune that part ALONE at a reference width (compensated, from the same statistics), run held-out
images through the rest of the network, and divide the relative error of the final features
(pre-logits) by the part's local error. ``allocation.allocate`` multiplies local error curves by
these weights. A replaceable module (``--depth``) is probed by its replacement itself, so its weighted error is
exactly the measured end-to-end error of that replacement: the local fit error alone picks the wrong blocks.
No labels are used; the inputs are calibration images (or sequences) kept out of the statistics.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from statistics import median
from typing import Any

import torch
from torch import Tensor, nn

from corp_deploy.base.errors import CorpError
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.pruner import Timer, prune_block
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.families import adapter_for
from corp_deploy.formats.calibration import Heldout
from corp_deploy.plan.allocation import MODULE_KEYS, Key, candidate_widths

REFERENCE_SPARSITY = 0.5
"""Each part is probed at its uniform-50% width: near the widths a 0.4-0.7 MACs budget picks."""
NEGLIGIBLE = 1e-9
"""A local error below this (fully redundant channels) gives no usable ratio: the part's median is used."""


def split_heldout(batches: Iterable[tuple[Tensor, int]], n: int) -> tuple[Tensor, Iterator[tuple[Tensor, int]]]:
    """The first ``n`` images of a calibration stream, and the rest of the stream (for the statistics).

    Reads only as many batches as it needs; a batch that straddles the split is cut, and unreadable
    counts of the batches read stay with the calibration stream so they are still reported.
    """
    it = iter(batches)
    held: list[Tensor] = []
    rest: list[tuple[Tensor, int]] = []
    have = 0
    for images, skipped in it:
        take = images[: n - have]
        held.append(take)
        rest.append((images[take.shape[0] :], skipped))
        have += take.shape[0]
        if have >= n:
            break
    images = torch.cat(held) if held else torch.empty(0)
    return images, itertools.chain(rest, it)


def hold_out(
    batches: Iterable[tuple[Tensor, int]], n: int, total: int | None
) -> tuple[Heldout, Iterable[tuple[Tensor, int]], int | None]:
    """The first ``n`` images of the stream (when no ``Heldout`` was drawn across the sample), the stream without them,
    and its new size: the sensitivity pass's inputs, kept out of the statistics."""
    if total is not None and total <= n:
        raise CorpError(
            f"--allocation sensitivity holds out {n} calibration images (--sensitivity-images) and "
            f"only {total} are given; pass more images or lower --sensitivity-images"
        )
    images, rest = split_heldout(batches, n)
    if images.shape[0] == 0:
        raise CorpError("no calibration images to hold out for --allocation sensitivity; check the calibration data")
    return Heldout(images, {"first images of the stream": images.shape[0]}), rest, total and total - images.shape[0]


def _relative(x: Tensor, ref: Tensor) -> float:
    return float((x - ref).double().square().sum() / ref.double().square().sum())


@torch.inference_mode()
def measure(model: nn.Module, stats: CalibrationStats, config: PruneConfig, heldout: Any) -> dict[Key, float]:
    """Sensitivity (final-feature relative error / local relative error) of every targeted (block, part).

    ``model`` is the dense model (left unchanged); ``heldout`` one batch of held-out inputs (images; token ids
    with their mask, whose padding the features leave out).
    """
    model.eval()
    adapter = adapter_for(model)
    inputs, call, dense = adapter.block_inputs(model, heldout)
    parts = config.target
    out: dict[Key, float] = {}
    blocks = adapter.blocks(model)

    def weight(i: int, trial: nn.Module, local: float) -> float:
        """Final-feature error with block i replaced by ``trial``, over ``local``."""
        block, blocks[i] = blocks[i], trial
        try:
            final = _relative(adapter.features_from(model, i, inputs[i], call, heldout), dense)
        finally:
            blocks[i] = block
        return final / local if local > NEGLIGIBLE else float("nan")

    for i, block in enumerate(blocks):
        qk, v = adapter.head_widths(block)
        full = {"mlp": adapter.mlp_out(block).in_features, "qk": qk, "v": v}
        probes = {}  # (block, part) -> the widths that prune it alone
        for part in parts:
            reference = (1 - REFERENCE_SPARSITY) * full[part]
            kept = min(candidate_widths(full[part], config.round_to), key=lambda w: abs(w - reference))
            if kept == full[part]:  # nothing can be removed: the weight never matters
                out[(i, part)] = 1.0
            else:
                probes[(i, part)] = Widths(**{part: kept})
        for module in config.depth:  # the whole module replaced, as a plan would: its weighted error is end to end
            probes[(i, MODULE_KEYS[module])] = Widths(replace=(module,))
        for key, widths in probes.items():
            trial = copy.deepcopy(block)
            entry = prune_block(adapter, trial, i, stats, widths, config, Timer())
            replaced = entry.get("replaced", {})
            local = replaced[widths.replace[0]]["rel_error"] if replaced else entry[key[1]]["rel_error"]["corp"]
            out[key] = weight(i, trial, local)
    for part in (*parts, *(MODULE_KEYS[m] for m in config.depth)):  # redundant parts: the typical weight of their kind
        known = [v for (_, p), v in out.items() if p == part and v == v]
        for key, v in out.items():
            if key[1] == part and v != v:
                out[key] = median(known) if known else 1.0
    return out
