"""The export stage: ONNX (``export``), engines (``build-engine``), INT8 (``quantize``), and all of them after
pruning (``prune-export``). The files and their records are written by ``exporters``."""

from __future__ import annotations

import functools
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from torch import nn

from corp_deploy import api
from corp_deploy.base.env import versions
from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_dir, check_writable, staged
from corp_deploy.base.steps import Steps, Stopped
from corp_deploy.bench.backends import rewrites_on
from corp_deploy.cli import genai
from corp_deploy.cli.export_options import (
    build_options,
    engine_group,
    onnx_options,
    tolerance,
    verify_group,
    verify_options,
)
from corp_deploy.cli.options import (
    calibration_source,
    model_options,
    needs,
    onnx_needs,
    out_options,
    out_path,
    precisions,
)
from corp_deploy.cli.prune import again, pruned, say_folder
from corp_deploy.cli.prune_options import prune_config, prune_options
from corp_deploy.cli.quantize_options import int4_candidates, int4_options, int4_setup, int8_options
from corp_deploy.exporters.compare import INT8
from corp_deploy.exporters.genai import CONFIG, GRAPH, NEW_TOKENS, tokenizer_files, write_genai_folder
from corp_deploy.exporters.int4 import (
    format_int4,
    format_int4_speed,
    int4_baseline,
    int4_graphs,
    int4_speed,
)
from corp_deploy.exporters.int4_quant import Scheme, decoder_graph
from corp_deploy.exporters.int8_recipes import parse_recipes, quantize_graphs
from corp_deploy.exporters.onnx_export import graph_precision, load_onnx, read_metadata
from corp_deploy.exporters.pipeline import (
    VerifyOptions,
    convert_verified,
    engine_verified,
    export_run,
    export_verified,
    format_summary,
    fp16_graph,
    is_text,
    write_export_record,
)
from corp_deploy.exporters.quantize import Data
from corp_deploy.exporters.rewrites import parse_rewrites
from corp_deploy.exporters.tensorrt_engine import (
    PRECISIONS,
    build_missing,
    for_graph,
    require_precision,
    select_flavour,
)
from corp_deploy.families.hf import hub as hf
from corp_deploy.families.timm import modules as surgery
from corp_deploy.families.timm.models import parse_model_args
from corp_deploy.formats import calibration, evaluation, sources
from corp_deploy.formats.artifact import META_FILE
from corp_deploy.formats.data import SYNTHETIC
from corp_deploy.formats.run_folder import (
    ARTIFACT,
    BASELINE_GENAI,
    GENAI_SUFFIX,
    INT4_SUFFIX,
    MODELS,
    engine_name,
    genai_name,
    onnx_name,
)
from corp_deploy.formats.text import int8_feeds
from corp_deploy.plan.report import format_report


def _pad_qk(model: nn.Module, description: dict, enabled: bool) -> dict:
    """Switch ``--pad-qk`` on in ``model``; the exported graph's description says how many blocks it padded."""
    return description | {"pad_qk_blocks": surgery.pad_qk(model)} if enabled else description


DECODER_ENGINES = (
    "decoders get none: an engine of the full-sequence logits graph cannot generate token by token (the genai "
    "folders are a decoder's runtime), and engines of the key/value-cache graph are not built yet"
)


def _int4_refused(precisions_: tuple[str, ...], decoder: bool) -> None:
    """INT4 weights are for decoders (their gate is perplexity): one line for a vision model or an encoder."""
    if "int4" in precisions_ and not decoder:
        raise CorpError(
            "--precision int4 is for decoders (OPT, Llama, Mistral, Qwen2: weight-only MatMulNBits gated on "
            "perplexity); use fp32, fp16 or int8 here"
        )


