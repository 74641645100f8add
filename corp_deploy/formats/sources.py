"""What a command was pointed at, as a model: a prune artifact, a ``transformers`` folder or ``hf:NAME``, or a timm
name; the dense original of an artifact; and what an exported file records about its model (``describe``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.base.version import __version__
from corp_deploy.families import adapter_for, for_model_type, structure
from corp_deploy.families.hf import hub
from corp_deploy.families.hf.adapter import MACS_SEQ_LEN, max_positions
from corp_deploy.families.timm.models import create_model, resolve_name
from corp_deploy.formats.artifact import META_FILE, load_pruned, read_meta
from corp_deploy.formats.data import data_config
from corp_deploy.formats.text import check_seq_len


def load_source(
    source: str | Path,
    weights: str = "pretrained",
    checkpoint: str | Path | None = None,
    model_args: dict | None = None,
    seq_len: int = MACS_SEQ_LEN,
) -> tuple[nn.Module, dict[str, Any]]:
    """A prune artifact folder, a ``transformers`` encoder (a folder with a config.json, or ``hf:NAME``) or a
    timm model name -> (model in eval mode, ``describe(model)``); text descriptions are for ``seq_len`` tokens."""
    if Path(source, META_FILE).is_file():
        meta = read_meta(source)
        model = load_pruned(source)
        return model, describe(model, meta["model"]["name"], meta["model"].get("args", {}), "corp-pruned", seq_len)
    if hub.is_source(str(source)):
        if checkpoint is not None or model_args:
            raise CorpError("--checkpoint and --model-arg are for timm models; a transformers folder holds its weights")
        model, _ = hub.load(str(source))
        return model, describe(model, str(source), {}, "pretrained", seq_len)
    model = create_model(str(source), weights=weights, checkpoint=checkpoint, model_args=model_args)
    origin = f"checkpoint:{Path(checkpoint).name}" if checkpoint else weights
    return model, describe(model, resolve_name(str(source)), model_args or {}, origin)


def dense_original(meta: dict[str, Any], checkpoint: str | Path | None = None) -> tuple[nn.Module | None, str]:
    """The dense original of a prune artifact (its ``corp.json``) with real weights: (model, "") or (None, why).

    From ``checkpoint`` if given (then its errors are the caller's), else from what the artifact
    records: the checkpoint it was pruned from (if that file is still there) or timm's pretrained
    weights. Random weights cannot be had again.
    """
    model, weights = meta["model"], meta["model"].get("weights", "")
    recorded = weights.removeprefix("checkpoint:") if weights.startswith("checkpoint:") else None
    path = checkpoint or (recorded if recorded and Path(recorded).is_file() else None)
    try:
        if path:
            return create_model(model["name"], checkpoint=path, model_args=model.get("args", {})), ""
        if weights == "pretrained":
            return create_model(model["name"], weights="pretrained", model_args=model.get("args", {})), ""
    except CorpError as e:
        if checkpoint:
            raise
        return None, str(e)
    return None, "dense weights were random or their checkpoint moved (pass --checkpoint)"


def describe(
    model: nn.Module, name: str, model_args: dict, weights: str, seq_len: int = MACS_SEQ_LEN
) -> dict[str, Any]:
    """What an exported file needs to say about its model: name, weights, widths, input, preprocessing.

    A text model's inputs are token ids and a mask of dynamic batch and sequence: it records their names,
    the sequence length it is meant for (``seq_len``: engine profiles, bench) and the range the positions allow.
    """
    if adapter_for(model).modality == "text":
        check_seq_len(seq_len, model.config)
        return {
            "modality": "text",
            "model": name,
            "model_args": model_args,
            "weights": weights,
            "structure": structure(model),
            "inputs": ["input_ids", "attention_mask"],
            "seq_len": seq_len,
            "max_positions": max_positions(model.config),
            "vocab_size": model.config.vocab_size,
            "corp_deploy": __version__,
        }
    cfg = data_config(model)
    return {
        "model": name,
        "model_args": model_args,
        "weights": weights,
        "structure": structure(model),
        "input_size": list(cfg["input_size"]),
        "preprocessing": {k: cfg[k] for k in ("mean", "std", "interpolation", "crop_pct") if k in cfg},
        "corp_deploy": __version__,
    }


def text_model(source: str | Path) -> tuple[nn.Module, Any]:
    """A ``transformers`` model (eval mode) and its tokenizer from a prune artifact, a local folder or ``hf:NAME``."""
    if Path(source, META_FILE).is_file():
        model = load_pruned(source)
        return model, hub.load_tokenizer(source, model.config.vocab_size)
    return hub.load(str(source))


def _config(source: str) -> dict:
    """A local folder's config.json ({} when it has none or it is unreadable)."""
    try:
        config = json.loads(Path(source, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_type(source: str) -> str | None:
    """The ``model_type`` in a local folder's config.json (None when it has none or it is unreadable)."""
    return _config(source).get("model_type")


def is_decoder(source: str) -> bool:
    """Whether a prune MODEL (a local transformers folder) is a decoder with a genai decode graph: a family that
    decodes, loaded with its language-model head. ``hub.load`` builds the class ``architectures`` names first, the
    base model (``LlamaModel``: hidden states, nothing to generate with) where it names none."""
    config = _config(source)
    family = for_model_type(config.get("model_type"))
    head = (config.get("architectures") or [""])[0].endswith("ForCausalLM")
    return family is not None and family.genai_type is not None and head
