"""A decoder (dense or pruned) as an onnxruntime-genai folder, verified by generating with it.

Layout (``write_genai_folder``): ``model.onnx`` (the decode-step graph, ``exporters.kv_cache``), its
``model.onnx.json`` record, ``genai_config.json`` and the tokenizer files of the model's folder, so that
``onnxruntime_genai.Model(folder)`` loads it and generates. The folder is written only if onnxruntime runs the
graph to the torch model's logits over a prefill and decode steps, and if genai's greedy generation from
``PROMPTS`` equals ``transformers``' ``generate`` (greedy, key/value cache) token for token.

Both references (the decode steps' logits, ``generate``'s tokens) are computed first, while the model is held; then
the model may be let go (``free``: a run that holds one model at a time) before the graph is built, checked in
onnxruntime and generated with in genai: at the 1.7B shape the float32 weights are 6.4 GiB, and the builder's copy
and each onnxruntime session of the graph as much again.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corp_deploy.base.deps import require
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.steps import phases
from corp_deploy.exporters import fused_decoder
from corp_deploy.exporters.compare import FP32, Tolerance
from corp_deploy.exporters.kv_cache import (
    KINDS,
    PAST,
    PRESENT,
    CacheLayout,
    DecodeStep,
    check_decode_steps,
    decode_references,
    export_decoder_onnx,
    layout,
)
from corp_deploy.exporters.onnx_export import DEFAULT_OPSET, check_opset, onnx_bytes
from corp_deploy.formats.run_folder import GENAI_CONFIG as CONFIG

GRAPH = "model.onnx"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""What genai's tokenizer reads beside the graph (a ``tokenizers`` JSON and its config), copied when present."""
PROMPTS = 2
NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 11)
TOKENIZER_SAMPLE = "The market rallied on Tuesday as the bank cut its price forecast."


SPECIAL = ("bos", "eos", "pad")
"""The special tokens genai's config names by id."""


def _tokenizer_ids(folder: Path) -> dict[str, int]:
    """The special tokens' ids a tokenizer folder names (``tokenizer_config.json``'s tokens, looked up in
    ``tokenizer.json``'s added tokens and vocabulary), read as JSON: no tokenizer library needed."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        core = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return {}
    ids = {t["content"]: t["id"] for t in core.get("added_tokens", [])}
    vocab = core.get("model", {}).get("vocab")
    ids |= vocab if isinstance(vocab, dict) else {}
    found = {}
    for kind in SPECIAL:
        token = config.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            found[kind] = ids[token]
    return found


def fill_special_ids(model: nn.Module, folder: Path | None) -> str | None:
    """Give ``model`` the BOS/EOS/pad ids its config leaves null (``Qwen2Config()``'s defaults do) from
    ``folder``'s ``generation_config.json``, else its tokenizer: genai's config takes numbers only, and
    ``transformers``' ``generate`` must stop and pad as genai does. A null BOS with an EOS becomes the EOS (Qwen2's
    own configs use one token for both). Returns the line that says what was filled, or None; one line when no EOS
    is found: without one genai cannot stop."""
    config, generation = model.config, getattr(model, "generation_config", None)
    try:
        given = json.loads((folder / "generation_config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        given = {}
    from_tokenizer = _tokenizer_ids(folder) if folder else {}
    filled = []
    for kind in ("eos", "bos", "pad"):  # the EOS first: a null BOS may take it
        name = f"{kind}_token_id"
        if getattr(config, name) is not None:
            continue
        value, where = given.get(name), "generation_config.json"
        if value is None:
            value, where = from_tokenizer.get(kind), "the tokenizer"
        if value is None and kind == "bos" and config.eos_token_id is not None:
            value, where = config.eos_token_id, "the EOS id"
        if value is None:
            continue
        setattr(config, name, value)
        if generation is not None:
            setattr(generation, name, value)
        filled.append(f"{name} {value} from {where}")
    if config.eos_token_id is None:
        raise CorpError(
            "the model names no eos_token_id (config.json, generation_config.json or its tokenizer) and genai needs "
            "one to stop generating; set eos_token_id in its config.json"
        )
    return f"the config leaves them null: {', '.join(filled)}" if filled else None


def genai_config(step: DecodeStep, config: Any, layout: CacheLayout) -> dict[str, Any]:
    """``genai_config.json`` for the graph: names, the cache's heads and (largest) width, greedy search.

    genai takes each layer's cache width from the graph's past-key dims; ``head_size`` is the widest."""
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if step.positions:
        inputs["position_ids"] = "position_ids"
    names = {f"past_{kind}_names": PAST.format(i="%d", kind=kind) for kind in KINDS}
    outputs = {"logits": "logits", **{f"present_{kind}_names": PRESENT.format(i="%d", kind=kind) for kind in KINDS}}
    context = config.max_position_embeddings
    eos = config.eos_token_id
    return {
        "model": {
            "type": step.family.genai_type,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": config.pad_token_id if config.pad_token_id is not None else eos,
            "context_length": context,
            "vocab_size": config.vocab_size,
            "decoder": {
                "filename": GRAPH,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": max(layout.stored("key")),
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": layout.kv_heads,
                "num_hidden_layers": len(layout.key),
                "inputs": {**inputs, **names},
                "outputs": outputs,
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": context,
            "min_length": 0,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "num_return_sequences": 1,
            "early_stopping": True,
            "length_penalty": 1.0,
            "diversity_penalty": 0.0,
            "no_repeat_ngram_size": 0,
        },
    }


def prompts(vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    """``PROMPTS`` token-id prompts of ``PROMPT_LENGTHS`` drawn from the vocabulary without special tokens (any
    model, with or without a tokenizer, gets the same check)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([t for t in range(vocab) if t not in special])
    return [pool[torch.randint(0, len(pool), (n,), generator=g)].tolist() for n in PROMPT_LENGTHS[:PROMPTS]]


