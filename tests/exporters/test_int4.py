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

from corp_deploy.base.errors import CorpError

pytest.importorskip("transformers", reason="text models need transformers (pip install '.[text]')")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from corp_deploy.exporters.int4 import calibration_record, int4_graphs  # noqa: E402
from corp_deploy.exporters.int4_gate import DecoderTolerance  # noqa: E402
from corp_deploy.exporters.int4_grid import grid_weight  # noqa: E402
from corp_deploy.exporters.int4_quant import (  # noqa: E402
    MINS,
    Scheme,
    dequantize,
    error_feedback_grids,
    matmul_errors,
    minmax_int4,
)
from corp_deploy.exporters.onnx_export import load_onnx  # noqa: E402
from corp_deploy.exporters.text_onnx import export_text_onnx  # noqa: E402
from corp_deploy.families.hf import hub  # noqa: E402
from corp_deploy.formats.artifact import load_pruned  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model folder, text folder, its FP32 logits graph)."""
    root = tmp_path_factory.mktemp("int4")
    folder, text = tiny_llama_folder(root)
    model, _ = hub.load(str(folder))
    graph = export_text_onnx(model, root / "dense.onnx", metadata={"modality": "text", "vocab_size": 300})
    return folder, text, graph


DOWN_PROJ = "/model/model/layers.0/mlp/down_proj/MatMul"
"""The first layer's down_proj in the traced logits graph (``text_onnx``'s TorchScript tracer names nodes by module)."""


def _windows(n: int = 4, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 300, (n, SEQ))


def _calibration() -> np.ndarray:
    """Windows standing in for the calibration documents' (apart from ``_windows()``, the gate's)."""
    return _windows(3, seed=11)


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
    scheme = Scheme(block_size=16, method="rtn", lm_head="int4", int8_outliers_db=None)
    record = int4_graphs([(graph, out)], windows, DecoderTolerance(2.0, 0.5), scheme)[0]
    proto = onnx.load(str(out))
    ops = [n.op_type for n in proto.graph.node]
    constants = {t.name for t in proto.graph.initializer}
    assert ops.count("MatMulNBits") == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and constants & set(n.input)]
    attrs = {a.name: a.i for n in proto.graph.node if n.op_type == "MatMulNBits" for a in n.attribute}
    assert attrs["block_size"] == 16 and attrs["bits"] == 4 and attrs["accuracy_level"] == 4
    meta = {e.key: e.value for e in proto.metadata_props}
    assert meta["precision"] == "int4" and json.loads(meta["int4_scheme"])["symmetric"] is True
    assert json.loads(meta["int4_scheme"])["method"] == "rtn" and json.loads(meta["int4_kept_float"]) == []
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
    default = (Scheme(), None, False, _calibration())  # the default scheme, which ranks MatMuls on calibration text
    measured = int4_graphs([(graph, tmp_path / "ok.int4.onnx")], windows, DecoderTolerance(10.0, 0.0), *default)
    measured = measured[0]["verify"]
    for tol in (
        DecoderTolerance(measured["ppl_ratio"] - 1e-6, 0.0),
        DecoderTolerance(10.0, measured["agreement"] + 1e-6),
    ):
        out = tmp_path / "bad" / "dense.int4.onnx"
        out.parent.mkdir(exist_ok=True)
        with pytest.raises(CorpError, match="fails its gate") as e:
            int4_graphs([(graph, out)], windows, tol, *default)
        assert "\n" not in str(e.value) and not any(out.parent.iterdir())
    tol = DecoderTolerance(measured["ppl_ratio"], measured["agreement"])  # a figure equal to its bound passes
    int4_graphs([(graph, tmp_path / "edge.int4.onnx")], windows, tol, *default)


def test_refusals_before_any_work(decoder, tmp_path) -> None:
    _, _, graph = decoder
    with pytest.raises(CorpError, match="power of two"):
        Scheme(block_size=24)
    with pytest.raises(CorpError, match="need calibration windows"):  # the default ranks MatMuls on calibration text
        int4_graphs([(graph, tmp_path / "q.int4.onnx")], _windows(), DecoderTolerance(10, 0))
    int4_graphs(
        [(graph, tmp_path / "q.int4.onnx")], _windows(), DecoderTolerance(10, 0), Scheme(), None, False, _calibration()
    )
    calibrated = (DecoderTolerance(10, 0), Scheme(), None, False, _calibration())
    with pytest.raises(CorpError, match="not an FP32 graph"):
        int4_graphs([(tmp_path / "q.int4.onnx", tmp_path / "qq.int4.onnx")], _windows(), *calibrated)
    with pytest.raises(CorpError, match="exists"):
        int4_graphs([(graph, tmp_path / "q.int4.onnx")], _windows(), *calibrated)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.int4.onnx", "q.int4.onnx.json"]


def _constants(proto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}


def _kernel_output(proto, node, x: np.ndarray) -> np.ndarray:
    """One MatMulNBits node of ``proto`` alone in a graph, run by onnxruntime's CPU kernel on ``x``."""
    h = onnx.helper
    k, n = (a.i for a in node.attribute if a.name in ("K", "N"))
    inits = [t for t in proto.graph.initializer if t.name in node.input[1:]]
    graph = h.make_graph(
        [node],
        "one",
        [h.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT, ["m", k])],
        [h.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, ["m", n])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {node.input[0]: x})[0]


