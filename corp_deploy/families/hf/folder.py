"""A pruned ``transformers`` model's artifact folder as a folder ``transformers`` loads alone.

The artifact folder IS the model folder: config.json, model.safetensors and the tokenizer files sit beside
``corp.json`` (which ``load_pruned`` reads, as before). Two forms:

- **standard**: every layer has the same widths and attention is as the family's config describes it (uniform
  MLP pruning): config.json is the family's own with the new MLP width (the family's ``bias_flags``, Llama's
  ``mlp_bias``/``attention_bias``, when CORP folded a constant into a bias-free reader; the Linears transformers
  then expects a bias on get a zero one), so ``AutoModel[ForCausalLM].from_pretrained(folder)`` loads it.
- **remote-code**: otherwise. config.json adds ``corp_layers`` (the per-layer widths), ``corp_names`` (where the
  family keeps its layers) and an ``auto_map`` to ``modeling_corp.py``, a copy of
  ``corp_deploy/families/hf/modeling.py``
  (torch and transformers only), so
  ``from_pretrained(folder, trust_remote_code=True)`` loads it. Why it is not the family's own format is one
  line, printed and recorded in ``corp.json``.

The source's tokenizer files, chat template and generation defaults, or an image model's
``preprocessor_config.json``, are copied beside them.
A sentence-transformers source (``modules.json`` with the Transformer module at its root) keeps its modules
(``1_Pooling/``, ``2_Normalize/``...) and configs, so ``SentenceTransformer(folder)`` loads the pruned model with
the source's pooling.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.families.hf import modeling
from corp_deploy.families.registry import adapter_for, structure

MODELING_FILE = "modeling_corp.py"
"""The remote-code folder's modeling file (``families/hf/modeling.py`` verbatim)."""
STANDARD, REMOTE = "standard", "remote-code"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
)
"""Tokenizer files copied from the source folder into the artifact (whichever exist)."""
USAGE_FILES = ("chat_template.jinja", "chat_template.json", "generation_config.json")
"""How the source is meant to be prompted and to generate (its chat template, its generation defaults: EOS ids,
sampling), copied like the tokenizer: without them ``apply_chat_template`` fails on the pruned folder."""


def dense_head(config: Any) -> int:
    """A transformers config's one attention head width (Q, K and V alike)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


DENSE_CONFIG = "dense_config"
"""``corp.json``'s record of a standard folder's MLP width as the dense model had it (config.json holds the pruned
one): what rebuilds the dense tree from the folder (``HfText.build``: ``load_pruned``'s start and bench's dense
reference). Bias flags are not put back: the dense reference of a folder whose config gained one has those (zero)
biases too."""
PREPROCESSOR_FILE = "preprocessor_config.json"
"""An image model's preprocessing (size, crop, mean and std), copied from the source like a tokenizer."""
HEAD_AUTO = {"ForCausalLM": "AutoModelForCausalLM", "ForImageClassification": "AutoModelForImageClassification"}
"""A model class's suffix -> the auto class that loads it with its head (else ``AutoModel``)."""
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
"""A sentence-transformers model's files at its root, copied beside the pruned Transformer module."""


@dataclass(frozen=True)
class Layout:
    """The form a pruned model's folder takes: ``config`` holds the family config's new values (standard form),
    ``why`` says in one line why it is not the family's own format (remote-code form)."""

    form: str
    config: dict[str, Any] = field(default_factory=dict)
    why: str = ""


def layout(model: nn.Module) -> Layout:
    """Standard when the family's config can describe every layer, else remote-code with the reason."""
    config, entries, family = model.config, structure(model), adapter_for(model)
    name, mlp_field = type(config).__name__, family.names.mlp_field
    widths = sorted({e["mlp_hidden"] for e in entries}, reverse=True)
    if len(widths) > 1:
        many = f"{len(widths)} widths, {widths[-1]} to {widths[0]}"
        listed = many if len(widths) > 4 else ", ".join(map(str, widths))
        return Layout(REMOTE, why=f"the layers' MLP widths differ ({listed}): {name} has one {mlp_field}")
    head = dense_head(config)
    for i, e in enumerate(entries):
        if (e["qk_dim"], e["v_dim"]) != (head, head):
            return Layout(
                REMOTE,
                why=f"layer {i}'s attention heads are {e['qk_dim']} wide for Q/K and {e['v_dim']} for V: "
                f"{name} has one head width ({head}) for Q, K and V",
            )
    new = family.mlp_config(config, widths[0])
    if new is None:
        return Layout(REMOTE, why=f"{name}'s {mlp_field} cannot give an MLP width of exactly {widths[0]}")
    for key in ("mlp_bias", "proj_bias"):
        folded = [i for i, e in enumerate(entries) if e.get(key)]
        if folded and key not in family.bias_flags:
            reader = (family.names.mlp_out if key == "mlp_bias" else family.names.proj).rpartition(".")[2]
            return Layout(
                REMOTE, why=f"layer {folded[0]}'s {reader} carries the compensation's bias: {name} has no flag for it"
            )
    for key, (flag, _) in family.bias_flags.items():
        new[flag] = getattr(config, flag) or any(e[key] for e in entries)
    return Layout(STANDARD, new)


