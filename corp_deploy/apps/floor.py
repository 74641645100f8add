"""The accuracy floor: the fastest configuration whose held-out drop stays within what the user accepts.

``corp-deploy sweep --frontier`` (and ``--max-drop D``) measures, beside each row's speed, its held-out drop
(``bench.drop``: the metric's name and direction explicit) for the pruned model in FP32 and in INT8
(``onnxruntime.quantization.quantize_dynamic``, per-channel QInt8: the runtime's own one-line quantizer), for plain
removal at the same widths, and for the dense model quantized the same way. The held-out inputs are never calibrated
on: a text folder's evaluation part (``text.split_documents``: disjoint from calibration and from the sensitivity
pass's held-out part) or the images outside the seeded calibration sample, or a separate ``--heldout-dir``.

``candidates`` turns a sweep record into frontier points (speed against dense FP32 on one backend, same run) and
``choose`` picks the fastest candidate within the drop, or refuses in one line naming the best drop reached.
"""

from __future__ import annotations

import copy
import shutil
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.base.tables import text_table
from corp_deploy.bench.drop import (
    METRICS,
    HeldoutSet,
    Outputs,
    check_metric,
    declared_pooling,
    default_metric,
    outputs,
    scores,
    value,
)
from corp_deploy.bench.frontier import mark_pareto
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.ranking import RANKERS
from corp_deploy.exporters.int8_recipes import dynamic_int8
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.exporters.text_onnx import graph
from corp_deploy.families import adapter_for
from corp_deploy.families.hf import hub
from corp_deploy.families.hf.adapter import max_positions
from corp_deploy.formats import calibration, evaluation, sources
from corp_deploy.formats.artifact import META_FILE, read_meta
from corp_deploy.formats.data import data_config, folder_batches, image_folder, labelled_batches, list_images, sample
from corp_deploy.formats.run_folder import ARTIFACT, MODELS, onnx_name
from corp_deploy.formats.text import (
    evaluation_documents,
    packed_sequences,
    read_documents,
    shuffled,
    tokenize,
)

SPEED_ON = "ort-cpu-fp32"
"""The backend every frontier speed is read on: its dense FP32 throughput is the 1.0 of every point."""
INT8_ON = "ort-cpu-int8"
DENSE_INT8 = onnx_name("dense", "int8")
HELDOUT_NUM = 256
"""Held-out images or documents (a decoder: windows) scored per model by default."""
DEFAULT_SEQ_LEN = 128
"""Tokens per held-out document unless told (the calibration default, ``--seq-len``), within the positions."""


# ----------------------------------------------------------------------------------- held-out inputs


def kind_of(model: nn.Module) -> str:
    """``image``, ``encoder`` or ``decoder``: how ``bench.drop`` reads the model's outputs."""
    adapter = adapter_for(model)
    if adapter.modality != "text":
        return "image"
    return "decoder" if adapter.causal else "encoder"


def text_heldout(
    model: nn.Module,
    tokenizer: Any,
    folder: str | Path,
    seq_len: int,
    num: int = HELDOUT_NUM,
    batch_size: int = 16,
    seed: int = 0,
    all_text: bool = False,
    pooling: dict[str, Any] | None = None,
) -> HeldoutSet:
    """A text model's held-out set: the folder's evaluation documents (never calibration or the sensitivity pass's
    held-out part), or all of them (``all_text``: a folder calibration never read). An encoder gets ``num`` documents,
    one per sequence, labelled by class folder when there are several; a decoder ``num`` packed windows."""
    if tokenizer is None:
        raise CorpError(f"{folder}: a text model's held-out set needs its tokenizer, and its folder has none")
    hint = "pass more documents, or a folder calibration never read (--heldout-dir)"
    chosen, _ = evaluation_documents(folder, all_text, hint)
    part = "all (a folder calibration never read)" if all_text else "evaluation part (never calibrated on)"
    if kind_of(model) == "decoder":
        ids = packed_sequences(tokenizer, shuffled(chosen, seed), seq_len, num, "held-out").numpy()
        feeds = [
            {"input_ids": ids[i : i + batch_size], "attention_mask": np.ones_like(ids[i : i + batch_size])}
            for i in range(0, len(ids), batch_size)
        ]
        source = {"folder": str(folder), "part": part, "windows": len(ids), "seq_len": seq_len}
        return HeldoutSet("decoder", feeds, source=source)
    picked = sample(chosen, num, seed)
    feeds = [
        {k: v.numpy() for k, v in tokenize(tokenizer, [d.text for d in picked[i : i + batch_size]], seq_len).items()}
        for i in range(0, len(picked), batch_size)
    ]
    classes = sorted({d.folder for d in picked})
    labels = np.array([classes.index(d.folder) for d in picked]) if len(classes) > 1 else None
    source = {"folder": str(folder), "part": part, "documents": dict(Counter(d.folder for d in picked))}
    held = HeldoutSet("encoder", feeds, labels, source | {"seq_len": seq_len})
    if pooling is not None:
        held.pooling = pooling
    return held


