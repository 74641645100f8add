"""INT8 of a sentence encoder, measured per real token (the gate) and per pooled embedding (what its users read).

    corp-deploy quantize RUN --calib-dir $BBC                        # RUN/{dense,pruned}.int8.onnx, verified
    python -m studies.text_int8_study RUN --calib-dir $BBC --model $MINILM --out studies/results/text-int8-study

For each FP32 graph of RUN with its verified INT8 graph beside it, on the held-out documents the gate read (the same
seeded draw, ``text.int8_feeds``): per real token of the last hidden state, the worst, 1st-percentile and mean
cosine and the relative error (the gate's figures); per sentence embedding, pooled as ``--model``'s
sentence-transformers folder declares (``modules.json``: its Pooling module's mode, then Normalize if listed), the
worst and mean cosine and the relative error. Then what a user of the embeddings reads: a ridge probe fitted on the
dense FP32 graph's embeddings of half of the folder's evaluation documents (``text.split_documents``: never calibrated
on, by CORP or INT8), scored on the other half for every graph, with the mean cosine to the dense FP32 embedding.
Then FP32 and INT8 onnxruntime CPU latency at ``--batch`` x ``--seq-len`` held-out tokens, all graphs interleaved in
one loop, with the load average before and after. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import RidgeClassifier

from corp_deploy.base.env import cpu_model
from corp_deploy.base.errors import CorpError
from corp_deploy.base.timing import Method, interleaved, summarize
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.runners import OrtRunner
from corp_deploy.families.hf.hub import load_tokenizer
from corp_deploy.formats.text import Document, int8_feeds, read_documents, split_documents, tokenize


def declared_pooling(model: Path) -> dict[str, Any]:
    """A sentence-transformers folder's pooling: {"mode": mean | cls | max, "normalize": bool}."""
    modules = json.loads((model / "modules.json").read_text())
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        raise CorpError(f"{model} declares no Pooling module (modules.json)")
    config = json.loads((model / kinds["Pooling"]["path"] / "config.json").read_text())
    modes = [
        m
        for m in ("mean", "cls", "max")
        if config.get(f"pooling_mode_{m}_tokens" if m != "cls" else "pooling_mode_cls_token")
    ]
    if len(modes) != 1:
        raise CorpError(f"{model}: pooling {config} is not one of mean, cls, max")
    return {"mode": modes[0], "normalize": "Normalize" in kinds}


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: dict[str, Any]) -> np.ndarray:
    """Sentence embeddings from (batch, tokens, hidden) as sentence-transformers pools them (padding excluded)."""
    m = mask[..., None].astype(hidden.dtype)
    if pooling["mode"] == "mean":
        out = (hidden * m).sum(1) / m.sum(1)
    elif pooling["mode"] == "cls":
        out = hidden[:, 0]
    else:
        out = np.where(m > 0, hidden, -np.inf).max(1)
    return out / np.linalg.norm(out, axis=-1, keepdims=True) if pooling["normalize"] else out


