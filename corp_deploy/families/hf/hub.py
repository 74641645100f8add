"""``transformers`` models as sources: ``hf:NAME`` or a local folder, loaded in float32 with their tokenizer.

The families themselves (where a model keeps its layers, how they are pruned) are ``corp_deploy.families``;
this module only finds, loads and checks what a user named.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from torch import nn

from corp_deploy.base import memory
from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.families import adapter_for, for_model_type
from corp_deploy.families.hf.adapter import architecture
from corp_deploy.families.onload import Onloader, meta_parameters


def transformers_module(purpose: str) -> Any:
    """``transformers``, or the one-line install hint (``pip install 'corp-deploy[text]'``)."""
    return require("transformers", purpose)


HUB_PREFIX = "hf:"


def is_source(model: str) -> bool:
    """Whether ``model`` names a ``transformers`` model: ``hf:NAME`` or a local folder with a config.json."""
    return model.startswith(HUB_PREFIX) or Path(model, "config.json").is_file()


def modality(source: str) -> str | None:
    """What a ``transformers`` source reads, ``text`` or ``image`` (the registered family of its config's
    ``model_type``), read without building the model; None when ``source`` is not a ``transformers`` model. A
    ``model_type`` no family takes counts as text: ``load`` then refuses it in one line."""
    if not is_source(source):
        return None
    where = source.removeprefix(HUB_PREFIX)
    try:
        if Path(where, "config.json").is_file():
            model_type = json.loads(Path(where, "config.json").read_text()).get("model_type")
        else:
            transformers = transformers_module("pruning a transformers model")
            model_type = transformers.AutoConfig.from_pretrained(where, **_offline(source)).model_type
    except (OSError, ValueError, KeyError, AttributeError):
        return "text"
    family = for_model_type(model_type)
    return "text" if family is None else family.modality


def load(source: str, onload: bool = False) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer or None) from a local folder or ``hf:NAME``; one line when it cannot.

    Always float32, whatever the checkpoint holds (OPT's are float16): calibration, the fold and perplexity run
    as for ViTs, and a float16 model on a CPU would be slow and lose precision; exports make FP16 themselves.

    ``onload``: a folder of safetensors (a local one, or an ``hf:NAME``'s snapshot in the hub cache) is built with
    its blocks' weights left on disk (``families.onload``: one block is read at a time by the prune's walk); a
    checkpoint whose names the model does not take as they are (renamed keys, ``.bin`` files) loads whole, as without
    it. Before any weight is read, what will be held is checked against the memory available, one line when it
    cannot fit: the float32 weights of a model loaded whole; onloaded, what stays resident (the embeddings, the
    head) and the largest block (nothing reads the pruned model whole after the walk: the save streams it). The
    prune's memory plan (``blockwise.memory_plan``) then counts the rest before any data is read."""
    transformers = transformers_module("pruning a transformers model")
    transformers.utils.logging.disable_progress_bar()  # corp-deploy prints its own progress
    where, offline = source.removeprefix(HUB_PREFIX), _offline(source)
    try:
        config = transformers.AutoConfig.from_pretrained(where, **offline)
        cls = architecture(transformers, config)
        folder = _snapshot(source, offline)
        model = _onloaded(cls, config, folder) if onload and folder is not None else None
        if model is None:
            if folder is not None:  # before loading: float32 weights the machine cannot hold are refused in one line
                _check_fits(memory.safetensors_bytes(folder, itemsize=4))
            model = cls.from_pretrained(where, attn_implementation="sdpa", dtype=torch.float32, **offline)
    except SafetensorError as e:  # a truncated or corrupt weights file: not the hub's, the folder's
        raise CorpError(
            f"cannot load the transformers model {source}: its weights file is damaged ({first_line(e)}); copy or "
            "download the folder again"
        ) from None
    except (OSError, ValueError, KeyError) as e:
        if offline:
            raise CorpError(
                f"cannot load {source}: the model hub is not reachable from here and {where} is not in the local "
                "cache; download it once where there is network (it is cached then), or pass a local folder"
            ) from None
        raise CorpError(f"cannot load the transformers model {source} ({first_line(e)})") from None
    text = adapter_for(model).modality == "text"
    return model.eval(), load_tokenizer(source, model.config.vocab_size) if text else None


def _snapshot(source: str, offline: dict[str, bool]) -> str | None:
    """The local folder of ``source``'s safetensors: the folder itself, or an ``hf:NAME``'s snapshot in the hub
    cache, its json and safetensors files fetched first as ``from_pretrained`` would fetch them (so that its size is
    checked and its blocks onloaded like a folder's); None when it has no safetensors (``.bin`` weights load whole)."""
    if source.startswith(HUB_PREFIX):
        from huggingface_hub import snapshot_download

        name = source.removeprefix(HUB_PREFIX)
        source = snapshot_download(name, allow_patterns=["*.json", "*.safetensors"], **offline)
    return source if Path(source).is_dir() and any(Path(source).glob("*.safetensors")) else None


def _onloaded(cls: type, config: Any, folder: str) -> nn.Module | None:
    """``cls`` built on the meta device with what is outside its blocks read from ``folder``
    (``Onloader``), or None when the checkpoint's names are not the model's; refused in one line before a weight is
    read when what onloading holds (``Onloader.held_bytes``) cannot fit."""
    with meta_parameters():
        model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    try:
        loader = Onloader(model, folder)
        _check_fits(loader.held_bytes())
        loader.start()
    except KeyError:
        return None
    return model


def _check_fits(weights: int) -> None:
    """The one line when ``weights`` bytes of float32 weights (with the runtime) cannot fit the host's memory."""
    memory.Plan({"weights": weights}, memory.available(), "host").check(
        "corp-deploy holds the weights in float32 on the host: run on a machine with more memory"
    )


def _offline(source: str) -> dict[str, bool]:
    """``local_files_only`` for an ``hf:NAME`` whose hub's host does not resolve: without it ``huggingface_hub``
    retries for ~25 s, printing a line per try, before it falls back to the cache or fails."""
    if not source.startswith(HUB_PREFIX):
        return {}
    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return {"local_files_only": True}
    return {}


def load_tokenizer(source: str | Path, vocab_size: int) -> Any:
    """The tokenizer beside a model (a folder, ``hf:NAME``, a prune artifact), or None when it has none; one line
    when it has more tokens than the model's embedding (it belongs to other weights)."""
    transformers = transformers_module("tokenizing text")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(source).removeprefix(HUB_PREFIX), **_offline(str(source))
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not tokenizer.vocab_size:  # no tokenizer files: transformers still builds the config's class, empty
        return None
    if len(tokenizer) > vocab_size:
        raise CorpError(
            f"the tokenizer of {source} has {len(tokenizer)} tokens and the model {vocab_size}: "
            "they do not belong together; use the tokenizer the weights were trained with"
        )
    return tokenizer