def _transformers_tokens(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=True, **kw)
    return out[0, len(prompt) :].tolist()


def _genai_tokens(og: Any, genai_model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    params = og.GeneratorParams(genai_model)
    total = len(prompt) + new_tokens
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    generator = og.Generator(genai_model, params)
    generator.append_tokens([prompt])
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt) :]


def genai_model(folder: Path) -> Any:
    """``onnxruntime_genai.Model`` of ``folder``, once for its checks: each load builds an onnxruntime session over
    the whole graph (seconds for SmolLM2-135M's 520 MB)."""
    og = require("onnxruntime_genai", "a decoder's genai folder")
    try:
        return og.Model(str(folder))
    except RuntimeError as e:
        raise CorpError(f"onnxruntime-genai cannot run {folder.name}: {first_line(e)}") from None


def greedy_references(
    model: nn.Module, prompt_ids: list[list[int]] | None = None, new_tokens: int = NEW_TOKENS
) -> list[dict[str, Any]]:
    """``generate``'s greedy tokens from ``prompt_ids`` (default: ``prompts``), ``new_tokens`` each (EOS suppressed
    until then: ``min_new_tokens``), as ``{"prompt", "tokens"}``: what ``verify_genai`` checks genai against, computed
    while the model is held."""
    config = model.config
    special = {t for t in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if t is not None}
    return [
        {"prompt": prompt, "tokens": _transformers_tokens(model, prompt, new_tokens)}
        for prompt in prompt_ids or prompts(config.vocab_size, special)
    ]


