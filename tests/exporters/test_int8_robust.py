"""INT8 that passes its own gate where outliers break plain INT8 (the inputs smoothed first, then the GEMMs behind the
worst-quantized activation kept float, chosen by measured error, named in the metadata), a post-LayerNorm residual
that stays float, and INT8 for text encoders (calibrated on a text folder's documents, verified on its held-out ones
at real tokens, batch and sequence dynamic). Tiny models."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TEXT_VOCAB, run

from corp_deploy.exporters.compare import INT8, compare
from corp_deploy.exporters.int8_quant import (
    compare_on,
    gemm_errors,
    quantize_int8,
    quantize_verified,
)
from corp_deploy.exporters.int8_recipes import quantize_graphs
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.runners import OrtRunner
from corp_deploy.exporters.smooth import SMOOTH_ALPHA, smooth

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

WIDTH, HIDDEN, OUTLIER = 16, 64, 2000.0


def _outlier_mlp(path: Path) -> Path:
    """x -> x W1 -> W2, for inputs whose channel 0 is OUTLIER times the others (``_batches``; W1's row 0 scaled
    down, so the function is an ordinary one): one per-tensor INT8 scale for x rounds every other channel to a
    few levels, the planted outlier of DINOv2's and BERT's activations. Only fc1 reads x."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((WIDTH, HIDDEN)).astype(np.float32) / 4
    w2 = rng.standard_normal((HIDDEN, WIDTH)).astype(np.float32) / 8
    w1[0] /= OUTLIER
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"),
    ]
    weights = [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"))]
    graph = helper.make_graph(
        nodes,
        "outlier_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _batches(n: int, seed: int) -> list[np.ndarray]:
    out = [np.random.default_rng(seed + i).standard_normal((16, WIDTH), dtype=np.float32) for i in range(n)]
    for x in out:
        x[:, 0] *= OUTLIER
    return out


def test_a_planted_outlier_unsmoothed_fails_plain_int8_and_passes_with_its_gemm_kept_float(tmp_path) -> None:
    src = _outlier_mlp(tmp_path / "mlp.onnx")
    calib, held = _batches(4, 0), _batches(2, 100)
    plain = quantize_int8(src, tmp_path / "plain.int8.onnx", calib)
    (miss,) = compare_on(OrtRunner(src, "cpu"), OrtRunner(plain, "cpu"), held)[1:]
    assert not miss.within(INT8)  # every GEMM in INT8 breaks the gate

    ranked = dict(gemm_errors(src, plain, calib[:1]))
    assert ranked["fc1"] < ranked["fc2"] - 20  # x quantizes worst, by far
    said: list[str] = []
    record = quantize_verified(src, tmp_path / "mlp.int8.onnx", calib, held, INT8, say=said.append, smooth_alpha=0)
    assert record["verify"]["cosine"] >= INT8.min_cosine and record["verify"]["rel_error"] <= INT8.max_rel_error
    meta = read_metadata(load_onnx(tmp_path / "mlp.int8.onnx"))
    assert (
        meta["int8_smoothing"] == {}
        and list(meta["int8_float_gemms"]) == ["fc1"]
        and "dB SQNR" in meta["int8_float_gemms"]["fc1"]
    )
    assert meta["int8_gemms"] == "1 of 2" and record["int8_float_gemms"] == meta["int8_float_gemms"]
    assert len(said) == 1 and "keeping fc1 float" in said[0]
    quantized = {n.name for n in load_onnx(tmp_path / "mlp.int8.onnx").graph.node if n.op_type == "DequantizeLinear"}
    assert any("w2" in n for n in quantized) and not any(n.startswith(("w1", "x_")) for n in quantized)


def test_a_graph_that_passes_keeps_every_gemm_in_int8(tmp_path) -> None:
    src = _outlier_mlp(tmp_path / "mlp.onnx")
    said: list[str] = []
    record = quantize_verified(
        src, tmp_path / "mlp.int8.onnx", _batches(4, 0), _batches(2, 100), INT8, say=said.append, smooth_alpha=0
    )
    # The same graph with a gate loose enough for the outlier: nothing is smoothed or kept float, nothing is said.
    loose = quantize_verified(
        src, tmp_path / "loose.int8.onnx", _batches(4, 0), _batches(2, 100), type(INT8)(-1.0, 1e9), say=said.append
    )
    assert loose["int8_float_gemms"] == {} and loose["int8_gemms"] == "2 of 2" and loose["int8_smoothing"] == {}
    assert record["int8_float_gemms"] and len(said) == 1
    assert not any(n.op_type == "Mul" for n in load_onnx(tmp_path / "loose.int8.onnx").graph.node)


def test_smoothing_is_exact_and_lets_a_planted_outlier_pass_with_every_gemm_in_int8(tmp_path) -> None:
    """SmoothQuant's migration, applied when plain INT8 misses: the same function in float, a flat input in INT8."""
    src = _outlier_mlp(tmp_path / "mlp.onnx")
    calib, held = _batches(4, 0), _batches(2, 100)
    assert smooth(src, tmp_path / "smoothed.onnx", calib) == 2  # x (fc1's input) and h (fc2's)
    (exact,) = compare_on(OrtRunner(src, "cpu"), OrtRunner(tmp_path / "smoothed.onnx", "cpu"), held)[1:]
    assert exact.within(type(INT8)(0.99999, 1e-5))
    said: list[str] = []
    record = quantize_verified(src, tmp_path / "mlp.int8.onnx", calib, held, INT8, say=said.append)
    assert record["verify"]["cosine"] >= INT8.min_cosine and record["verify"]["rel_error"] <= INT8.max_rel_error
    assert record["int8_float_gemms"] == {} and record["int8_gemms"] == "2 of 2"
    smoothing = read_metadata(load_onnx(tmp_path / "mlp.int8.onnx"))["int8_smoothing"]
    assert smoothing["alpha"] == SMOOTH_ALPHA and smoothing["inputs"] == 2 and "missed the gate" in smoothing["why"]
    assert len(said) == 1 and "smoothing" in said[0]
    assert record["quantized_from"] == "mlp.onnx" and not (tmp_path / "mlp-inferred.onnx").exists()


def test_a_smoothed_graph_that_still_misses_keeps_gemms_float_ranked_on_the_smoothed_graph(tmp_path) -> None:
    """A gate INT8 cannot meet even smoothed: the fallback ranks the smoothed graph's GEMMs, keeps the worst float,
    and stops in one line when one GEMM would be left in INT8."""
    from corp_deploy.base.errors import CorpError

    src = _outlier_mlp(tmp_path / "mlp.onnx")
    said: list[str] = []
    with pytest.raises(CorpError, match="does not match"):
        quantize_verified(
            src, tmp_path / "mlp.int8.onnx", _batches(4, 0), _batches(2, 100), type(INT8)(1.0, 0.0), say=said.append
        )
    assert len(said) == 2 and "smoothing" in said[0] and "dB SQNR" in said[1]
    assert "missed the gate" in said[1] and said[1].split()[2] in {"fc1", "fc2"}


def _post_layernorm_block(path: Path, outlier: float = 100.0) -> Path:
    """y = LN2(h + h W), h = LN1(x): a post-LayerNorm encoder block whose residual stream h carries an outlier
    channel (LN1's gamma; W reads it scaled down), as BERT's does. LN2 leaves that channel out of y (gamma 0), so
    y shows what happens to h's ordinary channels. One per-tensor INT8 scale for h rounds them to a few levels:
    harmless in W's input (W is small), not in the residual."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 30
    w[0] /= outlier
    gamma1 = np.ones(WIDTH, np.float32)
    gamma1[0] = outlier
    gamma2 = np.ones(WIDTH, np.float32)
    gamma2[0] = 0
    zeros = np.zeros(WIDTH, np.float32)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma1", "beta"], ["h"], name="ln1"),
        helper.make_node("MatMul", ["h", "w"], ["u"], name="fc"),
        helper.make_node("Add", ["h", "u"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "gamma2", "beta"], ["y"], name="ln2"),
    ]
    weights = [
        numpy_helper.from_array(a, n) for a, n in ((w, "w"), (gamma1, "gamma1"), (gamma2, "gamma2"), (zeros, "beta"))
    ]
    graph = helper.make_graph(
        nodes,
        "post_ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_post_layernorm_residual_stays_float_and_only_the_gemm_reads_int8(tmp_path) -> None:
    src = _post_layernorm_block(tmp_path / "block.onnx")
    calib = [np.random.default_rng(i).standard_normal((16, WIDTH), dtype=np.float32) for i in range(4)]
    held = [np.random.default_rng(100).standard_normal((32, WIDTH), dtype=np.float32)]
    out = quantize_int8(src, tmp_path / "block.int8.onnx", calib)
    comparisons = compare_on(OrtRunner(src, "cpu"), OrtRunner(out, "cpu"), held)
    assert all(c.within(INT8) for c in comparisons), comparisons
    nodes = {n.name: n for n in load_onnx(out).graph.node}
    assert list(nodes["residual"].input) == ["h", "u"] and nodes["ln2"].input[0] == "r"
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "u" for n in nodes.values())  # outputs float
    assert nodes["fc"].input[0] != "h"  # the GEMM itself reads the dequantized INT8 copy


def test_text_gate_reads_real_tokens_only() -> None:
    """Padding positions are no one's output: garbage there passes, a wrong real token fails."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 6, 8)).astype(np.float32)
    feed = {"input_ids": np.ones((2, 6), np.int64), "attention_mask": np.array([[1] * 6, [1, 1, 1, 0, 0, 0]])}

    def reference(x: dict) -> np.ndarray:
        return hidden[: len(x["input_ids"])]

    def padded_garbage(x: dict) -> np.ndarray:
        out = reference(x).copy()
        out[x["attention_mask"] == 0] = 1e6
        return out

    comparisons = compare_on(reference, padded_garbage, feed)
    assert [c.batch for c in comparisons] == [6, 9] and all(c.cosine == pytest.approx(1.0) for c in comparisons)

    def wrong_token(x: dict) -> np.ndarray:
        out = reference(x).copy()
        out[0, 0] = -out[0, 0]
        return out

    assert compare_on(reference, wrong_token, feed)[1].cosine == pytest.approx(-1.0)


def _text(root: Path, docs: int = 40) -> Path:
    """Documents in two class folders, of 5 to 30 words of the tiny vocabulary."""
    rng = random.Random(0)
    for i in range(docs):
        folder = root / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        words = [rng.choice(TEXT_VOCAB[5:]) for _ in range(rng.randint(5, 30))]
        (folder / f"{i}.txt").write_text(" ".join(words))
    return root


@pytest.fixture(scope="module")
def text_graph(bert_graph, tmp_path_factory) -> dict[str, Path]:
    """A tiny BERT exported to ONNX (the session's ``bert_graph``, copied: quantize writes beside it), and a text
    folder of 40 documents."""
    tmp = tmp_path_factory.mktemp("int8text")
    onnx = tmp / "graph" / "m.onnx"
    onnx.parent.mkdir()
    shutil.copy2(bert_graph["onnx"], onnx)
    return {"model": bert_graph["model"], "onnx": onnx, "text": _text(tmp / "text")}


@pytest.mark.e2e
def test_quantize_a_text_encoder_on_documents_verified_on_held_out_ones(text_graph, capsys) -> None:
    onnx, text = text_graph["onnx"], text_graph["text"]
    argv = ["quantize", str(onnx), "--calib-dir", str(text), "--int8-calib", "24", "--int8-verify", "4"]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    out = onnx.with_name("m.int8.onnx")
    record = json.loads(Path(f"{out}.json").read_text())
    verify = record["verify"]
    assert verify["sequences"] == 4 and verify["tokens"] > 4 * 5 and verify["cosine"] >= INT8.min_cosine
    calibration = record["int8_calibration"]
    assert calibration["samples"] == 24 and calibration["source"] == str(text)
    assert (
        set(calibration["folders"]["calibration"]) == {"a", "b"}
        and sum(calibration["folders"]["verification"].values()) == 4
    )
    assert record["modality"] == "text" and "m.int8.onnx" in stdout
    # Batch and sequence stay dynamic: a shape never calibrated or verified (3 x 23, padded) runs and holds.
    graph = load_onnx(out, weights=False)
    assert all(not d.dim_value for i in graph.graph.input for d in i.type.tensor_type.shape.dim)
    from corp_deploy.exporters.text_onnx import example_inputs

    ids, mask = example_inputs(len(TEXT_VOCAB), 3, 23, seed=7)
    x = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    real = mask.numpy().astype(bool)
    assert compare(OrtRunner(onnx, "cpu")(x)[real], OrtRunner(out, "cpu")(x)[real]).within(INT8)


@pytest.mark.e2e
def test_prune_export_int8_on_a_text_encoder(text_graph, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["prune-export", str(text_graph["model"]), "--calib-dir", str(text_graph["text"]), "--seq-len", "32"]
    argv += ["--round-to", "4", "--quiet", "--num-calib", "24", "--calib-batch-size", "8", "--precision", "fp32,int8"]
    argv += ["--int8-calib", "16", "--int8-verify", "4", "--out", str(out)]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    records = {r["file"]: r for r in json.loads((out / "export.json").read_text())["onnx"]}
    for m in ("dense", "pruned"):
        r = records[f"{m}.int8.onnx"]
        assert r["precision"] == "int8" and r["verify"]["cosine"] >= INT8.min_cosine and r["verify"]["sequences"] == 4
    assert "pruned.int8.onnx" in stdout


TEXT_BAD = {
    "no text": ([], "no calibration text"),
    "images, not text": (["--calib-dir", "IMAGES"], "no text (.txt files"),
    "too few documents": (["--calib-dir", "FEW"], "too few documents to hold any out for INT8"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(TEXT_BAD), ids=list(TEXT_BAD))
def test_text_int8_without_text_is_one_line_and_writes_nothing(case, text_graph, tmp_path, capsys) -> None:
    extra, message = TEXT_BAD[case]
    (tmp_path / "images").mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    (tmp_path / "few").mkdir()
    (tmp_path / "few" / "one.txt").write_text("the news")
    src = tmp_path / "m.onnx"
    src.write_bytes(text_graph["onnx"].read_bytes())
    paths = {"IMAGES": str(tmp_path / "images"), "FEW": str(tmp_path / "few")}
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, stderr = run(["quantize", str(src), *[paths.get(a, a) for a in extra]], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and message in lines[0] and "Traceback" not in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_library_refuses_a_text_graph_without_text(text_graph, tmp_path) -> None:
    from corp_deploy.base.errors import CorpError

    with pytest.raises(CorpError, match="is a text encoder: its INT8 calibrates on text documents"):
        quantize_graphs([(text_graph["onnx"], tmp_path / "m.int8.onnx")], "synthetic", INT8)
    assert list(tmp_path.iterdir()) == []
