"""Accuracy of a pruned model against its dense original, on every backend that can run.

Three pieces: pure statistics on output tensors (top-k, agreement, KL, cosine); a linear probe for
backbones without a classifier (closed-form ridge on the DENSE model's features, applied unchanged
to every pruned runner); and ``evaluate``, one pass over the images in which every runner sees
every batch, so each image is decoded once and all models get identical inputs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_file
from corp_deploy.base.tables import text_table
from corp_deploy.bench.backends import CUDA_DTYPES, Backend, all_backends
from corp_deploy.exporters.compare import Runner

Head = Callable[[Tensor], Tensor]
"""Outputs -> class logits: the identity for a classifier, a ``Probe`` for a backbone."""

PROBE_RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)

# ------------------------------------------------------------------------------ statistics


def topk_hits(logits: Tensor, labels: Tensor, k: int) -> int:
    """How many rows have their label among the ``k`` largest logits."""
    k = min(k, logits.shape[-1])
    return int((logits.topk(k, dim=-1).indices == labels[:, None]).any(-1).sum())


def kl_divergence(reference: Tensor, logits: Tensor) -> Tensor:
    """Per-row KL(softmax(reference) || softmax(logits)) in nats: what the pruned model loses."""
    ref = reference.double().log_softmax(-1)
    return (ref.exp() * (ref - logits.double().log_softmax(-1))).sum(-1)


def cosine(reference: Tensor, outputs: Tensor) -> Tensor:
    """Per-row cosine similarity, in float64 so that 0.99999 is still resolvable."""
    return F.cosine_similarity(outputs.double(), reference.double(), dim=-1)


# ----------------------------------------------------------------------------------- probe


@dataclass
class Probe:
    """A linear classifier on standardized features: ``((x - mean) / std) @ weight + bias``."""

    mean: Tensor
    std: Tensor
    weight: Tensor
    bias: Tensor
    ridge: float

    def __call__(self, features: Tensor) -> Tensor:
        return ((features.double() - self.mean) / self.std) @ self.weight + self.bias


def _ridge_fit(x: Tensor, y: Tensor, ridge: float) -> tuple[Tensor, Tensor]:
    """Least squares of centred one-hot targets on centred features, damped relative to the scale.

    The damping is ``ridge * mean(diag(gram))`` (as CORP's own ridge), which keeps the system
    positive definite, so a Cholesky solve is all it takes.
    """
    xm, ym = x.mean(0), y.mean(0)
    gram = (x - xm).T @ (x - xm)
    damping = ridge * gram.diagonal().mean().clamp_min(1e-12) * torch.eye(len(gram), dtype=gram.dtype)
    weight = torch.cholesky_solve((x - xm).T @ (y - ym), torch.linalg.cholesky(gram + damping))
    return weight, ym - xm @ weight


def fit_probe(
    features: Tensor, labels: Tensor, num_classes: int, ridges: Iterable[float] = PROBE_RIDGES, seed: int = 0
) -> Probe:
    """Ridge classifier in closed form (no SGD, no tuning loop to babysit).

    The ridge is chosen on a seeded held-out fifth of the training features, then the probe is
    refit on all of them. Fit it on the dense model only: the point is to measure how far the
    pruned features drift from the space the probe was trained in.
    """
    x = features.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    x = (x - mean) / std
    y = F.one_hot(labels, num_classes).double()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    val, train = order[: len(x) // 5], order[len(x) // 5 :]

    def held_out_accuracy(ridge: float) -> float:
        w, b = _ridge_fit(x[train], y[train], ridge)
        return topk_hits(x[val] @ w + b, labels[val], 1) / max(len(val), 1)

    best = max(ridges, key=held_out_accuracy)
    weight, bias = _ridge_fit(x, y, best)
    return Probe(mean, std, weight, bias, best)


# -------------------------------------------------------------------------------- evaluate


@dataclass
class Tally:
    """Running sums for one runner against the reference: no outputs are kept in memory."""

    images: int = 0
    top1: int = 0
    top5: int = 0
    agree: int = 0
    kl: float = 0.0
    cos: float = 0.0
    cos_min: float = 1.0
    err: float = 0.0
    ref: float = 0.0
    labelled: bool = False
    has_logits: bool = False

    def add(self, out: Tensor, reference: Tensor, labels: Tensor | None, head: Head | None) -> None:
        c = cosine(reference, out)
        self.images += len(out)
        self.cos += float(c.sum())
        self.cos_min = min(self.cos_min, float(c.min()))
        self.err += float((out.double() - reference.double()).square().sum())
        self.ref += float(reference.double().square().sum())
        if head is None:
            return
        logits, ref_logits = head(out), head(reference)
        self.has_logits = True
        self.agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        self.kl += float(kl_divergence(ref_logits, logits).sum())
        if labels is not None:
            self.labelled = True
            self.top1 += topk_hits(logits, labels, 1)
            self.top5 += topk_hits(logits, labels, 5)

    def result(self) -> dict[str, float]:
        n = max(self.images, 1)
        out = {
            "images": self.images,
            "cosine_mean": self.cos / n,
            "cosine_min": self.cos_min,
            "rel_error": (self.err / max(self.ref, 1e-30)) ** 0.5,
        }
        if self.has_logits:
            out |= {"top1_agreement": self.agree / n, "kl": self.kl / n}
        if self.labelled:
            out |= {"top1": self.top1 / n, "top5": self.top5 / n}
        return out


@dataclass
class Evaluation:
    """Per-runner results; ``reference`` names the dense runner the others are compared with."""

    reference: str
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: int = 0


def evaluate(
    runners: Mapping[str, Runner],
    reference: str,
    batches: Iterable[tuple[Tensor, Tensor | None, int]],
    head: Head | None = None,
    progress: Callable[[int], None] = lambda n: None,
) -> Evaluation:
    """Run every runner on every batch of ``(images, labels or None, skipped)``; tally against ``reference``.

    ``head`` turns outputs into class logits (accuracy, agreement, KL); without one (a backbone
    and no probe) only the cosine and relative error of the outputs are measured.
    """
    tallies = {name: Tally() for name in runners}
    skipped = 0
    for images, labels, bad in batches:
        skipped += bad
        if len(images) == 0:
            continue
        x = images.float().numpy()
        ref = torch.from_numpy(runners[reference](x))
        for name, run in runners.items():
            out = ref if name == reference else torch.from_numpy(run(x))
            tallies[name].add(out, ref, labels, head)
        progress(len(images))
    return Evaluation(reference, {name: t.result() for name, t in tallies.items()}, skipped)


def features(runner: Runner, batches: Iterable[tuple[Tensor, Tensor, int]]) -> tuple[Tensor, Tensor]:
    """All outputs of ``runner`` and their labels (for fitting a probe)."""
    outs, labels = [], []
    for images, y, _ in batches:
        if len(images):
            outs.append(torch.from_numpy(runner(images.float().numpy())))
            labels.append(y)
    return torch.cat(outs), torch.cat(labels)


def format_evaluation(evaluation: Evaluation, header: str) -> str:
    """One line per runner: accuracy if labelled, then agreement, KL and cosine against the dense reference."""
    columns = (
        ("top1", "top-1", "{:.2%}"),
        ("top5", "top-5", "{:.2%}"),
        ("top1_agreement", "agree", "{:.2%}"),
        ("kl", "KL", "{:.4f}"),
        ("cosine_mean", "cos mean", "{:.5f}"),
        ("cosine_min", "cos min", "{:.5f}"),
        ("rel_error", "rel err", "{:.4f}"),
    )
    present = [c for c in columns if any(c[0] in r for r in evaluation.results.values())]
    rows = [("model / backend", *(c[1] for c in present))]
    for name, r in evaluation.results.items():
        label = f"{name} (reference)" if name == evaluation.reference else name
        rows.append((label, *(c[2].format(r[c[0]]) if c[0] in r else "-" for c in present)))
    return f"{header}\n{text_table(rows)}"


# -------------------------------------------------------------------- runners of a run folder

EVAL_AUTO = ("torch-cpu-fp32", "ort-cpu-fp32", "ort-cpu-int8", "tensorrt-fp32", "tensorrt-fp16", "tensorrt-int8")
"""What ``eval --backends auto`` tries: the PyTorch model and each precision's graph once (bench's names; what the
run folder holds and this machine can run decides)."""


def eval_backends(backends: str) -> list[Backend]:
    """``--backends`` in bench's vocabulary (``corp_deploy.bench.backends``); a compiled or graph-replayed variant
    computes its eager model's outputs, so only eager backends are evaluated."""
    evaluable = {n: b for n, b in all_backends().items() if b.compiler is None and not b.graphed}
    names = EVAL_AUTO if backends == "auto" else tuple(b.strip() for b in backends.split(",") if b.strip())
    unknown = [n for n in names if n not in evaluable]
    if unknown or not names:
        named = ", ".join(unknown) or repr(backends)
        raise CorpError(f"unknown backend {named} for eval; choose auto or from {', '.join(evaluable)}")
    return [evaluable[n] for n in names]


