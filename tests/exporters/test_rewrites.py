"""Exact fixed-cost rewrites (exporters/rewrites.py): the same function, the exported graph verified, the choice
per backend, and the record of what was applied."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_CLI_ARGS, pruned_copy, run, tiny_vit

from corp_deploy.base.errors import CorpError
from corp_deploy.bench.backends import BACKENDS, rewrites_on
from corp_deploy.bench.meter import BackendMeter
from corp_deploy.core.config import PruneConfig
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.pipeline import export_verified
from corp_deploy.exporters.rewrites import PATCH_LINEAR, LinearPatchEmbed, parse_rewrites, rewritten
from corp_deploy.formats.sources import describe
from corp_deploy.plan import speed


@pytest.mark.parametrize("patch", [4, 8])
def test_patch_linear_equals_the_convolution(patch: int) -> None:
    """Per patch the Linear sums the same products as the conv: equal to fp32 rounding, embedding and logits."""
    model = tiny_vit(patch_size=patch)
    new, applied = rewritten(model, [PATCH_LINEAR])
    assert applied == (PATCH_LINEAR,)
    assert isinstance(new.patch_embed, LinearPatchEmbed) and not isinstance(model.patch_embed, LinearPatchEmbed)
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        embedded, expected = new.patch_embed(x), model.patch_embed(x)
        assert embedded.shape == expected.shape == (5, (32 // patch) ** 2, model.embed_dim)
        torch.testing.assert_close(embedded, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new(x), model(x), rtol=1e-5, atol=1e-5)


def test_patch_linear_applies_to_the_pruned_model_too() -> None:
    """The rewrite touches only the patch embedding: a pruned model keeps its widths and its outputs."""
    pruned, _ = pruned_copy(tiny_vit(), PruneConfig(sparsity=0.5, round_to=4))
    new, applied = rewritten(pruned, [PATCH_LINEAR])
    assert applied == (PATCH_LINEAR,)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(new(x), pruned(x), rtol=1e-5, atol=1e-5)


def test_a_padded_convolution_is_left_alone() -> None:
    """Kernel != stride or padding: not one GEMM per patch, so nothing is rewritten (nor copied)."""
    model = tiny_vit()
    conv = model.patch_embed.proj
    model.patch_embed.proj = torch.nn.Conv2d(3, conv.out_channels, conv.kernel_size, conv.stride, padding=1)
    assert rewritten(model, [PATCH_LINEAR]) == (model, ())


def test_the_exported_graph_is_verified_and_records_the_rewrite(tmp_path) -> None:
    """``export_verified`` exports the rewritten copy and checks it against the model as given (no Conv left)."""
    pytest.importorskip("onnxruntime")
    model = tiny_vit()
    path = tmp_path / "dense.onnx"
    record = export_verified(model, path, describe(model, "tiny", {}, "random"), rewrites=[PATCH_LINEAR])
    assert record["rewrites"] == [PATCH_LINEAR]
    assert record["verify"]["cosine"] > 0.99999
    proto = load_onnx(path)
    ops = {n.op_type for n in proto.graph.node}
    assert "Conv" not in ops and "MatMul" in ops | {"Gemm"}
    assert read_metadata(proto)["rewrites"] == [PATCH_LINEAR]
    plain = export_verified(model, tmp_path / "plain.onnx", describe(model, "tiny", {}, "random"))
    assert plain["rewrites"] == [] and "Conv" in {n.op_type for n in load_onnx(tmp_path / "plain.onnx").graph.node}


def test_defaults_per_backend_and_parsing() -> None:
    """``auto`` is the backend's measured choice: the GPU's torch backends get the rewrite, the CPU ones do not."""
    assert BACKENDS["torch-cuda-fp16-graph"].default_rewrites == rewrites_on("torch-cuda-fp16") == (PATCH_LINEAR,)
    assert rewrites_on("ort-cpu-fp32") == rewrites_on("torch-cpu-fp32") == rewrites_on(None) == rewrites_on("x") == ()
    assert parse_rewrites("auto", rewrites_on("torch-cuda-fp16")) == (PATCH_LINEAR,)
    assert parse_rewrites("none", rewrites_on("torch-cuda-fp16")) == ()
    assert parse_rewrites(f"{PATCH_LINEAR}, {PATCH_LINEAR}") == (PATCH_LINEAR,)
    for bad in ("", "conv-gemm", f"none,{PATCH_LINEAR}"):
        with pytest.raises(CorpError, match="--rewrites takes auto, none or"):
            parse_rewrites(bad)


def test_the_latency_key_holds_the_rewrites(monkeypatch) -> None:
    """A table measured with the rewrite is not one without it: the key says which were applied (a CPU backend's
    key, which applies none, stays what it was, so its cached tables stay valid)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "a GPU")
    cuda = speed.key("deit_tiny", {}, BackendMeter(BACKENDS["torch-cuda-fp16-graph"]), 1, 2)
    cpu = speed.key("deit_tiny", {}, BackendMeter(BACKENDS["ort-cpu-fp32"]), 1, 2)
    assert cuda["rewrites"] == {"applied": [PATCH_LINEAR]} and cpu["rewrites"] == {"opset": 20}
    assert BACKENDS["torch-cuda-fp16-graph"].rewrites == (PATCH_LINEAR,) and BACKENDS["ort-cpu-fp32"].rewrites == ()


@pytest.mark.e2e
def test_prune_export_rewrites_dense_and_pruned_alike(tmp_path, capsys) -> None:
    """Both graphs carry the rewrite (the ratio between them compares like with like), each verified."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "run"
    argv = ["prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--calib", "synthetic", "--quiet"]
    code, stdout, err = run([*argv, "--precision", "fp32", "--rewrites", PATCH_LINEAR, "--out", str(out)], capsys)
    assert code == 0, err
    assert "exact rewrites (verified above): dense.onnx (patch-linear); pruned.onnx (patch-linear)" in stdout
    onnx = json.loads((out / "export.json").read_text())["onnx"]
    assert {r["file"]: r["rewrites"] for r in onnx} == {"dense.onnx": [PATCH_LINEAR], "pruned.onnx": [PATCH_LINEAR]}
    code, _, err = run([*argv, "--rewrites", "conv-gemm", "--out", str(tmp_path / "bad")], capsys)
    assert code == 1 and err.count("\n") == 1 and "--rewrites takes auto, none or" in err
    assert not (tmp_path / "bad").exists()
