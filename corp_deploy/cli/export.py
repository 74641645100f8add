"""``export``: a model to a verified ONNX graph (and its FP16 copy), or a decoder to an onnxruntime-genai folder.
The files and their records are written by ``exporters``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from torch import nn

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir, check_writable, staged
from corp_deploy.cli import genai
from corp_deploy.cli.export_options import (
    onnx_options,
    verify_group,
    verify_options,
)
from corp_deploy.cli.options import (
    model_options,
    needs,
    onnx_needs,
)
from corp_deploy.exporters.genai import CONFIG, GRAPH, NEW_TOKENS, write_genai_folder
from corp_deploy.exporters.genai_target import filled
from corp_deploy.exporters.pipeline import (
    VerifyOptions,
    convert_verified,
    export_verified,
    format_summary,
    is_text,
)
from corp_deploy.exporters.rewrites import parse_rewrites
from corp_deploy.families.hf import hub
from corp_deploy.families.timm import surgery
from corp_deploy.families.timm.models import parse_model_args
from corp_deploy.formats import sources
from corp_deploy.formats.precisions import FP16, FP32
from corp_deploy.formats.precisions import parse as parse_precisions
from corp_deploy.formats.run_folder import onnx_name


def padded_qk(model: nn.Module, description: dict, enabled: bool) -> dict:
    """Switch ``--pad-qk`` on in ``model``; the exported graph's description says how many blocks it padded."""
    return description | {"pad_qk_blocks": surgery.pad_qk(model)} if enabled else description


def refuse_text_flags(pad_qk: bool, simplify: bool) -> None:
    """Refuse, before any work, what a text encoder's export does not do."""
    if pad_qk or simplify:
        raise CorpError("--pad-qk and --simplify are for timm ViTs; export text encoders without them")


@click.command()
@click.argument("source")
@model_options
@onnx_options
@verify_group
@click.option(
    "--precision",
    default=FP32.name,
    show_default=True,
    help=f"Comma list of {FP32.name}, {FP16.name}: the graphs written, each verified ({FP16.name}: <name>.fp16.onnx "
    "beside the FP32 one, FP16 inside, FP32 I/O).",
)
@click.option(
    "--seq-len",
    default=128,
    show_default=True,
    help="Text encoders: the tokens per sequence the graph is described for (engine profile, bench).",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    help=f"Decoders: a prompt genai and transformers each continue greedily by {NEW_TOKENS} tokens, which must "
    "match (repeatable; default: two random token prompts).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="ONNX file to write (*.onnx); for a decoder (OPT, Llama, Mistral, Qwen2), its onnxruntime-genai folder.",
)
@click.option("--overwrite", is_flag=True, help="Replace existing files.")
def export(
    source: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    opset: int,
    simplify: bool,
    pad_qk: bool,
    rewrites: str,
    decode_graph: str,
    verify: dict[str, Any],
    precision: str,
    seq_len: int,
    prompts: tuple[str, ...],
    out: str,
    overwrite: bool,
) -> None:
    """Export SOURCE (a prune artifact folder, a timm model name, or a transformers encoder: a folder with a
    config.json or hf:NAME) to ONNX, verified with onnxruntime; text graphs have dynamic batch and sequence.

    A decoder (OPT, Llama, Mistral, Qwen2; dense folder or prune artifact) with a folder as --out gets an
    onnxruntime-genai folder: the key/value-cache graph, genai_config.json and the tokenizer files, verified by
    generating."""
    opts = verify_options(verify)
    half_too = FP16.name in parse_precisions(precision, (FP32.name, FP16.name))
    rewrites_ = parse_rewrites(rewrites)
    out_ = Path(out)
    if out_.suffix != ".onnx":
        if not (hub.is_source(source) or Path(source).is_dir()):
            raise CorpError(f"--out must be a .onnx file ({genai.folder_is()}), got {out}")
        flags = (half_too, pad_qk, simplify, bool(rewrites_))
        _genai_export(source, out_, overwrite, opset, flags, opts, prompts, seq_len, decode_graph)
        return
    if prompts or decode_graph != "auto":
        raise CorpError("--prompt and --decode-graph are for a decoder's genai folder: pass a folder as --out")
    half = out_.with_name(onnx_name(out_.stem, FP16.name))
    for path in (out_, half) if half_too else (out_,):
        check_writable(path, overwrite)
    needs("ONNX export", *onnx_needs((FP16.name,) if half_too else (), simplify))
    model, description = sources.load_source(source, weights, checkpoint, parse_model_args(model_arg), seq_len)
    if is_text(description):
        refuse_text_flags(pad_qk, simplify)
    description = padded_qk(model, description, pad_qk)
    params = {out_.stem: sum(p.numel() for p in model.parameters())}
    with staged(out_, overwrite) as stage:  # the graph is checked with the model let go (on the meta device)
        args = (description, opset, simplify, opts, rewrites_, lambda: model.to("meta"))
        records = [export_verified(model, stage / out_.name, *args)]
        if half_too:
            records.append(convert_verified(stage / out_.name, stage / half.name, opts))
    click.echo(format_summary({"onnx": records, "engines": [], "engines_skipped": None}, params))
    click.echo(f"wrote {', '.join(str(out_.with_name(r['file'])) for r in records)} (each with a .json record)")


def _genai_export(
    source: str,
    out: Path,
    overwrite: bool,
    opset: int,
    flags: tuple[bool, ...],
    opts: VerifyOptions,
    prompts: tuple[str, ...],
    seq_len: int,
    decode_graph: str,
) -> None:
    """``export DECODER --out DIR``: every check before the model loads, then the folder, staged."""
    folder = genai.decoder_folder(source)
    if any(flags):
        raise CorpError(
            f"--precision {FP16.name}, --pad-qk, --simplify and --rewrites are not for a genai folder (FP32); "
            "leave them out"
        )
    check_writable(out, overwrite)
    genai.needs_genai()
    ids = genai.prompt_ids(folder, prompts)
    model, description = sources.load_source(source, "pretrained", None, {}, seq_len)
    with atomic_dir(out, overwrite) as tmp:
        record = write_genai_folder(model, tmp, description, folder, opset, ids, opts.fp32, graph=decode_graph)
    if line := filled(record, out.name):
        click.echo(line)
    click.echo(genai.summary(record, out.name, folder if prompts else None))
    click.echo(f"wrote {out}/ ({GRAPH}, {GRAPH}.json, {CONFIG}, tokenizer files): onnxruntime_genai.Model('{out}')")
