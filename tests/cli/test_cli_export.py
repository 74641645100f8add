"""`prune-export`, `export` and `build-engine` from the command line: real runs and bad inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import PRUNE, TINY_CLI_ARGS, run

import corp_deploy
from corp_deploy.exporters.compare import FP32, compare, random_inputs
from corp_deploy.exporters.runners import OrtRunner, TorchRunner
from corp_deploy.exporters.tensorrt_engine import FLAVOURS, VERIFIED, build_missing

pytestmark = pytest.mark.e2e

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")
pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")

PRUNE_EXPORT = ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--batch-range", "1:4:8"]
ENGINES_MISSING = build_missing()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("art") / "pruned"
    with pytest.raises(SystemExit) as done:
        corp_deploy.cli.main([*PRUNE, "--calib", "synthetic", "--out", str(out)])
    assert done.value.code == 0
    return out


def test_prune_export_writes_verified_onnx_and_engines_or_says_why_not(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code, stdout, stderr = run([*PRUNE_EXPORT, "--out", str(out)], capsys)
    assert code == 0, stderr
    expected = {"pruned", "dense.onnx", "pruned.onnx", "dense.fp16.onnx", "pruned.fp16.onnx", "export.json"}
    assert expected <= {p.name for p in out.iterdir()}
    record = json.loads((out / "export.json").read_text())
    assert [r["file"] for r in record["onnx"]] == ["dense.onnx", "dense.fp16.onnx", "pruned.onnx", "pruned.fp16.onnx"]
    for r in record["onnx"]:
        tol = r["verify"]["tolerance"]
        assert r["verify"]["cosine"] >= tol["min_cosine"] and r["verify"]["rel_error"] <= tol["max_rel_error"]
    assert record["size"]["pruned"]["params"] < record["size"]["dense"]["params"]
    # The artifact folder and the ONNX beside it are the same model.
    x = random_inputs(3, (3, 32, 32))
    reloaded = TorchRunner(corp_deploy.load_pruned(out / "pruned"))(x)
    assert compare(reloaded, OrtRunner(out / "pruned.onnx", "cpu")(x)).within(FP32)
    assert "pruned.fp16.onnx" in stdout and "cosine" in stdout
    if ENGINES_MISSING:
        assert f"TensorRT engines skipped: {ENGINES_MISSING}" in stdout
        assert record["engines"] == [] and record["engines_skipped"] == ENGINES_MISSING
    else:
        assert {e["file"] for e in record["engines"]} == {
            f"{m}.{p}.plan" for m in ("dense", "pruned") for p in ("fp32", "fp16")
        }
        for e in record["engines"]:
            assert (out / e["file"]).stat().st_size == e["engine_bytes"]
            assert (e["status"] == VERIFIED) == (e["verify"] is not None)
        unverified = sum(e["verify"] is None for e in record["engines"])
        assert stdout.count("built, not executed") == unverified
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary leftovers


def test_export_a_prune_artifact_with_fp16(artifact, tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    code, stdout, stderr = run(
        ["export", str(artifact), "--out", str(out), "--precision", "fp32,fp16", "--verify-batch-sizes", "2,5"], capsys
    )
    assert code == 0, stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["m.fp16.onnx", "m.fp16.onnx.json", "m.onnx", "m.onnx.json"]
    record = json.loads((tmp_path / "m.onnx.json").read_text())
    assert record["weights"] == "corp-pruned" and record["verify"]["batches"] == [2, 5]
    assert "m.fp16.onnx" in stdout


def test_export_checks_its_graph_with_the_model_let_go(artifact, tmp_path, capsys, monkeypatch) -> None:
    """Issue 49: `export` opened onnxruntime's session beside the model (a 1.7B decoder's 6.8 GB twice); the model
    is now on the meta device when the session opens, and the graph still verifies."""
    from corp_deploy.exporters import pipeline
    from corp_deploy.formats import sources

    loaded, resident = [], []
    load, runner = sources.load_source, pipeline.OrtRunner

    def loading(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    def opening(*args, **kwargs):
        resident.append(any(not p.is_meta for p in loaded[0][0].parameters()))
        return runner(*args, **kwargs)

    monkeypatch.setattr(sources, "load_source", loading)
    monkeypatch.setattr(pipeline, "OrtRunner", opening)
    code, _, stderr = run(["export", str(artifact), "--out", str(tmp_path / "m.onnx")], capsys)
    assert code == 0, stderr
    assert resident == [False] and json.loads((tmp_path / "m.onnx.json").read_text())["verify"]["cosine"] > 0.999


def test_export_a_timm_model(tmp_path, capsys) -> None:
    pytest.importorskip("onnxslim", reason="--simplify needs onnxslim (in the onnx extra; absent from the GPU image)")
    out = tmp_path / "dense.onnx"
    argv = ["export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--out", str(out), "--simplify"]
    code, _, stderr = run(argv, capsys)
    assert code == 0, stderr
    record = json.loads((tmp_path / "dense.onnx.json").read_text())
    assert record["model"] == "deit_tiny_patch16_224" and record["simplified"] and record["weights"] == "random"


def test_failed_verification_is_an_error_and_leaves_no_file(artifact, tmp_path, capsys) -> None:
    """A cosine above 1 cannot be met: the gate must fire and the file must not appear."""
    out = tmp_path / "m.onnx"
    code, _, stderr = run(["export", str(artifact), "--out", str(out), "--tol-cosine", "1.0000001"], capsys)
    assert code == 1 and "does not match at batch 1" in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def _not_onnx(tmp_path: Path) -> Path:
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x00\x01 definitely not protobuf \xff" * 10)
    return path


BAD = {
    "onnx missing": (["build-engine", "{tmp}/nope.onnx"], "does not exist"),
    "not onnx": (["build-engine", "{junk}"], "not a readable ONNX model"),
    "bad precision": (["build-engine", "{junk}", "--precision", "int4"], "Invalid value for '--precision'"),
    "batch range reversed": (["build-engine", "{junk}", "--batch-range", "8:4:2"], "1 <= min <= opt <= max"),
    "export bad opset": (["export", "{artifact}", "--out", "{tmp}/m.onnx", "--opset", "12"], "'--opset': 12 is not in"),
    "export one verify batch": (["export", "{artifact}", "--out", "{tmp}/m.onnx", "--verify-batch-sizes", "4"], "two"),
    "export not .onnx": (["export", "{artifact}", "--out", "{tmp}/m.plan"], "must be a .onnx file"),
    "export unknown model": (["export", "deit_tinyy", "--out", "{tmp}/m.onnx"], "did you mean"),
    "prune-export bad precision": ([*PRUNE_EXPORT, "--precision", "fp32,int4", "--out", "{tmp}/run"], "fp32, fp16"),
    "prune-export reversed batch": ([*PRUNE_EXPORT, "--batch-range", "4:2:1", "--out", "{tmp}/run"], "min <= opt"),
}
NO_ENGINES = {
    "build-engine": (
        ["build-engine", "{onnx}"],
        "cannot build TensorRT engines here: TensorRT is not installed (pip install 'corp-deploy[tensorrt]' "
        "--extra-index-url https://pypi.nvidia.com); TensorRT-RTX is not installed "
        "(pip install 'corp-deploy[tensorrt-rtx]')",
    ),
    "require engines": ([*PRUNE_EXPORT, "--require-engines", "--out", "{tmp}/run"], "--require-engines: cannot"),
    "runtime tensorrt-rtx": (["build-engine", "{onnx}", "--runtime", "tensorrt-rtx"], "TensorRT-RTX is not installed"),
}
BAD |= {f"no engine library: {case}": (argv, message) for case, (argv, message) in NO_ENGINES.items()}
BAD |= {
    "compute capability 9.0": (["build-engine", "{onnx}", "--compute-capability", "9.0"], "7.5, 8.0, 8.6, 8.9, 12.0"),
    "profile misses verify batch": (
        ["build-engine", "{onnx}", "--batch-range", "2:4:8"],
        "verify batch sizes 1 are outside",
    ),
    "tensorrt with targets": (
        ["build-engine", "{onnx}", "--runtime", "tensorrt", "--compute-capability", "8.9"],
        "--compute-capability is for --runtime tensorrt-rtx",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_export_input_is_one_line_and_writes_nothing(case, artifact, tmp_path, capsys, monkeypatch) -> None:
    onnx = tmp_path / "ok.onnx"
    if "{onnx}" in BAD[case][0]:
        assert run(["export", str(artifact), "--out", str(onnx)], capsys)[0] == 0
    if case.startswith("no engine library"):
        for flavour in FLAVOURS.values():
            monkeypatch.setitem(sys.modules, flavour.module, None)  # neither flavour importable
    places = {"tmp": tmp_path, "junk": _not_onnx(tmp_path), "artifact": artifact, "onnx": onnx}
    before = sorted(p.name for p in tmp_path.iterdir())
    argv, expected = BAD[case]
    code, _, stderr = run([a.format(**places) for a in argv], capsys)
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_bad_opset_is_refused_before_the_prune(tmp_path, capsys, monkeypatch) -> None:
    """Issue 50, item 5: ``--opset 5`` was refused only after the prune (40 s), and the "to finish" commands it
    printed repeated it. It is refused as the flags are read: nothing pruned, nothing written, one line."""

    def never(*args, **kwargs):
        raise AssertionError("pruned before the options were checked")

    monkeypatch.setattr("corp_deploy.cli.prune_export.pruned", never)
    code, _, stderr = run([*PRUNE_EXPORT, "--opset", "5", "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and lines == [
        "error: Invalid value for '--opset': 5 is not in the range 18<=x<=23. (see corp-deploy --help)"
    ], stderr
    assert not (tmp_path / "run").exists()