def figures(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Per row (token or embedding): worst, 1st-percentile and mean cosine; max |diff| / max |ref|."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    cos = (ref * got).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))
    return {
        "rows": len(ref),
        "worst_cosine": float(cos.min()),
        "p1_cosine": float(np.quantile(cos, 0.01)),
        "mean_cosine": float(cos.mean()),
        "rel_error": float(np.abs(ref - got).max() / np.abs(ref).max()),
    }


def embed(runner: OrtRunner, tokenizer: Any, docs: list[Document], seq_len: int, pooling: dict[str, Any]) -> np.ndarray:
    """Pooled sentence embeddings of ``docs`` from one graph, 32 documents a batch."""
    out = []
    for i in range(0, len(docs), 32):
        feed = {k: v.numpy() for k, v in tokenize(tokenizer, [d.text for d in docs[i : i + 32]], seq_len).items()}
        out.append(pool(runner(feed), feed["attention_mask"].astype(bool), pooling))
    return np.concatenate(out)


def probe(
    runners: dict[str, OrtRunner],
    reference: OrtRunner,
    tokenizer: Any,
    source: str,
    seq_len: int,
    pooling: dict[str, Any],
) -> dict[str, dict[str, float]]:
    """Per graph: probe top-1 (percent, with its standard error) and mean cosine to ``reference``'s (dense FP32)
    embedding, on the odd half of the evaluation documents; the probe is fitted on the reference's embeddings of the
    even half."""
    docs = split_documents(read_documents(source)).evaluation
    train, test = docs[::2], docs[1::2]
    classes = sorted({d.folder for d in docs})
    labels = lambda part: np.array([classes.index(d.folder) for d in part])  # noqa: E731
    fitted = RidgeClassifier(alpha=1.0).fit(embed(reference, tokenizer, train, seq_len, pooling), labels(train))
    ref = embed(reference, tokenizer, test, seq_len, pooling)
    out = {}
    for name, runner in runners.items():
        got = embed(runner, tokenizer, test, seq_len, pooling)
        hit = fitted.predict(got) == labels(test)
        cos = (ref * got).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))
        se = 100 * float(hit.std() / np.sqrt(len(hit)))
        out[name] = {
            "documents": len(test),
            "top1": 100 * float(hit.mean()),
            "top1_se": se,
            "cosine": float(cos.mean()),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="prune-export folder with {dense,pruned}.onnx and their .int8.onnx")
    p.add_argument("--calib-dir", required=True, help="the text folder the INT8 graphs were calibrated on")
    p.add_argument("--model", type=Path, required=True, help="the sentence-transformers folder (pooling, tokenizer)")
    p.add_argument("--int8-calib", type=int, default=256)
    p.add_argument("--int8-verify", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-seconds", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("studies/results/text-int8-study"))
    a = p.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    pairs = [(a.run / f"{m}.onnx", a.run / f"{m}.int8.onnx") for m in ("dense", "pruned")]
    pairs = [(f, q) for f, q in pairs if q.is_file()]
    if not pairs:
        raise CorpError(f"{a.run} has no verified INT8 graph; run `corp-deploy quantize {a.run} --calib-dir ...`")
    pooling = declared_pooling(a.model)
    meta = read_metadata(load_onnx(pairs[0][0], weights=False))
    tokenizer = load_tokenizer(a.model, meta["vocab_size"])
    _, held, _ = int8_feeds(tokenizer, a.calib_dir, meta["vocab_size"], a.int8_calib, a.int8_verify, a.seq_len)
    mask = held["attention_mask"].astype(bool)
    runners = {p.name: OrtRunner(p, "cpu", a.threads) for pair in pairs for p in pair}
    rows = []
    for fp32, int8 in pairs:
        ref, got = runners[fp32.name](held), runners[int8.name](held)
        smoothing = read_metadata(load_onnx(int8, weights=False)).get("int8_smoothing", {})
        rows.append(
            {
                "graph": int8.name,
                "reference": fp32.name,
                "int8_gemms": read_metadata(load_onnx(int8, weights=False))["int8_gemms"],
                "smoothing_alpha": smoothing.get("alpha"),
                "per_token": figures(ref[mask], got[mask]),
                "pooled": figures(pool(ref, mask, pooling), pool(got, mask, pooling)),
            }
        )
    reference = runners.get("dense.onnx") or OrtRunner(a.run / "dense.onnx", "cpu", a.threads)
    probed = probe(runners, reference, tokenizer, a.calib_dir, a.seq_len, pooling)
    timed = {k: v[: a.batch] for k, v in held.items()}
    steps = {name: _step(runner, timed) for name, runner in runners.items()}
    times = interleaved(steps, Method(warmup_iters=2, min_iters=10, min_seconds=a.min_seconds, round_iters=2))
    speed = {name: summarize(t, a.batch).__dict__ for name, t in times.items()}
    record = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "pooling": pooling,
        "documents": int(len(mask)),
        "rows": rows,
        "probe": probed,
        "latency": {"batch": a.batch, "tokens": int(timed["attention_mask"].shape[1]), "ms": speed},
        "machine": f"{cpu_model()}, {a.threads} onnxruntime threads",
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(table(record) + "\n")
    print(table(record))


def _step(runner: OrtRunner, feed: dict[str, np.ndarray]):
    def step() -> float:
        t = time.perf_counter()
        runner(feed)
        return time.perf_counter() - t

    return step


def table(record: dict[str, Any]) -> str:
    """Accuracy per token and pooled, then FP32 / INT8 latency, as markdown."""
    pooled = f"{record['pooling']['mode']} pooling" + (", normalized" if record["pooling"]["normalize"] else "")
    lines = [
        f"INT8 against FP32 on {record['documents']} held-out documents; pooled: {pooled}.",
        "",
        "| graph | INT8 GEMMs | smoothing | token worst cos | token p1 cos | token mean cos | token rel err "
        "| pooled worst cos | pooled mean cos | pooled rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        t, e = r["per_token"], r["pooled"]
        lines.append(
            f"| {r['graph']} | {r['int8_gemms']} | {r['smoothing_alpha'] or '-'} | {t['worst_cosine']:.4f} | "
            f"{t['p1_cosine']:.4f} | {t['mean_cosine']:.5f} | {t['rel_error']:.3f} | {e['worst_cosine']:.5f} | "
            f"{e['mean_cosine']:.6f} | {e['rel_error']:.3f} |"
        )
    if probed := record.get("probe"):
        n = next(iter(probed.values()))["documents"]
        lines += ["", f"Probe (fitted on dense.onnx's embeddings of unseen evaluation documents), {n} other ones:"]
        lines += ["", "| graph | probe top-1 % | mean cosine to dense.onnx |", "|---|---|---|"]
        lines += [f"| {g} | {p['top1']:.1f} +- {p['top1_se']:.1f} | {p['cosine']:.4f} |" for g, p in probed.items()]
    lat = record["latency"]
    lines += ["", f"onnxruntime CPU, batch {lat['batch']} x {lat['tokens']} tokens, interleaved ({record['machine']}):"]
    lines += ["", "| graph | p50 ms | mean ms | sequences/s |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {s['p50_ms']:.1f} | {s['mean_ms']:.1f} | {s['throughput']:.1f} |" for name, s in lat["ms"].items()
    ]
    before, after = (", ".join(f"{x:.2f}" for x in record[k]) for k in ("load_before", "load_after"))
    lines += ["", f"Load average before {before}; after {after}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
