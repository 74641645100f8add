"""corp-deploy: CORP one-shot structured pruning of vision transformers, for deployment."""

__version__ = "0.1.0"

from corp_deploy.api import PruneResult, calibration_batches, prune, resolve_device, save  # noqa: E402
from corp_deploy.artifact import load_pruned  # noqa: E402
from corp_deploy.errors import CorpError  # noqa: E402
from corp_deploy.models import create_model  # noqa: E402
from corp_deploy.pruner import PruneConfig, calibrate, prune_model  # noqa: E402

__all__ = [
    "CorpError",
    "PruneConfig",
    "PruneResult",
    "calibrate",
    "calibration_batches",
    "create_model",
    "load_pruned",
    "prune",
    "prune_model",
    "resolve_device",
    "save",
]
