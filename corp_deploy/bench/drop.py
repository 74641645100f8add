"""The held-out drop: what a pruned or quantized model loses against its dense model on inputs calibration never read.

One number per candidate, with its name and direction explicit, so that "the fastest model within D" means one thing:

- ``cosine``: mean cosine between the candidate's and the dense model's output per input: a text encoder's sentence
  embedding (pooled as its sentence-transformers folder declares, else masked mean pooling), an image model's final
  features (a classifier's logits). Higher is better; drop = dense (1.0) - candidate.
- ``agreement``: share of inputs (a decoder: of next-token predictions) whose top-1 equals the dense model's; needs
  class logits (a classifier or a decoder). Higher is better; drop = dense (1.0) - candidate.
- ``perplexity``: a decoder's perplexity on held-out windows (``formats.evaluation.perplexity``'s protocol, from the
  logits).
  Lower is better; drop = candidate / dense - 1 (0.05: 5% higher).
- ``accuracy``: labelled top-1: a classifier's own logits, else a ridge probe (``accuracy.fit_probe``) fitted on the
  DENSE outputs of the even-numbered held-out inputs and scored on the odd ones for every model. Higher is better;
  drop = dense - candidate.

Every model is scored through a ``Runner`` (numpy in, numpy out), so an ONNX graph (FP32, INT8) is scored as deployed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from corp_deploy.base.errors import CorpError
from corp_deploy.bench.accuracy import cosine, fit_probe, topk_hits
from corp_deploy.exporters.compare import Feed, Runner

KINDS = ("image", "encoder", "decoder")


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    what: str

    def drop(self, dense: float, value: float) -> float:
        """How much worse ``value`` is than the dense model's: a difference, or a ratio minus one (perplexity)."""
        return dense - value if self.higher_is_better else value / dense - 1


METRICS = {
    m.name: m
    for m in (
        Metric("cosine", True, "mean output cosine to the dense model"),
        Metric("agreement", True, "top-1 agreement with the dense model"),
        Metric("perplexity", False, "perplexity (drop: ratio to dense - 1)"),
        Metric("accuracy", True, "labelled top-1"),
    )
}


def default_metric(kind: str) -> str:
    """The label-free metric each kind of model is judged by unless told otherwise."""
    return "perplexity" if kind == "decoder" else "cosine"


@dataclass
class HeldoutSet:
    """Inputs calibration never read, as the runners take them, and where they came from."""

    kind: str
    """``image``, ``encoder`` (a text encoder: outputs pooled per sequence) or ``decoder`` (outputs are logits)."""
    feeds: list[Feed]
    labels: np.ndarray | None = None
    """One class index per image or document, when the source is labelled (class folders)."""
    source: dict[str, Any] = field(default_factory=dict)
    """What they are: folder, how many, per class, why calibration never read them."""
    pooling: dict[str, Any] = field(default_factory=lambda: {"mode": "mean", "normalize": True})
    classifier: bool = False
    """Whether an image model's output is class logits (agreement and accuracy read them directly)."""

    def __len__(self) -> int:
        return sum(len(f["input_ids"]) if isinstance(f, dict) else len(f) for f in self.feeds)


def declared_pooling(folder: str | Path) -> dict[str, Any]:
    """A sentence-transformers folder's pooling, ``{"mode": mean | cls | max, "normalize": bool}``; mean pooling
    and normalisation (sentence-transformers' default) for a plain transformers folder."""
    modules_file = Path(folder, "modules.json")
    if not modules_file.is_file():
        return {"mode": "mean", "normalize": True}
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in json.loads(modules_file.read_text())}
    if "Pooling" not in kinds:
        return {"mode": "mean", "normalize": "Normalize" in kinds}
    config = json.loads(Path(folder, kinds["Pooling"]["path"], "config.json").read_text())
    keys = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}
    modes = [m for m, key in keys.items() if config.get(key)]
    if len(modes) != 1:
        raise CorpError(f"{folder}: pooling {config} is not one of mean, cls, max")
    return {"mode": modes[0], "normalize": "Normalize" in kinds}


def pool(hidden: Tensor, mask: Tensor, pooling: Mapping[str, Any]) -> Tensor:
    """Sentence embeddings from (batch, tokens, hidden) as sentence-transformers pools them (padding left out)."""
    m = mask[..., None].to(hidden.dtype)
    if pooling["mode"] == "mean":
        out = (hidden * m).sum(1) / m.sum(1).clamp_min(1)
    elif pooling["mode"] == "cls":
        out = hidden[:, 0]
    else:
        out = hidden.masked_fill(m == 0, float("-inf")).amax(1)
    return F.normalize(out, dim=-1) if pooling["normalize"] else out


