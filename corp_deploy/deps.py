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
}
"""Top-level import name -> (distribution on the package index, corp-deploy extra that installs it)."""


def install_hint(module: str) -> str:
    """The pip command that brings ``module`` (``pip install 'corp-deploy[onnx]'``)."""
    top = module.split(".")[0]
    dist, extra = PACKAGES.get(top, (top, None))
    return f"pip install 'corp-deploy[{extra}]'" if extra else f"pip install {dist}"


def missing(*modules: str) -> str | None:
    """The first of ``modules`` that cannot be imported, as ``"<distribution> (<pip command>)"``; None if all can.

    Importing (not just finding) the module is the check: a package whose native libraries do not
    load is as missing as one that is not installed.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            top = module.split(".")[0]
            return f"{PACKAGES.get(top, (top, None))[0]} ({install_hint(module)})"
    return None


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise a one-line CorpError: ``"<purpose> needs <dist>: <pip command>"``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise CorpError(f"{purpose} needs {PACKAGES.get(top, (top, None))[0]}: {install_hint(module)}") from None