def _int4_windows(tokenizer_source: str | Path | None, data: str, vocab: int, int4: dict[str, Any], seed: int):
    """The held-out windows (numpy) that verify INT4 graphs: ``data``'s held-out documents, or random tokens."""
    tokenizer = None
    if data != SYNTHETIC and tokenizer_source is not None:
        tokenizer = hf.load_tokenizer(tokenizer_source, vocab)
    windows = evaluation.heldout_windows(tokenizer, data, vocab, int4["int4_seq_len"], int4["int4_windows"], seed)
    return windows.numpy()


def _int4_calibration(
    tokenizer_source: str | Path | None, data: str, vocab: int, int4: dict[str, Any], seed: int, scheme: Scheme
) -> dict[str, Any]:
    """``int4_graphs``' calibration arguments: windows of ``data``'s calibration documents (disjoint from the
    held-out ones the gate reads) when the scheme reads any (GPTQ, the error ranking), else none."""
    if not scheme.calibrated:
        return {}
    tokenizer = None
    if data != SYNTHETIC and tokenizer_source is not None:
        tokenizer = hf.load_tokenizer(tokenizer_source, vocab)
    num, seq_len = int4["int4_calib_windows"], int4["int4_seq_len"]
    windows = calibration.calibration_windows(tokenizer, data, vocab, seq_len, num, seed).numpy()
    part = "random tokens" if data == SYNTHETIC else "calibration documents (disjoint from the held-out ones)"
    return {"calibration": windows, "calibration_info": {"text": data, "part": part, "seed": seed}}


def _text_export(pad_qk: bool, simplify: bool) -> None:
    """Refuse, before any work, what a text encoder's export does not do."""
    if pad_qk or simplify:
        raise CorpError("--pad-qk and --simplify are for timm ViTs; export text encoders without them")


def _text_int8(
    tokenizer_from: str | Path, source: str, num_calib: int, num_verify: int, seed: int
) -> Callable[[Any], Data]:
    """Graph -> a text encoder's INT8 data (``text.int8_feeds``): vocabulary and sequence length from the graph's
    metadata, documents from ``source`` tokenized by the tokenizer of ``tokenizer_from`` (the model's)."""

    def feeds(proto) -> Data:
        meta = read_metadata(proto)
        tokenizer = None if source == SYNTHETIC else hf.load_tokenizer(tokenizer_from, meta["vocab_size"])
        if source != SYNTHETIC and tokenizer is None:
            raise CorpError(f"{tokenizer_from} has no tokenizer; text INT8 calibrates on documents tokenized by it")
        return int8_feeds(tokenizer, source, meta["vocab_size"], num_calib, num_verify, meta["seq_len"], seed)

    return feeds


@click.command()
@click.argument("source")
@model_options
@onnx_options
@verify_group
@click.option("--fp16", is_flag=True, help="Also write <name>.fp16.onnx (FP16 inside, FP32 I/O), verified.")
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
    fp16: bool,
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
    rewrites_ = parse_rewrites(rewrites)
    out_ = Path(out)
    if out_.suffix != ".onnx":
        if not (hf.is_source(source) or Path(source).is_dir()):
            raise CorpError(f"--out must be a .onnx file ({genai.folder_is()}), got {out}")
        flags = (fp16, pad_qk, simplify, bool(rewrites_))
        _genai_export(source, out_, overwrite, opset, flags, opts, prompts, seq_len, decode_graph)
        return
    if prompts or decode_graph != "auto":
        raise CorpError("--prompt and --decode-graph are for a decoder's genai folder: pass a folder as --out")
    half = out_.with_name(f"{out_.stem}.fp16.onnx")
    for path in (out_, half) if fp16 else (out_,):
        check_writable(path, overwrite)
    needs("ONNX export", *onnx_needs(("fp16",) if fp16 else (), simplify))
    model, description = sources.load_source(source, weights, checkpoint, parse_model_args(model_arg), seq_len)
    if is_text(description):
        _text_export(pad_qk, simplify)
    description = _pad_qk(model, description, pad_qk)
    with staged(out_, overwrite) as stage:
        records = [export_verified(model, stage / out_.name, description, opset, simplify, opts, rewrites_)]
        if fp16:
            records.append(convert_verified(stage / out_.name, stage / half.name, opts))
    params = {out_.stem: sum(p.numel() for p in model.parameters())}
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
        raise CorpError("--fp16, --pad-qk, --simplify and --rewrites are not for a genai folder (FP32); leave them out")
    check_writable(out, overwrite)
    genai.needs_genai()
    ids = genai.prompt_ids(folder, prompts)
    model, description = sources.load_source(source, "pretrained", None, {}, seq_len)
    with atomic_dir(out, overwrite) as tmp:
        record = write_genai_folder(model, tmp, description, folder, opset, ids, opts.fp32, graph=decode_graph)
    if line := genai.filled(record, out.name):
        click.echo(line)
    click.echo(genai.summary(record, out.name, folder if prompts else None))
    click.echo(f"wrote {out}/ ({GRAPH}, {GRAPH}.json, {CONFIG}, tokenizer files): onnxruntime_genai.Model('{out}')")


