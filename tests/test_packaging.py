"""The package metadata builds without a warning from the build backend (offline, under a second)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_build_backend_prints_no_warning_and_writes_the_spdx_license(tmp_path) -> None:
    """What `pip install -e .` asks setuptools for first: the metadata. Deprecated configuration
    (such as a TOML-table license) is reported there, as a warning that precedes a removal date."""
    hook = "import sys, setuptools.build_meta as b; print(b.prepare_metadata_for_build_editable(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", hook, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "warning" not in (done.stdout + done.stderr).lower(), done.stderr
    metadata = (tmp_path / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
