"""The measurement stage: latency (``bench``), the sparsity sweep (``sweep``) and accuracy (``eval``)."""

from __future__ import annotations

import functools
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch

from corp_deploy.apps import floor
from corp_deploy.apps.sweep import (
    DEFAULT_SPARSITIES,
    Speedups,
    format_sweep,
    parse_sparsities,
    parse_speedups,
    plot_sweep,
)
from corp_deploy.apps.sweep import sweep as run_sweep
from corp_deploy.base.env import device_name
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir, atomic_file, check_writable
from corp_deploy.base.steps import INTERRUPTED, Stopped
from corp_deploy.base.timing import Method
from corp_deploy.bench import gate, meter
from corp_deploy.bench.accuracy import Evaluation, append_evaluation, evaluate_run, format_evaluation
from corp_deploy.bench.backends import RunFolder, rewrites_on
from corp_deploy.bench.backends import select as select_backends
from corp_deploy.bench.baseline import baseline_graph, runs_beside
from corp_deploy.bench.baseline import loader as baseline_loader
from corp_deploy.bench.decode import DECODE_BACKENDS, NEW_TOKENS, PROMPTS, decode_benchmark, parse_prompts
from corp_deploy.bench.decode import select as select_decoders
from corp_deploy.bench.drop import METRICS, declared_pooling, default_metric
from corp_deploy.bench.frontier import format_frontier, mark_pareto, plot_frontier
from corp_deploy.bench.report import format_markdown, format_table, skipped_lines, to_csv
from corp_deploy.bench.report import plot as draw
from corp_deploy.bench.run import benchmark, parse_batch_sizes
from corp_deploy.cli.inputs import inputs
from corp_deploy.cli.options import (
    ONNX_EXPORT,
    calib_options,
    group,
    model_options,
    needs,
    quiet_option,
    result_options,
)
from corp_deploy.cli.prune_options import (
    latency_options,
    method_options,
    prune_config,
    recover_options,
    recovery_setup,
)
from corp_deploy.core.recover import Recovery
from corp_deploy.families.hf import hub as hf
from corp_deploy.families.hf.adapter import max_positions
from corp_deploy.families.registry import get as get_family
from corp_deploy.families.timm.models import create_model, parse_model_args, resolve_name
from corp_deploy.formats import calibration, evaluation, sources
from corp_deploy.formats.artifact import META_FILE, read_meta
from corp_deploy.formats.text import read_documents
from corp_deploy.plan import latency, speed
from corp_deploy.plan.loop import latency_loop

timing_group = group(
    click.option("--warmup-iters", default=Method.warmup_iters, show_default=True),
    click.option("--warmup-seconds", default=Method.warmup_seconds, show_default=True),
    click.option("--min-iters", default=Method.min_iters, show_default=True, help="Timed iterations, at least."),
    click.option("--min-seconds", default=Method.min_seconds, show_default=True, help="Timed seconds, at least."),
    into="timing",
)