DenseLoader = Callable[[dict[str, Any]], tuple[torch.nn.Module | None, str]]
"""An artifact's ``corp.json`` -> (its dense original with real weights, "") or (None, why not).

Rebuilding a dense timm model with its weights (hub, checkpoint) is the caller's business: the CLI
passes ``corp_deploy.formats.sources.dense_original``."""


def graph_name(which: str, backend: Backend) -> str:
    """The run folder's file ``backend`` runs for model ``which``: ``pruned.onnx``, ``dense.int8.onnx``,
    ``pruned.fp16.plan``, ``dense.xml``... (its export target's ``file_name``)."""
    return backend.target.file_name(which, backend.precision)


def _graph_runner(backend: Backend, path: Path, threads: int | None) -> tuple[Runner | None, str]:
    """A runner of the export target's file at ``path`` on ``backend``, or (None, why it cannot run here)."""
    from corp_deploy.exporters.runners import OrtRunner

    if not path.is_file():
        return None, f"no {path.name} in {path.parent}"
    if why := backend.ready(path):
        return None, why
    if backend.runtime == "onnxruntime":  # on the backend's device; the target's runner is the CPU's
        return OrtRunner(path, "gpu" if backend.device == "cuda" else "cpu", threads), ""
    return backend.target.runner(path, threads), ""


