"""``exporters.attention``: each exported attention chain becomes one ``MultiHeadAttention`` computing the same thing.

Pruned encoders are the point: per-layer widths, Q/K narrower or wider than V, a Q/K head size that is no longer the
one the scale was written for. Every text case is compared with the unfused graph on padded batches (what a wrong
mask would change), and a chain whose mask is not the padding input is left alone. timm's ViT writes attention two
ways (dense: one packed ``qkv`` unbound in three; pruned: split by unequal widths): both fuse.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from helpers import padded_batches, pruned_copy, tiny_bert, tiny_vit

from corp_deploy.api import prune
from corp_deploy.core.config import PruneConfig, parse_budget
from corp_deploy.exporters.attention import fuse_attention
from corp_deploy.formats.sources import describe

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

CONFIGS = {
    "dense": None,
    "qk-narrower-than-v": PruneConfig(target="all", mlp_sparsity=0.5, qk_sparsity=0.5, v_sparsity=0.25, round_to=4),
    "per-layer-widths": PruneConfig(target="all", budget=parse_budget("macs=0.6"), round_to=4, allocation="local"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def encoder(request, tmp_path_factory):
    """A tiny BERT, pruned as the case says, exported as ``export`` writes it: (graph path, widths per layer)."""
    from corp_deploy.exporters.pipeline import export_verified

    model = tiny_bert()
    if CONFIGS[request.param] is not None:
        model = copy.deepcopy(model)
        prune(model, padded_batches(8), CONFIGS[request.param], "cpu", progress=False)
    path = tmp_path_factory.mktemp(request.param) / "m.onnx"
    export_verified(model, path, describe(model, "tiny", {}, "random", seq_len=24))
    widths = [(b.attention.self.query.out_features, b.attention.self.value.out_features) for b in model.encoder.layer]
    return path, widths


def _outputs(model: onnx.ModelProto) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, {k: v.numpy() for k, v in inputs.items()})[0] for inputs, _ in padded_batches(3, seed=7)]


def test_every_layer_becomes_one_multiheadattention_with_the_same_outputs(encoder) -> None:
    path, widths = encoder
    plain = onnx.load(str(path))
    fused = copy.deepcopy(plain)
    assert fuse_attention(fused) == len(widths) == 2
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "Softmax" not in ops and "Where" not in ops
    assert len(ops) < len(plain.graph.node) - 2 * 12  # each layer's chain was a dozen nodes or more
    onnx.checker.check_model(fused)
    for a, b in zip(_outputs(plain), _outputs(fused), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_the_scale_is_the_graphs_own_not_the_ops_default(encoder) -> None:
    """A pruned Q/K head keeps the dense head's 1/sqrt(d); the op's default would use the pruned head size."""
    path, widths = encoder
    fused = onnx.load(str(path))
    fuse_attention(fused)
    attrs = [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        for n in fused.graph.node
        if n.op_type == "MultiHeadAttention"
    ]
    assert [a["scale"] for a in attrs] == pytest.approx([1 / np.sqrt(16)] * 2)  # tiny_bert: 4 heads of 16
    assert [a["num_heads"] for a in attrs] == [4, 4] and all(qk % 4 == 0 and v % 4 == 0 for qk, v in widths)


def test_a_chain_masked_by_anything_but_the_padding_input_is_left_alone(encoder) -> None:
    path, _ = encoder
    model = onnx.load(str(path))
    for node in model.graph.node:  # the same mask, read from an input the rewrite knows nothing about
        node.input[:] = ["padding" if i == "attention_mask" else i for i in node.input]
    next(i for i in model.graph.input if i.name == "attention_mask").name = "padding"
    assert fuse_attention(model) == 0
    assert not any(n.op_type == "MultiHeadAttention" for n in model.graph.node)


def test_timm_vits_dense_and_pruned_with_unequal_widths_fuse_to_the_same_outputs(tmp_path) -> None:
    from corp_deploy.exporters.pipeline import export_verified

    dense = tiny_vit()
    pruned, _ = pruned_copy(dense, PruneConfig(target="all", mlp_sparsity=0.5, qk_sparsity=0.5, v_sparsity=0.25))
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32), dtype=np.float32)
    for name, model in (("dense", dense), ("pruned", pruned)):
        path = tmp_path / f"{name}.onnx"
        export_verified(model, path, describe(model, "tiny", {}, "random"))
        plain = onnx.load(str(path))
        fused = copy.deepcopy(plain)
        assert fuse_attention(fused) == len(model.blocks), name
        assert "Softmax" not in {n.op_type for n in fused.graph.node}
        a, b = (
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
            for m in (plain, fused)
        )
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