def bench_method(timing: dict[str, Any]) -> Method:
    """The timing group as a bench ``Method``."""
    return Method(**timing)


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("--batch-sizes", help="Comma-separated batch sizes [1,8,32; a decoder's 1,8].")
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto: every backend this machine can run (CUDA graphs, torch-cuda-*-graph, included) except torch.compile's "
    "(torch-cuda-*-compile[-graph]), which compile each model and batch size first: minutes in all. "
    "Or a comma list (see corp_deploy.bench.backends).",
)
@click.option(
    "--seq-len", type=int, help="Text encoders: tokens per sequence [the --seq-len the run was exported for]."
)
@click.option(
    "--prompt-lens",
    default=PROMPTS,
    show_default=True,
    help="Decoders: prompt lengths (tokens); each is timed as prefill, then decode one token at a time.",
)
@click.option(
    "--new-tokens",
    default=NEW_TOKENS,
    show_default=True,
    help="Decoders: decode steps per prompt before a fresh prefill (the context stays within prompt + this).",
)
@click.option("--repeats", default=1, show_default=True, help="Repeat the measurement; report medians.")
@click.option("--threads", type=int, help="CPU threads for PyTorch and onnxruntime [default: theirs].")
@click.option("--include-copies", is_flag=True, help="Time host->device input and device->host output copies too.")
@timing_group
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the versioned record here.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write every statistic as CSV.")
@click.option("--markdown", type=click.Path(dir_okay=False), help="Write the table as markdown.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: throughput and p50 vs batch size.")
@click.option("--baseline", type=click.Path(dir_okay=False), help="Bench JSON to gate against.")
@click.option("--max-regression", default="5%", show_default=True, help="Gate threshold.")
@click.option(
    "--gate",
    "gate_mode",
    type=click.Choice(gate.MODES),
    default="absolute",
    show_default=True,
    help="absolute (p50) or ratio (speedup) against --baseline; quantize-only: pruned INT8 against the dense model "
    "quantized by onnxruntime's quantize_dynamic (a decoder: pruned INT4 against genai's builder -p int4 of the dense "
    "model), timed in this run (no --baseline).",
)
@click.option(
    "--no-quantize-only",
    is_flag=True,
    help="Leave out the quantize-only baseline (the dense graph through onnxruntime's quantize_dynamic; a decoder's: "
    "genai's builder -p int4 of the dense model, baseline-genai-int4/), otherwise timed beside dense and pruned on "
    "the onnxruntime CPU backends (a decoder's: genai-cpu-int4).",
)
def bench(
    run_dir: str,
    batch_sizes: str | None,
    backends: str,
    seq_len: int | None,
    prompt_lens: str,
    new_tokens: int,
    repeats: int,
    threads: int | None,
    include_copies: bool,
    timing: dict[str, Any],
    json_out: str | None,
    csv_out: str | None,
    markdown: str | None,
    plot: str | None,
    baseline: str | None,
    max_regression: str,
    gate_mode: str,
    no_quantize_only: bool,
) -> None:
    """Time dense against pruned from a prune-export RUN_DIR on every backend this machine has.

    A text encoder's run is timed on full sequences of --seq-len tokens: sentences/s and tokens/s. A decoder's
    (OPT, Llama, Mistral, Qwen2) is timed by phase at each --prompt-lens: prefill tokens/s, and decode ms/token and
    tokens/s with the key/value cache (corp_deploy.bench.decode); the gate compares each phase.
    """
    run = RunFolder.open(run_dir, seq_len)
    if run.decoder and (seq_len is not None or plot or include_copies):
        raise CorpError(
            "--seq-len, --plot and --include-copies are for encoders and images; a decoder takes --prompt-lens"
        )
    sizes = parse_batch_sizes(batch_sizes or ("1,8" if run.decoder else "1,8,32"))
    prompts = parse_prompts(prompt_lens, run.graph.get("max_positions", 0), new_tokens) if run.decoder else []
    method = bench_method(timing)
    limit = gate.parse_fraction(max_regression)
    quantize_only = gate_mode == gate.QUANTIZE_ONLY
    if quantize_only and (baseline or no_quantize_only):
        raise CorpError(
            "--gate quantize-only gates this run's pruned INT8 (a decoder's INT4) against the quantize-only baseline "
            "timed beside it: run it without --baseline and --no-quantize-only"
        )
    reference = gate.load_baseline(baseline) if baseline else None
    for path in (json_out, csv_out, markdown, plot):
        if path:
            check_writable(path, overwrite=True)
    if plot:
        needs("--plot", "matplotlib")
    if run.decoder:
        chosen, skipped = select_decoders(backends, run)
        click.echo(f"method: {method.describe()}; {repeats} repeat(s); decode: {new_tokens} tokens per prefill")
        record = decode_benchmark(
            run, chosen, sizes, prompts, method, repeats, new_tokens, threads, skipped, click.echo, not no_quantize_only
        )
    else:
        chosen, skipped = select_backends(backends, run, elsewhere=("decoder runs", DECODE_BACKENDS))
        click.echo(
            f"method: {method.describe()}; {repeats} repeat(s); inputs on the device"
            + (" (host copies timed)" if include_copies else " (copies not timed)")
        )
        with tempfile.TemporaryDirectory(prefix="corp-bench-baseline-") as tmp:
            base = None if no_quantize_only else _quantize_only(run, chosen, Path(tmp), skipped)
            record = benchmark(
                run, chosen, sizes, method, repeats, include_copies, threads, skipped, click.echo, base and base[0]
            )
        if base:
            record["quantize_only_baseline"] = base[1]
    if not record["results"]:  # a record of nothing would read as a run that passed
        why = "; ".join(f"{k}: {v}" for k, v in record["skipped"].items())
        raise CorpError(f"nothing measured: every backend was skipped ({why}); pass --backends with one that runs here")
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
    if reference is not None or quantize_only:
        checks = (
            gate.against_quantize_only(record, limit)
            if quantize_only
            else gate.compare(record, reference, limit, gate_mode)
        )
        click.echo(gate.format_checks(checks, limit, gate_mode))
        bad = sum(c.regressed for c in checks)
        if bad:
            raise CorpError(f"latency regression: {bad} of {len(checks)} checks beyond {limit:.1%} ({gate_mode} gate)")