def run_runners(
    root: str | Path, backends: str = "auto", dense: DenseLoader | None = None, threads: int | None = None
) -> tuple[dict[str, Runner], str, dict[str, str], torch.nn.Module]:
    """Every (model, backend) of a prune-export folder or prune artifact that can run here.

    Returns the runners by name (``"pruned ort-cpu-int8"``: the model and bench's backend name), the dense
    reference's name (PyTorch when ``dense`` gives the dense weights, else dense.onnx), ``{skipped: why}`` and the
    pruned module.
    """
    from corp_deploy.exporters.runners import TorchRunner
    from corp_deploy.formats.artifact import META_FILE, load_pruned, read_meta

    root = Path(root)
    artifact = root / "pruned" if (root / "pruned" / META_FILE).is_file() else root
    if not (artifact / META_FILE).is_file():
        raise CorpError(f"{root} is neither a prune-export folder nor a prune artifact (no {META_FILE})")
    wanted = eval_backends(backends)
    pruned = load_pruned(artifact)
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    dense_model, dense_why = None, "no way to load the dense weights was given"
    if dense is not None and any(b.runtime == "torch" for b in wanted):
        dense_model, dense_why = dense(read_meta(artifact))
    for backend in wanted:
        if backend.device == "cuda" and not torch.cuda.is_available():
            for which in ("dense", "pruned"):
                skipped[f"{which} {backend.name}"] = "no CUDA GPU visible"
            continue
        if backend.runtime == "torch":
            dtype = CUDA_DTYPES[backend.precision]  # each runner moves and casts its own copy
            if dense_model is None:
                skipped[f"dense {backend.name}"] = dense_why
            else:
                runners[f"dense {backend.name}"] = TorchRunner(copy.deepcopy(dense_model).eval(), backend.device, dtype)
            runners[f"pruned {backend.name}"] = TorchRunner(copy.deepcopy(pruned), backend.device, dtype)
            continue
        for which in ("dense", "pruned"):
            runner, why = _graph_runner(backend, root / graph_name(which, backend), threads)
            if runner is None:
                skipped[f"{which} {backend.name}"] = why
            else:
                runners[f"{which} {backend.name}"] = runner
    dense_names = [n for n in runners if n.startswith("dense ")]
    if not dense_names:
        raise CorpError(
            f"no dense reference for {root}: its dense weights cannot be rebuilt and it has no dense.onnx; "
            "pass --checkpoint with the original weights"
        )
    if backends != "auto":
        for name, why in skipped.items():
            if name.startswith("pruned"):
                raise CorpError(f"{name} cannot run here: {why}")
    return runners, dense_names[0], skipped, pruned


def image_batches(
    folder: str | Path, labelled: bool, data_config: dict[str, Any], num: int, batch_size: int, seed: int, workers: int
) -> tuple[Iterable[tuple[Tensor, Tensor | None, int]], int]:
    """A seeded subset of ``num`` images as ``(images, labels or None, skipped)`` batches, and its size."""
    from corp_deploy.formats import data

    if labelled:
        files, labels, _ = data.image_folder(folder)
        pick = data.sample(list(range(len(files))), num, seed)
        loader = data.labelled_batches(
            [files[i] for i in pick], [labels[i] for i in pick], data_config, batch_size, workers
        )
        return loader, len(pick)
    files = data.sample(data.list_images(folder), num, seed)
    loader = data.folder_batches(files, data_config, batch_size, workers)
    return ((x, None, skipped) for x, skipped in loader), len(files)