def test_hqq_has_a_float_zero_point_per_block_and_an_int8_head_and_the_sidecar_says_so(decoder, tmp_path) -> None:
    _, _, graph = decoder
    out, windows = tmp_path / "dense.int4.onnx", _windows()
    scheme = Scheme(block_size=16, method="hqq", int8_outliers_db=None)
    record = int4_graphs([(graph, out)], windows, DecoderTolerance(2.0, 0.5), scheme)[0]
    proto = onnx.load(str(out))
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    bits = {n.name: {a.name: a.i for a in n.attribute} for n in nbits}
    head = next(n for n in proto.graph.node if "logits" in n.output)
    assert head.op_type == "MatMulNBits" and bits[head.name]["bits"] == 8  # the LM head: 8-bit
    assert sorted(b["bits"] for b in bits.values()) == [4] * 14 + [8]
    assert all(b["block_size"] == 16 and b["accuracy_level"] == 4 for b in bits.values())
    constants = _constants(proto)
    floats = [n for n in nbits if n is not head and constants[n.input[3]].dtype == np.float32]
    assert len(floats) == 14  # HQQ: a float zero point per block
    s = record["int4_scheme"]
    assert (s["method"], s["block_size"], s["symmetric"], s["accuracy_level"]) == ("hqq", 16, False, 4)
    assert s["zero_point"] == "float per block" and s["lm_head"].startswith("int8")
    assert record["int4_kept_float"] == [] and record["int4_matmuls"] == 14
    assert record["int4_lm_head"] == {"node": head.name.removesuffix("_Q8"), "precision": "int8"}
    assert "calibration" not in record  # HQQ reads no data
    rng = np.random.default_rng(0)
    for node in (nbits[0], head):  # the recorded weights are what the kernel multiplies by
        x = rng.standard_normal((3, bits[node.name]["K"])).astype(np.float32)
        w = dequantize(node, constants)
        assert np.allclose(_kernel_output(proto, node, x), x @ w, rtol=2e-2, atol=2e-2 * np.abs(x @ w).max())
    float_head = int4_graphs(
        [(graph, tmp_path / "h.int4.onnx")],
        windows,
        DecoderTolerance(2.0, 0.5),
        Scheme(method="hqq", lm_head="fp32", int8_outliers_db=None),
    )
    head = next(n for n in onnx.load(str(tmp_path / "h.int4.onnx")).graph.node if "logits" in n.output)
    assert head.op_type == "MatMul" and float_head[0]["int4_matmuls"] == 14
    assert float_head[0]["int4_kept_float"] == [{"node": head.name, "reason": "the LM head (--int4-lm-head fp32)"}]