def _quantize_only(run: RunFolder, backends: list, tmp: Path, skipped: dict[str, str]) -> tuple | None:
    """(the quantize-only baseline's loader, where its graph came from) when an onnxruntime CPU backend runs and the
    run folder has dense.onnx; else None, the reason in ``skipped``."""
    if not any(runs_beside(b) for b in backends):
        return None
    if not run.onnx("dense").is_file():
        skipped["quantize-only baseline"] = f"no dense.onnx in {run.root} to quantize"
        return None
    graph, origin = baseline_graph(run, tmp)
    return baseline_loader(graph), origin


def _text_eval(
    run_dir: str, source: str, text: str, seq_len: int | None, all_text: bool, batch_size: int, num: int, quiet: bool
) -> None:
    """``eval --text``: perplexity of ``source`` and, for a prune artifact, of its dense original when that loads
    (the transformers folder or hf:NAME it was pruned from; skipped with the reason when it does not), on the
    first ``num`` windows; each line printed as soon as it is measured, the record appended to RUN_DIR/eval.json
    (a local folder; hf:NAME has none)."""
    if num < 1:
        raise CorpError(f"--num must be >= 1, got {num}")
    hf.transformers_module("evaluating a text model")
    artifact = Path(source, META_FILE).is_file()
    if not (artifact or hf.is_source(source)):
        raise CorpError(f"{source} is neither a prune artifact nor a transformers folder (config.json) or hf:NAME")
    read_documents(text)  # a folder without text fails before any model loads
    local = Path(run_dir).is_dir()
    if local:
        check_writable(Path(run_dir) / "eval.json", overwrite=True)
    device = calibration.resolve_device("auto")
    results: dict[str, Any] = {}

    def line(label: str, where: str) -> str:
        model, tokenizer = sources.text_model(where)
        length = seq_len or min(2048, max_positions(model.config))
        r = evaluation.text_perplexity(model, tokenizer, text, length, batch_size, device, all_text, num, not quiet)
        results[label] = {**r, "model": where}
        return (
            f"{label}: perplexity {r['perplexity']:.3f} on {r['windows']} of {r['of_windows']} windows of "
            f"{r['seq_len']} tokens ({r['part']}: {r['documents']} of {r['of_documents']} documents of {text}) "
            f"[{where}]"
        )

    click.echo(line("pruned" if artifact else "model", source))  # first: its errors are the user's to fix
    if artifact:
        origin = read_meta(source)["model"]["name"]
        try:
            click.echo(line("dense", origin))
        except CorpError as e:
            results["dense"] = {"skipped": str(e)}
            click.echo(f"dense: skipped ({e})")
    if local:
        record = {"metric": "perplexity", "text": str(text), "results": results}
        record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
        click.echo(f"appended to {append_evaluation(run_dir, record)}")


