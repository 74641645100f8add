"""corp-deploy: CORP one-shot structured pruning of vision transformers, for deployment.

The public API is re-exported here lazily: ``import corp_deploy`` (or any of its light modules,
``corp_deploy.errors``, ``fsio``, ``tables``, ``deps``, ``version``) loads neither torch nor timm; the first
use of a name below imports the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from corp_deploy.version import __version__

_EXPORTS = {
    "Calibrated": "corp_deploy.api",
    "CorpError": "corp_deploy.errors",
    "PruneConfig": "corp_deploy.pruner",
    "PruneResult": "corp_deploy.api",
    "calibrate": "corp_deploy.pruner",
    "calibrated": "corp_deploy.api",
    "calibration_batches": "corp_deploy.calibration",
    "create_model": "corp_deploy.models",
    "load_pruned": "corp_deploy.artifact",
    "prune": "corp_deploy.api",
    "prune_model": "corp_deploy.pruner",
    "resolve_device": "corp_deploy.calibration",
    "save": "corp_deploy.api",
}
__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # static checkers and IDEs see the names eagerly
    from corp_deploy.api import Calibrated, PruneResult, calibrated, prune, save  # noqa: F401
    from corp_deploy.artifact import load_pruned  # noqa: F401
    from corp_deploy.calibration import calibration_batches, resolve_device  # noqa: F401
    from corp_deploy.errors import CorpError  # noqa: F401
    from corp_deploy.models import create_model  # noqa: F401
    from corp_deploy.pruner import PruneConfig, calibrate, prune_model  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'corp_deploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