def image_heldout(
    model: nn.Module,
    folder: str | Path,
    num: int = HELDOUT_NUM,
    batch_size: int = 32,
    seed: int = 0,
    exclude: set[Path] | frozenset[Path] = frozenset(),
) -> HeldoutSet:
    """An image model's held-out set: ``num`` images of ``folder`` not in ``exclude`` (the calibration sample),
    labelled when the folder is an ImageFolder tree (class subfolders)."""
    try:
        files, labels, _ = image_folder(folder)
    except CorpError:
        files, labels = list_images(folder), None
    keep = [i for i, f in enumerate(files) if f not in exclude]
    if not keep:
        raise CorpError(
            f"every image of {folder} is in the calibration sample; pass --heldout-dir with images calibration "
            "never reads, or a lower --num-calib"
        )
    pick = sample(keep, num, seed)
    cfg = data_config(model)
    if labels is None:
        loader = ((x, None) for x, _ in folder_batches([files[i] for i in pick], cfg, batch_size, 0))
    else:
        batches = labelled_batches([files[i] for i in pick], [labels[i] for i in pick], cfg, batch_size, 0)
        loader = ((x, y) for x, y, _ in batches)
    feeds, ys = [], []
    for x, y in loader:
        if len(x):
            feeds.append(x.float().numpy())
            ys.append(y)
    found = None if labels is None else torch.cat(ys).numpy()
    classes = found is not None and len(np.unique(found)) > 1
    source = {"folder": str(folder), "images": sum(len(f) for f in feeds), "excluded": "the calibration sample"}
    return HeldoutSet("image", feeds, found if classes else None, source, classifier=_classifier(model))


def _classifier(model: nn.Module) -> bool:
    """Whether an image model outputs class logits (timm ``num_classes``, transformers ``num_labels`` with a head)."""
    if getattr(model, "num_classes", 0):
        return True
    return hasattr(model, "classifier") and getattr(getattr(model, "config", None), "num_labels", 0) > 0


def calibration_sample(source: str | Path, num_calib: int, seed: int) -> set[Path]:
    """The images ``calibration.calibration_data`` reads from ``source`` (the same seeded sample)."""
    return set(sample(list_images(source), num_calib, seed))


def heldout_for(
    model: nn.Module,
    tokenizer: Any,
    calib_source: str,
    num_calib: int,
    seed: int,
    heldout_dir: str | None,
    num: int,
    seq_len: int,
    pooling: dict[str, Any] | None = None,
) -> HeldoutSet:
    """The held-out set a sweep scores on: ``heldout_dir`` whole when given (calibration never read it), else the
    part of the calibration source calibration never reads. Noise calibration has no held-out inputs."""
    folder = heldout_dir or calib_source
    if folder == "synthetic":
        raise CorpError("--calib synthetic has no held-out inputs to measure a drop on: pass --heldout-dir DIR")
    if heldout_dir and calib_source != "synthetic":
        held, calib = Path(heldout_dir).resolve(), Path(calib_source).resolve()
        if held.is_relative_to(calib) or calib.is_relative_to(held):
            raise CorpError(
                f"--heldout-dir {heldout_dir} overlaps the calibration folder {calib_source}: pass a folder "
                "calibration never reads, or leave --heldout-dir out to score the part of it calibration never reads"
            )
    if kind_of(model) == "image":
        exclude = frozenset() if heldout_dir else calibration_sample(calib_source, num_calib, seed)
        return image_heldout(model, folder, num, seed=seed, exclude=exclude)
    return text_heldout(
        model, tokenizer, folder, seq_len, num, seed=seed, all_text=heldout_dir is not None, pooling=pooling
    )


# ------------------------------------------------------------------------------------------- INT8


# ------------------------------------------------------------------------------------ sweep's hook


def widths_of(model: nn.Module, config: PruneConfig) -> list[Widths]:
    """The kept widths of a pruned model's targeted parts, block by block (to prune another way at the same ones)."""
    adapter = adapter_for(model)
    out = []
    for block in adapter.blocks(model):
        qk, v = adapter.head_widths(block)
        full = {"mlp": adapter.mlp_out(block).in_features, "qk": qk, "v": v}
        out.append(Widths(**{part: full[part] for part in config.target}))
    return out