@click.command()
@click.argument("model")
@model_options
@calib_options
@quiet_option
@group(method_options, into="pruning")
@click.option("--sparsities", help=f"Comma list of sparsities [{DEFAULT_SPARSITIES}].")
@click.option(
    "--speedups",
    help="Instead of --sparsities: comma list of speed targets (e.g. 1.5,2,2.5), each a latency budget on "
    "--latency-on; one latency table, one calibration, a model per target timed against dense (x2.00/ folders).",
)
@latency_options
@click.option(
    "--latency-rounds",
    default=3,
    show_default=True,
    help="--speedups: per target, times dense and pruned on --latency-on and re-allocates while it misses.",
)
@recover_options
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto (as in bench: torch.compile backends only when named), or a comma list of bench backends.",
)
@click.option("--batch-sizes", default="1,32", show_default=True, help="Small (latency) and large (throughput).")
@click.option("--min-seconds", default=2.0, show_default=True, help="Timed seconds per model and batch, at least.")
@click.option("--out", required=True, type=click.Path(), help="Sweep folder (s0.50/, ..., sweep.json, sweep.png).")
@click.option("--overwrite", is_flag=True, help="Write into --out even if it exists (same-name files are replaced).")
@click.option(
    "--frontier",
    is_flag=True,
    help="Also measure each row's held-out drop (CORP FP32 and INT8, plain removal at the same widths) and the dense "
    "model quantized by onnxruntime (quantize_dynamic, per-channel QInt8): frontier.json and frontier.png, the points "
    "no other point beats marked.",
)
@click.option(
    "--max-drop",
    type=float,
    help="Choose the fastest configuration (row x precision) whose held-out drop stays within this (--metric; "
    "implies --frontier); none within it: one line, nothing written.",
)
@click.option(
    "--metric",
    type=click.Choice(("cosine", "agreement", "perplexity", "accuracy")),
    help="Held-out metric [cosine (encoders: pooled embedding, ViTs: final features); decoders: perplexity]. "
    "Drop: dense - value (perplexity: value / dense - 1).",
)
@click.option(
    "--heldout-dir",
    type=click.Path(),
    help="Held-out inputs calibration never reads (all of them) [default: the --calib-dir part calibration never "
    "reads: a text folder's evaluation documents, the images outside the calibration sample].",
)
@click.option("--heldout-num", default=256, show_default=True, help="Held-out images, documents or windows scored.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue a sweep that stopped in --out, with the same command and flags: its finished points (with "
    "bench.json) are kept, the rest made (calibrating again); what a stopped sweep says to run.",
)
def sweep(
    pruning: dict[str, Any],
    quiet: bool,
    sparsities: str | None,
    speedups: str | None,
    latency: dict[str, Any],
    latency_rounds: int,
    backends: str,
    batch_sizes: str,
    min_seconds: float,
    out: str,
    overwrite: bool,
    frontier: bool,
    max_drop: float | None,
    metric: str | None,
    heldout_dir: str | None,
    heldout_num: int,
    resume: bool,
    recovery: dict[str, Any],
    **flags: Any,
) -> None:
    """Calibrate MODEL once, then prune, export and bench it at every sparsity (the paper's Table 10), or at
    every speed target (--speedups, with --latency-on); MODEL a timm ViT or a transformers folder (a text encoder,
    or a decoder: timed as the full-sequence forward of its logits graph, prefill; decode ms/token is bench's).

    With --frontier or --max-drop, also the held-out drop of every row in FP32 and INT8, of plain removal and of the
    dense model quantized: the accuracy-speed frontier, and the fastest configuration within --max-drop.

    A sweep that stops (Ctrl-C, a failed point) keeps its finished points whole and says the command that
    continues it: the same one with --resume.

    With --recover-steps (or --recover-minutes), every pruned model is trained towards the dense one after CORP,
    before it is exported: each point's graphs, speeds and drops are the recovered model's."""
    if latency["speedup"] is not None:
        raise CorpError("sweep takes --speedups (a comma list), not --speedup")
    if sparsities is not None and speedups is not None:
        raise CorpError("--sparsities and --speedups are two kinds of sweep; pass one of the two")
    targets = None if speedups is None else parse_speedups(speedups)
    values = parse_sparsities(sparsities or DEFAULT_SPARSITIES) if targets is None else []
    sizes = parse_batch_sizes(batch_sizes)
    speedup = None if targets is None else max(targets)  # checked as --speedup; each target replaces its budget
    config = prune_config(pruning, latency | {"speedup": speedup}, **({} if targets else {"sparsity": max(values)}))
    backend = None if targets is None else meter.check_backend(latency["latency_on"])
    if Path(out).is_dir() and not (resume or overwrite):
        raise CorpError(
            f"output {out} already exists; pass --resume to continue its sweep, or --overwrite, or another --out"
        )
    if not resume:
        check_writable(out, overwrite)
    needs("sweep", *ONNX_EXPORT)
    say = (lambda line: None) if quiet else click.echo
    if max_drop is not None and max_drop < 0:
        raise CorpError(f"--max-drop must be >= 0, got {max_drop}")
    recover = recovery_setup(recovery)
    measured = frontier or max_drop is not None or metric is not None
    text = hf.modality(flags["model"]) == "text"
    seq_len = flags["seq_len"] if text else None
    on = (
        None
        if backend is None
        else speed.Latency(backend, latency["latency_batch"], latency["latency_table"], latency_rounds, seq_len)
    )
    got = inputs(**flags, hold_out=config.heldout_images, transformers=True)
    description = sources.describe(got.net, got.name, got.args, got.weights, *([seq_len] if text else []))
    accuracy = None
    if measured:
        tokenizer = hf.load_tokenizer(flags["model"], got.net.config.vocab_size) if text else None
        num_calib = got.total + (got.heldout.images.shape[0] if got.heldout is not None and not text else 0)
        held = floor.heldout_for(
            got.net,
            tokenizer,
            got.source,
            num_calib,
            flags["seed"],
            heldout_dir,
            heldout_num,
            flags["seq_len"],
            declared_pooling(flags["model"]) if text and Path(flags["model"]).is_dir() else None,
        )
        accuracy = floor.Accuracy(held, metric or default_metric(held.kind))
        say(f"held-out {accuracy.metric} ({METRICS[accuracy.metric].what}) on {floor.heldout_words(held.source)}")
    plan = None
    if backend is not None:
        table = speed.latency_table(got.net, got.name, got.args, on, say, config.depth, config.depth_fit)
        plan = Speedups(targets, table, got.heldout, latency_loop(on, say))
    method = Method(warmup_iters=3, min_iters=5, min_seconds=min_seconds)  # large batches: seconds dominate
    settings = (backends, sizes, method, quiet, plan, latency, accuracy, recover)
    if max_drop is not None:  # nothing is written unless a configuration passes
        try:
            with atomic_dir(out, overwrite) as tmp:
                result = _sweep_run(got, description, values, config, tmp, *settings)
                _write_frontier(result, tmp, max_drop)
        except Stopped as e:  # its staging folder is gone: nothing to resume
            reason = f"{e.what}; nothing written (--max-drop writes {out} whole or not at all): run the command again"
            raise Stopped(reason, e.exit_code == INTERRUPTED, e.bug) from None
    else:
        result = _sweep_run(got, description, values, config, Path(out), *settings, overwrite, _resumed())
        if accuracy is not None:
            _write_frontier(result, Path(out), None)
    try:
        plot_sweep(result, Path(out) / "sweep.png")
    except CorpError as e:
        click.echo(f"no plot: {e}")
    click.echo(
        f"wrote {out}/ ({'x' if targets else 's'}*/ run folders with bench.json, sweep.json, sweep.png"
        + (", frontier.json, frontier.png)" if accuracy is not None else ")")
    )


