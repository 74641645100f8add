"""INT4 weight-only decoders (``exporters.int4``, ``quantize --precision int4``, ``prune-export --precision int4``).

A tiny random Llama (4 query heads over 2 K/V heads) and a word-level text folder (``helpers.tiny_llama_folder``);
the gate's figures are recomputed here from onnxruntime's logits with torch's cross-entropy, not with the module's
own arithmetic.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import run, tiny_llama_folder

from corp_deploy.errors import CorpError

pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from corp_deploy import hf  # noqa: E402
from corp_deploy.artifact import load_pruned  # noqa: E402
from corp_deploy.exporters.int4 import DecoderTolerance, Scheme, int4_graphs  # noqa: E402
from corp_deploy.exporters.text_onnx import export_text_onnx  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model folder, text folder, its FP32 logits graph)."""
    root = tmp_path_factory.mktemp("int4")
    folder, text = tiny_llama_folder(root)
    model, _ = hf.load(str(folder))
    graph = export_text_onnx(model, root / "dense.onnx", metadata={"modality": "text", "vocab_size": 300})
    return folder, text, graph


def _windows(n: int = 4, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 300, (n, SEQ))


def _scores(path: Path, windows: np.ndarray) -> tuple[float, np.ndarray]:
    """Perplexity (torch's mean cross-entropy over every predicted token) and the top-1 predictions."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"input_ids": windows, "attention_mask": np.ones_like(windows)})[0]
    z = torch.from_numpy(logits[:, :-1]).double()
    nll = F.cross_entropy(z.flatten(0, 1), torch.from_numpy(windows[:, 1:]).flatten())
    return math.exp(float(nll)), logits[:, :-1].argmax(-1)


def test_int4_replaces_every_weight_matmul_and_records_gate_figures_that_recompute(decoder, tmp_path) -> None:
    _, _, graph = decoder
    out, windows = tmp_path / "dense.int4.onnx", _windows()
    record = int4_graphs([(graph, out)], windows, DecoderTolerance(2.0, 0.5), Scheme(block_size=16))[0]
    proto = onnx.load(str(out))
    ops = [n.op_type for n in proto.graph.node]
    constants = {t.name for t in proto.graph.initializer}
    assert ops.count("MatMulNBits") == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and constants & set(n.input)]
    attrs = {a.name: a.i for n in proto.graph.node if n.op_type == "MatMulNBits" for a in n.attribute}
    assert attrs["block_size"] == 16 and attrs["bits"] == 4 and attrs["accuracy_level"] == 4
    meta = {e.key: e.value for e in proto.metadata_props}
    assert meta["precision"] == "int4" and json.loads(meta["int4_scheme"])["symmetric"] is True
    assert record == json.loads(Path(f"{out}.json").read_text())
    ref_ppl, ref_top = _scores(graph, windows)
    got_ppl, got_top = _scores(out, windows)
    v = record["verify"]
    assert v["tokens"] == 4 * (SEQ - 1) and v["seq_len"] == SEQ
    assert v["reference_ppl"] == pytest.approx(ref_ppl, rel=1e-9) and v["candidate_ppl"] == pytest.approx(got_ppl)
    assert v["agreement"] == pytest.approx(float((ref_top == got_top).mean()))
    assert v["candidate_ppl"] != v["reference_ppl"]  # the weights really changed
    assert record["bytes"] < 0.6 * graph.stat().st_size


def test_the_gate_refuses_a_graph_just_outside_either_bound_and_writes_nothing(decoder, tmp_path) -> None:
    _, _, graph = decoder
    windows = _windows()
    measured = int4_graphs([(graph, tmp_path / "ok.int4.onnx")], windows, DecoderTolerance(10.0, 0.0))[0]["verify"]
    for tol in (
        DecoderTolerance(measured["ppl_ratio"] - 1e-6, 0.0),
        DecoderTolerance(10.0, measured["agreement"] + 1e-6),
    ):
        out = tmp_path / "bad" / "dense.int4.onnx"
        out.parent.mkdir(exist_ok=True)
        with pytest.raises(CorpError, match="fails its gate") as e:
            int4_graphs([(graph, out)], windows, tol)
        assert "\n" not in str(e.value) and not any(out.parent.iterdir())
    tol = DecoderTolerance(measured["ppl_ratio"], measured["agreement"])  # a figure equal to its bound passes
    int4_graphs([(graph, tmp_path / "edge.int4.onnx")], windows, tol)


def test_refusals_before_any_work(decoder, tmp_path) -> None:
    _, _, graph = decoder
    with pytest.raises(CorpError, match="power of two"):
        Scheme(block_size=24)
    int4_graphs([(graph, tmp_path / "q.int4.onnx")], _windows(), DecoderTolerance(10, 0))
    with pytest.raises(CorpError, match="not an FP32 graph"):
        int4_graphs([(tmp_path / "q.int4.onnx", tmp_path / "qq.int4.onnx")], _windows())
    with pytest.raises(CorpError, match="exists"):
        int4_graphs([(graph, tmp_path / "q.int4.onnx")], _windows())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.int4.onnx", "q.int4.onnx.json"]


@pytest.mark.e2e
def test_prune_export_writes_int4_genai_folders_that_generate_and_bench_and_quantize_redoes_them(
    tmp_path, capsys
) -> None:
    # One layer (the unit tests' graph has two): prune-export writes two logits and two decode-step graphs, and a
    # decode-step export takes about twice as long with two layers; nothing here depends on the depth.
    folder, text = tiny_llama_folder(tmp_path, layers=1)
    out = tmp_path / "run"
    common = ["--calib-dir", str(text), "--seq-len", str(SEQ), "--round-to", "4", "--quiet", "--num-calib", "8"]
    int4 = ["--int4-seq-len", str(SEQ), "--int4-windows", "4", "--int4-block-size", "16"]
    argv = ["prune-export", str(folder), *common, "--target", "mlp,v", "--precision", "int4", *int4]
    code, stdout, stderr = run([*argv, "--verify-batches", "1,2", "--out", str(out)], capsys)
    assert code == 0, stderr
    assert "top-1 agree" in stdout
    records = json.loads((out / "export.json").read_text())["int4"]
    assert [r["folder"] for r in records] == ["dense-genai-int4", "pruned-genai-int4"]
    assert all(r["verify"]["text"] == str(text) and r["verify"]["windows"] == 4 for r in records)
    int4_folder = out / "pruned-genai-int4"
    files = {"model.onnx", "model.onnx.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert files <= {f.name for f in int4_folder.iterdir()}
    assert (int4_folder / "genai_config.json").read_text() == (out / "pruned-genai" / "genai_config.json").read_text()
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(int4_folder / "model.onnx")).graph.node}

    og = pytest.importorskip("onnxruntime_genai")
    from corp_deploy.bench.decode import GenaiSession

    session = GenaiSession(og, og.Model(str(out / "pruned-genai")), 300, batch=2, prompt=6, new_tokens=4)
    session.start()
    tokens = np.stack([session.step(None) for _ in range(4)], 1)
    pruned = load_pruned(out / "pruned")
    pruned.generation_config.eos_token_id = None  # the session never stops at EOS either
    ids = torch.from_numpy(session.ids)
    expected = pruned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)[:, 6:]
    assert (torch.from_numpy(tokens.astype(np.int64)) == expected).all()  # the timed session decodes greedily
    session = GenaiSession(og, og.Model(str(int4_folder)), 300, batch=2, prompt=6, new_tokens=4)
    session.start()
    tokens = np.stack([session.step(None) for _ in range(4)], 1)
    assert tokens.shape == (2, 4) and (tokens >= 0).all() and (tokens < 300).all()  # genai runs the INT4 graph
    fast = ["--warmup-iters", "1", "--warmup-seconds", "0", "--min-iters", "2", "--min-seconds", "0"]
    backends = "genai-cpu-fp32,genai-cpu-int4"
    bench = ["bench", str(out), "--backends", backends, "--batch-sizes", "2", "--prompt-lens", "8", "--new-tokens", "2"]
    code, stdout, stderr = run([*bench, *fast], capsys)
    assert code == 0, stderr
    assert stdout.count("genai-cpu-int4  cpu     int4") == 2  # prefill and decode rows

    before = (int4_folder / "model.onnx.json").read_text()
    again = ["quantize", str(out), "--precision", "int4", "--calib-dir", str(text), *int4]
    code, stdout, stderr = run(again, capsys)
    assert code == 1 and "exists" in stderr and stderr.count("\n") == 1  # no --overwrite
    code, stdout, stderr = run([*again, "--tol-ppl-ratio", "0.5", "--overwrite"], capsys)
    assert code == 1 and "fails its gate" in stderr and stderr.count("\n") == 1
    assert (int4_folder / "model.onnx.json").read_text() == before  # a refused graph replaces nothing
    code, stdout, stderr = run([*again, "--overwrite"], capsys)
    assert code == 0, stderr
    assert json.loads((int4_folder / "model.onnx.json").read_text())["verify"] == records[1]["verify"]


@pytest.mark.e2e
def test_int4_on_a_vision_model_or_an_encoder_is_one_line_and_writes_nothing(bert_graph, tmp_path, capsys) -> None:
    bert = bert_graph["model"]  # the session's tiny BERT folder and its encoder graph (conftest)
    out = tmp_path / "vit"
    argv = ["prune-export", "deit_tiny", "--weights", "random", "--calib", "synthetic", "--precision", "int4"]
    code, _, stderr = run([*argv, "--out", str(out)], capsys)
    assert code == 1 and "int4 is for decoders" in stderr and stderr.count("\n") == 1 and not out.exists()
    code, _, stderr = run([*argv[:1], str(bert), *argv[4:], "--out", str(out)], capsys)
    assert code == 1 and "int4 is for decoders" in stderr and stderr.count("\n") == 1 and not out.exists()
    graph = Path(shutil.copy2(bert_graph["onnx"], tmp_path / "bert.onnx"))  # so that anything written beside it shows
    code, _, stderr = run(["quantize", str(graph), "--precision", "int4", "--calib", "synthetic"], capsys)
    assert code == 1 and "not a decoder graph" in stderr and stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert.onnx"]
