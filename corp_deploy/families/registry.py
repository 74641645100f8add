"""The family registry: name -> ``Adapter``, filled by the family modules themselves.

A family module ends with ``register(ItsAdapter())``; this module never imports one by name (no arrow from the
core to a family, no import loop). The built-in families are the modules of this package's subpackages
(``timm/``, ``hf/``) other than their shared machinery, imported the first time a model or an artifact asks:
adding one is adding its file. A third-party family registers from its own package the same way.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Any

from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families.base import Adapter

INFRASTRUCTURE = frozenset({"adapter", "folder", "hub", "modeling", "models", "modules"})
"""Modules of the family subpackages that hold no family (a subpackage's shared machinery: importing ``modeling``
would import ``transformers``); every other one registers one."""
_FAMILIES: dict[str, Adapter] = {}
_loaded = False


def register(adapter: Adapter) -> Adapter:
    """Add a family (its ``name`` is the key artifacts record); a second family under one name is a bug."""
    if _FAMILIES.get(adapter.name, adapter) is not adapter:
        raise ValueError(f"two model families are named {adapter.name!r}")
    _FAMILIES[adapter.name] = adapter
    return adapter


def families() -> Iterator[Adapter]:
    """Every registered family, built-in ones first."""
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(__package__)
        for sub in pkgutil.iter_modules(package.__path__):
            if not sub.ispkg:
                continue
            path = importlib.import_module(f"{__package__}.{sub.name}").__path__
            for module in pkgutil.iter_modules(path):
                if module.name not in INFRASTRUCTURE:
                    importlib.import_module(f"{__package__}.{sub.name}.{module.name}")
    yield from list(_FAMILIES.values())


def get(name: str) -> Adapter | None:
    """The family an artifact names, or None when this version has none of that name."""
    return next((f for f in families() if f.name == name), None)


def for_model_type(model_type: str | None) -> Adapter | None:
    """The ``transformers`` family of a config.json's ``model_type`` (read without building the model), or None."""
    return next((f for f in families() if model_type in getattr(f, "model_types", ())), None)


def decoders() -> str:
    """The families that decode in onnxruntime-genai, as a message says them."""
    return ", ".join(f.summary.split(" (")[0].removeprefix("transformers ") for f in families() if f.genai_type)


def supported() -> str:
    """The families, as the one line of an error says them."""
    return "; ".join(f.summary for f in families())


def adapter_for(model: nn.Module) -> Adapter:
    """The family of ``model``; one line naming the supported families when it has none."""
    found = next((f for f in families() if f.matches(model)), None)
    if found is None:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        named = type(model).__name__ + (f" (model_type {kind!r})" if kind else "")
        raise CorpError(f"{named} is not a supported model family; corp-deploy prunes {supported()}")
    return found


def structure(model: nn.Module) -> list[dict[str, Any]]:
    """Per-block widths as recorded in ``corp.json``."""
    adapter = adapter_for(model)
    return [adapter.structure(block) for block in adapter.blocks(model)]