@dataclass
class Outputs:
    """What the metrics read of one model over the whole held-out set."""

    rows: Tensor | None = None
    """Per input: pooled embedding, features or logits (images, encoders)."""
    nll: float = 0.0
    tokens: int = 0
    top1: Tensor | None = None
    """A decoder's next-token argmax at every predicted position, flattened."""


@torch.inference_mode()
def outputs(runner: Runner, held: HeldoutSet) -> Outputs:
    """Run ``runner`` over ``held`` and keep only what the metrics need (a decoder's logits are reduced per batch)."""
    rows, top1, nll, tokens = [], [], 0.0, 0
    for feed in held.feeds:
        out = torch.from_numpy(runner(feed))
        if held.kind == "image":
            rows.append(out.double())
        elif held.kind == "encoder":
            rows.append(pool(out.double(), torch.from_numpy(feed["attention_mask"]), held.pooling))
        else:
            ids = torch.from_numpy(feed["input_ids"])
            logits = out[:, :-1].double()
            nll += float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
            tokens += ids[:, 1:].numel()
            top1.append(logits.argmax(-1).flatten())
    if held.kind == "decoder":
        return Outputs(nll=nll, tokens=tokens, top1=torch.cat(top1))
    return Outputs(rows=torch.cat(rows))


def check_metric(metric: str, held: HeldoutSet) -> None:
    """One line when ``metric`` cannot be measured on ``held`` (before any model runs)."""
    if metric not in METRICS:
        raise CorpError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    if metric == "perplexity" and held.kind != "decoder":
        raise CorpError(f"perplexity is a decoder's metric; this {held.kind} model takes cosine, agreement or accuracy")
    if metric == "cosine" and held.kind == "decoder":
        raise CorpError("a decoder's outputs are next-token logits: use perplexity or agreement, not cosine")
    if metric == "agreement" and held.kind != "decoder" and not held.classifier:
        raise CorpError("agreement needs class logits; this model outputs features: use cosine, or accuracy (labels)")
    if metric == "accuracy":
        if held.labels is None:
            raise CorpError("accuracy needs labels: held-out inputs from class folders (an ImageFolder, text by class)")
        if held.kind == "decoder":
            raise CorpError("a decoder has no labelled accuracy here: use perplexity or agreement")
        if len(np.unique(held.labels)) < 2:
            raise CorpError("accuracy needs held-out inputs of at least two classes")


def value(metric: str, out: Outputs, dense: Outputs, held: HeldoutSet) -> float:
    """``metric`` of ``out`` (``dense`` is the reference the label-free metrics compare with)."""
    if metric == "perplexity":
        return float(np.exp(out.nll / out.tokens))
    if metric == "agreement":
        if held.kind == "decoder":
            return float((out.top1 == dense.top1).double().mean())
        return float((out.rows.argmax(-1) == dense.rows.argmax(-1)).double().mean())
    if metric == "cosine":
        return float(cosine(dense.rows, out.rows).mean())
    labels = torch.from_numpy(held.labels)
    if held.classifier:
        return topk_hits(out.rows, labels, 1) / len(labels)
    train, test = slice(0, None, 2), slice(1, None, 2)
    probe = fit_probe(dense.rows[train], labels[train], int(labels.max()) + 1)
    return topk_hits(probe(out.rows[test]), labels[test], 1) / len(labels[test])


def scores(
    runners: Mapping[str, Runner], reference: str, held: HeldoutSet, metrics: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per runner: each of ``metrics`` and its drop against the ``reference`` runner (the dense model), e.g.
    ``{"pruned": {"cosine": 0.97, "cosine_drop": 0.03}}``. The reference is run once; every runner sees the same
    inputs."""
    for metric in metrics:
        check_metric(metric, held)
    dense = outputs(runners[reference], held)
    results = {}
    for name, runner in runners.items():
        out = dense if name == reference else outputs(runner, held)
        row = {}
        for metric in metrics:
            row[metric] = value(metric, out, dense, held)
        results[name] = row
    for row in results.values():
        for metric in metrics:
            row[f"{metric}_drop"] = METRICS[metric].drop(results[reference][metric], row[metric])
    return results
