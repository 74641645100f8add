"""A full disk at every writer: one line naming the destination and saying what to do, exit 1, no
traceback, nothing half-written. The disk is made full by making the writer fail as it does there
(errno 28, safetensors' own error type, onnx's silent truncation): a real full disk needs a mount."""

from __future__ import annotations

import errno
import pathlib
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
from helpers import PRUNE, run

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import staged
from corp_deploy.exporters.tensorrt_engine import build_missing

pytestmark = pytest.mark.e2e
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")

FREE_SPACE = "free space on that disk or choose another output path"

TINY_EXPORT = ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--batch-range", "1:4:8", "--precision", "fp32"]


def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _one_error(code: int, stderr: str, destination: Path) -> str:
    assert code == 1 and "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert f"could not write {destination}: out of disk space (" in line and FREE_SPACE in line, line
    return line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A prune-export folder (FP32 graphs with preprocessing metadata; engines where a TensorRT builds)."""
    out = tmp_path_factory.mktemp("full") / "run"
    with pytest.raises(SystemExit) as done:
        from corp_deploy.cli import main

        main([*TINY_EXPORT, "--out", str(out)])
    assert done.value.code == 0
    return out


def test_prune_whose_safetensors_write_fails_on_a_full_disk(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("corp_deploy.formats.safetensors_writer.write", disk_full)
    out = tmp_path / "run"
    _one_error(*run([*PRUNE, "--calib", "synthetic", "--out", str(out)], capsys)[::2], out)
    assert list(tmp_path.iterdir()) == []


def test_prune_export_whose_onnx_write_fails_on_a_full_disk(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(onnx, "save", disk_full)  # a failed write names no file: OSError.filename is None
    out = tmp_path / "run"
    line = _one_error(*run([*TINY_EXPORT, "--out", str(out)], capsys)[::2], out / "dense.onnx")
    assert f"{out}/ holds pruned/ (all whole); to finish: corp-deploy export " in line  # the prune is kept
    assert [p.name for p in tmp_path.iterdir()] == ["run"] and [p.name for p in out.iterdir()] == ["pruned"]


def _source(run_dir: Path, folder: Path) -> Path:
    folder.mkdir()
    for f in run_dir.glob("pruned.onnx*"):
        shutil.copy(f, folder / f.name)
    return folder / "pruned.onnx"


def test_quantize_whose_write_fails_on_a_full_disk(run_dir, tmp_path, capsys, monkeypatch) -> None:
    src = _source(run_dir, tmp_path / "graphs")
    before = sorted(p.name for p in src.parent.iterdir())
    monkeypatch.setattr(onnx, "save_model", disk_full)  # onnxruntime's quantizer writes with it
    code, _, stderr = run(["quantize", str(src), "--calib", "synthetic"], capsys)
    _one_error(code, stderr, src.with_name("pruned.int8.onnx"))
    assert sorted(p.name for p in src.parent.iterdir()) == before


def test_quantize_on_a_full_disk_where_onnx_truncates_silently(run_dir, tmp_path, capsys, monkeypatch) -> None:
    """onnx's C++ shape inference writes ``<graph>-inferred.onnx`` beside the graph it reads and, on a full
    disk, leaves it truncated without an error; the quantizer then fails reading it. The copy must land
    in the stage (never beside the user's graph) and the error must say the disk is full."""
    src = _source(run_dir, tmp_path / "graphs")
    before = sorted(p.name for p in src.parent.iterdir())

    def truncating(model_path: str, output_path: str, *args, **kwargs) -> None:
        Path(output_path).write_bytes(Path(model_path).read_bytes()[:1000])

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes_path", truncating)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=0))
    code, _, stderr = run(["quantize", str(src), "--calib", "synthetic"], capsys)
    _one_error(code, stderr, src.with_name("pruned.int8.onnx"))
    assert sorted(p.name for p in src.parent.iterdir()) == before


@pytest.mark.skipif(build_missing() is not None, reason=f"no engine builds here: {build_missing()}")
def test_build_engine_whose_write_fails_on_a_full_disk(run_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(pathlib.Path, "write_bytes", disk_full)
    out = tmp_path / "engines" / "e.plan"
    argv = ["build-engine", str(run_dir / "pruned.onnx"), "--precision", "fp32", "--batch-range", "1:4:8"]
    _one_error(*run([*argv, "--out", str(out)], capsys)[::2], out)
    assert list(out.parent.iterdir()) == []


def test_bench_json_whose_write_fails_on_a_full_disk(run_dir, tmp_path, capsys, monkeypatch) -> None:
    write_text = pathlib.Path.write_text

    def full_for_json(self, *args, **kwargs):
        if self.name == "b.json":
            disk_full()
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_for_json)
    out = tmp_path / "records" / "b.json"
    argv = ["bench", str(run_dir), "--backends", "ort-cpu-fp32", "--batch-sizes", "1", "--min-iters", "1"]
    argv += ["--min-seconds", "0", "--warmup-iters", "0", "--warmup-seconds", "0", "--json", str(out)]
    _one_error(*run(argv, capsys)[::2], out)
    assert list(out.parent.iterdir()) == []


def test_a_full_disk_outside_a_staged_writer_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    """Writers that are not staged (a sweep's bench.json) fail with an OSError that names no file."""
    monkeypatch.setattr("corp_deploy.cli.bench.RunFolder.open", disk_full)
    code, _, stderr = run(["bench", str(tmp_path)], capsys)
    assert code == 1 and stderr.strip().splitlines() == [f"error: No space left on device; {FREE_SPACE}"]


def test_nested_stages_name_the_outer_destination_once(tmp_path) -> None:
    """prune-export stages its run folder and, inside it, each INT8 graph: the line names the folder asked for."""
    run_dir = tmp_path / "run"

    def export_run() -> None:
        with staged(run_dir) as outer, staged(outer / "x.onnx") as inner:
            (inner / "x.onnx").write_text("half a graph")
            disk_full()

    with pytest.raises(CorpError, match=f"^could not write {re.escape(str(run_dir))}: out of disk space") as failed:
        export_run()
    assert str(failed.value).count("could not write") == 1
    assert list(tmp_path.iterdir()) == []