def _genai_brief(record: dict[str, Any]) -> dict[str, Any]:
    """A genai folder's checks and cache layout, for ``export.json``."""
    genai_ = record["genai"]
    equal = all(p["genai_equal"] for p in genai_["prompts"])
    checks = {"runtime": genai_["runtime"], "prompts": len(genai_["prompts"]), "new_tokens": genai_["new_tokens"]}
    brief = {"verify": record["verify"], "genai": {**checks, "tokens_equal": equal}, "kv_cache": record["kv_cache"]}
    return brief | {k: record[k] for k in ("writer", "why_not_fused") if k in record}


@click.command("build-engine")
@click.argument("onnx_file", type=click.Path())
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="fp16",
    show_default=True,
    help="fp32, fp16 or int8 (from a Q/DQ graph).",
)
@engine_group
@verify_group
@click.option("--out", type=click.Path(dir_okay=False), help="Engine file [<name>.<precision>.plan beside the ONNX].")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine.")
def build_engine(
    onnx_file: str, precision: str, engine: dict[str, Any], verify: dict[str, Any], out: str | None, overwrite: bool
) -> None:
    """Build a TensorRT or TensorRT-RTX engine from ONNX_FILE; verify it against onnxruntime where it can run.

    An FP32 graph asked for as fp16 is converted first (<name>.fp16.onnx beside it, reused while
    the FP32 graph is unchanged): TensorRT builds the graph's own types. Without a supported GPU
    (TensorRT-RTX builds ahead of time) the engine is recorded as built only, not executed.
    """
    opts = verify_options(verify)
    options = build_options(engine, precision, opts)
    source = Path(onnx_file)
    proto = load_onnx(source, weights=False)
    meta = read_metadata(proto)
    options = for_graph(options, meta["seq_len"] if is_text(meta) else None)
    stem = source.name.removesuffix(".onnx").removesuffix(".fp16").removesuffix(".int8")
    plan = Path(out) if out else source.with_name(f"{stem}.{precision}.plan")
    check_writable(plan, overwrite)
    if precision == "int8":  # made by `quantize`, never converted here: it needs calibration images
        if meta.get("precision") == "int8" and meta.get("int8_scheme", {}).get("format") != "QDQ":
            raise CorpError(
                f"{source} is not a Q/DQ graph (INT8 recipe {meta.get('int8_recipe', {}).get('chosen', 'unknown')}); "
                "TensorRT builds INT8 engines from Q/DQ only: quantize with --int8-recipe static"
            )
        require_precision(proto, source, precision)
    select_flavour(options)  # fail before converting anything
    if precision == "fp16" and graph_precision(proto) == "fp32":
        source = fp16_graph(source, source.with_name(f"{stem}.fp16.onnx"), opts, click.echo)
    record = engine_verified(source, plan, options, opts, overwrite)
    click.echo(format_summary({"onnx": [], "engines": [{"file": plan.name, **record}], "engines_skipped": None}))
    target = record.get("gpu") or f"targets {','.join(record['targets'])}"
    click.echo(f"wrote {plan} and {plan}.json ({record['flavour']} {record['version']}, {target}; {record['status']})")


