"""`pip install -e .` as the build backend sees it: no warning about the configuration, offline, in seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from helpers import ROOT


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


def _project_copy(tmp_path: Path) -> Path:
    """A fresh checkout's files (no venv, caches or build output), so a build leaves nothing in this one."""
    project = tmp_path / "project"
    ignore = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "runs", "docs")
    shutil.copytree(ROOT, project, ignore=ignore)
    return project


def test_the_wheel_installs_one_package(tmp_path) -> None:
    """``pip install corp-deploy`` adds ``corp_deploy`` and nothing else at the top level, and the studies and the
    GPU suite stay in the repository."""
    project = _project_copy(tmp_path)
    (tmp_path / "dist").mkdir()
    wheel, _ = _hook("build_wheel", project, tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"corp_deploy"}, top
    for module in (
        "exporters/pipeline.py",
        "bench/run.py",
        "apps/sweep.py",
        "apps/real.py",
        "core/pruner.py",
        "families/hf/modeling.py",
        "cli/__init__.py",
    ):
        assert f"corp_deploy/{module}" in names, module
    packages = [p.parent.relative_to(project) for p in (project / "corp_deploy").rglob("__init__.py")]
    missing = [str(p) for p in packages if f"{p.as_posix()}/__init__.py" not in names]
    assert not missing, f"package folders left out of the wheel (pyproject's packages): {missing}"
    assert not [n for n in names if "study" in n or "gpu_suite" in n], names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:
        assert "corp-deploy = corp_deploy.cli:main" in z.read(entry).decode()


def test_an_offline_editable_install_maps_the_folders(tmp_path) -> None:
    """What the GPU machine does (``pip install --no-deps --no-build-isolation -e .``, no network): the editable
    wheel's import hook finds ``corp_deploy`` and its libraries in the checkout's own folders,
    from any working directory. ``-S`` plus the bare site-packages path keeps this checkout's own editable hook out."""
    project = _project_copy(tmp_path)
    (tmp_path / "wheel").mkdir()
    wheel, _ = _hook("build_editable", project, tmp_path / "wheel")
    site = tmp_path / "site"
    with zipfile.ZipFile(tmp_path / "wheel" / wheel) as z:
        z.extractall(site)
    code = (
        "import site, sys; site.addsitedir(sys.argv[1]); sys.path.append(sys.argv[2]); "
        "import corp_deploy.exporters.pipeline as p, corp_deploy.bench.run as r, corp_deploy.base.version as v; "
        "print(p.__file__); print(r.__file__); print(v.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site), sysconfig.get_paths()["purelib"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    files = [Path(line) for line in done.stdout.split()]
    assert files == [
        project / "corp_deploy/exporters/pipeline.py",
        project / "corp_deploy/bench/run.py",
        project / "corp_deploy/base/version.py",
    ]


def test_the_command_line_starts_without_the_text_extra() -> None:
    """`pip install corp-deploy[onnx]` (no transformers) must still run `corp-deploy` for ViTs: a module-level import of
    the `transformers` side anywhere on the CLI's import path stops every command (it did: exporters.fused_decoder)."""
    code = "import sys; sys.modules['transformers'] = None; import corp_deploy.cli; corp_deploy.cli.main(['--help'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "prune-export" in done.stdout, done.stderr[-2000:]
