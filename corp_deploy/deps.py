"""Optional dependencies: one gate that imports a module or says, in one line, what to install.

Every optional import in corp-deploy goes through ``require`` (fail with the install line) or
``missing`` (ask first, e.g. before minutes of calibration), so the message and the extra that
brings each package are written once, here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from corp_deploy.errors import CorpError

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
}
"""Top-level import name -> (distribution on the package index, corp-deploy extra that installs it)."""
INDEX_URLS: dict[str, str] = {"tensorrt": "https://pypi.nvidia.com"}
"""Packages whose real wheels are on another index (PyPI's ``tensorrt`` is a placeholder)."""


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


def optional(module: str) -> ModuleType | None:
    """``module`` imported, or None when it cannot be: the one place an ImportError is caught.

    Importing (not just finding) the module is the check: a package whose native libraries do not
    load is as missing as one that is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def missing(*modules: str) -> str | None:
    """The first of ``modules`` that cannot be imported, as ``"<distribution> (<pip command>)"``; None if all can."""
    for module in modules:
        if optional(module) is None:
            return f"{distribution(module)} ({install_hint(module)})"
    return None


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise a one-line CorpError: ``"<purpose> needs <dist>: <pip command>"``."""
    found = optional(module)
    if found is None:
        raise CorpError(f"{purpose} needs {distribution(module)}: {install_hint(module)}")
    return found