@click.command()
@click.argument("source", type=click.Path())
@click.option(
    "--precision",
    type=click.Choice(("int8", "int4")),
    default="int8",
    show_default=True,
    help="int8: the fastest INT8 recipe that passes the gate (--int8-recipe: static Q/DQ, dynamic, smoothed); "
    "int4: weight-only MatMulNBits (decoders).",
)
@click.option(
    "--calib-dir", type=click.Path(), help="The images CORP calibrated on (same --seed); int4: the text folder."
)
@click.option("--calib", type=str, help="'synthetic': noise images, for smoke tests only.")
@click.option("--seed", default=0, show_default=True, help="Seed of the calibration sample (CORP's).")
@int8_options
@int4_options
@click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the FP32 graph [int8 {INT8.min_cosine}].")
@click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |FP32| [int8 {INT8.max_rel_error}].")
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--overwrite", is_flag=True, help="Replace existing INT8 / INT4 files.")
def quantize(
    source: str,
    precision: str,
    calib_dir: str | None,
    calib: str | None,
    seed: int,
    int8_calib: int,
    int8_verify: int,
    calib_method: str,
    smooth_alpha: float,
    int8_recipe: str,
    int8_batch: int,
    int4: dict[str, Any],
    tol_cosine: float | None,
    tol_rel: float | None,
    workers: int,
    overwrite: bool,
) -> None:
    """INT8 of SOURCE (a prune-export folder's dense/pruned.onnx, or one .onnx): <name>.int8.onnx, by the fastest
    --int8-recipe that passes the INT8 gate (static Q/DQ, onnxruntime's dynamic, smoothed).

    Calibrated on the first --int8-calib images of CORP's seeded sample, verified against the FP32
    graph on the next --int8-verify; written only if it passes the INT8 gate. A text encoder's graph calibrates
    on documents of --calib-dir (CORP's sample of them) and verifies on its held-out documents. GEMMs that
    quantize worst stay float, one at a time, while the graph misses the gate (recorded and printed). With
    --precision int4, a decoder's weight-only INT4 graph <name>.int4.onnx, verified on --int4-windows held-out
    windows of the --calib-dir text (perplexity ratio and top-1 agreement against the FP32 graph).
    """
    if precision == "int4":
        _quantize_int4(Path(source), calibration_source(calib_dir, calib, True), int4, seed, overwrite)
        return
    pairs = _int8_pairs(Path(source))
    recipes = parse_recipes(int8_recipe)
    metas = [read_metadata(load_onnx(g, weights=False)) for g, _ in pairs]
    data = calibration_source(calib_dir, calib, any(is_text(m) for m in metas))
    for _, out in pairs:
        check_writable(out, overwrite)
    needs("INT8 quantization", "onnx", "onnxruntime")
    tol = tolerance(INT8, tol_cosine, tol_rel)
    text = None
    if is_text(metas[0]):  # a run folder's graphs are one model's: the tokenizer is its artifact's, or its source's
        artifact = pairs[0][0].parent / ARTIFACT
        tokenizer_from = artifact if (artifact / META_FILE).is_file() else metas[0]["model"]
        text = _text_int8(tokenizer_from, data, int8_calib, int8_verify, seed)
    records = quantize_graphs(
        pairs,
        data,
        tol,
        int8_calib,
        int8_verify,
        seed,
        calib_method,
        workers,
        overwrite,
        text,
        click.echo,
        smooth_alpha,
        recipes,
        int8_batch,
        baseline=True,
    )
    click.echo(format_summary({"onnx": records, "engines": [], "engines_skipped": None}))
    click.echo(f"wrote {', '.join(str(out.parent / r['file']) for r in records)} (each with a .json record)")


