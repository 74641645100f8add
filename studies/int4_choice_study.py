"""SmolLM2 INT4 (issue 43 item 3): the recipe ``prune-export --precision int4`` chose, against what a user gets from
the runtime alone, decode ms/token at batch 1 in onnxruntime-genai on the CPU.

RUN is a ``prune-export --precision int4`` folder of a decoder (or one whose genai folders ``export`` wrote and
``quantize --precision int4`` quantized: the INT4 records are read from the folders' sidecars). Beside its genai
folders (FP32 and the chosen INT4, dense and pruned) this builds genai's builder ``-p int4 -e cpu`` (its defaults,
as a user runs it) of the dense HF folder and of RUN's ``pruned/`` artifact, gates both on the INT4 gate's held-out
windows (the same windows: same text, tokenizer, seed, count and length as the run's records; the study checks that
the chosen folders' perplexity recomputes), then times every folder with the choice's own timer
(``exporters.int4.decode_ms``: the folders interleaved in rounds after a warm-up), ``--repeats`` times, and writes
one JSON record.

    python -m studies.int4_choice_study RUN --model DENSE_HF --calib-dir BBC --json docs/smollm2-int4-choice.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from corp_deploy.base.env import cpu_features, cpu_model
from corp_deploy.exporters.genai import CONFIG, GRAPH
from corp_deploy.exporters.int4 import decode_ms
from corp_deploy.exporters.int4_gate import compare_decoders
from corp_deploy.families.hf import hub
from corp_deploy.formats import evaluation

STEMS = ("dense", "pruned")
BUILDER = {"builder-dense-int4": None, "builder-pruned-int4": "pruned"}
"""genai's builder int4 folders this study writes in RUN, and the HF folder each reads (None: ``--model``)."""


def build(run: Path, model: Path) -> None:
    """genai's builder ``-p int4 -e cpu`` as a user runs it, where RUN does not hold its folder yet."""
    for name, source in BUILDER.items():
        if not (run / name / GRAPH).is_file():
            hf_folder = model if source is None else run / source
            argv = ["-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(run / name)]
            subprocess.run([sys.executable, *argv, "-p", "int4", "-e", "cpu"], check=True, capture_output=True)


def pinned(folder: Path, tmp: Path) -> Path:
    """The builder's graph with its cache inputs' head and width dims made numbers (it leaves them symbolic; the
    gate's prefill reads them): a copy in ``tmp``."""
    import onnx

    decoder = json.loads((folder / CONFIG).read_text())["model"]["decoder"]
    proto = onnx.load(str(folder / GRAPH))
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name.startswith(("past_key_values", "present")):
            dims = value.type.tensor_type.shape.dim
            dims[1].dim_value, dims[3].dim_value = decoder["num_key_value_heads"], decoder["head_size"]
    out = tmp / f"{folder.name}.onnx"
    onnx.save(proto, str(out))
    return out


PAIRS = {
    "pruned vs dense, minmax": ("dense-genai-int4", "pruned-genai-int4"),
    "pruned vs dense, builder": ("builder-dense-int4", "builder-pruned-int4"),
    "pruned minmax vs builder of dense": ("builder-dense-int4", "pruned-genai-int4"),
}
"""Speed ratios (the first folder's ms/token over the second's) the study reports per repeat."""


def paired(repeats: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each of ``PAIRS`` timed in a repeat: its ratio within each repeat (the two folders ran in the same rounds,
    so the machine's drift between repeats cancels), median and quartiles over the repeats."""
    out = {}
    for label, (a, b) in PAIRS.items():
        if a in repeats[0] and b in repeats[0]:
            r = np.array([t[a] / t[b] for t in repeats])
            q1, median, q3 = np.percentile(r, [25, 50, 75])
            out[label] = {"median": float(median), "q1": float(q1), "q3": float(q3), "n": len(r)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--model", type=Path, required=True, help="The dense HF folder RUN was pruned from.")
    parser.add_argument("--calib-dir", required=True, help="The text RUN's INT4 gate read.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--int4-only", action="store_true", help="Time the INT4 folders only (not the FP32 ones).")
    args = parser.parse_args()
    run = args.run
    build(run, args.model)
    records = {f"{s}-genai-int4": json.loads((run / f"{s}-genai-int4" / f"{GRAPH}.json").read_text()) for s in STEMS}
    verify = records["dense-genai-int4"]["verify"]
    vocab = json.loads((run / "dense-genai" / CONFIG).read_text())["model"]["vocab_size"]
    tokenizer = hub.load_tokenizer(str(args.model), vocab)
    windows = evaluation.heldout_windows(
        tokenizer, args.calib_dir, vocab, verify["seq_len"], verify["windows"], verify["seed"]
    ).numpy()
    gates = {}
    for stem in STEMS:
        reference = run / f"{stem}-genai" / GRAPH
        chosen = compare_decoders(reference, run / f"{stem}-genai-int4" / GRAPH, windows).as_dict()
        recorded = records[f"{stem}-genai-int4"]["verify"]
        assert np.isclose(chosen["candidate_ppl"], recorded["candidate_ppl"]), "not the run's windows"
        with tempfile.TemporaryDirectory() as tmp:
            builder = compare_decoders(reference, pinned(run / f"builder-{stem}-int4", Path(tmp)), windows).as_dict()
        gates[f"{stem}-genai-int4"], gates[f"builder-{stem}-int4"] = chosen, builder
    folders = [*([] if args.int4_only else ["dense-genai", "pruned-genai"]), *records, *BUILDER]
    repeats = [decode_ms({name: run / name for name in folders}) for _ in range(args.repeats)]
    median = {name: float(np.median([r[name] for r in repeats])) for name in folders}
    record = {
        "cpu": cpu_model(),
        "flags": cpu_features()["flags"],
        "chosen": {name: records[name]["int4_choice"]["chosen"] for name in records},
        "gates": gates,
        "decode_ms_per_token": {"repeats": repeats, "median": median},
        "paired": paired(repeats),
    }
    for name in folders:
        gate = gates.get(name)
        figures = f"ppl x{gate['ppl_ratio']:.3f} agreement {gate['agreement']:.3f}" if gate else "FP32"
        print(f"{name:26s} {median[name]:7.2f} ms/token  {figures}")
    for label, r in record["paired"].items():
        print(f"{label:40s} median {r['median']:.3f}x, middle half {r['q1']:.3f}-{r['q3']:.3f}x, {r['n']} repeats")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