def test_keep_float_leaves_the_worst_measured_matmuls_float_and_names_them(decoder, tmp_path) -> None:
    _, _, graph = decoder
    out, windows, calibration = tmp_path / "dense.int4.onnx", _windows(), _windows(3, seed=11)
    scheme = Scheme(block_size=16, method="rtn", keep_float=2, int8_outliers_db=None)
    with pytest.raises(CorpError, match="need calibration windows"):
        int4_graphs([(graph, out)], windows, DecoderTolerance(2.0, 0.5), scheme)
    assert not out.exists()
    info = {"text": "synthetic", "part": "calibration"}
    record = int4_graphs([(graph, out)], windows, DecoderTolerance(2.0, 0.5), scheme, None, False, calibration, info)[0]
    proto = onnx.load(str(out))
    kept = record["int4_kept_float"]
    assert len(kept) == 2 and all("SQNR" in f["reason"] and "calibration windows" in f["reason"] for f in kept)
    constants = _constants(proto)
    by_name = {n.name: n for n in proto.graph.node}
    for f in kept:  # float in the graph: a MatMul over a float32 weight
        node = by_name[f["node"]]
        assert node.op_type == "MatMul" and constants[node.input[1]].dtype == np.float32
    assert sum(n.op_type == "MatMulNBits" for n in proto.graph.node) == 14 - 2 + 1  # and the int8 head
    assert [n for n, _ in record["int4_worst_sqnr_db"][:2]] == [f["node"] for f in kept]  # the worst two
    assert record["calibration"] == calibration_record(calibration, info)
    assert record["calibration"]["ids_sha256"] == __import__("hashlib").sha256(calibration.astype(np.int64)).hexdigest()
    everything = onnx.load(str(graph))
    rtn = tmp_path / "all.int4.onnx"
    int4_graphs([(graph, rtn)], windows, DecoderTolerance(2.0, 0.5), Scheme(16, method="rtn", int8_outliers_db=None))
    ranked = matmul_errors(everything, onnx.load(str(rtn)), calibration)  # the ranking, recomputed independently
    assert [n for n, _ in ranked[:2]] == [f["node"] for f in kept]


def test_gptq_reads_calibration_windows_and_a_failing_gate_still_writes_nothing(decoder, tmp_path) -> None:
    _, _, graph = decoder
    windows, calibration = _windows(), _windows(4, seed=5)
    out = tmp_path / "g" / "dense.int4.onnx"
    out.parent.mkdir()
    scheme = Scheme(block_size=16, method="gptq", keep_nodes=(DOWN_PROJ,), int8_outliers_db=None)  # named
    with pytest.raises(CorpError, match="fails its gate"):
        int4_graphs([(graph, out)], windows, DecoderTolerance(10.0, 1.01), scheme, None, False, calibration)
    assert not any(out.parent.iterdir())
    record = int4_graphs([(graph, out)], windows, DecoderTolerance(10.0, 0.0), scheme, None, False, calibration)[0]
    proto = onnx.load(str(out))
    bits = sorted(
        next(a.i for a in n.attribute if a.name == "bits") for n in proto.graph.node if n.op_type == "MatMulNBits"
    )
    assert bits == [4] * 13 + [8]  # onnxruntime's GPTQ ignores nodes_to_exclude: the head and the named one held back
    assert next(n for n in proto.graph.node if n.name == DOWN_PROJ).op_type == "MatMul"
    assert record["int4_kept_float"] == [{"node": DOWN_PROJ, "reason": "named by the caller"}]
    assert not [n for n in proto.graph.node if n.op_type == "Identity" and n.name.endswith(".kept_float")]
    assert record["int4_scheme"]["method"] == "gptq" and record["int4_scheme"]["symmetric"] is True
    assert record["calibration"]["windows"] == 4 and record["calibration"]["seq_len"] == SEQ
    rtn = tmp_path / "rtn.int4.onnx"
    int4_graphs(
        [(graph, rtn)],
        windows,
        DecoderTolerance(10.0, 0.0),
        Scheme(16, method="rtn", lm_head="int4", int8_outliers_db=None),
    )
    gptq_weights, rtn_proto = _constants(proto), onnx.load(str(rtn))
    rtn_weights = {
        n.output[0]: _constants(rtn_proto)[n.input[1]] for n in rtn_proto.graph.node if n.op_type == "MatMulNBits"
    }
    differs = [
        n.name
        for n in proto.graph.node
        if n.op_type == "MatMulNBits" and not np.array_equal(gptq_weights[n.input[1]], rtn_weights[n.output[0]])
    ]
    assert differs  # GPTQ's rounding is not round-to-nearest's
    with pytest.raises(CorpError, match="symmetric form"):
        Scheme(method="hqq", symmetric=True)
    with pytest.raises(CorpError, match="--int4-method"):
        Scheme(method="awq")