def _sweep_run(
    got: Any,
    description: dict[str, Any],
    values: list[float],
    config: Any,
    out: Path,
    backends: str,
    sizes: list[int],
    method: Method,
    quiet: bool,
    plan: Speedups | None,
    latency: dict[str, Any],
    accuracy: floor.Accuracy | None,
    recovery: Recovery | None,
    overwrite: bool = True,
    resume: str | None = None,
) -> dict[str, Any]:
    """``sweep.sweep`` with the command's settings; prints its table."""
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
        overwrite,
        plan,
        rewrites_on(latency["latency_on"]),
        resume=resume,
        accuracy=accuracy,
        recovery=recovery,
        options=result_options("sparsities", "speedups"),  # a point's result does not depend on the others
    )
    click.echo(format_sweep(result))
    return result


def _write_frontier(result: dict[str, Any], out: Path, max_drop: float | None) -> None:
    """frontier.json (every point, Pareto flags, the floor's choice and every candidate's pass/fail) and
    frontier.png in ``out``; with ``max_drop``, the choice, or one line (``floor.choose``) when none passes."""
    metric = result["accuracy"]["metric"]
    points = mark_pareto(floor.candidates(result))
    chosen = None
    if max_drop is not None:
        points = [p | ({"passes": p["drop"] <= max_drop} if p["candidate"] else {}) for p in points]
        chosen = floor.choose(points, max_drop, metric)
    record = {"model": result["model"], "accuracy": result["accuracy"], "speed_on": floor.SPEED_ON, "points": points}
    if max_drop is not None:
        record["floor"] = {"max_drop": max_drop, "metric": metric, "chosen": chosen, "file": floor.file_of(chosen)}
    (out / "frontier.json").write_text(json.dumps(record, indent=2) + "\n")
    click.echo(format_frontier(points, metric, chosen))
    try:
        name = Path(result["model"]).name + (" (CORP + recovery)" if "recovery" in result else "")
        title = f"{name}: held-out {metric} drop vs speed ({floor.SPEED_ON}, largest batch)"
        plot_frontier(points, out / "frontier.png", title, metric, max_drop)
    except CorpError as e:
        click.echo(f"no frontier plot: {e}")
    if chosen is not None:
        click.echo(
            f"chose {floor.file_of(chosen)}: {chosen['speedup']:.2f}x, {metric} drop {chosen['drop']:.4g} "
            f"<= {max_drop:g}"
        )


