"""corp-deploy: CORP one-shot structured pruning of transformers (timm ViTs; BERT, OPT, Llama, Mistral, Qwen2, ViT
and DINOv2 through ``transformers``), for deployment.

The folders are the layers, bottom up: ``base`` (errors, files, tables, optional dependencies, environment),
``families`` (what a model is: where it keeps its blocks, how a block is rebuilt), ``core`` (the pruning
algorithm), ``formats`` (artifacts, inputs, evaluation), ``exporters`` and ``bench`` (ONNX, engines, timing),
``plan`` (widths under a budget or a speed), ``api`` (the facade below), then ``apps`` and ``cli``. No module
imports a floor above its own (``tests/house/test_layers.py``).

The public API is re-exported here lazily: ``import corp_deploy`` (or any module of ``corp_deploy.base``) loads
neither torch nor timm; the first use of a name below imports the module that defines it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from corp_deploy.base.version import __version__

_EXPORTS = {
    "Calibrated": "corp_deploy.api",
    "CorpError": "corp_deploy.base.errors",
    "PruneConfig": "corp_deploy.core.config",
    "PruneResult": "corp_deploy.api",
    "calibrate": "corp_deploy.core.pruner",
    "calibrated": "corp_deploy.api",
    "calibration_batches": "corp_deploy.formats.calibration",
    "create_model": "corp_deploy.families.timm.models",
    "load_pruned": "corp_deploy.formats.artifact",
    "prune": "corp_deploy.api",
    "prune_model": "corp_deploy.core.pruner",
    "resolve_device": "corp_deploy.formats.calibration",
    "save": "corp_deploy.api",
}
__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # static checkers and IDEs see the names eagerly
    from corp_deploy.api import Calibrated, PruneResult, calibrated, prune, save  # noqa: F401
    from corp_deploy.base.errors import CorpError  # noqa: F401
    from corp_deploy.core.config import PruneConfig  # noqa: F401
    from corp_deploy.core.pruner import calibrate, prune_model  # noqa: F401
    from corp_deploy.families.timm.models import create_model  # noqa: F401
    from corp_deploy.formats.artifact import load_pruned  # noqa: F401
    from corp_deploy.formats.calibration import calibration_batches, resolve_device  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'corp_deploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