def _quantize_int4(source: Path, data: str, int4: dict[str, Any], seed: int, overwrite: bool) -> None:
    """``quantize --precision int4``: every graph and destination checked, then the windows, then the graphs."""
    scheme, tol = int4_setup(int4)
    pairs = _int4_pairs(source)
    protos = [decoder_graph(g / GRAPH if g.is_dir() else g) for g, _ in pairs]
    for _, out in pairs:
        check_writable(out, overwrite)
    needs("INT4 quantization", "onnx", "onnxruntime")
    folder = source if source.is_dir() else source.parent  # a run folder's artifact, or a genai folder's own files
    tokenizer = next((d for d in (folder, folder / "pruned") if (d / "tokenizer_config.json").is_file()), None)
    vocab = read_metadata(protos[0]).get("vocab_size")
    if vocab is None:
        raise CorpError(f"{pairs[0][0]} records no vocab_size; export it with `corp-deploy export` or `prune-export`")
    windows = _int4_windows(tokenizer, data, vocab, int4, seed)
    calibration = _int4_calibration(tokenizer, data, vocab, int4, seed, scheme)
    info, candidates = {"text": data, "seed": seed}, int4_candidates(int4, scheme)
    records = int4_graphs(pairs, windows, tol, scheme, info, overwrite, **calibration, candidates=candidates)
    click.echo(format_int4(records))
    click.echo(f"wrote {', '.join(str(out) for _, out in pairs)} (each with a .json record)")


def _int4_pairs(source: Path) -> list[tuple[Path, Path]]:
    """(FP32, INT4) for a decoder's genai folders (a run folder's ``*-genai/``, or one such folder), else for its
    dense/pruned.onnx or one .onnx file (``<name>.int4.onnx``)."""
    genai_folders = [source] if (source / CONFIG).is_file() else sorted(source.glob(f"*{GENAI_SUFFIX}"))
    if source.is_dir() and genai_folders:
        return [(f, f.with_name(f"{f.name}{INT4_SUFFIX}")) for f in genai_folders]
    return [(g, g.with_name(f"{g.stem}.int4.onnx")) for g in _fp32_graphs(source)]


def _fp32_graphs(source: Path) -> list[Path]:
    """A run folder's dense and pruned FP32 graphs, or one .onnx file."""
    if source.is_dir():
        graphs = [source / onnx_name(m) for m in MODELS if (source / onnx_name(m)).is_file()]
        if not graphs:
            raise CorpError(
                f"{source} has no dense.onnx or pruned.onnx; run `corp-deploy prune-export` or pass a .onnx"
            )
    elif source.suffix == ".onnx":
        graphs = [source]
    else:
        raise CorpError(f"{source} is neither a prune-export folder nor a .onnx file")
    return graphs


def _int8_pairs(source: Path) -> list[tuple[Path, Path]]:
    """(FP32 graph, INT8 file) for a run folder's dense and pruned graphs, or for one .onnx file."""
    graphs = _fp32_graphs(source)
    return [(g, g.with_name(onnx_name(g.stem, "int8"))) for g in graphs]


