"""Optional dependencies: one gate that imports a module or says, in one line, what to install.

Every optional import in corp-deploy goes through ``require`` (fail with the install line) or
``missing`` (ask first, e.g. before minutes of calibration), so the message and the extra that
brings each package are written once, here. The gate also refuses a package older than corp-deploy
supports (``FLOORS``), read from the installed distribution's metadata BEFORE importing it: an old
``transformers`` imports fine and then fails deep inside a forward with an AttributeError.
"""

from __future__ import annotations

import functools
import importlib
import re
from importlib import metadata
from types import ModuleType

from corp_deploy.base.errors import CorpError

PACKAGES: dict[str, tuple[str, str | None]] = {
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "onnxconverter_common": ("onnxconverter-common", "onnx"),
    "onnxslim": ("onnxslim", "onnx"),
    "matplotlib": ("matplotlib", "bench"),
    "sklearn": ("scikit-learn", "demo"),
    "tensorrt": ("tensorrt", "tensorrt"),
    "tensorrt_rtx_bindings": ("tensorrt-rtx-cu13-bindings", "tensorrt-rtx"),
    "transformers": ("transformers", "text"),
    "onnxruntime_genai": ("onnxruntime-genai", "genai"),
    "sentence_transformers": ("sentence-transformers", "sentence"),
}
"""Top-level import name -> (distribution on the package index, corp-deploy extra that installs it)."""
FLOORS: dict[str, str] = {
    "onnx": "1.16",
    "onnxruntime": "1.18",
    "onnxscript": "0.2",
    "onnxconverter-common": "1.14",
    "onnxslim": "0.1.40",
    "matplotlib": "3.7",
    "scikit-learn": "1.3",
    "tensorrt": "10",
    "transformers": "5.23",
    "onnxruntime-genai": "0.18",
    "sentence-transformers": "6",
}
"""Distribution -> the oldest release corp-deploy supports: pyproject.toml's ``>=`` for those it lists
(tests/base/test_deps_env.py checks they agree)."""
INDEX_URLS: dict[str, str] = {"tensorrt": "https://pypi.nvidia.com"}
"""Packages whose real wheels are on another index (PyPI's ``tensorrt`` is a placeholder)."""


def register_package(module: str, dist: str, extra: str, floor: str | None = None) -> None:
    """Add a package a plug-in module needs (an export target): its distribution, the extra that installs it and
    the oldest release supported, so that its one-line install message is written where the module is."""
    PACKAGES[module] = (dist, extra)
    if floor is not None:
        FLOORS[dist] = floor


def install_hint(module: str) -> str:
    """The pip command that brings ``module`` (``pip install 'corp-deploy[onnx]'``)."""
    top = module.split(".")[0]
    dist, extra = PACKAGES.get(top, (top, None))
    command = f"pip install 'corp-deploy[{extra}]'" if extra else f"pip install {dist}"
    return f"{command} --extra-index-url {INDEX_URLS[top]}" if top in INDEX_URLS else command


def distribution(module: str) -> str:
    """The distribution that brings ``module`` (``onnxconverter_common`` -> ``onnxconverter-common``)."""
    top = module.split(".")[0]
    return PACKAGES.get(top, (top, None))[0]


@functools.cache
def _providers() -> dict[str, list[str]]:
    """Top-level import name -> the installed distributions that provide it (``onnxruntime-gpu`` for onnxruntime)."""
    return metadata.packages_distributions()


def installed_version(module: str) -> str | None:
    """The installed version of the distribution that brings ``module``, from its metadata (nothing is imported);
    None when no installed distribution provides it. The usual distribution is asked first; the scan of every
    installed one (``_providers``, slow) only when it is absent."""
    try:
        return metadata.version(distribution(module))
    except metadata.PackageNotFoundError:
        pass
    for name in _providers().get(module.split(".")[0], []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, ...]:
    """``5.24.0`` -> (5, 24); the leading release numbers, trailing zeros dropped (``1.23.0rc1`` -> (1, 23))."""
    found = re.match(r"\d+(\.\d+)*", version)
    numbers = [int(n) for n in found.group().split(".")] if found else [0]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def too_old(module: str) -> str | None:
    """``"<dist> <version> is installed, older than the <dist>>=<floor> corp-deploy needs: <pip command>"`` when
    the installed distribution of ``module`` is older than ``FLOORS`` allows; None otherwise (or not installed)."""
    dist = distribution(module)
    floor, version = FLOORS.get(dist), installed_version(module)
    if floor is None or version is None or release(version) >= release(floor):
        return None
    needed = f"{dist}>={floor}"
    return f"{dist} {version} is installed, older than the {needed} corp-deploy needs: pip install -U '{needed}'"


def optional(module: str) -> ModuleType | None:
    """``module`` imported, or None when it cannot be (or is older than ``FLOORS``): the one place an ImportError is
    caught.

    Importing (not just finding) the module is the check: a package whose native libraries do not
    load is as missing as one that is not installed.
    """
    if too_old(module):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def missing(*modules: str) -> str | None:
    """The first of ``modules`` that cannot be imported, as ``"<distribution> (<pip command>)"`` (or what
    ``too_old`` says); None if all can."""
    for module in modules:
        if old := too_old(module):
            return old
        if optional(module) is None:
            return f"{distribution(module)} ({install_hint(module)})"
    return None


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise a one-line CorpError: ``"<purpose> needs <dist>: <pip command>"``, or
    ``"<purpose>: <too_old>"``."""
    if old := too_old(module):
        raise CorpError(f"{purpose}: {old}")
    found = optional(module)
    if found is None:
        raise CorpError(f"{purpose} needs {distribution(module)}: {install_hint(module)}")
    return found
