"""A decoder's onnxruntime-genai folder from the command line: which sources make one, the checks made before any
work (the ``genai`` extra, the source, the prompts' lengths), and the lines printed after it is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corp_deploy.base.errors import CorpError
from corp_deploy.cli.options import ONNX_EXPORT, needs
from corp_deploy.exporters.genai import NEW_TOKENS
from corp_deploy.families import decoders, for_model_type, get
from corp_deploy.families.hf.adapter import max_positions
from corp_deploy.families.hf.hub import HUB_PREFIX
from corp_deploy.formats.artifact import META_FILE, read_meta
from corp_deploy.formats.sources import is_decoder, model_type

PURPOSE = "a decoder's onnxruntime-genai folder"


def folder_is() -> str:
    return f"a folder is the genai export of a decoder ({decoders()})"


def needs_genai() -> None:
    """One line, before any work, when onnxruntime-genai (the ``genai`` extra) or the ONNX stack is missing."""
    needs(PURPOSE, *ONNX_EXPORT, "onnxruntime_genai")


def decoder_folder(source: str) -> Path:
    """The folder of a decoder SOURCE (a prune artifact or a transformers folder): its config.json and tokenizer
    files are the genai folder's. Anything else is one line, before the model is loaded."""
    path = Path(source)
    if source.startswith(HUB_PREFIX):
        raise CorpError(
            f"{source}: a genai folder is made from a local folder; download it first "
            f"(hf download {source.removeprefix(HUB_PREFIX)} --local-dir DIR) and export DIR"
        )
    if (path / META_FILE).is_file():
        family = read_meta(path)["family"]  # another corp-deploy format or version: one line there
        if get(family).genai_type is None:
            raise CorpError(f"{source} is a {family} prune artifact: --out must be a .onnx file ({folder_is()})")
        return path
    if (path / "config.json").is_file():
        if not is_decoder(source):
            kind = model_type(source) or "transformers"
            family = for_model_type(kind)
            head = " without a language-model head (its config.json names no ...ForCausalLM architecture)"
            head = head if family is not None and family.genai_type else ""
            raise CorpError(f"{source} is a {kind} model{head}: --out must be a .onnx file ({folder_is()})")
        return path
    raise CorpError(
        f"{source} is neither a prune artifact (no {META_FILE}) nor a transformers folder (no config.json); "
        f"a genai folder is made from one of those ({decoders()})"
    )


def prompt_ids(folder: Path, texts: tuple[str, ...]) -> list[list[int]] | None:
    """``--prompt`` texts as token ids with the folder's tokenizer; one line for a prompt that, with the
    ``NEW_TOKENS`` generated, passes the model's positions, or for prompts without tokenizer files."""
    if not texts:
        return None
    import transformers

    if not (folder / "tokenizer.json").is_file():
        raise CorpError(f"--prompt needs the model's tokenizer files; {folder} has no tokenizer.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    limit = max_positions(transformers.AutoConfig.from_pretrained(str(folder)))
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(ids) + NEW_TOKENS > limit:
            raise CorpError(
                f"--prompt {text[:40]!r}... is {len(ids)} tokens: with the {NEW_TOKENS} generated that passes the "
                f"model's {limit} positions; shorten it to {limit - NEW_TOKENS} tokens or fewer"
            )
        out.append(ids)
    return out


def summary(record: dict[str, Any], name: str, folder: Path | None) -> str:
    """What the terminal shows of a genai folder: the check, the cache layout and, with ``folder`` (the tokenizer's),
    each prompt's continuation. Pass a folder only for prompts a user wrote: the default prompts are random tokens
    (equality with transformers is the test, not fluency), whose continuations read as a broken model; they stay in
    the folder's ``model.onnx.json``."""
    pad, genai = record["kv_cache"]["padding"], record["genai"]
    worst = max(record["verify"]["max_rel_error_per_step"])
    lines = [
        f"{name}: decode-step graph = torch within {worst:.1e} over prefill + {record['verify']['decode_steps']} "
        f"steps; {genai['runtime']} greedy = transformers for {len(genai['prompts'])} prompts x "
        f"{genai['new_tokens']} tokens",
        f"{name}: written by {record['writer']}"
        + (f" (not fused: {record['why_not_fused']})" if record.get("why_not_fused") else ""),
        f"{name}: cache widths per layer {_widths(record['kv_cache']['key_cache'])} (K "
        f"{_widths(record['kv_cache']['key'])}, V {_widths(record['kv_cache']['value'])}); zero-padding costs "
        f"{100 * pad['overhead']:.1f}% more cache",
    ]
    tokenizer = _tokenizer(folder)
    for check in genai["prompts"] if tokenizer is not None else ():
        text = tokenizer.decode(check["prompt"]) + "|" + tokenizer.decode(check["tokens"])
        lines.append(f"{name}: {text!r}")
    return "\n".join(lines)


def _widths(widths: list[int]) -> str:
    """``64 x30`` for equal widths, ``32..64 over 30 layers`` otherwise: a line, not a list of 30."""
    low, high = min(widths), max(widths)
    return f"{low} x{len(widths)}" if low == high else f"{low}..{high} over {len(widths)} layers"


def _tokenizer(folder: Path | None) -> Any:
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))
