"""Export targets as data (``exporters.targets``): every target registered with every piece, a target registered
here reaching the CLI, the pipeline and the bench loop without other edits, the precision literals of the CLI
counted, and the OpenVINO target end to end on a tiny ViT (export, verify, run, bench beside onnxruntime)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_CLI_ARGS, run

from corp_deploy.bench import backends
from corp_deploy.exporters import targets
from corp_deploy.exporters.targets import BenchSpec, Target
from corp_deploy.formats.precisions import PRECISIONS

FAST = ["--min-iters", "3", "--min-seconds", "0", "--warmup-iters", "1", "--warmup-seconds", "0"]


def test_every_target_is_registered_with_every_piece() -> None:
    registered = targets.load()
    assert list(registered)[0] == targets.ONNX and {"openvino", "tensorrt", "genai"} <= set(registered)
    for target in registered.values():
        assert target.name and target.what and target.precisions
        assert set(target.precisions) <= set(PRECISIONS)
        assert callable(target.write) and callable(target.runner) and callable(target.file_name)
        assert (target.modules or target.automatic) and target.files
        assert target.backends or target.name == "genai"  # a decoder's folders are timed by bench.decode's backends
        assert target.file_name("dense", target.precisions[0]) != target.file_name("dense", target.precisions[1])
        for spec in target.backends:
            assert spec.name in backends.all_backends() and spec.precision in target.precisions


def test_the_bench_backends_are_the_targets_and_their_flags_come_from_their_option_groups(capsys) -> None:
    """``bench``'s backends beyond PyTorch's are built from the targets' ``BenchSpec``s, and a target's option group
    (data) becomes its command-line flags: TensorRT's builder flags, OpenVINO's NNCF preset."""
    registered = targets.load()
    every = backends.all_backends()
    for name, target in (("ort-cpu-fp32", "onnx"), ("tensorrt-fp16", "tensorrt"), ("ov-cpu-int8", "openvino")):
        assert every[name].target is registered[target]
    assert {n for n, b in every.items() if b.target is None} == set(backends.TORCH_BACKENDS)
    for command, flags in (("prune-export", ("--openvino-int8-preset", "--workspace-gib")), ("build-engine", ())):
        code, stdout, _ = run([command, "--help"], capsys)
        assert code == 0
        for flag in (*flags, *(o.flag for o in registered["tensorrt"].options)):
            assert flag in stdout


def test_the_cli_spells_at_most_ten_precision_literals() -> None:
    """Precisions are data (``formats.precisions``): the command line names them through it, not as strings."""
    literals = []
    for path in sorted((ROOT / "corp_deploy" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in PRECISIONS:
                literals.append(f"{path.name}:{node.lineno}")
    assert len(literals) <= 10, literals


def test_a_missing_target_package_is_one_line_saying_what_to_install(monkeypatch, capsys) -> None:
    absent = dataclasses.replace(targets.load()["openvino"], modules=("no_such_mod",))
    monkeypatch.setitem(targets.TARGETS, "openvino", absent)
    code, _, stderr = run(["prune-export", "deit_tiny", "--targets", "onnx,openvino", "--out", "x"], capsys)
    assert code == 1 and stderr.strip().splitlines() == [
        "error: --targets openvino needs no_such_mod (pip install no_such_mod)"
    ]


@pytest.fixture()
def fake_target(monkeypatch, tmp_path):
    """A target registered in the test alone: it copies the FP32 graphs and runs them in onnxruntime."""
    from corp_deploy.exporters.runners import OrtRunner
    from corp_deploy.formats.run_folder import onnx_name, write_sidecar

    written: list[str] = []

    def write(job):
        records = []
        for stem in job.stems:
            out = job.out / f"{stem}.fake"
            out.write_bytes((job.out / onnx_name(stem)).read_bytes())
            check = {"reference": "dense.onnx", "runtime": "ort-cpu", "max_abs": 0.0, "cosine": 1.0, "top1": 1.0}
            record = {"file": out.name, "target": "fake", "precision": "fp32", "bytes": 1, "seconds": 0.0}
            record["verify"] = check  # a copy is its own reference
            write_sidecar(out, record)
            written.append(out.name)
            records.append(record)
        return records

    fake = Target(
        name="fake",
        what="a copy of the ONNX graph, run by onnxruntime",
        precisions=("fp32",),
        file_name=lambda stem, precision: f"{stem}.fake",
        write=write,
        runner=lambda path, threads: OrtRunner(path, "cpu", threads),
        modules=("onnxruntime",),
        backends=(BenchSpec("fake-cpu-fp32", "fake", "cpu", "fp32"),),
        files=(("*.fake", "a copy of the FP32 graph (the toy target)", "onnxruntime.InferenceSession({p})"),),
    )
    monkeypatch.setitem(targets.TARGETS, "fake", fake)
    return written


def test_a_target_registered_here_reaches_the_cli_the_pipeline_and_the_bench(fake_target, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--round-to", "4", "--quiet"]
    argv += ["--num-calib", "16", "--calib", "synthetic", "--precision", "fp32", "--targets", "onnx,fake"]
    code, _, stderr = run([*argv, "--out", str(out)], capsys)
    assert code == 0, stderr
    assert fake_target == ["dense.fake", "pruned.fake"]
    assert [r["file"] for r in json.loads((out / "export.json").read_text())["targets"]["fake"]] == fake_target
    readme = (out / "README.md").read_text()
    assert (
        "| `dense.fake` | a copy of the FP32 graph (the toy target) | `onnxruntime.InferenceSession('dense.fake')` |"
        in (readme)
    )
    bench = tmp_path / "b.json"
    code, stdout, stderr = run(
        ["bench", str(out), "--backends", "fake-cpu-fp32", "--batch-sizes", "1", *FAST, "--json", str(bench)], capsys
    )
    assert code == 0, stderr
    assert {(r["backend"], r["model"]) for r in json.loads(bench.read_text())["results"]} == {
        ("fake-cpu-fp32", "dense"),
        ("fake-cpu-fp32", "pruned"),
    }


def _in_a_fresh_process(argv: list[str]) -> subprocess.CompletedProcess:
    """``python ARGV`` in its own process: a crash (the signal-stack one, fixed at its cause: ``openvino.core``) fails
    the test rather than the pytest worker, and NNCF's own Cores (one per engine: out of our hands) never share a
    worker with a later test's DataLoader."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=600)


