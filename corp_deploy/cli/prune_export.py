"""``prune-export``: prune, then export dense and pruned (graphs, engines, INT8, a decoder's genai and INT4
folders), each verified; a step that stops names the commands that make the rest."""

from __future__ import annotations

import functools
import shlex
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from corp_deploy import api
from corp_deploy.base import memory
from corp_deploy.base.env import versions
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir
from corp_deploy.base.steps import Steps, Stopped, written
from corp_deploy.bench.backends import rewrites_on
from corp_deploy.cli import genai
from corp_deploy.cli.export import export, padded_qk, refuse_text_flags
from corp_deploy.cli.export_options import (
    build_options,
    engine_group,
    onnx_options,
    target_group,
    verify_group,
    verify_options,
)
from corp_deploy.cli.options import (
    calibration_source,
    command_line,
    needs,
    onnx_needs,
    out_options,
    out_path,
)
from corp_deploy.cli.prune import Pruned, again, pruned, say_folder
from corp_deploy.cli.prune_options import prune_config, prune_options
from corp_deploy.cli.quantize import build_engine, quantize
from corp_deploy.cli.quantize_options import (
    int4_candidates,
    int4_options,
    int4_setup,
    int8_calib,
    int8_options,
    int8_quantizer,
)
from corp_deploy.exporters import targets as export_targets
from corp_deploy.exporters.genai import GRAPH, tokenizer_files
from corp_deploy.exporters.genai_target import GENAI
from corp_deploy.exporters.int4 import (
    BuilderInput,
    format_int4,
    format_int4_speed,
    int4_graphs,
)
from corp_deploy.exporters.int8_recipes import parse_recipes
from corp_deploy.exporters.pipeline import (
    OneAtATime,
    decoder_int4_baseline,
    export_run,
    format_summary,
    write_export_record,
)
from corp_deploy.exporters.quant_data import int4_calibration, int4_windows, int8_data, text_int8
from corp_deploy.exporters.rewrites import parse_rewrites
from corp_deploy.exporters.targets import ONNX
from corp_deploy.exporters.tensorrt_engine import (
    build_missing,
    for_graph,
)
from corp_deploy.families import onload
from corp_deploy.families.hf import hub
from corp_deploy.formats import sources
from corp_deploy.formats.artifact import load_pruned
from corp_deploy.formats.precisions import FP16, FP32, INT4, INT8, PRECISIONS
from corp_deploy.formats.precisions import parse as parse_precisions
from corp_deploy.formats.run_folder import (
    ARTIFACT,
    README,
    engine_name,
    genai_name,
    onnx_name,
    read_sidecar,
    write_readme,
)
from corp_deploy.plan.report import format_report, peak_memory

DECODER_ENGINES = (
    "decoders get none: an engine of the full-sequence logits graph cannot generate token by token (the genai "
    "folders are a decoder's runtime), and engines of the key/value-cache graph are not built yet"
)


def _int4_refused(precisions_: tuple[str, ...], decoder: bool) -> None:
    """INT4 weights are for decoders (their gate is perplexity): one line for a vision model or an encoder."""
    if INT4.name in precisions_ and not decoder:
        raise CorpError(
            "--precision int4 is for decoders (OPT, Llama, Mistral, Qwen2: weight-only MatMulNBits gated on "
            "perplexity); use fp32, fp16 or int8 here"
        )


