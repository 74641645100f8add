"""``build-engine`` (TensorRT or TensorRT-RTX engines) and ``quantize`` (INT8 Q/DQ, a decoder's INT4) of
exported graphs; the files and their records are written by ``exporters``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable
from corp_deploy.cli import quantize_options
from corp_deploy.cli.export_options import (
    build_options,
    engine_group,
    tolerance,
    verify_group,
    verify_options,
)
from corp_deploy.cli.options import (
    calibration_source,
    command_line,
    needs,
)
from corp_deploy.cli.quantize_options import int4_candidates, int4_options, int4_setup, int8_options, int8_quantizer
from corp_deploy.exporters.compare import INT8 as INT8_GATE
from corp_deploy.exporters.genai import GRAPH
from corp_deploy.exporters.int4 import (
    format_int4,
    int4_graphs,
)
from corp_deploy.exporters.int4_quant import decoder_graph
from corp_deploy.exporters.int8_recipes import parse_recipes
from corp_deploy.exporters.onnx_export import graph_precision, load_onnx, read_metadata
from corp_deploy.exporters.pipeline import (
    engine_verified,
    format_summary,
    fp16_graph,
    is_text,
    record_quantized,
)
from corp_deploy.exporters.quant_data import int4_calibration, int4_windows, text_int8
from corp_deploy.exporters.targets import file_kinds
from corp_deploy.exporters.tensorrt_engine import (
    PRECISIONS,
    for_graph,
    require_precision,
    select_flavour,
)
from corp_deploy.formats.artifact import META_FILE
from corp_deploy.formats.precisions import FP16, FP32, INT4, INT8
from corp_deploy.formats.run_folder import (
    ARTIFACT,
    RECORD,
    int4_pairs,
    int8_pairs,
    onnx_name,
    write_readme,
)


@click.command("build-engine")
@click.argument("onnx_file", type=click.Path())
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=FP16.name,
    show_default=True,
    help=f"{', '.join(PRECISIONS)} ({INT8.name}: from a Q/DQ graph).",
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
    if precision == INT8.name:  # made by `quantize`, never converted here: it needs calibration images
        if meta.get("precision") == INT8.name and meta.get("int8_scheme", {}).get("format") != "QDQ":
            raise CorpError(
                f"{source} is not a Q/DQ graph (INT8 recipe {meta.get('int8_recipe', {}).get('chosen', 'unknown')}); "
                "TensorRT builds INT8 engines from Q/DQ only: quantize with --int8-recipe static"
            )
        require_precision(proto, source, precision)
    select_flavour(options)  # fail before converting anything
    if precision == FP16.name and graph_precision(proto) == FP32.name:
        source = fp16_graph(source, source.with_name(onnx_name(stem, FP16.name)), opts, click.echo)
    record = engine_verified(source, plan, options, opts, overwrite)
    click.echo(format_summary({"onnx": [], "engines": [{"file": plan.name, **record}], "engines_skipped": None}))
    target = record.get("gpu") or f"targets {','.join(record['targets'])}"
    click.echo(f"wrote {plan} and {plan}.json ({record['flavour']} {record['version']}, {target}; {record['status']})")


@click.command()
@click.argument("source", type=click.Path())
@click.option(
    "--precision",
    type=click.Choice((INT8.name, INT4.name)),
    default=INT8.name,
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
@click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the FP32 graph [int8 {INT8_GATE.min_cosine}].")
@click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |FP32| [int8 {INT8_GATE.max_rel_error}].")
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--overwrite", is_flag=True, help="Replace existing INT8 / INT4 files.")
def quantize(
    source: str,
    precision: str,
    calib_dir: str | None,
    calib: str | None,
    seed: int,
    int8_opts: dict[str, Any],
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
    if precision == INT4.name:
        _quantize_int4(Path(source), calibration_source(calib_dir, calib, True), int4, seed, overwrite)
        return
    pairs = int8_pairs(Path(source))
    parse_recipes(int8_opts["int8_recipe"])  # a bad recipe fails before the graphs are read
    metas = [read_metadata(load_onnx(g, weights=False)) for g, _ in pairs]
    data = calibration_source(calib_dir, calib, any(is_text(m) for m in metas))
    for _, out in pairs:
        check_writable(out, overwrite)
    needs("INT8 quantization", "onnx", "onnxruntime")
    tol = tolerance(INT8_GATE, tol_cosine, tol_rel)
    text = None
    if is_text(metas[0]):  # a run folder's graphs are one model's: the tokenizer is its artifact's, or its source's
        artifact = pairs[0][0].parent / ARTIFACT
        tokenizer_from = artifact if (artifact / META_FILE).is_file() else metas[0]["model"]
        text = text_int8(
            tokenizer_from, data, quantize_options.int8_calib(int8_opts, True), int8_opts["int8_verify"], seed
        )
    records = int8_quantizer(int8_opts, data, tol, seed, workers, text, overwrite)(pairs)
    click.echo(format_summary({"onnx": records, "engines": [], "engines_skipped": None}))
    click.echo(f"wrote {', '.join(str(out.parent / r['file']) for r in records)} (each with a .json record)")
    _recorded(Path(source), onnx=records)


def _recorded(folder: Path, **quantized: Any) -> None:
    """A run folder's export.json and README.md updated with what quantize wrote (nothing for a lone graph)."""
    if folder.is_dir() and (record := record_quantized(folder, **quantized)) is not None:
        summary = format_summary(record, {k: v["params"] for k, v in record.get("size", {}).items()})
        click.echo(
            f"updated {folder / RECORD} and {write_readme(folder, record, summary, command_line(), file_kinds())}"
        )


def _quantize_int4(source: Path, data: str, int4: dict[str, Any], seed: int, overwrite: bool) -> None:
    """``quantize --precision int4``: every graph and destination checked, then the windows, then the graphs."""
    scheme, tol = int4_setup(int4)
    pairs = int4_pairs(source)
    protos = [decoder_graph(g / GRAPH if g.is_dir() else g) for g, _ in pairs]
    for _, out in pairs:
        check_writable(out, overwrite)
    needs("INT4 quantization", "onnx", "onnxruntime")
    folder = source if source.is_dir() else source.parent  # a run folder's artifact, or a genai folder's own files
    tokenizer = next((d for d in (folder, folder / "pruned") if (d / "tokenizer_config.json").is_file()), None)
    vocab = read_metadata(protos[0]).get("vocab_size")
    if vocab is None:
        raise CorpError(f"{pairs[0][0]} records no vocab_size; export it with `corp-deploy export` or `prune-export`")
    windows = int4_windows(tokenizer, data, vocab, int4["int4_seq_len"], int4["int4_windows"], seed)
    calibration = int4_calibration(
        tokenizer, data, vocab, int4["int4_seq_len"], int4["int4_calib_windows"], seed, scheme
    )
    info, candidates = {"text": data, "seed": seed}, int4_candidates(int4, scheme)
    records = int4_graphs(pairs, windows, tol, scheme, info, overwrite, **calibration, candidates=candidates)
    click.echo(format_int4(records))
    click.echo(f"wrote {', '.join(str(out) for _, out in pairs)} (each with a .json record)")
    _recorded(source, int4=records)