def test_openvino_runners_freed_in_creation_order_leave_signals_deliverable(tmp_path) -> None:
    """The OpenVINO segfault's cause: each ``openvino.Core``'s CPU plugin swaps the thread's alternate signal stack
    for its own and puts back the one it found when freed, so Cores freed in creation order left the thread on an
    unmapped stack, and the next signal handled on it (CPython's handlers run ``SA_ONSTACK``; torch's DataLoader
    handles SIGCHLD) was a SIGSEGV. One Core per process (``openvino.core``). In a fresh process: the old code dies."""
    pytest.importorskip("openvino", reason="openvino not installed (pip install '.[openvino]')")
    code = (
        "import gc, signal, subprocess, sys, numpy as np, openvino as ov; from openvino import opset13 as ops; "
        "from corp_deploy.exporters.openvino import OvRunner; p = ops.parameter([1, 16], np.float32); "
        "w = ops.constant(np.ones((16, 16), np.float32)); "
        "ov.save_model(ov.Model([ops.relu(ops.matmul(p, w, False, False))], [p]), sys.argv[1]); "
        "a, b = OvRunner(sys.argv[1]), OvRunner(sys.argv[1]); del a; gc.collect(); del b; gc.collect(); "
        "signal.signal(signal.SIGCHLD, lambda *_: None); subprocess.run(['true']); print('delivered')"
    )
    done = _in_a_fresh_process(["-c", code, str(tmp_path / "m.xml")])
    assert done.returncode == 0 and "delivered" in done.stdout, (done.returncode, done.stderr[-800:])


@pytest.mark.e2e
def test_openvino_writes_verified_ir_and_times_it_beside_onnxruntime(tmp_path) -> None:
    pytest.importorskip("openvino", reason="openvino not installed (pip install '.[openvino]')")
    pytest.importorskip("nncf", reason="nncf not installed (pip install '.[openvino]')")
    out = tmp_path / "run"
    argv = ["-m", "corp_deploy", "prune-export", "deit_tiny", "--weights", "random", *TINY_CLI_ARGS, "--round-to", "4"]
    argv += ["--quiet", "--num-calib", "16", "--calib", "synthetic", "--precision", "fp32,int8"]
    argv += ["--targets", "onnx,openvino", "--int8-calib", "16", "--int8-verify", "8"]
    done = _in_a_fresh_process([*argv, "--openvino-int8-preset", "performance", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    for name in ("dense.xml", "pruned.xml", "dense.int8.xml", "pruned.int8.xml"):
        assert (out / name).is_file() and (out / name).with_suffix(".bin").is_file()
        record = json.loads((out / f"{name}.json").read_text())
        assert record["target"] == "openvino" and record["verify"]["cosine"] > 0.9
        assert record.get("preset", "performance") == "performance"  # the option group reached NNCF
    assert "| `pruned.int8.xml` | OpenVINO IR, INT8 by NNCF" in (out / "README.md").read_text()
    same = (
        "import sys, numpy as np; from pathlib import Path; from corp_deploy.exporters.openvino import OvRunner; "
        "from corp_deploy.exporters.runners import OrtRunner; out = Path(sys.argv[1]); "
        "x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32); "
        "ov, ort = OvRunner(out / 'pruned.xml')(x), OrtRunner(out / 'pruned.onnx', 'cpu')(x); "
        "assert np.allclose(ov, ort, atol=1e-4), float(np.abs(ov - ort).max())"
    )
    done = _in_a_fresh_process(["-c", same, str(out)])
    assert done.returncode == 0, done.stderr
    bench = tmp_path / "b.json"
    argv = ["-m", "corp_deploy", "bench", str(out), "--backends", "ort-cpu-fp32,ov-cpu-fp32,ov-cpu-int8"]
    done = _in_a_fresh_process([*argv, "--batch-sizes", "1", *FAST, "--json", str(bench)])
    assert done.returncode == 0, done.stderr
    record = json.loads(bench.read_text())
    measured = {(r["backend"], r["model"]) for r in record["results"]}
    assert {("ov-cpu-fp32", m) for m in ("dense", "pruned", "baseline")} <= measured
    assert ("ort-cpu-fp32", "baseline") in measured
    assert "openvino" in record["quantize_only_baseline"]
    assert record["environment"]["cpu_features"]["model"] in done.stdout and "openvino" in record["environment"]