def runner(model: nn.Module) -> TorchRunner:
    """A PyTorch runner of ``model`` as its graph is exported (a text model takes ids and mask)."""
    model = copy.deepcopy(model).to("cpu").eval()
    return TorchRunner(graph(model)[0] if adapter_for(model).modality == "text" else model)


@dataclass
class Accuracy:
    """What ``sweep.sweep`` measures beside speed: per row the held-out ``metric`` of CORP in FP32 (and INT8 when
    ``int8``) and of plain removal at the same widths; once, the dense model in FP32 and INT8."""

    heldout: HeldoutSet
    metric: str
    int8: bool = True
    removal: bool = True
    _dense: Outputs | None = field(default=None, repr=False)
    _record: dict[str, Any] = field(default_factory=dict, repr=False)
    _dense_int8: Path | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_metric(self.metric, self.heldout)

    def _score(self, run: Any) -> dict[str, float]:
        v = value(self.metric, outputs(run, self.heldout), self._dense, self.heldout)
        dense = self._record["dense"]["fp32"][self.metric]
        return {self.metric: v, "drop": METRICS[self.metric].drop(dense, v)}

    def start(self, dense_onnx: Path) -> None:
        """Score the dense graph (the reference) and, with ``int8``, write and score ``dense.int8.onnx`` beside it."""
        reference = OrtRunner(dense_onnx, "cpu")
        self._dense = outputs(reference, self.heldout)
        v = value(self.metric, self._dense, self._dense, self.heldout)
        self._record = {"dense": {"fp32": {self.metric: v, "drop": 0.0}}}
        if self.int8:
            self._dense_int8 = dense_onnx.with_name(DENSE_INT8)
            dynamic_int8(dense_onnx, self._dense_int8, per_channel=True)
            self._record["dense"]["int8"] = self._score(OrtRunner(self._dense_int8, "cpu"))

    def quantize(self, pruned_onnx: Path) -> None:
        """``pruned.int8.onnx`` beside a row's pruned graph, and a copy of ``dense.int8.onnx``: bench's ort-cpu-int8
        times the pair in the row's folder; ``score`` scores the pruned one."""
        if self.int8:
            dynamic_int8(pruned_onnx, pruned_onnx.with_name(onnx_name("pruned", "int8")), per_channel=True)
            shutil.copyfile(self._dense_int8, pruned_onnx.with_name(DENSE_INT8))

    def score(self, folder: Path, calib: api.Calibrated, config: PruneConfig, result: api.PruneResult) -> dict:
        """One row's held-out figures: CORP's graphs as exported, removal's model at CORP's widths (its channels by
        the same ranker, or by the paper's where that ranker orders them by CORP's own refit, which removal lacks)."""
        row = {"corp": {"fp32": self._score(OrtRunner(folder / onnx_name("pruned"), "cpu"))}}
        if self.int8:
            row["corp"]["int8"] = self._score(OrtRunner(folder / onnx_name("pruned", "int8"), "cpu"))
        if self.removal:
            ranker = PruneConfig.ranker if RANKERS[config.ranker].refits else config.ranker
            plain = replace(config, compensation="none", budget=None, ranker=ranker)
            removed = calib.prune(plain, widths=widths_of(result.model, config)).model
            row["removal"] = {"fp32": self._score(runner(removed))}
        return row

    def record(self) -> dict[str, Any]:
        """The sweep record's ``accuracy``: metric, direction, held-out inputs, the dense figures."""
        metric = METRICS[self.metric]
        return {
            "metric": metric.name,
            "higher_is_better": metric.higher_is_better,
            "what": metric.what,
            "heldout": self.heldout.source,
            **self._record,
        }


# ------------------------------------------------------------------------------------ the frontier


def _largest(pairs: list[dict[str, Any]], backend: str) -> dict[str, Any] | None:
    mine = [p for p in pairs if p["backend"] == backend]
    return max(mine, key=lambda p: p["batch"]) if mine else None