def evaluate_run(
    root: str | Path,
    data_dir: str | Path | None = None,
    images: str | Path | None = None,
    probe_train: str | Path | None = None,
    num: int = 10**9,
    batch_size: int = 32,
    backends: str = "auto",
    dense: DenseLoader | None = None,
    seed: int = 0,
    workers: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Dense vs pruned on every runnable backend of a run folder: the record ``corp-deploy eval`` prints and keeps.

    ``data_dir`` is a labelled ImageFolder (top-1/top-5), ``images`` a folder of unlabelled images
    (agreement, KL, cosine against the dense model). A backbone without a classifier needs
    ``probe_train``, a labelled ImageFolder on whose DENSE features a linear probe is fitted.
    ``dense`` loads the dense original for the PyTorch reference (without it: dense.onnx).
    """
    from tqdm import tqdm

    from corp_deploy.formats.data import data_config

    if (data_dir is None) == (images is None):
        raise CorpError("pass exactly one of --data-dir (labelled ImageFolder) or --images (unlabelled folder)")
    if num < 1 or batch_size < 1:
        raise CorpError("--num and --batch-size must be >= 1")
    runners, reference, skipped, pruned = run_runners(root, backends, dense)
    cfg = data_config(pruned)
    classifier = getattr(pruned, "num_classes", 0) > 0
    head: Head | None = (lambda t: t) if classifier else None
    probe_record = None
    if probe_train is not None:
        train, total = image_batches(probe_train, True, cfg, 10**9, batch_size, seed, workers)
        bar = tqdm(train, total=-(-total // batch_size), unit="batch", desc="probe features", disable=not progress)
        feats, labels = features(runners[reference], bar)
        probe = fit_probe(feats, labels, int(labels.max()) + 1, seed=seed)
        head = probe
        probe_record = {"train_dir": str(probe_train), "train_images": len(feats), "ridge": probe.ridge}
    elif data_dir is not None and not classifier:
        raise CorpError(
            "this model is a backbone (no classifier head): pass --probe-train DIR, a labelled ImageFolder, "
            "to fit a linear probe on the dense model's features"
        )
    batches, total = image_batches(data_dir or images, data_dir is not None, cfg, num, batch_size, seed, workers)
    with tqdm(total=total, unit="img", desc="eval", disable=not progress) as bar:
        result = evaluate(runners, reference, batches, head, bar.update)
    return {
        "data": str(data_dir or images),
        "labelled": data_dir is not None,
        "images": total - result.skipped,  # scored: an unreadable file is counted apart, never as scored
        "skipped_files": result.skipped,
        "probe": probe_record,
        "reference": result.reference,
        "results": result.results,
        "skipped_backends": skipped,
        "input_size": list(cfg["input_size"]),
    }


def append_evaluation(root: str | Path, record: dict[str, Any]) -> Path:
    """Append ``record`` to ``root/eval.json``, the run folder's list of evaluations (oldest first); its path."""
    log = Path(root) / "eval.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    with atomic_file(log, overwrite=True) as tmp:
        tmp.write_text(json.dumps([*history, record], indent=2) + "\n")
    return log


# ------------------------------------------------------------------------ linear-probe task


def load_labelled(folder: str | Path, data_config: dict[str, Any], batch_size: int = 64) -> tuple[Tensor, Tensor]:
    """Every image of a labelled ImageFolder, preprocessed, in memory (for studies that score many models)."""
    batches, _ = image_batches(folder, True, data_config, 10**9, batch_size, seed=0, workers=0)
    images, labels = zip(*((x, y) for x, y, _ in batches if len(x)), strict=True)
    return torch.cat(images), torch.cat(labels)


def outputs(runner: Runner, images: Tensor, batch_size: int = 32) -> Tensor:
    return torch.cat(
        [torch.from_numpy(runner(images[i : i + batch_size].numpy())) for i in range(0, len(images), batch_size)]
    )


@dataclass
class ProbeTask:
    """A frozen linear-probe benchmark: fit once on the dense model, then score any runner of it.

    Holds the test images in memory so that a study scoring dozens of pruned variants decodes
    them once; the dense test features are the reference for cosine and agreement.
    """

    probe: Probe
    images: Tensor
    labels: Tensor
    dense: Tensor
    train_images: int

    @classmethod
    def build(cls, dense: Runner, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]) -> ProbeTask:
        feats = outputs(dense, train[0])
        probe = fit_probe(feats, train[1], int(train[1].max()) + 1)
        return cls(probe, test[0], test[1], outputs(dense, test[0]), len(feats))

    def score(self, runner: Runner | None = None) -> dict[str, float]:
        """Probe top-1, agreement with the dense model, KL and feature cosine (``None``: the dense model)."""
        out = self.dense if runner is None else outputs(runner, self.images)
        tally = Tally()
        tally.add(out, self.dense, self.labels, self.probe)
        return tally.result()
