"""First contact: the commands as a new user types them, without --out and without calibration data."""

from __future__ import annotations

import json
import shlex

import pytest
from helpers import PRUNE, TINY_CLI_ARGS, run

from corp_deploy.cli import SMOKE_IMAGES

pytestmark = pytest.mark.e2e


def test_prune_writes_to_runs_model_sparsity_and_never_overwrites_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run([*PRUNE, "--calib", "synthetic"], capsys)
    out = tmp_path / "runs" / "deit_tiny-s50"
    assert code == 0, stderr
    assert "wrote runs/deit_tiny-s50/" in stdout and (out / "corp.json").is_file()
    (out / "mine.txt").write_text("keep")
    code, _, stderr = run([*PRUNE, "--calib", "synthetic"], capsys)
    assert code == 1 and "runs/deit_tiny-s50 already exists" in stderr and "--overwrite" in stderr
    assert (out / "mine.txt").read_text() == "keep"
    code, _, _ = run([*PRUNE, "--calib", "synthetic", "--sparsity", "0.25", "--overwrite"], capsys)
    assert code == 0 and (tmp_path / "runs" / "deit_tiny-s25" / "corp.json").is_file()


def test_prune_export_writes_to_runs_model_sparsity(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install '.[onnx]')")
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run(["prune-export", *PRUNE[1:], "--calib", "synthetic", "--precision", "fp32"], capsys)
    assert code == 0, stderr
    assert "wrote runs/deit_tiny-s50/" in stdout
    assert {"pruned", "dense.onnx", "pruned.onnx", "export.json"} <= {
        p.name for p in (tmp_path / "runs/deit_tiny-s50").iterdir()
    }


def test_no_calibration_data_is_one_line_with_a_smoke_command_that_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run(["prune-export", "deit_base", "--sparsity", "0.5"], capsys)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "--calib-dir DIR" in errors[0] and "Traceback" not in stderr
    assert errors[0].endswith(": corp-deploy prune-export deit_base --sparsity 0.5 --weights random --calib synthetic")
    assert list(tmp_path.iterdir()) == []

    typed = ["prune", "deit_tiny", *TINY_CLI_ARGS, "--round-to", "4", "--quiet"]
    code, _, stderr = run(typed, capsys)
    suggested = shlex.split(stderr.strip().splitlines()[-1].split("): ", 1)[1])
    assert suggested == ["corp-deploy", *typed, "--weights", "random", "--calib", "synthetic"]
    code, stdout, stderr = run(suggested[1:], capsys)
    assert code == 0, stderr
    meta = json.loads((tmp_path / "runs" / "deit_tiny-s50" / "corp.json").read_text())
    assert meta["report"]["calibration"]["images"] == SMOKE_IMAGES  # noise needs no 4000 images
