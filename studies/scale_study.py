"""How corp-deploy's cost grows with model size: random-weight models of real shapes, built without holding them twice.

    python -m studies.scale_study build smollm2-1.7b /tmp/scale            # the folder (and /tmp/scale/text)
    python -m studies.scale_study build llama-7b /tmp/scale                # bf16, ~13.5 GB on disk
    python -m studies.scale_study run smollm2-135m /tmp/scale --report out.json   # prune, timed per step

``build`` writes a ``transformers`` Llama folder (config, safetensors shards, a byte-level BPE tokenizer trained on the
calibration text) tensor by tensor: the model is made on the meta device and each weight is drawn, written and
dropped, so creating a 7B folder needs one shard of memory, not the model's. ``run`` prunes it with the CLI's defaults
(``python -m corp_deploy prune``; run it under ``/usr/bin/time -v`` for the peak RSS) and prints one markdown row of
docs/BENCHMARKS.md's scaling table from the artifact's corp.json. Text for calibration is this repository's docs
(prose and code in markdown), cut into ``documents`` files: any prose serves random weights.
"""

from __future__ import annotations

import argparse
import json
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


def write_text(root: Path, documents: int = 64) -> Path:
    """``documents`` .txt files cut from the repository's markdown (the calibration text)."""
    text = root / "text"
    text.mkdir(parents=True, exist_ok=True)
    words = " ".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("docs/*.md"))).split()
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


def run(shape: str, root: Path, extra: list[str]) -> dict:
    """``prune`` of the built folder with defaults (32 x 256 tokens, sparsity 0.3, MLP), its corp.json."""
    out = root / f"{shape}-pruned"
    command = [
        sys.executable, "-m", "corp_deploy", "prune", str(root / shape), "--calib-dir", str(root / "text"),
        "--num-calib", "32", "--seq-len", "256", "--sparsity", "0.3", "--target", "mlp", "--out", str(out),
        "--overwrite", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    meta = json.loads((out / "corp.json").read_text())
    return {"shape": shape, "wall_s": time.perf_counter() - start, "command": " ".join(command), **meta["report"]}


def row(report: dict) -> str:
    """One markdown row: shape, seconds per step (the rest: starting, loading, reading the text, writing), the wall
    time, the memory plan's predicted peak and the measured peak RSS (GiB)."""
    s, memory = report["seconds"], report["memory"]
    steps = [s.get(k, 0.0) for k in ("calibration", "ranking", "compensation")]
    cells = " | ".join(f"{x:.1f}" for x in [*steps, report["wall_s"] - sum(steps), report["wall_s"]])
    plan = memory.get("plan", {})
    return (
        f"| {report['shape']} | {report['calibration']['mode']} | {cells} | {plan.get('peak_gib', float('nan')):.2f} "
        f"| {memory['host_rss_mib'] / 1024:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("root", type=Path)
    parser.add_argument("--layers", type=int, help="build: fewer blocks than the shape has")
    parser.add_argument("--report", type=Path, help="run: write the full report here")
    args, extra = parser.parse_known_args()
    if args.action == "build":
        print(build(args.shape, args.root, args.layers))
        return
    report = run(args.shape, args.root, extra)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(row(report))


if __name__ == "__main__":
    main()