@torch.no_grad()
def stored(model: nn.Module) -> nn.Module:
    """The model as its folder stores it: itself, or (a standard folder with a folded bias) a copy whose Linears
    that the config flags give a bias have one, zero where the pruned model has none: transformers' Llama has
    one ``mlp_bias`` for gate, up and down and one ``attention_bias`` for q, k, v and o. The copy's modules are new,
    its weights the model's own: a 1.7B decoder's save holds its weights once."""
    plan, family = layout(model), adapter_for(model)
    if plan.form != STANDARD:
        return model
    flags = [flag for flag, _ in family.bias_flags.values() if plan.config[flag] and not getattr(model.config, flag)]
    if not flags:
        return model
    model = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())})  # the weights shared
    for block in family.blocks(model):
        for flag, paths in family.bias_flags.values():
            for path in paths if flag in flags else ():
                old = modeling.get(block, path)
                if old.bias is None:
                    new = modeling.linear_like(old, old.in_features, old.out_features, True)
                    new.weight = old.weight  # on meta where the model is onloaded: its zero bias is made here
                    new.bias = nn.Parameter(torch.zeros_like(new.bias, device="cpu" if new.bias.is_meta else None))
                    modeling.put(block, path, new)
    for flag in flags:
        setattr(model.config, flag, True)
    return model


def write(model: nn.Module, folder: Path) -> dict[str, Any]:
    """config.json (and modeling_corp.py) in the model's form, the source's tokenizer and sentence-transformers
    files; returns what ``corp.json`` records about the folder (``form``, ``why``, ``loads_with``)."""
    plan = layout(model)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    for stale in ("auto_map", modeling.WIDTHS_KEY, modeling.NAMES_KEY):  # a remote-code artifact's
        if hasattr(config, stale):
            delattr(config, stale)
    auto = next((a for suffix, a in HEAD_AUTO.items() if type(model).__name__.endswith(suffix)), "AutoModel")
    dense: dict[str, Any] = {}
    if plan.form == STANDARD:
        flags = {flag for flag, _ in adapter_for(model).bias_flags.values()}
        for key, value in plan.config.items():
            if key not in flags:  # a width (a bias flag stays: the stored weights carry those biases)
                dense[key] = getattr(config, key)
            setattr(config, key, value)
        loads_with = f"{auto}.from_pretrained(folder)"
    else:
        base = type(model.base_model).__name__
        classes = {"AutoModel": base} | ({auto: type(model).__name__} if auto != "AutoModel" else {})
        setattr(config, modeling.WIDTHS_KEY, structure(model))
        setattr(config, modeling.NAMES_KEY, adapter_for(model).names.record())
        config.auto_map = {name: f"{Path(MODELING_FILE).stem}.Corp{cls}" for name, cls in classes.items()}
        shutil.copy2(modeling.__file__, folder / MODELING_FILE)
        loads_with = f"{auto}.from_pretrained(folder, trust_remote_code=True)"
    config.save_pretrained(folder)
    source = Path(getattr(model.config, "_name_or_path", "") or "")
    for name in (*TOKENIZER_FILES, *USAGE_FILES, PREPROCESSOR_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
    record = {"form": plan.form, "loads_with": loads_with} | ({"why": plan.why} if plan.why else {})
    if dense := {k: v for k, v in dense.items() if v != plan.config[k]}:
        record[DENSE_CONFIG] = dense
    if copy_sentence_transformers(source, folder):
        trust = "" if plan.form == STANDARD else ", trust_remote_code=True"
        record["sentence_transformers"] = f"SentenceTransformer(folder{trust})"
    return record


def copy_sentence_transformers(source: Path, folder: Path) -> bool:
    """The source's sentence-transformers files and module folders, when its Transformer module is its root (the
    pruned model takes that place); whether it was one."""
    modules_file = source / "modules.json"
    if not modules_file.is_file():
        return False
    try:
        modules = json.loads(modules_file.read_text())
        paths = [m.get("path", "") for m in modules]
    except (ValueError, AttributeError, TypeError):
        raise CorpError(f"{modules_file} is not a sentence-transformers module list; fix or remove it") from None
    if "" not in paths:
        return False
    for name in SENTENCE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
    for path in paths:
        if path and (source / path).is_dir():
            shutil.copytree(source / path, folder / path)
    return True


def describe(record: dict[str, Any]) -> str:
    """One line for the terminal: how the folder loads without corp-deploy, and why it is not standard."""
    line = f"loads without corp-deploy: {record['loads_with']}"
    if "sentence_transformers" in record:
        line += f" or {record['sentence_transformers']}"
    return line + (f" (remote code: {record['why']})" if "why" in record else " (the family's own format)")
