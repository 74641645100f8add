"""The prune stage: the `prune` command, and `pruned` (calibrate and prune what `cli.inputs` built), which prune-export
reuses."""

from __future__ import annotations

import copy
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import click
import torch
from torch import nn

from corp_deploy import api
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import check_writable
from corp_deploy.base.steps import Stopped, written
from corp_deploy.bench import meter
from corp_deploy.cli.inputs import inputs
from corp_deploy.cli.options import model_options, out_options, out_path
from corp_deploy.cli.prune_options import prune_config, prune_options, recovery_setup
from corp_deploy.core import distributed
from corp_deploy.core.config import PruneConfig
from corp_deploy.core.recover import Interrupted, Kept
from corp_deploy.families import adapter_for, onload
from corp_deploy.families.hf import hub
from corp_deploy.families.timm.models import create_model, parse_model_args, resolve_name
from corp_deploy.formats.artifact import read_meta
from corp_deploy.plan import latency, speed
from corp_deploy.plan.loop import latency_loop
from corp_deploy.plan.report import format_report


class Pruned(NamedTuple):
    result: api.PruneResult
    name: str
    args: dict
    weights: str
    dense: nn.Module | None
    """The dense model kept (``pruned(keep_dense=True)``); None for a ``transformers`` source without a recovery: its
    folder is read again when needed."""
    stopped: str | None = None
    """Why a recovery did not finish (Ctrl-C): the result holds CORP's weights and its report says so."""


@click.command()
@prune_options
@out_options("Artifact folder")
def prune(out: str | None, overwrite: bool, **kwargs: Any) -> None:
    """Prune MODEL (timm name or alias such as deit_base; a transformers folder or hf:NAME) with CORP into --out.

    With --speedup S (or --budget latency=F) the widths are allocated against a latency table measured on
    --latency-on at --latency-batch-size (cached); the speed is predicted, not checked (prune-export checks it).
    """
    started = time.perf_counter()
    config = prune_config(kwargs.pop("pruning"), kwargs["latency"])
    out = out_path(out, kwargs["model"], config, overwrite)
    run = pruned(config, **kwargs, transformers=True, out=out)
    if run is None:  # a data-parallel rank other than 0: its shard is merged, rank 0 writes
        return
    path = api.save(run.result, out, run.name, run.args, weights=run.weights, overwrite=overwrite)
    if run.stopped:
        raise Stopped(
            f"{run.stopped}; wrote {path}/ with CORP's weights, not recovered (its corp.json says so); to recover, "
            f"run {again()}",
            interrupted=True,
        )
    click.echo(format_report(run.result.report))
    click.echo(f"wrote {path}/ ({', '.join(written(Path(path)))}); load it with corp_deploy.load_pruned({str(path)!r})")
    say_folder(path)
    click.echo(
        f"wall time {time.perf_counter() - started:.1f} s (the time above plus loading the model and data, any "
        "latency table, any recovery, and writing)"
    )


def say_folder(path: str | Path) -> None:
    """A text artifact's one line on how it loads without corp-deploy (and why it needs remote code, if it does)."""
    folder = read_meta(path).get("folder")
    if folder:
        from corp_deploy.families.hf.folder import describe

        click.echo(f"{path}/ {describe(folder)}")