@click.command("prune-export")
@prune_options
@onnx_options
@verify_group
@engine_group
@click.option(
    "--precision", default="fp32,fp16", show_default=True, help="Engine precisions: fp32, fp16, int8 (implies --int8)."
)
@click.option("--require-engines", is_flag=True, help="Fail (instead of skipping engines) where none can be built.")
@click.option(
    "--latency-rounds",
    default=3,
    show_default=True,
    help="A latency budget: times dense and pruned on --latency-on, and re-allocates while the measured speedup "
    "misses the target by more than the noise band, this many timings at most.",
)
@click.option(
    "--int8", is_flag=True, help="Also write dense/pruned.int8.onnx (the fastest --int8-recipe that passes), verified."
)
@int8_options
@int4_options
@out_options("Run folder")
def prune_export(
    opset: int,
    simplify: bool,
    pad_qk: bool,
    rewrites: str,
    decode_graph: str,
    verify: dict[str, Any],
    engine: dict[str, Any],
    precision: str,
    require_engines: bool,
    latency_rounds: int,
    int8: bool,
    int8_calib: int,
    int8_verify: int,
    calib_method: str,
    smooth_alpha: float,
    int8_recipe: str,
    int8_batch: int,
    int4: dict[str, Any],
    out: str | None,
    overwrite: bool,
    **prune_args: Any,
) -> None:
    """Prune MODEL, export dense and pruned to ONNX, build TensorRT engines; verify every step that can run.

    Writes --out/{pruned/, dense.onnx, pruned.onnx, *.fp16.onnx, *.plan, export.json}: pruned/ as soon as the
    prune is done, then each file as it is verified, export.json last. A step that fails or is interrupted keeps
    pruned/ and the finished files, and names the corp-deploy commands that make the rest. Engines
    built ahead of time by TensorRT-RTX without a supported GPU are marked built, not executed.
    With --speedup S (or --budget latency=F) the pruned model is timed against the dense one on --latency-on
    before anything is written, and re-allocated from the same statistics while it misses (--latency-rounds).
    A decoder gets dense-genai/ and pruned-genai/ (onnxruntime-genai folders) and, with --precision int4,
    dense-genai-int4/ and pruned-genai-int4/ (weight-only MatMulNBits), verified on --int4-windows held-out
    windows of the --calib-dir text.
    """
    started = time.perf_counter()
    precisions_ = precisions(precision)
    recipes = parse_recipes(int8_recipe)
    text = hf.modality(prune_args["model"]) == "text"
    decoder = text and sources.is_decoder(prune_args["model"])
    _int4_refused(precisions_, decoder)
    int4_setup(int4)  # a bad INT4 flag fails here
    if text:
        _text_export(pad_qk, simplify)
    config = prune_config(prune_args.pop("pruning"), prune_args["latency"])
    rewrites_ = parse_rewrites(rewrites, rewrites_on(prune_args["latency"]["latency_on"]))
    opts = verify_options(verify)
    build = for_graph(build_options(engine, "fp32", opts), prune_args["seq_len"] if text else None)
    no_engines = DECODER_ENGINES if decoder else None  # engines of logits graphs nobody can generate with
    if require_engines and (no_engines or build_missing(build)):
        raise CorpError(f"--require-engines: cannot build TensorRT engines here: {no_engines or build_missing(build)}")
    out = out_path(out, prune_args["model"], config, overwrite)
    needs("prune-export", *onnx_needs(precisions_, simplify))
    if decoder:
        genai.needs_genai()
    quantize = None
    if int8 or "int8" in precisions_:  # INT8 engines are built from the INT8 graphs
        source = calibration_source(prune_args["calib_dir"], prune_args["calib"], text)
        feeds = _text_int8(prune_args["model"], source, int8_calib, int8_verify, prune_args["seed"]) if text else None
        quantize = functools.partial(
            quantize_graphs,
            source=source,
            tol=opts.int8,
            num_calib=int8_calib,
            num_verify=int8_verify,
            seed=prune_args["seed"],
            method=calib_method,
            smooth_alpha=smooth_alpha,
            workers=prune_args["workers"] or 0,
            text=feeds,
            say=click.echo,
            recipes=recipes,
            batch=int8_batch,
            baseline=True,
        )
    rounds = latency_rounds if prune_args["latency"]["latency_on"] is not None else None
    run = pruned(config, **prune_args, keep_dense=True, transformers=True, latency_rounds=rounds, rewrites=rewrites_)
    if run is None:
        return
    prune_seconds = time.perf_counter() - started  # the model, the data, any latency table, the prune, a recovery
    click.echo(format_report(run.result.report))
    seq_len = prune_args["seq_len"]
    models = {
        "dense": (run.dense, sources.describe(run.dense, run.name, run.args, run.weights, seq_len)),
        "pruned": (
            run.result.model,
            _pad_qk(
                run.result.model, sources.describe(run.result.model, run.name, run.args, "corp-pruned", seq_len), pad_qk
            ),
        ),
    }
    run_dir = Path(out)
    with atomic_dir(run_dir, overwrite) as tmp:  # first, alone: a later step that stops leaves the prune
        api.save(run.result, tmp / ARTIFACT, run.name, run.args, weights=run.weights)
    engines = tuple(p for p in precisions_ if p != "int4")
    buildable = no_engines is None and not build_missing(build)
    finish = _finisher(run_dir, prune_args["model"], engines, quantize is not None, decoder, precisions_, buildable)
    if run.stopped:
        raise Stopped(
            f"{run.stopped}; wrote {run_dir}/pruned/ with CORP's weights, not recovered (its corp.json says so); "
            f"to export it: {finish()}; to recover, run {again()}",
            interrupted=True,
        )
    click.echo(f"wrote {run_dir}/pruned/ (the pruned model); now the exports")
    steps = Steps(run_dir, finish, click.echo)
    record = export_run(
        models, run_dir, engines, opset, simplify, opts, build, require_engines, quantize, rewrites_, no_engines, steps
    )
    genai_records = {}
    if decoder:
        with steps("genai folders (dense, pruned)"):
            for stem, (model, description) in models.items():
                with atomic_dir(run_dir / genai_name(stem)) as folder:
                    genai_records[stem] = write_genai_folder(
                        model, folder, description, run_dir / ARTIFACT, opset, None, opts.fp32, graph=decode_graph
                    )
                if line := genai.filled(genai_records[stem], genai_name(stem)):
                    click.echo(line)
        # each folder's model.onnx.json has it all; export.json names the folders and their checks
        record["genai"] = {genai_name(stem): _genai_brief(r) for stem, r in genai_records.items()}
    if "int4" in precisions_:
        with steps("INT4 quantization"):
            data, seed = calibration_source(prune_args["calib_dir"], prune_args["calib"]), prune_args["seed"]
            vocab = run.dense.config.vocab_size
            windows = _int4_windows(prune_args["model"], data, vocab, int4, seed)
            pairs = [(run_dir / genai_name(s), run_dir / genai_name(s, int4=True)) for s in models]
            scheme, tol = int4_setup(int4)
            calibration = _int4_calibration(prune_args["model"], data, vocab, int4, seed, scheme)
            inputs = [(model, tokenizer_files(run_dir / ARTIFACT)) for model, _ in models.values()]
            info, candidates = {"text": data, "seed": seed}, int4_candidates(int4, scheme)
            record["int4"] = int4_graphs(
                pairs, windows, tol, scheme, info, **calibration, candidates=candidates, sources=inputs
            )
            record |= _int4_baseline(run_dir, [out.name for _, out in pairs], windows, tol, inputs[0], info)
    record = write_export_record(run_dir, run.name, run.result.report, record, versions())
    click.echo(format_summary(record, {k: v["params"] for k, v in record["size"].items()}))
    if "int4" in record:
        click.echo(format_int4(record["int4"]))
        if "int4_speed" in record:
            click.echo(format_int4_speed([*record["int4"], record["int4_baseline"]], record["int4_speed"]))
        elif "int4_baseline" in record:
            click.echo(f"quantize-only baseline not built: {record['int4_baseline']['error']}")
    for stem, genai_record in genai_records.items():
        click.echo(genai.summary(genai_record, genai_name(stem), None))  # random-token prompts
    folders = ", ".join(f"{genai_name(stem)}/" for stem in genai_records)
    click.echo(f"wrote {out}/ (pruned/, ONNX files, engines, export.json{', ' + folders if folders else ''})")
    say_folder(run_dir / ARTIFACT)
    click.echo(steps.wall_time(time.perf_counter() - started, {"prune (model, data, tables, recovery)": prune_seconds}))


