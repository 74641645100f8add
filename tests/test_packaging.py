"""`pip install -e .` as the build backend sees it: no warning about the configuration, offline, in seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hook(name: str, project: Path, out: Path) -> tuple[str, str]:
    """Run one PEP 517 hook of setuptools in ``project`` as pip does (a fresh process); (its return value, output)."""
    code = f"import sys, setuptools.build_meta as b; print(b.{name}(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", code, str(out)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1], done.stdout + done.stderr


def test_build_backend_does_not_warn_and_writes_the_spdx_license(tmp_path) -> None:
    """Deprecated configuration (such as a TOML-table license) is reported while the metadata is
    prepared, as a warning that precedes a removal date: there must be none. Building the editable
    wheel must not deprecate anything either (setuptools' note on flat-layout editable imports is
    information, not a deprecation)."""
    project = tmp_path / "project"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "runs"))
    (tmp_path / "meta").mkdir()
    info, output = _hook("prepare_metadata_for_build_editable", project, tmp_path / "meta")
    assert "warning" not in output.lower(), output
    metadata = (tmp_path / "meta" / info / "METADATA").read_text().splitlines()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata

    (tmp_path / "wheel").mkdir()
    wheel, output = _hook("build_editable", project, tmp_path / "wheel")
    assert "deprecat" not in output.lower(), output
    with zipfile.ZipFile(tmp_path / "wheel" / wheel) as z:
        assert f"{info}/licenses/LICENSE" in z.namelist()