def pruned(
    config: PruneConfig,
    latency: dict[str, Any],
    recovery: dict[str, Any],
    quiet: bool,
    dist_timeout: float,
    max_stats_gib: float | None = None,
    keep_dense: bool = False,
    transformers: bool = False,
    latency_rounds: int | None = None,
    rewrites: tuple[str, ...] | None = None,
    out: str | Path | None = None,
    **flags: Any,
) -> Pruned | None:
    """Validate the flags, then build, calibrate, prune ``config`` (``options.prune_config``; its calibration step
    here, before the model loads; ``api.prune`` checks it against the model before any data is read) and, with
    ``--recover-*``, recover.

    Under torchrun every rank calibrates its shard; rank 0 gets the result, the others ``None``. A latency
    budget's table is measured (or read) before calibration (``speed.latency_table``); ``latency_rounds`` closes the
    loop (``plan.loop.latency_loop``); both time the models with ``rewrites`` (None: the backend's defaults), as they
    will be exported.

    A transformers folder without a latency budget is onloaded (``families.onload``: one block's weights in memory
    at a time; the latency table and loop time the whole model). The dense model of a transformers source is never
    held twice: a recovery reads it again after the prune, and ``keep_dense`` alone leaves it to the caller
    (``Pruned.dense`` None: prune-export reads it when its export's turn comes, the pruned model let go first); a
    timm model's is a copy made before pruning (small: 4 bytes a parameter, 88 MB for a ViT-S). A recovery
    (``api.recover_pruned``, after the closed loop: the widths are final) trains on the first ``recover.KEPT_INPUTS``
    calibration inputs, kept as the calibration pass reads them (``recover.Kept``), on the device pruning used,
    with the sensitivity pass's held-out inputs (if any) evaluated, never trained on.
    """
    api.calibration_mode(config, max_stats_gib, distributed.processes())  # refused before the model and data load
    recover = recovery_setup(recovery)
    if recover is not None and distributed.launched():
        raise CorpError("--recover-steps/--recover-minutes train in one process; run it without torchrun")
    backend = None if latency["latency_on"] is None else meter.check_backend(latency["latency_on"], rewrites)
    seq_len = flags["seq_len"] if hub.modality(flags["model"]) == "text" else None  # a text encoder: at --seq-len
    say = (lambda line: None) if quiet else click.echo
    on = None
    if backend is not None:
        on = speed.Latency(backend, latency["latency_batch"], latency["latency_table"], latency_rounds, seq_len)
    got = inputs(
        **flags, dist_timeout=dist_timeout, hold_out=config.heldout_images, transformers=transformers, onload=on is None
    )
    if out is not None and got.world.is_main and (short := onload.disk_shortfall(got.net, out)):
        say(short)
    table = (
        None
        if on is None
        else speed.latency_table(got.net, got.name, got.args, on, say, config.depth, config.depth_fit)
    )
    loop = None if on is None else latency_loop(on, say)
    keep = keep_dense or recover is not None
    reread = keep and hub.is_source(flags["model"])  # read again after the prune, never held twice
    dense = copy.deepcopy(got.net) if keep and not reread else None  # pruning works in place
    progress = not quiet and got.world.is_main
    batches = got.batches if recover is None else Kept(got.batches, adapter_for(got.net).count)
    result = api.prune(
        got.net,
        batches,
        config,
        got.device,
        got.total,
        progress,
        got.world,
        dist_timeout,
        max_stats_gib,
        got.heldout,
        table,
        loop,
    )
    if result is None:
        return None
    if reread and recover is not None:
        dense = hub.load(flags["model"])[0]
        onload.restore(result.model)  # trained whole: its pruned blocks read back from the store
    stopped = None
    if recover is not None:
        try:
            api.recover_pruned(result, dense, batches.batches, recover, got.heldout, say)
        except Interrupted as e:
            stopped = str(e)
    result.report["calibration"] |= {"source": got.source, "seed": flags["seed"]}
    if seq_len is not None:
        result.report["calibration"]["seq_len"] = seq_len
    return Pruned(result, got.name, got.args, got.weights, dense, stopped)


def again() -> str:
    """The running command line, to run again over what it wrote (``--overwrite`` added)."""
    given = click.get_current_context().find_root().obj
    argv = ["corp-deploy", *(sys.argv[1:] if given is None else given)]
    return shlex.join(argv + ([] if "--overwrite" in argv else ["--overwrite"]))


@click.command()
@click.argument("model")
@model_options
@click.option("--latency-on", required=True, metavar="BACKEND", help="The bench backend to measure (ort-cpu-fp32...).")
@click.option(
    "--latency-batch-size", "latency_batch", default=32, show_default=True, help="Batch size the table is for."
)
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
        raise CorpError("--latency-batch-size must be >= 1 and --check >= 0")
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