def _int4_baseline(run_dir: Path, folders: list[str], windows, tol, source, info: dict[str, Any]) -> dict[str, Any]:
    """The decoder's quantize-only baseline (genai's builder ``-p int4`` of the dense model, gated) and its decode
    speed beside the INT4 ``folders``, interleaved in one run: ``export.json``'s ``int4_baseline`` and
    ``int4_speed``. A model the builder does not take leaves the reason instead."""
    try:
        dense = run_dir / genai_name("dense")
        baseline = int4_baseline(dense, run_dir / BASELINE_GENAI, windows, tol, source, info)
    except CorpError as e:
        return {"int4_baseline": {"error": first_line(e)}}
    return {"int4_baseline": baseline, "int4_speed": int4_speed(run_dir, [*folders, BASELINE_GENAI])}


def _finisher(
    out: Path,
    model: str,
    engines: tuple[str, ...],
    int8: bool,
    decoder: bool,
    precisions_: tuple[str, ...],
    buildable: bool,
) -> Callable[[], str]:
    """The commands that make what a stopped ``prune-export`` left unwritten, each with the flags this one was
    given that it takes; made now (while the command's options are at hand), read when a step stops."""
    sources_ = {"dense": model, "pruned": str(out / ARTIFACT)}
    not_for_artifact = ("weights", "checkpoint", "model_arg")
    quantize_flags = _given(quantize, ("tol_cosine", "tol_rel"))  # prune-export's tolerances are its FP32 gates
    made: list[tuple[tuple[Path, ...], list[str]]] = []  # (what a command writes, the command)
    for stem, source in sources_.items():
        graphs = (out / onnx_name(stem), *((out / onnx_name(stem, "fp16"),) if "fp16" in engines else ()))
        flags = [
            *_given(export, not_for_artifact if stem == "pruned" else ()),
            *(["--fp16"] if len(graphs) > 1 else []),
        ]
        made.append((graphs, ["export", source, *flags, "--out", str(graphs[0])]))
    if int8:
        made.append((tuple(out / onnx_name(s, "int8") for s in sources_), ["quantize", str(out), *quantize_flags]))
    for stem, source in sources_.items() if decoder else ():
        folder = out / genai_name(stem)
        skip = ("fp16", "pad_qk", "simplify", "rewrites", *(not_for_artifact if stem == "pruned" else ()))
        made.append(((folder,), ["export", source, *_given(export, skip), "--out", str(folder)]))
    if "int4" in precisions_:
        int4_out = tuple(out / genai_name(s, int4=True) for s in sources_)
        made.append((int4_out, ["quantize", str(out), "--precision", "int4", *quantize_flags]))
    for precision in engines if buildable else ():
        for stem in sources_:
            plan = out / engine_name(stem, precision)
            graph = out / onnx_name(stem, "int8" if precision == "int8" else "fp32")
            argv = ["build-engine", str(graph), "--precision", precision, *_given(build_engine), "--out", str(plan)]
            made.append(((plan,), argv))

    def finish() -> str:
        todo = [  # a command whose outputs are partly there replaces them: they are remade together
            [*argv, *(["--overwrite"] if any(p.exists() for p in outputs) else [])]
            for outputs, argv in made
            if not all(p.exists() for p in outputs)
        ]
        if not todo:
            return "every file is written; only export.json, the record of a whole run, is missing"
        return " && ".join(shlex.join(["corp-deploy", *argv]) for argv in todo)

    return finish


def _given(command: click.Command, skip: tuple[str, ...] = ()) -> list[str]:
    """The options of the running command that came from its command line and that ``command`` takes too (but
    ``skip``, ``--out``, ``--overwrite``, ``--precision``), as flags again: a follow-up command that does what it
    would have done."""
    ctx = click.get_current_context()
    takes = {p.name for p in command.params if isinstance(p, click.Option)}
    flags: list[str] = []
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name not in takes or p.name in (*skip, "out", "overwrite", "precision"):
            continue
        if ctx.get_parameter_source(p.name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[p.name]
        if p.is_flag:
            flags += [p.opts[0]] if value else list(p.secondary_opts[:1])
        else:
            for v in value if p.multiple else (value,):
                flags += [p.opts[0], str(v)]
    return flags
