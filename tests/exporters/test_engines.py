"""Engines built for real: TensorRT-RTX builds ahead of time on this CPU-only machine.

Dense and pruned tiny ViTs (head dim 32; pruned Q/K 16, V 32), FP32 and FP16, through the same
``export_run`` that ``prune-export`` uses; then the sidecar, the attention-fusion finding, the
refusals the runner makes before deserializing, and bad input.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import pruned_copy, tiny_vit

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import sha256
from corp_deploy.core.config import PruneConfig
from corp_deploy.exporters import tensorrt_engine
from corp_deploy.exporters.onnx_export import load_onnx, read_metadata
from corp_deploy.exporters.pipeline import VerifyOptions, engine_verified, export_run, format_summary
from corp_deploy.exporters.tensorrt_engine import (
    FLAVOURS,
    RTX_COMPUTE_CAPABILITIES,
    RTX_DEFAULT_TARGETS,
    VERIFIED,
    BuildOptions,
    Profile,
    TrtRunner,
    build_engine,
    build_missing,
    check_compatible,
    flavour_missing,
    load_runtime,
    parse_compute_capabilities,
    read_engine_meta,
    sidecar,
)
from corp_deploy.formats.sources import describe

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

RTX_MISSING = flavour_missing(FLAVOURS["tensorrt-rtx"])
needs_rtx = pytest.mark.skipif(RTX_MISSING is not None, reason=f"TensorRT-RTX engines: {RTX_MISSING}")
BUILD = BuildOptions(profile=Profile(1, 4, 8), workspace_gib=1, runtime="tensorrt-rtx")
WIDE = {"embed_dim": 128, "num_heads": 4}
"""Head dim 32: at 50% the pruned Q/K width is 16 (the smallest fused-attention head size), V stays 32."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    """``export_run`` on dense and pruned tiny ViTs: four ONNX files and four TensorRT-RTX engines."""
    if RTX_MISSING:
        pytest.skip(f"TensorRT-RTX engines: {RTX_MISSING}")
    out = tmp_path_factory.mktemp("run")
    dense = tiny_vit(**WIDE)
    pruned, _ = pruned_copy(dense, PruneConfig(sparsity=0.5, round_to=8))
    models = {m: (net, describe(net, "tiny", WIDE, "random")) for m, net in (("dense", dense), ("pruned", pruned))}
    return out, export_run(models, out, build=BUILD, require_engines=True)


def _engine(record: dict, name: str) -> dict:
    return next(e for e in record["engines"] if e["file"] == name)


@needs_rtx
def test_rtx_engines_for_dense_and_pruned_fp32_fp16_are_real_and_honestly_labelled(run) -> None:
    out, record = run
    assert [e["file"] for e in record["engines"]] == [
        "dense.fp32.plan",
        "pruned.fp32.plan",
        "dense.fp16.plan",
        "pruned.fp16.plan",
    ]
    version = __import__("tensorrt_rtx_bindings").__version__
    for e in record["engines"]:
        engine = out / e["file"]
        assert e["flavour"] == "tensorrt-rtx" and e["version"] == version and "gpu" not in e
        assert e["targets"] == list(RTX_DEFAULT_TARGETS) and e["targets_default"]
        assert e["engine_bytes"] == engine.stat().st_size > 100_000 and e["build_seconds"] > 0
        assert json.loads(sidecar(engine).read_text()) == {k: v for k, v in e.items() if k != "file"}
        assert read_engine_meta(engine)["engine_sha256"] == sha256(engine)
        source = out / e["onnx"]["path"]
        assert source.name == e["file"].replace(".fp32.plan", ".onnx").replace(".plan", ".onnx")
        assert e["precision"] == ("fp16" if ".fp16." in source.name else "fp32")
        # Nothing claims a verification that did not run.
        assert (e["status"] == VERIFIED) == (e["verify"] is not None)
        if not torch.cuda.is_available():
            assert e["status"] == "built only (not executed: no supported GPU here: no CUDA GPU is visible)"
    text = format_summary(record)
    if not torch.cuda.is_available():
        assert text.count("built, not executed") == 4 and "engines built only (not executed: no supported GPU" in text


@needs_rtx
def test_parser_accepts_the_pruned_graph_with_unequal_qk_and_v_widths(run) -> None:
    out, record = run
    structure = read_metadata(load_onnx(out / "pruned.onnx", weights=False))["structure"]
    assert {b["qk_dim"] for b in structure} == {16}  # V keeps the head dim 32
    assert _engine(record, "pruned.fp16.plan")["attention"]["blocks"] == len(structure) == 2


@needs_rtx
def test_attention_fusion_is_read_from_the_ahead_of_time_build(run) -> None:
    """FP16 dense: one fused MHA kernel per block; FP16 pruned (Q/K 16 != V 32): none (TensorRT-RTX 1.7)."""
    _, record = run
    dense, pruned = _engine(record, "dense.fp16.plan"), _engine(record, "pruned.fp16.plan")
    assert dense["attention"] == {
        "blocks": 2,
        "fused_mha_layers": 2,
        "seen_in": "the builder's layer list (verbose log)",
    }
    assert pruned["attention"]["fused_mha_layers"] == 0


@needs_rtx
def test_profile_covers_the_verify_batches_or_nothing_is_built(run, tmp_path) -> None:
    out, record = run
    assert all(e["profile"] == {"min": 1, "opt": 4, "max": 8} for e in record["engines"])
    assert all(e["input"] == {"name": "images", "shape": [3, 32, 32]} for e in record["engines"])
    with pytest.raises(CorpError, match="verify batch sizes 16 are outside the engine batch range 1:4:8"):
        engine_verified(out / "pruned.onnx", tmp_path / "p.plan", BUILD, VerifyOptions(batches=(1, 16)))
    assert list(tmp_path.iterdir()) == []


@needs_rtx
def test_build_verification_checks_staleness_against_the_graph_it_built_from(run, tmp_path, monkeypatch) -> None:
    out, _ = run
    asked: list = []
    real = tensorrt_engine.run_missing
    monkeypatch.setattr(tensorrt_engine, "run_missing", lambda *a, **k: asked.append(k.get("onnx")) or real(*a, **k))
    build_engine(out / "pruned.fp16.onnx", tmp_path / "p.plan", BUILD, check=lambda engine: {})
    assert asked == [out / "pruned.fp16.onnx"]


@needs_rtx
def test_compute_capability_targets_are_built_and_recorded(run, tmp_path) -> None:
    out, _ = run
    options = BuildOptions(profile=Profile(1, 4, 8), compute_capabilities=("7.5",))  # auto: TensorRT-RTX
    record = engine_verified(out / "pruned.fp16.onnx", tmp_path / "turing.plan", options)
    # TensorRT-RTX has no FP32 GEMM for Turing: a real build failure, reported in one line, nothing written.
    assert record["flavour"] == "tensorrt-rtx" and record["targets"] == ["7.5"] and not record["targets_default"]
    with pytest.raises(CorpError, match=r"^TensorRT-RTX could not build an engine from .*Turing \(SM75\)"):
        engine_verified(out / "pruned.onnx", tmp_path / "turing32.plan", replace(options, precision="fp32"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turing.plan", "turing.plan.json"]


@needs_rtx
def test_support_matrix_matches_the_installed_library() -> None:
    import tensorrt_rtx_bindings as trt

    members = [n for n in trt.ComputeCapability.__members__ if n.startswith("SM")]
    assert [f"{n[2:-1]}.{n[-1]}" for n in members] == list(RTX_COMPUTE_CAPABILITIES)
    assert parse_compute_capabilities("8.9, 7.5") == ("7.5", "8.9") and parse_compute_capabilities(None) == ()
    for bad in ("9.0", "sm_89", ""):
        with pytest.raises(CorpError, match="--compute-capability takes TensorRT-RTX targets"):
            parse_compute_capabilities(bad)


RTX_HERE = {"version": "1.7.1.116", "cuda": "13.0"}


@pytest.mark.parametrize(
    ("gpu", "targets", "message"),
    [
        (
            ("NVIDIA H100 80GB HBM3", "9.0"),
            None,
            "compute capability 8.0-12.x, 7.5 on request\\); this GPU is NVIDIA H100",
        ),
        (("NVIDIA H200", "9.0"), ["9.0"], "^TensorRT-RTX engines run on RTX-class GPUs .*NVIDIA H200, 9.0$"),
        (
            ("NVIDIA GeForce RTX 2080 Ti", "7.5"),
            None,
            "targets compute capability 8.0, .*rebuild it with --compute-capability 7.5",
        ),
        (
            ("NVIDIA GeForce RTX 4090", "8.9"),
            ["8.6"],
            "targets compute capability 8.6; this GPU is NVIDIA GeForce RTX 4090, 8.9",
        ),
        (("NVIDIA GeForce RTX 4090", "8.9"), None, None),
        (("NVIDIA GeForce RTX 2080 Ti", "7.5"), ["7.5"], None),
    ],
)
def test_rtx_engine_runs_only_on_gpus_it_targets(tmp_path, gpu, targets, message) -> None:
    meta = _rtx_meta(tmp_path, targets)
    here = {**RTX_HERE, "gpu": gpu[0], "compute_capability": gpu[1]}
    if message is None:
        check_compatible(meta, here, tmp_path / "m.plan")
    else:
        with pytest.raises(CorpError, match=message):
            check_compatible(meta, here, tmp_path / "m.plan")


def test_rtx_engine_from_another_release_is_refused(tmp_path) -> None:
    here = {"version": "1.8.0.1", "gpu": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9"}
    with pytest.raises(CorpError, match="built with TensorRT-RTX 1.7.1.116 but this machine has 1.8.0.1; .*rebuild"):
        check_compatible(_rtx_meta(tmp_path), here, tmp_path / "m.plan")


def test_engine_of_the_other_flavour_is_refused_in_one_line(tmp_path) -> None:
    meta = _rtx_meta(tmp_path)
    with pytest.raises(CorpError, match="^m.plan is a TensorRT-RTX engine, not a TensorRT one: run it with --runtime"):
        load_runtime(meta, tmp_path / "m.plan", "tensorrt")
    with pytest.raises(CorpError, match="^m.plan is a TensorRT engine, not a TensorRT-RTX one"):
        load_runtime({**meta, "flavour": "tensorrt"}, tmp_path / "m.plan", "tensorrt-rtx")


@needs_rtx
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_runner_without_a_gpu_refuses_before_deserializing(run) -> None:
    out, _ = run
    with pytest.raises(CorpError, match="^no supported GPU here: no CUDA GPU is visible$"):
        TrtRunner(out / "pruned.fp16.plan")


class _Context:
    """An execution context whose profile takes batches 1..8 of 3x32x32 but refuses ``refused`` shapes."""

    def __init__(self, refused: set[tuple[int, ...]]) -> None:
        self.refused, self.asked, self.shape, self.ran = refused, [], (1, 3, 32, 32), False

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.asked.append(shape)
        if shape in self.refused:
            return False  # TensorRT keeps the previous shape
        self.shape = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> None:
        pass

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self.shape[0], 10)

    def execute_async_v3(self, stream: int) -> bool:
        self.ran = True
        return True


def _fake_runner(context: _Context) -> TrtRunner:
    runner = TrtRunner.__new__(TrtRunner)  # no GPU here: the runner's state without a deserialized engine
    runner.context, runner.input, runner.output, runner.label, runner.name = context, "x", "y", "TensorRT", "t"
    runner.input_dtype = runner.output_dtype = torch.float32
    runner.meta, runner.profile = {"input": {"shape": [3, 32, 32]}}, Profile(1, 4, 8)
    return runner


@pytest.mark.parametrize(
    ("shape", "asked"),
    [((2, 3, 32, 32), True), ((9, 3, 32, 32), False), ((2, 3, 48, 48), False), ((3, 32, 32), False)],
    ids=["refused-by-tensorrt", "batch-over-max", "other-image-size", "no-batch-axis"],
)
def test_a_shape_the_engine_cannot_take_is_one_line_not_a_run_on_the_last_shape(shape, asked, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    context = _Context(refused={(2, 3, 32, 32)})
    runner = _fake_runner(context)
    assert runner.run(torch.zeros(4, 3, 32, 32)).shape == (4, 10) and context.ran
    context.ran = False
    expected = re.escape(
        f"input shape {shape} is outside TensorRT engine t's profile (min (1, 3, 32, 32), max (8, 3, 32, 32))"
    )
    with pytest.raises(CorpError, match=expected):
        runner.run(torch.zeros(shape))
    assert not context.ran and (context.asked[-1] == shape) == asked  # outside the recorded profile: not even asked


@needs_rtx
def test_corrupt_engine_is_refused(run, tmp_path) -> None:
    out, _ = run
    engine = tmp_path / "pruned.fp16.plan"
    engine.write_bytes((out / "pruned.fp16.plan").read_bytes()[:1000])
    sidecar(engine).write_text(sidecar(out / "pruned.fp16.plan").read_text())
    with pytest.raises(CorpError, match="pruned.fp16.plan is not the file its pruned.fp16.plan.json describes"):
        TrtRunner(engine)


@needs_rtx
def test_onnx_the_parser_rejects_is_one_line_and_writes_nothing(tmp_path) -> None:
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 8, 8])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3, 8, 8])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["images"], ["out"], domain="corp.test")], "g", [x], [y])
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("corp.test", 1)]
    save(helper.make_model(graph, opset_imports=opsets), tmp_path / "rejected.onnx")
    with pytest.raises(CorpError, match="^TensorRT-RTX cannot parse .*rejected.onnx: .*Plugin not found") as e:
        engine_verified(tmp_path / "rejected.onnx", tmp_path / "r.plan", replace(BUILD, precision="fp32"))
    assert "\n" not in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["rejected.onnx"]


def test_no_tensorrt_of_either_flavour_names_both_install_commands(monkeypatch) -> None:
    for flavour in FLAVOURS.values():
        monkeypatch.setitem(sys.modules, flavour.module, None)  # import fails as if not installed
    why = build_missing()
    assert "pip install 'corp-deploy[tensorrt]' --extra-index-url https://pypi.nvidia.com" in why
    assert "pip install 'corp-deploy[tensorrt-rtx]'" in why and "\n" not in why
    assert (
        build_missing(BuildOptions(runtime="tensorrt-rtx"))
        == f"TensorRT-RTX is not installed ({FLAVOURS['tensorrt-rtx'].install})"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"runtime": "tensorrt", "compute_capabilities": ("8.9",)},
            "--compute-capability is for --runtime tensorrt-rtx",
        ),
        ({"runtime": "tensorrt-rtx", "timing_cache": Path("c")}, "TensorRT-RTX has no timing cache"),
        ({"runtime": "onnxruntime"}, "--runtime must be one of auto, tensorrt, tensorrt-rtx"),
    ],
)
def test_engine_options_that_contradict_each_other_are_refused(options, message) -> None:
    with pytest.raises(CorpError, match=message):
        BuildOptions(**options)


def _rtx_meta(tmp_path: Path, targets: list[str] | None = None) -> dict:
    """A TensorRT-RTX sidecar as ``build_engine`` writes it (only the keys the checks read)."""
    return {
        "flavour": "tensorrt-rtx",
        "version": "1.7.1.116",
        "targets": targets or list(RTX_DEFAULT_TARGETS),
        "onnx": {"path": "missing.onnx", "sha256": "0"},
    }