def candidates(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Frontier points of a sweep record with ``accuracy``: every (row, method, precision) with its speed against
    dense FP32 on ``SPEED_ON`` at the largest batch (same row's run: FP32 pairs interleaved, INT8 pairs interleaved,
    the two in one run) and its held-out drop. Plain removal has CORP's widths, so CORP's FP32 speed. ``candidate``
    marks what the floor may choose (CORP and the quantized dense model; not dense FP32, not removal)."""
    acc = result["accuracy"]
    metric = acc["metric"]
    points = [_point("dense", "dense", "fp32", 1.0, acc["dense"]["fp32"], metric, False)]
    dense_int8 = []
    for row in result["rows"]:
        name = row.get("folder") or _folder(row)
        fp32, int8 = _largest(row["bench"], SPEED_ON), _largest(row["bench"], INT8_ON)
        if fp32 is None:
            raise CorpError(f"the frontier reads speeds on {SPEED_ON}, and {name} was not timed there (--backends)")
        for method, figures in row["accuracy"].items():
            for precision, fig in figures.items():
                if precision == "fp32":
                    speed = fp32["throughput_ratio"]
                elif int8 is not None:
                    speed = int8["pruned_throughput"] / fp32["dense_throughput"]
                else:
                    continue
                points.append(_point(name, method, precision, speed, fig, metric, method == "corp"))
        if int8 is not None:
            dense_int8.append(int8["dense_throughput"] / fp32["dense_throughput"])
    if "int8" in acc["dense"] and dense_int8:
        points.append(
            _point("dense", "dense", "int8", statistics.median(dense_int8), acc["dense"]["int8"], metric, True)
        )
    return points


def _folder(row: dict[str, Any]) -> str:
    return f"s{row['sparsity']:.2f}" if "sparsity" in row else f"x{row['speedup']:.2f}"


def _point(
    row: str, method: str, precision: str, speed: float, fig: dict[str, float], metric: str, candidate: bool
) -> dict[str, Any]:
    return {
        "row": row,
        "method": method,
        "precision": precision,
        "speedup": speed,
        metric: fig[metric],
        "drop": fig["drop"],
        "candidate": candidate,
    }


def choose(points: list[dict[str, Any]], max_drop: float, metric: str) -> dict[str, Any]:
    """The fastest candidate whose drop is at most ``max_drop``; one line naming the best drop reached when none."""
    eligible = [p for p in points if p["candidate"]]
    passing = [p for p in eligible if p["drop"] <= max_drop]
    if not passing:
        best = min(eligible, key=lambda p: p["drop"])
        raise CorpError(
            f"no configuration keeps the {metric} drop within {max_drop:g}: the best reached {best['drop']:.4g} "
            f"({file_of(best)}, {best['speedup']:.2f}x); "
            "try lower sparsities or speed targets, or a larger --max-drop"
        )
    return max(passing, key=lambda p: p["speedup"])


def file_of(point: dict[str, Any]) -> str:
    """The graph a point is: ``x2.00/pruned.int8.onnx``, ``dense.onnx``..."""
    if point["method"] == "dense":
        return onnx_name("dense", point["precision"])
    return f"{point['row']}/{onnx_name('pruned', point['precision'])}"


# ------------------------------------------------------------------------------ eval of a run folder


def artifact_of(run_dir: str | Path) -> Path:
    """The prune artifact of a run folder: ``RUN/pruned`` of a prune-export or sweep folder, or ``RUN`` itself."""
    root = Path(run_dir)
    if (root / ARTIFACT / META_FILE).is_file():
        return root / ARTIFACT
    if (root / META_FILE).is_file():
        return root
    raise CorpError(f"{root} is neither a prune-export folder nor a prune artifact (no {META_FILE})")


def evaluate_text(
    run_dir: str | Path,
    text: str | Path,
    metrics: Sequence[str] = (),
    all_text: bool = False,
    num: int = HELDOUT_NUM,
    seq_len: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """A text run's held-out figures: the pruned model against the dense model it was pruned from (PyTorch), and
    every graph the run folder holds (``dense.onnx``, ``pruned.onnx``, their ``.int8.onnx``), on ``text``'s
    evaluation documents (or all of it: ``all_text``). ``metrics`` default to the family's (``default_metric``), plus
    accuracy when the documents come from several class folders. Returns the record ``eval`` prints and keeps."""
    from corp_deploy.formats import sources

    artifact = artifact_of(run_dir)
    pruned, tokenizer = sources.text_model(artifact)
    origin = read_meta(artifact)["model"]["name"]
    dense = sources.text_model(origin)[0]
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, max_positions(pruned.config))
    held = text_heldout(pruned, tokenizer, text, seq_len, num, batch_size, seed, all_text, declared_pooling(origin))
    metrics = list(metrics) or [default_metric(held.kind), *(["accuracy"] if held.labels is not None else [])]
    runners = {"dense torch-cpu-fp32": runner(dense), "pruned torch-cpu-fp32": runner(pruned)}
    root = artifact.parent if artifact.name == ARTIFACT else artifact
    for which in MODELS:
        for precision in ("fp32", "int8"):
            if (root / onnx_name(which, precision)).is_file():
                runners[f"{which} ort-cpu-{precision}"] = OrtRunner(root / onnx_name(which, precision), "cpu")
    results = scores(runners, "dense torch-cpu-fp32", held, metrics)
    return {
        "data": str(text),
        "heldout": held.source,
        "metrics": {m: {"higher_is_better": METRICS[m].higher_is_better, "what": METRICS[m].what} for m in metrics},
        "reference": "dense torch-cpu-fp32",
        "dense": origin,
        "results": results,
    }


def heldout_words(source: dict[str, Any]) -> str:
    """A held-out set's source as a sentence (the record keeps the dict): ``docs/ (part evaluation, documents 12:
    class0 5, class1 7, seq len 32)``."""

    def said(value: Any) -> str:
        if isinstance(value, dict):
            return f"{sum(value.values())}: " + ", ".join(f"{Path(k).name or k} {v}" for k, v in value.items())
        return str(value)

    rest = ", ".join(f"{k.replace('_', ' ')} {said(v)}" for k, v in source.items() if k != "folder")
    return f"{source.get('folder', '?')}" + (f" ({rest})" if rest else "")


def format_scores(record: dict[str, Any]) -> str:
    """One line per model and backend: each metric and its drop against the dense reference."""
    metrics = list(record["metrics"])
    lines = [("model / backend", *(c for m in metrics for c in (m, f"{m} drop")))]
    for name, row in record["results"].items():
        label = f"{name} (reference)" if name == record["reference"] else name
        lines.append((label, *(f"{row[c]:.5f}" for m in metrics for c in (m, f"{m}_drop"))))
    return text_table(lines)


def frontier_record(
    result: dict[str, Any], max_drop: float | None
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """(frontier.json's record, its points with Pareto flags, the floor's choice) of a sweep ``result``: every point;
    with ``max_drop``, each candidate's pass/fail and the fastest that passes (``choose``: one line when none does)."""
    metric = result["accuracy"]["metric"]
    points = mark_pareto(candidates(result))
    chosen = None
    if max_drop is not None:
        points = [p | ({"passes": p["drop"] <= max_drop} if p["candidate"] else {}) for p in points]
        chosen = choose(points, max_drop, metric)
    record = {"model": result["model"], "accuracy": result["accuracy"], "speed_on": SPEED_ON, "points": points}
    if max_drop is not None:
        record["floor"] = {"max_drop": max_drop, "metric": metric, "chosen": chosen, "file": file_of(chosen)}
    return record, points, chosen


