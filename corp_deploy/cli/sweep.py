"""``sweep``: calibrate once, then prune, export and bench at every sparsity or speed target; with a held-out
metric, the accuracy-speed frontier and the fastest configuration within a drop."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import click

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
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import atomic_dir, check_writable
from corp_deploy.base.steps import INTERRUPTED, Stopped
from corp_deploy.base.timing import Method
from corp_deploy.bench import meter
from corp_deploy.bench.backends import rewrites_on
from corp_deploy.bench.drop import METRICS, declared_pooling, default_metric
from corp_deploy.bench.frontier import format_frontier, plot_frontier
from corp_deploy.bench.run import parse_batch_sizes
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
from corp_deploy.families.hf import hub
from corp_deploy.formats import sources
from corp_deploy.plan import speed
from corp_deploy.plan.loop import latency_loop


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
    text = hub.modality(flags["model"]) == "text"
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
        tokenizer = hub.load_tokenizer(flags["model"], got.net.config.vocab_size) if text else None
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
    record, points, chosen = floor.frontier_record(result, max_drop)
    metric = record["accuracy"]["metric"]
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