def _resumed() -> str:
    """The running command line with ``--resume`` (and without ``--overwrite``): what continues it."""
    given = click.get_current_context().find_root().obj
    argv = [a for a in (sys.argv[1:] if given is None else given) if a != "--overwrite"]
    return shlex.join(["corp-deploy", *argv, *([] if "--resume" in argv else ["--resume"])])


@click.command("eval")
@click.argument("run_dir", type=click.Path())
@click.option("--data-dir", type=click.Path(), help="Labelled ImageFolder (a subfolder per class): top-1/top-5.")
@click.option("--images", type=click.Path(), help="Unlabelled images: agreement, KL and cosine vs the dense model.")
@click.option("--probe-train", type=click.Path(), help="Labelled ImageFolder to fit a linear probe (backbones).")
@click.option(
    "--num",
    default=10**9,
    show_default="all",
    help="Evaluate a seeded subset of this many images (with --text: the first this many windows).",
)
@click.option("--batch-size", type=int, help="Images (default 32) or text windows (default 1) per batch.")
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    help="auto (torch-cpu-fp32, ort-cpu-fp32, ort-cpu-int8, tensorrt-fp32/fp16/int8: what the folder holds and "
    "this machine runs), or a comma list of bench's backends (eager ones: torch-cuda-fp16, ort-cuda-fp32...).",
)
@click.option(
    "--text",
    type=click.Path(),
    help="Text runs: this .txt/.jsonl folder's evaluation part (decoders: perplexity; encoders: pooled embedding "
    "cosine to the dense model, and accuracy by a probe when the documents come from class folders).",
)
@click.option("--seq-len", type=int, help="With --text: tokens per window [default: the positions, at most 2048].")
@click.option("--all-text", is_flag=True, help="With --text: every document (calibration never read this folder).")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="The dense weights, if the recorded ones moved.")
@click.option("--seed", default=0, show_default=True)
@click.option("--workers", default=0, show_default=True, help="Image decoding worker processes.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def eval_command(
    run_dir: str, quiet: bool, text: str | None, seq_len: int | None, all_text: bool, **kwargs: Any
) -> None:
    """Accuracy of dense and pruned models from RUN_DIR on every backend that can run; appended to RUN_DIR/eval.json.

    With --text, RUN_DIR is a text run (a prune-export or sweep folder, a prune artifact; a decoder also a
    transformers folder or hf:NAME). A decoder's measure is its perplexity (SparseGPT's protocol), for an artifact the
    dense model it was pruned from too, when it loads; an encoder's the held-out drop (``bench.drop``): the pooled
    embedding cosine to the dense model (and a probe's accuracy with class folders), on every model the run holds.
    """
    encoder = _text_run(run_dir, text)
    if text is not None:
        if kwargs["data_dir"] or kwargs["images"] or kwargs["probe_train"]:
            raise CorpError("--text measures a text model; --data-dir, --images and --probe-train are image sets")
        if encoder:
            _encoder_eval(run_dir, text, seq_len, all_text, kwargs)
            return
        source = str(floor.artifact_of(run_dir)) if Path(run_dir, "pruned", META_FILE).is_file() else run_dir
        _text_eval(run_dir, source, text, seq_len, all_text, kwargs["batch_size"] or 1, kwargs["num"], quiet)
        return
    kwargs["batch_size"] = kwargs["batch_size"] or 32
    check_writable(Path(run_dir) / "eval.json", overwrite=True)
    dense = functools.partial(sources.dense_original, checkpoint=kwargs.pop("checkpoint"))
    record = evaluate_run(run_dir, dense=dense, progress=not quiet, **kwargs)
    record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
    for line in skipped_lines(record["skipped_backends"]):
        click.echo(line)
    probe = record["probe"]
    header = (
        f"{record['images']} images from {record['data']} ({'labelled' if record['labelled'] else 'unlabelled'}"
        + (f"; {record['skipped_files']} unreadable, skipped" if record["skipped_files"] else "")
        + "), "
        f"input {'x'.join(map(str, record['input_size']))}"
        + (f"; linear probe fit on {probe['train_images']} dense features (ridge {probe['ridge']:g})" if probe else "")
    )
    click.echo(format_evaluation(Evaluation(record["reference"], record["results"]), header))
    click.echo(f"appended to {append_evaluation(run_dir, record)}")