@click.command("prune-export")
@prune_options
@onnx_options
@verify_group
@engine_group
@target_group(into="target_opts")
@click.option(
    "--precision",
    default=f"{FP32.name},{FP16.name}",
    show_default=True,
    help=f"Comma list of {', '.join(PRECISIONS)}: the graphs of every target and the engines; {INT8.name} also "
    "writes dense/pruned.int8.onnx (the fastest --int8-recipe that passes, calibrated and verified), "
    f"{INT4.name} a decoder's weight-only genai folders.",
)
@click.option(
    "--targets",
    "targets_",
    default=ONNX,
    show_default=True,
    help="Comma list of export targets: "
    + "; ".join(
        f"{t.name} ({t.what}{', always' if t.name == ONNX else ', written where it can be' if t.automatic else ''})"
        for t in export_targets.load().values()
    )
    + ". Each file is verified against its reference and timed by bench beside onnxruntime.",
)
@click.option("--require-engines", is_flag=True, help="Fail (instead of skipping engines) where none can be built.")
@click.option(
    "--latency-rounds",
    default=3,
    show_default=True,
    help="A latency budget: times dense and pruned on --latency-on, and re-allocates while the measured speedup "
    "misses the target by more than the noise band, this many timings at most.",
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
    target_opts: dict[str, Any],
    precision: str,
    require_engines: bool,
    latency_rounds: int,
    targets_: str,
    int8_opts: dict[str, Any],
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
    precisions_ = parse_precisions(precision)
    targets = export_targets.parse(targets_)
    recipes = parse_recipes(int8_opts["int8_recipe"])  # a bad recipe fails before the prune
    text = hub.modality(prune_args["model"]) == "text"
    decoder = text and sources.is_decoder(prune_args["model"])
    _int4_refused(precisions_, decoder)
    int4_setup(int4)  # a bad INT4 flag fails here
    if text:
        refuse_text_flags(pad_qk, simplify)
    config = prune_config(prune_args.pop("pruning"), prune_args["latency"])
    rewrites_ = parse_rewrites(rewrites, rewrites_on(prune_args["latency"]["latency_on"]))
    opts = verify_options(verify)
    build = for_graph(build_options(engine, FP32.name, opts), prune_args["seq_len"] if text else None)
    no_engines = DECODER_ENGINES if decoder else None  # engines of logits graphs nobody can generate with
    if require_engines and (no_engines or build_missing(build)):
        raise CorpError(f"--require-engines: cannot build TensorRT engines here: {no_engines or build_missing(build)}")
    out = out_path(out, prune_args["model"], config, overwrite)
    needs("prune-export", *onnx_needs(precisions_, simplify))
    if decoder:
        genai.needs_genai()
    quantize = data = None
    if INT8.name in precisions_:  # INT8 engines are built from the INT8 graphs
        source = calibration_source(prune_args["calib_dir"], prune_args["calib"], text)
        counts, seed, workers = (
            (int8_calib(int8_opts, text), int8_opts["int8_verify"]),
            prune_args["seed"],
            prune_args["workers"] or 0,
        )
        feeds = text_int8(prune_args["model"], source, *counts, seed) if text else None
        quantize = int8_quantizer(int8_opts, source, opts.int8, seed, workers, feeds)
        data = int8_data(source, *counts, seed, workers, feeds)
    plan = _export_plan(prune_args["model"], INT4.name in precisions_, decoder)  # before the model and data load
    rounds = latency_rounds if prune_args["latency"]["latency_on"] is not None else None
    run = pruned(
        config, **prune_args, keep_dense=True, transformers=True, latency_rounds=rounds, rewrites=rewrites_, out=out
    )
    if run is None:
        return
    prune_seconds = time.perf_counter() - started  # the model, the data, any latency table, the prune, a recovery
    click.echo(format_report(run.result.report))
    run_dir = Path(out)
    models = _models(run, prune_args["model"], run_dir / ARTIFACT, prune_args["seq_len"], pad_qk)
    with atomic_dir(run_dir, overwrite) as tmp:  # first, alone: a later step that stops leaves the prune
        api.save(run.result, tmp / ARTIFACT, run.name, run.args, weights=run.weights)
    if onload.of(run.result.model) is not None:  # the artifact holds it now (``_models`` reads it from there)
        onload.release(run.result.model)  # the store: the pruned model's float32 size on disk
        run.result.model.to("meta")  # what stayed resident (the 1.7B shape's embedding and head: 0.8 GB)
    engines = tuple(p for p in precisions_ if p != INT4.name)
    buildable = no_engines is None and not build_missing(build)
    # an INT8 engine is built from a Q/DQ graph only (``export_run`` skips it otherwise): where another recipe may be
    # chosen, the finishing commands build none, as the run itself might not have
    finishing = engines if recipes == ("static",) else tuple(p for p in engines if p != INT8.name)
    finish = _finisher(run_dir, prune_args["model"], finishing, quantize is not None, decoder, precisions_, buildable)
    if run.stopped:
        raise Stopped(
            f"{run.stopped}; wrote {run_dir}/pruned/ with CORP's weights, not recovered (its corp.json says so); "
            f"to export it: {finish()}; to recover, run {again()}",
            interrupted=True,
        )
    click.echo(f"wrote {run_dir}/pruned/ (the pruned model); now the exports")
    steps = Steps(run_dir, finish, click.echo)
    folders = _folders(prune_args["model"], run_dir / ARTIFACT)
    record = export_run(
        models,
        run_dir,
        engines,
        opset,
        simplify,
        opts,
        build,
        require_engines,
        quantize,
        rewrites_,
        no_engines,
        steps,
        click.echo,
        targets,
        data,
        export_targets.option_values(target_opts)
        | {GENAI: {"decoder": decoder, "opset": opset, "graph": decode_graph, "folders": folders}},
    )
    genai_records = {stem: read_sidecar(run_dir / genai_name(stem) / GRAPH) for stem in models if decoder}
    if INT4.name in precisions_:
        with steps("INT4 quantization"):
            data, seed = calibration_source(prune_args["calib_dir"], prune_args["calib"]), prune_args["seed"]
            vocab = run.result.model.config.vocab_size  # the config stays when the weights are let go
            windows = int4_windows(prune_args["model"], data, vocab, int4["int4_seq_len"], int4["int4_windows"], seed)
            pairs = [(run_dir / genai_name(s), run_dir / genai_name(s, int4=True)) for s in models]
            scheme, tol = int4_setup(int4)
            calibration = int4_calibration(
                prune_args["model"], data, vocab, int4["int4_seq_len"], int4["int4_calib_windows"], seed, scheme
            )
            tokenizer = tokenizer_files(run_dir / ARTIFACT)
            inputs = [  # the builder reads each model's folder; the model is read only where there is none
                BuilderInput(functools.partial(_model, models, stem), tokenizer, folders[stem]) for stem in models
            ]
            info, candidates = {"text": data, "seed": seed}, int4_candidates(int4, scheme)
            record["int4"] = int4_graphs(
                pairs, windows, tol, scheme, info, **calibration, candidates=candidates, sources=inputs, say=click.echo
            )
            record |= decoder_int4_baseline(run_dir, [out.name for _, out in pairs], windows, tol, inputs[0], info)
    if plan is not None:
        record["memory"] = {"plan": plan.to_dict(), **peak_memory(torch.device("cpu"))}
    record = write_export_record(run_dir, run.name, run.result.report, record, versions())
    summary = format_summary(record, {k: v["params"] for k, v in record["size"].items()})
    click.echo(summary)
    if "int4" in record:
        click.echo(format_int4(record["int4"]))
        if "int4_speed" in record:
            click.echo(format_int4_speed([*record["int4"], record["int4_baseline"]], record["int4_speed"]))
        elif "int4_baseline" in record:
            click.echo(f"quantize-only baseline not built: {record['int4_baseline']['error']}")
    for stem, genai_record in genai_records.items():
        click.echo(genai.summary(genai_record, genai_name(stem), None))  # random-token prompts
    write_readme(run_dir, record, summary, command_line(), export_targets.file_kinds())
    click.echo(
        f"wrote {out}/ ({', '.join(written(run_dir))}; each graph and engine with its .json record); "
        f"what each file is: {run_dir / README}"
    )
    say_folder(run_dir / ARTIFACT)
    click.echo(steps.wall_time(time.perf_counter() - started, {"prune (model, data, tables, recovery)": prune_seconds}))


def _export_plan(source: str, int4: bool, decoder: bool) -> memory.Plan | None:
    """The exports' predicted peak for a ``transformers`` folder (``memory.export_plan``, from its safetensors'
    headers), or the one line that says it cannot fit and what would; None for other sources (a timm model: small)."""
    if not (hub.is_source(source) and Path(source).is_dir()):
        return None
    weights = memory.safetensors_bytes(source, itemsize=4)
    return memory.export_plan(weights, memory.available(), int4, decoder).check(
        "prune-export holds one model at a time in float32 and the exporters' copies beside it (an estimate from "
        "their measured multiples); run `corp-deploy prune` here (one block at a time) and export its artifact on a "
        f"machine with more memory, free memory, or set {memory.ENV}=GIB to plan with that much instead"
    )


def _models(
    run: Pruned, source: str, artifact: Path, seq_len: int, pad_qk: bool
) -> Mapping[str, tuple[nn.Module, dict[str, Any]]]:
    """Stem -> (model, description), what the exports read. A ``transformers`` source's are held one at a time
    (``OneAtATime``): the pruned one as the prune left it until another is read, then read again from its saved
    ``artifact``; the dense one read from ``source`` when its turn comes (a recovery's copy let go now). A timm
    model's are both held: small (88 MB for a ViT-S), and its dense copy has no file to be read again from. An
    onloaded prune's model was never whole: it is read from the artifact when its turn comes."""

    def dense(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        return model, sources.describe(model, run.name, run.args, run.weights, seq_len)

    def pruned(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
        return model, padded_qk(model, sources.describe(model, run.name, run.args, "corp-pruned", seq_len), pad_qk)

    if not hub.is_source(source):
        return {"dense": dense(run.dense), "pruned": pruned(run.result.model)}
    if run.dense is not None:
        run.dense.to("meta")
    readers = {"dense": lambda: dense(hub.load(source)[0]), "pruned": lambda: pruned(load_pruned(artifact))}
    if onload.of(run.result.model) is not None:  # never whole (its blocks in the store): read from the artifact
        return OneAtATime(readers)
    return OneAtATime(readers, held=("pruned", pruned(run.result.model)))


def _folders(source: str, artifact: Path) -> dict[str, Path | None]:
    """Each stem's ``transformers`` folder on disk, which genai's builder reads itself (no copy written while the model
    is held): the source where it is a local folder, and the run's saved prune ``artifact``."""
    return {"dense": Path(source) if Path(source).is_dir() else None, "pruned": artifact}


def _model(models: Mapping[str, tuple[nn.Module, dict[str, Any]]], stem: str) -> nn.Module:
    return models[stem][0]


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
        half = onnx_name(stem, FP16.name)
        graphs = (out / onnx_name(stem), *((out / half,) if FP16.name in engines else ()))
        flags = [
            *_given(export, not_for_artifact if stem == "pruned" else ()),
            *(["--precision", f"{FP32.name},{FP16.name}"] if len(graphs) > 1 else []),
        ]
        made.append((graphs, ["export", source, *flags, "--out", str(graphs[0])]))
    if int8:
        made.append((tuple(out / onnx_name(s, INT8.name) for s in sources_), ["quantize", str(out), *quantize_flags]))
    for stem, source in sources_.items() if decoder else ():
        folder = out / genai_name(stem)
        skip = ("precision", "pad_qk", "simplify", "rewrites", *(not_for_artifact if stem == "pruned" else ()))
        made.append(((folder,), ["export", source, *_given(export, skip), "--out", str(folder)]))
    if INT4.name in precisions_:
        int4_out = tuple(out / genai_name(s, int4=True) for s in sources_)
        made.append((int4_out, ["quantize", str(out), "--precision", INT4.name, *quantize_flags]))
    for precision in engines if buildable else ():
        for stem in sources_:
            plan = out / engine_name(stem, precision)
            graph = out / onnx_name(stem, precision if precision == INT8.name else FP32.name)
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