def _one_matmul(weight: np.ndarray):
    h = onnx.helper
    k, n = weight.shape
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="fc")],
        "fc",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "s", k])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", "s", n])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_minmax_gives_a_q4_1_weight_back_exactly_and_rounds_any_other_to_half_a_step(tmp_path) -> None:
    rng = np.random.default_rng(0)
    k, n, block = 64, 24, 16
    low = rng.standard_normal((k // block, 1, n)).astype(np.float32) * 0.1
    step = rng.uniform(0.001, 0.02, (k // block, 1, n)).astype(np.float32)
    codes = rng.integers(0, 16, (k // block, block, n))
    codes[:, 0], codes[:, 1] = 0, 15  # each block spans its grid, as a Q4_1 block does
    grid = (low + step * codes).reshape(k, n).astype(np.float32)
    x = rng.standard_normal((2, 5, k)).astype(np.float32)
    for weight, exact in ((grid, True), (rng.standard_normal((k, n)).astype(np.float32), False)):
        proto = _one_matmul(weight)
        minmax_int4(proto, block, 0, set())
        ops = [node.op_type for node in proto.graph.node]
        assert ops.count("MatMulNBits") == 1 and "fc" not in [node.name for node in proto.graph.node]
        constants = _constants(proto)
        node = next(node for node in proto.graph.node if node.op_type == "MatMulNBits")
        assert not constants[node.input[3]].any()  # zero point 0: the kernel's uint4 path
        w = dequantize(node, constants) + np.repeat(constants[f"fc{MINS}"], block, axis=0)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        y = session.run(None, {"x": x})[0]
        assert np.allclose(y, x @ w, rtol=1e-5, atol=1e-5)  # the graph computes with that weight
        half_step = np.repeat(np.ptp(weight.reshape(-1, block, n), axis=1) / 30, block, axis=0)
        if exact:
            assert np.allclose(w, weight, rtol=0, atol=1e-6)
        else:
            assert (np.abs(w - weight) <= half_step + 1e-6).all() and not np.allclose(w, weight, atol=1e-3)
    short = _one_matmul(grid[:40])  # K not a multiple of the block: the last block is short
    minmax_int4(short, block, 0, set())
    w = dequantize(next(n for n in short.graph.node if n.op_type == "MatMulNBits"), _constants(short))
    assert np.allclose(w + np.repeat(_constants(short)[f"fc{MINS}"], block, axis=0)[:40], grid[:40], atol=1e-6)
    y = ort.InferenceSession(short.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x[..., :40]}
    )[0]
    assert np.allclose(y, x[..., :40] @ grid[:40], rtol=1e-5, atol=1e-5)


def test_minmax_on_a_decoder_runs_on_matmulnbits_and_records_its_method(decoder, tmp_path) -> None:
    _, _, graph = decoder
    out = tmp_path / "dense.int4.onnx"
    scheme = Scheme(block_size=16, method="minmax", int8_outliers_db=None)
    record = int4_graphs([(graph, out)], _windows(), DecoderTolerance(2.0, 0.5), scheme)[0]
    proto = onnx.load(str(out))
    nbits = {n.name: {a.name: a.i for a in n.attribute} for n in proto.graph.node if n.op_type == "MatMulNBits"}
    assert sorted(b["bits"] for b in nbits.values()) == [4] * 14 + [8] and record["int4_matmuls"] == 14
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.name in weight_names(graph)]
    s = record["int4_scheme"]
    assert (s["method"], s["block_size"], s["symmetric"], s["accuracy_level"]) == ("minmax", 16, False, 4)
    assert s["zero_point"].startswith("float offset") and s["quantizer"].startswith("corp-deploy")
    assert record["verify"]["ppl_ratio"] < 2.0 and record["int4_kept_float"] == []


def weight_names(graph: Path) -> set[str]:
    proto = onnx.load(str(graph))
    constants = {t.name for t in proto.graph.initializer}
    return {n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in constants}


def test_the_default_quantizes_the_one_matmul_off_a_q4_1_grid_with_error_feedback_and_the_rest_exactly(
    decoder, tmp_path
) -> None:
    """The real case in miniature: a GGUF Q4_1 model's weights sit on a grid of 16 levels per block, except those
    CORP's compensation rewrote (the pruned down_proj). minmax gives the grid back; the measured outlier stays 4-bit,
    its codes chosen by GPTQ's error feedback on a grid with a uint4 zero point (no offset nodes), recorded with its
    SQNR rounded and with feedback; without error feedback it goes to 8 bits."""
    _, _, graph = decoder
    proto = onnx.load(str(graph))
    weights = {n.input[1]: n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name in weight_names(graph)}
    for t in proto.graph.initializer:
        if t.name in weights and weights[t.name] != DOWN_PROJ:
            w = onnx.numpy_helper.to_array(t)
            b = w.reshape(-1, 16, w.shape[1])
            low, step = b.min(1, keepdims=True), np.ptp(b, axis=1, keepdims=True) / 15
            t.CopyFrom(onnx.numpy_helper.from_array((low + step * np.round((b - low) / step)).reshape(w.shape), t.name))
    gridded = tmp_path / "grid.onnx"
    onnx.save(proto, str(gridded))
    out, eight = tmp_path / "grid.int4.onnx", tmp_path / "grid.int8.onnx"
    tol = DecoderTolerance(1.25, 0.8)
    record = int4_graphs([(gridded, out)], _windows(), tol, Scheme(16), None, False, _calibration())[0]
    assert record["int4_scheme"]["method"] == "minmax" and record["int4_scheme"]["error_feedback"]
    assert record["int4_int8"] == [] and record["int4_kept_float"] == [] and record["int4_matmuls"] == 14
    (feedback,) = record["int4_error_feedback"]
    assert feedback["node"] == DOWN_PROJ and "with error feedback" in feedback["reason"]
    assert record["int4_worst_sqnr_db"][0][0] == DOWN_PROJ and record["int4_worst_sqnr_db"][0][1] < 30
    assert record["int4_median_sqnr_db"] > 60 and record["verify"]["agreement"] > 0.9
    int4 = onnx.load(str(out))
    nodes, constants = {n.name: n for n in int4.graph.node}, _constants(int4)
    assert f"{DOWN_PROJ}.offsets" not in nodes and f"{DOWN_PROJ}{MINS}" not in constants  # the zero point holds it
    grid = error_feedback_grids(load_onnx(gridded), {DOWN_PROJ}, _calibration(), 16)[DOWN_PROJ]
    assert np.allclose(dequantize(nodes[f"{DOWN_PROJ}_Q4"], constants), grid_weight(*grid, 16), rtol=0, atol=1e-6)
    node = onnx.NodeProto()
    node.CopyFrom(nodes[f"{DOWN_PROJ}_Q4"])
    next(a for a in node.attribute if a.name == "accuracy_level").i = 0  # float activations: the weight alone
    x = np.random.default_rng(0).standard_normal((5, grid[0].shape[0])).astype(np.float32)
    assert np.allclose(_kernel_output(int4, node, x), x @ grid_weight(*grid, 16), rtol=1e-4, atol=1e-4)
    record = int4_graphs(
        [(gridded, eight)], _windows(), tol, Scheme(16, error_feedback=False), None, False, _calibration()
    )[0]
    assert [r["node"] for r in record["int4_int8"]] == [DOWN_PROJ] and record["int4_error_feedback"] == []
    assert "below" in record["int4_int8"][0]["reason"] and record["int4_matmuls"] == 13
    nodes = {n.name: n for n in onnx.load(str(eight)).graph.node}
    assert next(a.i for a in nodes[f"{DOWN_PROJ}_Q8"].attribute if a.name == "bits") == 8


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
    code, stdout, stderr = run([*argv, "--verify-batch-sizes", "1,2", "--out", str(out)], capsys)
    assert code == 0, stderr
    assert "top-1 agree" in stdout
    genai = json.loads((out / "export.json").read_text())["genai"]  # dense: genai's builder; V-pruned: torch.export
    dense = genai["dense-genai"]
    assert dense["writer"].startswith("onnxruntime-genai") and "why_not_fused" not in dense
    assert "for V: GroupQueryAttention" in genai["pruned-genai"]["why_not_fused"]
    export = json.loads((out / "export.json").read_text())
    records = export["int4"]
    assert [r["folder"] for r in records] == ["dense-genai-int4", "pruned-genai-int4"]
    # the quantize-only baseline: genai's builder -p int4 of the dense model, gated, timed beside both in one run
    baseline = export["int4_baseline"]
    assert baseline["folder"] == "baseline-genai-int4" and baseline["int4_scheme"]["method"] == "builder"
    speed = export["int4_speed"]["decode_ms_per_token"]
    assert sorted(speed) == ["baseline-genai-int4", "dense-genai-int4", "pruned-genai-int4"]
    row = next(line for line in stdout.splitlines() if line.startswith("baseline-genai-int4 (quantize-only baseline)"))
    verdict = "passes" if baseline["int4_baseline"]["passes_gate"] else "fails"
    assert f"{verdict} gate x{baseline['verify']['ppl_ratio']:.3f}" in row and "1.00x" in row
    assert all(r["verify"]["text"] == str(text) and r["verify"]["windows"] == 4 for r in records)
    int4_folder = out / "pruned-genai-int4"
    files = {"model.onnx", "model.onnx.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert files <= {f.name for f in int4_folder.iterdir()}
    assert (int4_folder / "genai_config.json").read_text() == (out / "pruned-genai" / "genai_config.json").read_text()
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(int4_folder / "model.onnx")).graph.node}

    og = pytest.importorskip("onnxruntime_genai")
    from corp_deploy.base.timing import GenaiSession

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
    code, stdout, stderr = run([*bench, *fast, "--gate", "quantize-only", "--max-regression", "900%"], capsys)
    assert code == 0, stderr
    assert stdout.count("genai-cpu-int4  cpu     int4") == 2  # prefill and decode rows
    assert "regression gate (quantize-only, max 900.0%): 0 of 2 regressed" in stdout  # int4 prefill and decode
    assert "genai-cpu-int4 batch 2 decode at prompt 8 pruned vs quantize-only baseline p50 ms" in stdout
    assert "pruned vs quantize-only" in stdout and "quantize-only baseline: baseline-genai-int4/: " in stdout
    assert f"{verdict} gate x" in stdout.split("quantize-only baseline: ")[1]

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


def test_a_graph_with_external_weights_is_quantized_one_weight_at_a_time_to_the_same_int4_graph(
    decoder, tmp_path, monkeypatch
) -> None:
    """The FP32 graph is read without its weights (the 1.7B shape's are 6.4 GiB beside the graph): each MatMul's
    weight is read when its turn comes, onnxruntime reads the ranking's activations from the file, and what stays
    float is taken in last. The INT4 graph is the one quantized from the graph held whole."""
    from corp_deploy.exporters import int4_quant

    _, _, graph = decoder
    outside = tmp_path / "outside" / "model.onnx"
    outside.parent.mkdir()
    proto = onnx.load(str(graph))
    onnx.save(proto, str(outside), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    loads: list[bool] = []
    real = int4_quant.load_onnx

    def spy(path, weights=True):
        loads.append(weights)
        return real(path, weights)

    monkeypatch.setattr(int4_quant, "load_onnx", spy)
    scheme = Scheme(block_size=16)  # minmax, the LM head in 8 bits, MatMuls ranked on calibration windows
    whole, apart = tmp_path / "whole.int4.onnx", tmp_path / "apart.int4.onnx"
    int4_quant.quantize_int4(graph, whole, scheme, _calibration())
    int4_quant.quantize_int4(outside, apart, scheme, _calibration())
    assert loads and not any(loads)  # never with its weights
    a, b = onnx.load(str(whole)), onnx.load(str(apart))
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    assert a.metadata_props == b.metadata_props and len(a.graph.initializer) == len(b.graph.initializer)
    for x, y in zip(a.graph.initializer, b.graph.initializer, strict=True):
        assert x.name == y.name and np.array_equal(onnx.numpy_helper.to_array(x), onnx.numpy_helper.to_array(y))


def test_the_error_ranking_reads_fewer_windows_where_their_activations_would_pass_the_bound(
    decoder, monkeypatch
) -> None:
    """Every weight MatMul's input is held for the ranking: where the windows' rows would pass ``ACTIVATION_BYTES``
    (the 1.7B shape's 16 windows: 2.8 GB), the first ones that fit are read, and the record says how many."""
    from corp_deploy.exporters import int4_quant

    _, _, graph = decoder
    fp32, calibration = load_onnx(graph, weights=False), _windows(16, seed=11)
    assert len(int4_quant.ranking_windows(fp32, calibration)) == int4_quant.RANK_WINDOWS  # a small model: all
    one = 4 * SEQ * sum(int4_quant._input_widths(fp32).values())
    monkeypatch.setattr(int4_quant, "ACTIVATION_BYTES", 3 * one + 1)
    assert len(int4_quant.ranking_windows(fp32, calibration)) == 3
    acts = int4_quant.ranking_activations(fp32, int4_quant.ranking_windows(fp32, calibration))
    assert sum(x.nbytes for x in acts.values()) <= 3 * one + 1 and {x.shape[0] for x in acts.values()} == {3 * SEQ}