def verify_genai(folder: Path, loaded: Any, references: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy generation in onnxruntime-genai from each reference's prompt against its ``generate`` tokens
    (``greedy_references``); fails unless every token matches. genai suppresses EOS until as many tokens are out
    (``min_length``), so every prompt checks them all. ``loaded`` is ``genai_model(folder)``."""
    og = require("onnxruntime_genai", "a decoder's genai folder")
    new_tokens = len(references[0]["tokens"])
    try:
        checks = [
            {**r, "genai_equal": _genai_tokens(og, loaded, r["prompt"], new_tokens) == r["tokens"]} for r in references
        ]
    except RuntimeError as e:
        raise CorpError(f"onnxruntime-genai cannot run {folder.name}: {first_line(e)}") from None
    bad = [c for c in checks if not c["genai_equal"]]
    if bad:
        raise CorpError(
            f"onnxruntime-genai's greedy tokens differ from transformers' for {len(bad)} of {len(checks)} prompts "
            f"({folder.name}); nothing was written"
        )
    return {"runtime": f"onnxruntime-genai {og.__version__}", "new_tokens": new_tokens, "prompts": checks}


def check_tokenizer(folder: Path, loaded: Any) -> dict[str, Any] | None:
    """Whether genai tokenizes ``TOKENIZER_SAMPLE`` as ``transformers`` does; None without tokenizer files.
    ``loaded`` is ``genai_model(folder)``."""
    if not (folder / "tokenizer.json").is_file():
        return None
    og = require("onnxruntime_genai", "a decoder's genai folder")
    transformers = require("transformers", "a decoder's genai folder")
    want = transformers.AutoTokenizer.from_pretrained(str(folder))(TOKENIZER_SAMPLE)["input_ids"]
    try:
        got = [int(t) for t in og.Tokenizer(loaded).encode(TOKENIZER_SAMPLE)]
    except RuntimeError as e:
        raise CorpError(f"onnxruntime-genai cannot read the tokenizer of {folder.name}: {first_line(e)}") from None
    if got != want:
        raise CorpError(f"onnxruntime-genai tokenizes differently from transformers ({got[:8]} vs {want[:8]}...)")
    return {"sample": TOKENIZER_SAMPLE, "tokens": want}


def tokenizer_files(folder: Path | None) -> list[Path]:
    """``TOKENIZER_FILES`` present in ``folder`` (none without one): what a genai folder and the builder read."""
    return [folder / n for n in TOKENIZER_FILES if folder and (folder / n).is_file()]


GRAPHS = ("auto", "fused", "export")
"""``--decode-graph``: genai's builder (``fused``, ``exporters.fused_decoder``), ``torch.export``
(``export``, ``exporters.kv_cache``: any widths), or ``auto`` (fused where the builder takes the model)."""


def choose_graph(model: nn.Module, graph: str, tokenizer: Sequence[Path]) -> tuple[str, str | None]:
    """(``fused`` or ``export``, why not fused) for ``--decode-graph``; fused asked of a model it cannot take is
    one line."""
    if graph not in GRAPHS:
        raise CorpError(f"--decode-graph must be one of {', '.join(GRAPHS)}, got {graph!r}")
    why = fused_decoder.unsupported(model, tokenizer) if graph != "export" else "asked for (--decode-graph export)"
    if graph == "fused" and why:
        raise CorpError(f"--decode-graph fused: {why}; use --decode-graph export or auto")
    return ("export", why) if why else ("fused", None)


def write_genai_folder(
    model: nn.Module,
    folder: Path,
    description: dict[str, Any],
    tokenizer_dir: Path | None = None,
    opset: int = DEFAULT_OPSET,
    prompt_ids: list[list[int]] | None = None,
    tol: Tolerance = FP32,
    steps: int = 4,
    graph: str = "auto",
    source: Path | None = None,
    free: Callable[[], None] = lambda: None,
    again: Callable[[], nn.Module] | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write and verify the genai folder for ``model`` into ``folder`` (created; callers stage it); its record.

    ``graph`` picks the decode step's writer (``GRAPHS``). The graph must reproduce torch's logits within ``tol``
    (its relative error) over a prefill and ``steps`` decode steps, and genai must generate ``generate``'s tokens
    from ``prompt_ids`` (default ``prompts``); ``model.onnx.json`` records both checks, the tokenizer check, the
    cache layout and which writer made the graph (and why not the fused one). Under ``auto`` a fused graph that
    fails a check is replaced by the exported one, the failure recorded as the reason.

    Both references are computed first; ``free`` is then called as soon as the model's weights are no longer needed
    (the exported graph written; for the builder, before it loads its own copy from ``source``, the model's
    ``transformers`` folder, or from a copy written first where there is none). ``again`` reads the model anew after
    ``free``, for the exported graph that replaces a failed fused one. ``say`` gets a line as each phase starts (each
    is minutes at the 1.7B shape).
    """
    check_opset(opset)
    require("onnxruntime_genai", "a decoder's genai folder")
    filled = fill_special_ids(model, tokenizer_dir)
    description = description | ({"special_ids_filled": filled} if filled else {})  # recorded with the graph
    tokenizer = tokenizer_files(tokenizer_dir)
    writer, why = choose_graph(model, graph, tokenizer)
    check = {"prompt_ids": prompt_ids, "tol": tol, "steps": steps, "free": free, "say": say}
    if writer == "fused":
        try:  # a config whose ids were filled here differs from the folder's: the builder reads a copy
            return _written(
                folder, description, "fused", tokenizer, opset, None, model, None if filled else source, **check
            )
        except CorpError as e:
            if graph == "fused":
                raise
            shutil.rmtree(folder, ignore_errors=True)
            why = f"the builder's graph failed its check ({e})"
            if again is not None:
                model = again()
                fill_special_ids(model, tokenizer_dir)
    return _written(folder, description, "export", tokenizer, opset, why, model, None, **check)


def _written(
    folder: Path,
    description: dict[str, Any],
    writer: str,
    tokenizer: list[Path],
    opset: int,
    why: str | None,
    model: nn.Module,
    source: Path | None,
    prompt_ids: list[list[int]] | None,
    tol: Tolerance,
    steps: int,
    free: Callable[[], None],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """``write_genai_folder`` with one writer: the references, the graph (the model let go once written, or before
    the builder runs), its checks against the references, the folder's files and record."""
    og = require("onnxruntime_genai", "a decoder's genai folder")
    folder.mkdir(parents=True, exist_ok=True)
    phase = phases(folder.name, say)
    phase("transformers' references (greedy tokens, decode-step logits)")
    tokens = greedy_references(model, prompt_ids)
    reference = decode_references(model, steps, batched=writer == "export")
    config = model.config  # kept when the weights are let go
    start = time.perf_counter()
    metadata = {**description, "precision": "fp32", "graph": "decode-step"}
    phase(
        f"the decode-step graph ({writer}; the model let go {'before the builder' if writer == 'fused' else 'after'})"
    )
    if writer == "fused":
        lay = layout(model, padded=False)
        fused_decoder.build_fused(model, folder, metadata, tokenizer, source=source, free=free)
        made = {"writer": f"onnxruntime-genai {og.__version__} model builder (fused operators)"}
    else:
        step = export_decoder_onnx(model, folder / GRAPH, opset, metadata)
        lay = step.lay
        free()
        made = {"writer": f"torch.export (opset {opset})", "why_not_fused": why}
    seconds = time.perf_counter() - start
    phase("onnxruntime's check of the decode steps")
    check = check_decode_steps(reference, folder / GRAPH)
    worst = max(check["max_rel_error_per_step"])
    if worst > tol.max_rel_error:
        raise CorpError(
            f"the decode-step graph differs from torch by {worst:.2e} (relative; FP32 gate {tol.max_rel_error})"
        )
    if writer == "export":
        for f in tokenizer:
            shutil.copy2(f, folder / f.name)
        (folder / CONFIG).write_text(json.dumps(genai_config(step, config, lay), indent=2) + "\n")
    phase("onnxruntime-genai's greedy generation")
    loaded = genai_model(folder)
    record = {
        "file": GRAPH,
        "precision": "fp32",
        "graph": "decode-step",
        **made,
        "opset": opset,
        "bytes": onnx_bytes(folder / GRAPH),
        "seconds": round(seconds, 2),
        "kv_cache": lay.record(),
        "verify": {**check, "reference": "torch (its own key/value cache)", "tolerance": asdict(tol)},
        "tokenizer": check_tokenizer(folder, loaded),
        "genai": verify_genai(folder, loaded, tokens),
        **description,
    }
    (folder / f"{GRAPH}.json").write_text(json.dumps(record, indent=2) + "\n")
    phase(None)
    return record