def _text_run(run_dir: str, text: str | None) -> bool:
    """Whether RUN_DIR holds a text encoder (its family, read from corp.json); one line when a text run comes
    without --text (an image option would not fit it)."""
    try:
        family = get_family(read_meta(floor.artifact_of(run_dir))["family"])
    except CorpError:
        return False  # a transformers folder or hf:NAME (decoders), or an error eval's own paths report
    if family is None or family.modality != "text":
        return False
    if text is None:
        kind = "decoder" if family.causal else "text encoder"
        raise CorpError(f"{run_dir} holds a {kind}: pass --text DIR, a .txt/.jsonl folder of held-out text")
    return not family.causal


def _encoder_eval(run_dir: str, text: str, seq_len: int | None, all_text: bool, kwargs: dict[str, Any]) -> None:
    """``eval --text`` of a text encoder's run: ``floor.evaluate_text``, printed and appended to eval.json."""
    num = min(kwargs["num"], floor.HELDOUT_NUM * 4)
    record = floor.evaluate_text(run_dir, text, (), all_text, num, seq_len, kwargs["batch_size"] or 16, kwargs["seed"])
    record |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": device_name(torch.device("cpu"))}
    click.echo(f"held-out: {floor.heldout_words(record['heldout'])}")
    click.echo(floor.format_scores(record))
    click.echo(f"appended to {append_evaluation(run_dir, record)}")


@click.command()
@click.argument("model")
@model_options
@click.option("--latency-on", required=True, metavar="BACKEND", help="The bench backend to measure (ort-cpu-fp32...).")
@click.option("--latency-batch", default=32, show_default=True, help="Batch size the table is for.")
@click.option("--check", default=0, show_default=True, help="Also time N random mixed-width models: the error.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the table here (for prune --latency-table).")
@click.option("--overwrite", is_flag=True, help="Replace --out if it exists.")
def profile(
    model: str,
    weights: str,
    checkpoint: str | None,
    model_arg: tuple[str, ...],
    latency_on: str,
    latency_batch: int,
    check: int,
    out: str | None,
    overwrite: bool,
) -> None:
    """Measure (or read from the cache) MODEL's latency table on a backend: every block's time by its widths.

    The table is what --speedup / --budget latency=F allocate against. It is measured from a few uniform-width
    models with random weights (values do not change a dense model's time) and cached per model, backend,
    device, precision, batch, threads and library versions.
    """
    if out is not None:
        check_writable(out, overwrite)
    if latency_batch < 1 or check < 0:
        raise CorpError("--latency-batch must be >= 1 and --check >= 0")
    backend = meter.check_backend(latency_on)
    net = create_model(model, weights=weights, checkpoint=checkpoint, model_args=parse_model_args(model_arg))
    key = speed.key(resolve_name(model), parse_model_args(model_arg), backend, latency_batch, torch.get_num_threads())
    start = time.perf_counter()
    table = speed.table_for(net, key, backend, say=click.echo)
    click.echo(latency.format_table(table))
    click.echo(f"table ready in {time.perf_counter() - start:.1f} s")
    if check:
        errors = speed.check_table(net, table, backend, check)
        for e in errors:
            click.echo(
                f"mixed-width model: predicted {e['predicted_s'] * 1e3:.1f} ms, "
                f"measured {e['measured_s'] * 1e3:.1f} ms "
                f"({100 * e['error']:+.1f}%); speedup over dense measured with it: {100 * e['speedup_error']:+.1f}%"
            )
    if out is not None:
        latency.write(table, out)
        click.echo(f"wrote {out}")