def decoder_perplexities(
    source: str,
    text: str,
    seq_len: int | None,
    all_text: bool,
    batch_size: int,
    num: int,
    progress: bool,
    results: dict[str, Any] | None = None,
) -> Iterator[str]:
    """``eval --text`` of a decoder: one line for ``source``'s perplexity and, for a prune artifact, one for its dense
    original when that loads (the transformers folder or hf:NAME it was pruned from; skipped with the reason when it
    does not), on the first ``num`` windows; each line yielded as soon as it is measured, and its figures put in
    ``results`` by label (the record ``eval.json`` keeps)."""
    results = {} if results is None else results
    if num < 1:
        raise CorpError(f"--num must be >= 1, got {num}")
    hub.transformers_module("evaluating a text model")
    artifact = Path(source, META_FILE).is_file()
    if not (artifact or hub.is_source(source)):
        raise CorpError(f"{source} is neither a prune artifact nor a transformers folder (config.json) or hf:NAME")
    read_documents(text)  # a folder without text fails before any model loads
    device = calibration.resolve_device("auto")

    def line(label: str, where: str) -> str:
        model, tokenizer = sources.text_model(where)
        length = seq_len or min(2048, max_positions(model.config))
        r = evaluation.text_perplexity(model, tokenizer, text, length, batch_size, device, all_text, num, progress)
        results[label] = {**r, "model": where}
        return (
            f"{label}: perplexity {r['perplexity']:.3f} on {r['windows']} of {r['of_windows']} windows of "
            f"{r['seq_len']} tokens ({r['part']}: {r['documents']} of {r['of_documents']} documents of {text}) "
            f"[{where}]"
        )

    yield line("pruned" if artifact else "model", source)  # first: its errors are the user's to fix
    if artifact:
        origin = read_meta(source)["model"]["name"]
        try:
            yield line("dense", origin)
        except CorpError as e:
            results["dense"] = {"skipped": str(e)}
            yield f"dense: skipped ({e})"
