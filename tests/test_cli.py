"""The command line: a real run, and every bad input ending in one line, exit != 0, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_CLI_ARGS, tiny_vit
from safetensors.torch import save_file

import corp_deploy
from corp_deploy.cli import main

BASE = [
    "prune",
    "deit_tiny",
    "--weights",
    "random",
    *TINY_CLI_ARGS,
    "--round-to",
    "4",
    "--quiet",
    "--num-calib",
    "16",
    "--calib-batch-size",
    "8",
]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_prune_from_image_folder_writes_a_loadable_artifact(tmp_path, image_dir, capsys) -> None:
    out = tmp_path / "run"
    code, stdout, _ = run([*BASE, "--calib-dir", str(image_dir), "--workers", "0", "--out", str(out)], capsys)
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
    code, stdout, _ = run([*BASE, "--calib-dir", str(image_dir), "--workers", "0", "--out", str(out)], capsys)
    assert code == 0 and "1 unreadable, skipped" in stdout
    assert json.loads((out / "corp.json").read_text())["report"]["calibration"]["skipped"] == 1


def test_overwrite_replaces_an_existing_artifact(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "old.txt").write_text("x")
    code, _, _ = run([*BASE, "--calib", "synthetic", "--out", str(out), "--overwrite"], capsys)
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
    "sparsity >= 1": ([*BASE, "--calib", "synthetic", "--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
    "negative sparsity": ([*BASE, "--calib", "synthetic", "--attn-sparsity", "-0.1"], "--attn-sparsity"),
    "zero channels left": ([*BASE, "--calib", "synthetic", "--sparsity", "0.9", "--round-to", "8"], "leaves 0"),
    "zero V channels left": (
        [*BASE, "--calib", "synthetic", "--target", "all", "--v-sparsity", "0.9", "--round-to", "8"],
        "leaves 0 of 16 V channels per head (block 0)",
    ),
    "bad target": ([*BASE, "--calib", "synthetic", "--target", "mlp,values"], "--target must be"),
    "V with scale-norm": (
        [*BASE, "--calib", "synthetic", "--target", "v", "--model-arg", "scale_attn_norm=true"],
        "V pruning is not supported for block 0",
    ),
    "empty calib folder": ([*BASE, "--calib-dir", "{empty}"], "no images"),
    "missing calib folder": ([*BASE, "--calib-dir", "{tmp}/nope"], "does not exist"),
    "all images unreadable": ([*BASE, "--calib-dir", "{corrupt}", "--workers", "0"], "could be read"),
    "checkpoint does not fit": ([*BASE, "--calib", "synthetic", "--checkpoint", "{foreign}"], "does not fit"),
    "checkpoint not a checkpoint": ([*BASE, "--calib", "synthetic", "--checkpoint", "{junk}"], "cannot read"),
    "unsupported family": (["prune", "resnet18", "--weights", "random", "--calib", "synthetic"], "not supported"),
    "no calibration source": ([*BASE], "--calib-dir"),
    "bad ranker": ([*BASE, "--calib", "synthetic", "--ranker", "best"], "--ranker must be one of"),
    "bad model arg": ([*BASE, "--calib", "synthetic", "--model-arg", "depth"], "key=value"),
    "no cuda": ([*BASE, "--calib", "synthetic", "--device", "cuda"], "no CUDA GPU"),
    "not a number": ([*BASE, "--calib", "synthetic", "--sparsity", "half"], "not a valid float"),
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
    code, _, stderr = run([*BASE, "--calib", "synthetic", "--out", str(out)], capsys)
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
